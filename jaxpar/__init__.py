"""jaxpar: parallel training strategies for language models in JAX/XLA.

Device meshes with ``pp``/``dp``/``sp``/``tp`` axes, ZeRO stages 0–3, Megatron tensor and
sequence parallelism, Ulysses and ring attention, pipeline schedules from tables, a planner,
and the everyday parts (model, data, training loop, checkpoints).
"""

__version__ = "0.1.0"
