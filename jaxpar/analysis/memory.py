"""Per-device memory and data-parallel traffic of a layout: prediction next to the compiled step.

:func:`theory` reports the ZeRO paper's convention (mixed-precision Adam, 2 + 2 + 12 bytes per
parameter) beside what jaxpar's compiled step holds — the planner's one memory model,
:func:`jaxpar.planner.footprint.memory`, the function ``jaxpar plan`` calls too. :func:`measure`
compiles the real train step and reads XLA's per-device memory analysis and the collectives of
the optimized HLO. :func:`dp_comm_theory` is the planner's data-parallel traffic
(:func:`jaxpar.planner.traffic.dp_traffic`).
"""

from __future__ import annotations

from typing import Any

from jaxpar.analysis import theory as T
from jaxpar.config import LayoutConfig, ModelConfig, RunConfig


def theory(
    layout: LayoutConfig,
    model: ModelConfig | None = None,
    params: float | None = None,
    seq: int = 2048,
    microbatch_size: int = 1,
    platform: str = "gpu",
) -> dict[str, Any]:
    """Per-device bytes: ZeRO convention at the top level, jaxpar's compiled step under
    ``stored`` (and its whole breakdown under ``memory_breakdown_bytes``).

    With only ``params`` (Ψ) the ZeRO figures use Ψ/(tp·pp) per device and nothing else can be
    computed (it needs the model's shape).
    """
    from jaxpar.planner.footprint import memory
    from jaxpar.planner.moe import report as moe_report
    from jaxpar.planner.shapes import param_counts, zero_shards
    from jaxpar.planner.workload import Shape

    if model is None and params is None:
        raise ValueError("theory needs a model or a parameter count")
    nz = zero_shards(layout)
    if model is not None:
        pc = param_counts(model, layout)
        psi, psi_local = float(pc.full), float(pc.local)
    else:
        psi = float(params)
        psi_local = psi / (layout.tp * layout.pp)
    z = T.zero_model_states(psi_local, nz, layout.zero)
    out: dict[str, Any] = {
        "params_count": psi,
        "params_per_device": psi_local,
        "zero_shards": nz,
        "model_states_bytes": z["total"],
        "params_bytes": z["params"],
        "grads_bytes": z["grads"],
        "optimizer_bytes": z["optimizer"],
        "activations_bytes": None,
        "stored": None,
        "memory_per_device_bytes": None,
        "memory_breakdown_bytes": None,
        "moe": None,
    }
    if model is None:
        return out
    batch = microbatch_size * layout.microbatches * layout.dp
    mem = memory(model, layout, Shape(batch, seq))
    out["activations_bytes"] = mem["activations"]
    wc = T.DTYPE_BYTES[layout.compute_dtype]
    out["moe"] = moe_report(model, layout, microbatch_size, seq, wc, platform) or None
    out["memory_per_device_bytes"] = mem["total"]
    out["memory_breakdown_bytes"] = {k: v for k, v in mem.items() if k != "total"}
    states = mem["params"] + mem["grads"] + mem["optimizer"]
    out["stored"] = {
        "model_states_bytes": states,
        "params_bytes": mem["params"],
        "grads_bytes": mem["grads"],
        "optimizer_bytes": mem["optimizer"],
        "activations_bytes": mem["activations"],
        "at_rest_bytes": mem["params"] + mem["optimizer"] + mem["host"],
    }
    return out


def dp_comm_theory(cfg: RunConfig) -> dict[str, float]:
    """Data-parallel wire bytes per device per step of ``cfg``'s ZeRO stage
    (:func:`jaxpar.planner.traffic.dp_traffic`: the stage's collectives and dtypes)."""
    from jaxpar.planner.traffic import dp_traffic

    return dp_traffic(cfg.model, cfg.layout)


def dp_axes_of(mesh: Any) -> set[str]:
    """The data-parallel mesh axes (``dp``, ``dpr``/``dps`` under hybrid sharding,
    ``edp``/``ep`` under expert parallelism)."""
    return {a for a in mesh.axis_names if a.startswith("dp") or a in ("edp", "ep")}


def comm_report(compiled: Any, mesh: Any) -> dict[str, Any]:
    """Collective bytes per (kind, axes) of a compiled step, plus the data-parallel subtotal
    (reductions whose groups vary only along dp axes; wire bytes per device per step)."""
    from jaxpar.analysis.hlo import collective_bytes

    rep = collective_bytes(compiled, mesh)
    out = rep.to_dict()
    dp = dp_axes_of(mesh)
    # the MoE dispatch's all-to-all over ep is not the data-parallel reduction
    red = [s for (kind, ax), s in rep.stats.items()
           if ax and set(ax) <= dp and "all-to-all" not in kind]  # fmt: skip
    wire = sum(s.wire_bytes for s in red)
    held = sum(s.bytes for s in red)
    out["dp_wire_bytes"] = wire
    out["dp_bytes"] = held
    return out


def measure(cfg: RunConfig, devices: Any = None, comm: bool = True) -> dict[str, Any]:
    """Compile the real train step for ``cfg`` (nothing runs) and report XLA's per-device
    memory (``argument``, ``output``, ``temp``, ...), the model states it holds at rest
    (``state_bytes`` = arguments − the batch shard) and, with ``comm``, the collectives."""
    import jax
    import numpy as np

    from jaxpar.analysis.hlo import compiled_memory
    from jaxpar.devices import make_mesh
    from jaxpar.train.step import Trainer

    devices = list(devices if devices is not None else jax.devices())[: cfg.layout.n_devices]
    mesh = make_mesh(cfg.layout, devices)
    tr = Trainer(cfg, mesh)
    compiled = tr.compile_step()
    mem = compiled_memory(compiled)
    batch_rows = cfg.train.global_batch // cfg.layout.dp
    batch = batch_rows * (cfg.train.seq_len + 1) * np.dtype(np.int32).itemsize
    on_host = mem.get("host_argument") or 0
    out: dict[str, Any] = dict(mem)
    out["batch_bytes"] = batch
    out["state_bytes"] = (mem["argument"] or 0) + on_host - batch
    out["device_state_bytes"] = (mem["argument"] or 0) - batch
    if comm:
        out["comm"] = comm_report(compiled, mesh)
    return out
