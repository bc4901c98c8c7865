"""The planner's view of a mixture-of-experts layer: active parameters, the dispatch buffer,
its all-to-all over ``ep`` and the experts' compute with its load imbalance.

What the trainer builds (:mod:`jaxpar.model.moe`, docs/moe.md) and what this module prices:

* **Parameters**: the per-tensor counts of :mod:`jaxpar.planner.shapes` already shard the
  routed experts over ``ep`` and ZeRO over ``edp`` (the trainer's rules), so params, grads and
  Adam's moments need nothing here. A token's FLOPs come from its *active* parameters
  (:meth:`jaxpar.config.ModelConfig.active_param_count`: attention, dense blocks, the router,
  shared experts and ``top_k`` routed experts), through :mod:`jaxpar.analysis.theory`.
* **Dispatch buffer**: each device scatters its kept assignments into ``[E, b, C, D]`` (``b``
  rows of its micro-batch, ``C = S`` dropless or ``ceil(cf·top_k·S/E)``); after the
  all-to-all the owner holds its ``E/ep`` experts' slots of ``ep·b`` rows, the same count. A
  slot costs what a token of a dense SwiGLU costs, at the expert width (``F/tp``), plus the
  dispatch and combine rows (``D`` each): :data:`SLOT_VALUES` below.
* **All-to-all**: dispatch and combine forward and their transposes backward. Padded, each
  moves the whole buffer in the compute dtype: ``4·E·b·C·D`` bytes per MoE layer per
  micro-batch per device (``tests/test_moe.py`` checks it on the HLO). Ragged (what the
  trainer runs on GPU with ``ep > 1``, :mod:`jaxpar.model.ragged`), each moves the kept
  assignments, at most ``min(top_k·b·S, E·b·C)`` rows (:func:`moved_rows`); the HLO's
  operands are the static buffers that bound it. Under any remat policy the backward's
  recompute runs the forward pair again (``tests/test_planner_moe.py``). It is exposed:
  nothing overlaps it in jaxpar's step. Memory is the padded slots either way: the ragged
  owner computes its rows in the same ``[E/ep, ep·b·C, D]`` layout.
* **Expert compute** runs on all ``C`` slots (the padded einsum computes padding too), so the
  padded path's time does not depend on the routing; the ragged path it stands in for would
  take ``top_k·S`` rows times the busiest expert's load over the mean
  (:data:`DEFAULT_LOAD_FACTOR`, the ``moe_load`` metric), reported beside it, not costed.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpar.config import LayoutConfig, ModelConfig

# Values one dispatch slot keeps for the backward, per remat policy, as (per D, per local F):
# none — the received dispatch row and the combined output row, SwiGLU's six F-wide values;
# selective (dot outputs) — gate and up, the down projection's output; full — nothing.
# The compiled step of tests/test_planner_moe.py holds these within its tolerance.
SLOT_VALUES = {"none": (2, 6), "selective": (1, 2), "full": (0, 0), "offload": (0, 0)}
# Router values per token in fp32 kept for the backward (logits, probabilities, selection).
ROUTER_VALUES = 3
# The busiest expert's load over the mean that a ragged dispatch would see (1.0 = balanced);
# jaxpar's padded dispatch computes every slot, so it only enters the report.
DEFAULT_LOAD_FACTOR = 1.25


@dataclass(frozen=True)
class MoeFigures:
    """One MoE layer on one device for one micro-batch."""

    slots: int  # E·b·C dispatch slots (before and after the all-to-all)
    capacity: int  # C
    moved: int  # rows one all-to-all moves: the slots padded, the kept assignments ragged
    dispatch: str  # "padded" or "ragged", as the trainer chooses on the platform
    a2a_bytes: float  # dispatch + combine, forward + backward (+ recompute): moved bytes
    expert_flops: float  # forward FLOPs of the routed experts on the slots (padding included)
    useful_flops: float  # forward FLOPs of the kept assignments (top_k per token, dropless)


def capacity(model: ModelConfig, seq: int) -> int:
    """Slots per expert per sequence: the model's own rule (:func:`jaxpar.model.moe.capacity`;
    imported here, not at the top, so that planning a dense model never loads flax)."""
    from jaxpar.model.moe import capacity as model_capacity

    return model_capacity(model, seq)


def slots(model: ModelConfig, rows: int, seq: int) -> int:
    """``E·b·C`` dispatch slots per device and micro-batch: what the experts compute and keep,
    with either dispatch (the ragged owner computes in the padded layout)."""
    return model.moe.experts * rows * capacity(model, seq)


def dispatch(model: ModelConfig, lay: LayoutConfig, platform: str) -> str:
    """``ragged`` or ``padded``: what the trainer dispatches with on ``platform``."""
    return "ragged" if model.moe.ragged(platform, lay.ep) else "padded"


def moved_rows(model: ModelConfig, lay: LayoutConfig, rows: int, seq: int, platform: str) -> int:
    """Rows one dispatch all-to-all moves per device: the ``E·b·C`` slots padded; ragged, the
    kept assignments, at most ``top_k·b·S`` and at most the slots."""
    n = slots(model, rows, seq)
    return min(model.moe.top_k * rows * seq, n) if dispatch(model, lay, platform) == "ragged" else n


def figures(model: ModelConfig, lay: LayoutConfig, rows: int, seq: int, wc: int,
            platform: str) -> MoeFigures:  # fmt: skip
    """The MoE layer's figures for ``rows`` local sequences of ``seq`` tokens (``wc``: bytes of
    the compute dtype) on ``platform`` (``hardware.platform``: which dispatch runs)."""
    e = model.moe
    c = capacity(model, seq)
    n_slots = slots(model, rows, seq)
    moved = moved_rows(model, lay, rows, seq, platform)
    # Any remat policy re-runs the forward pair: no policy saves a collective's output (the
    # selective one keeps dot outputs only), so the backward's recompute exchanges again.
    passes = 4 if lay.remat == "none" else 6
    a2a = passes * moved * model.d_model * wc if lay.ep > 1 else 0.0
    f = model.expert_ff / lay.tp
    per_slot = 2 * 3 * model.d_model * f  # gate, up and down matmuls of one slot
    return MoeFigures(n_slots, c, moved, dispatch(model, lay, platform), a2a, n_slots * per_slot,
                      rows * seq * e.top_k * per_slot)  # fmt: skip


def slot_residual_bytes(model: ModelConfig, lay: LayoutConfig, rows: int, seq: int, wc: int,
                        remat: str) -> float:  # fmt: skip
    """Bytes one MoE layer's routed part keeps for the backward (dispatch slots and router)."""
    per_d, per_f = SLOT_VALUES[remat]
    slot = per_d * model.d_model + per_f * model.expert_ff / lay.tp
    router = ROUTER_VALUES * model.moe.experts * rows * seq * 4 if remat == "none" else 0.0
    return slots(model, rows, seq) * slot * wc + router


def shared_model(model: ModelConfig) -> ModelConfig:
    """The block of a MoE layer without its routed experts: a dense block whose FFN is the
    shared experts (width ``shared_experts · expert_ff``, 0 without them)."""
    import dataclasses

    from jaxpar.config import MoeConfig

    width = model.moe.shared_experts * model.expert_ff
    return dataclasses.replace(model, d_ff=width, moe=MoeConfig())


def report(model: ModelConfig, lay: LayoutConfig, rows: int, seq: int, wc: int,
           platform: str) -> dict:  # fmt: skip
    """The ``moe`` JSON object of ``jaxpar plan`` / ``jaxpar memory`` (null for dense)."""
    if not model.moe.enabled:
        return {}
    fig = figures(model, lay, rows, seq, wc, platform)
    return {
        "params_total": model.param_count(),
        "params_active": model.active_param_count(),
        "moe_layers": model.moe_layers(),
        "ep": lay.ep,
        "dispatch": fig.dispatch,
        "capacity": fig.capacity,
        "dispatch_slots": fig.slots,
        "dispatch_buffer_bytes": fig.slots * model.d_model * wc,
        "moved_rows": fig.moved,
        "all_to_all_bytes_per_layer": fig.a2a_bytes,
        "padding_compute_share": 1 - fig.useful_flops / fig.expert_flops,
        "assumed_load_factor": DEFAULT_LOAD_FACTOR,
    }
