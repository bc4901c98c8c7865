"""Enumerate layouts on a cluster, cost them, keep those that fit, rank by predicted step time.

The search space: tp (divisors of the head count up to two nodes), sp (Ulysses, dividing the
heads left per tp rank and the sequence), pp (dividing the layers and the devices left), dp the
rest; for pipelines every schedule with its allowed virtual stages; ZeRO 0–3; micro-batch size
(the divisors of the per-dp batch up to ``MAX_MB_TOKENS`` tokens, and 1); Megatron sequence
parallelism on or off; remat and offload. Pruning, so that a 1024-device cluster answers in
about a second:

* a (tp, sp, pp) whose smallest possible footprint (ZeRO-3, everything offloadable offloaded,
  full remat) does not fit is skipped whole;
* remat is tried cheapest first (none, selective, full) and the first that fits is kept — a
  slower remat of the same layout can never rank higher;
* offload is tried only when no remat fits without it;
* Megatron sequence parallelism is always on with tp > 1: it moves the same bytes as plain TP
  (all-gather + reduce-scatter instead of all-reduce) and stores less, so it never loses;
* pipeline figures come from :mod:`jaxpar.planner.pipe` (cached, extrapolated in m).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from jaxpar.analysis import theory as T
from jaxpar.config import HardwareConfig, LayoutConfig, ModelConfig
from jaxpar.planner import memory as M
from jaxpar.planner.cost import Cost, step_cost
from jaxpar.planner.pipe import figures, schedule_error

HEADROOM = 0.92  # share of device memory a layout may use (runtime, fragmentation, NCCL buffers)
MAX_MB_TOKENS = 65536  # past this many tokens per micro-batch, matmul efficiency is saturated
PIPE_CHOICES = (
    ("1f1b", 1),
    ("gpipe", 1),
    ("interleaved", 2),
    ("interleaved", 4),
    ("zb-h1", 1),
    ("zbv", 2),
    ("dualpipev", 2),
)
REMATS = ("none", "selective", "full")


@dataclass
class Candidate:
    """One costed layout."""

    layout: LayoutConfig
    memory: dict[str, float]
    cost: Cost
    bubble: float
    usable: float
    flags: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        """Whether the per-device total fits the usable device memory."""
        return self.memory["total"] <= self.usable

    @property
    def step_time(self) -> float:
        """Predicted seconds per optimizer step."""
        return self.cost.step_time


def layout_dict(lay: LayoutConfig, shape: M.Shape) -> dict:
    """The ``layout`` JSON object."""
    return {
        "dp": lay.dp,
        "tp": lay.tp,
        "pp": lay.pp,
        "sp": lay.sp,
        "zero": lay.zero,
        "schedule": lay.schedule if lay.pp > 1 else None,
        "virtual": lay.virtual,
        "microbatch_size": shape.microbatch_size(lay),
        "microbatches": lay.microbatches,
        "remat": lay.remat,
        "offload": lay.offload,
        "sequence_parallel": lay.sequence_parallel,
    }


def evaluate(
    model: ModelConfig, hw: HardwareConfig, lay: LayoutConfig, shape: M.Shape, lockstep=True
) -> Candidate:
    """Cost one layout (assumed valid: see :func:`jaxpar.planner.plan.check_layout`).
    ``lockstep=False`` times pipelines asynchronously (for other frameworks' results)."""
    pf = figures(lay.schedule, lay.pp, lay.microbatches, lay.virtual, lockstep=lockstep)
    mem = M.memory(model, lay, shape, pf.peak_stashes)
    cost = step_cost(model, hw, lay, shape, pf.makespan_over_busy, pf.ticks)
    flags = list(cost.flags)
    if lay.pp > 1 and lay.microbatches < 4 * lay.pp:
        flags.append(
            f"few micro-batches for the schedule: m={lay.microbatches} < 4·pp={4 * lay.pp}; "
            f"bubble {pf.bubble_fraction:.0%}"
        )
    return Candidate(lay, mem, cost, pf.bubble_fraction, hw.device_memory_bytes * HEADROOM, flags)


def microbatch_sizes(per_dp: int, seq: int) -> list[int]:
    """Micro-batch sizes tried: divisors of the per-dp batch, up to ``MAX_MB_TOKENS`` tokens."""
    return [b for b in _divisors(per_dp) if b == 1 or b * seq <= MAX_MB_TOKENS]


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]


def shapes(model: ModelConfig, hw: HardwareConfig, n: int, seq: int) -> Iterator[tuple]:
    """(tp, sp, pp, dp) splits of ``n`` devices the model's shape allows."""
    for tp in _divisors(n, 2 * hw.devices_per_node):
        if model.n_heads % tp or model.d_ff % tp or tp & (tp - 1):
            continue
        for sp in _divisors(n // tp, 8):
            if (model.n_heads // tp) % sp or seq % sp or sp & (sp - 1):
                continue
            for pp in _divisors(n // (tp * sp), 64):
                if model.n_layers % pp:
                    continue
                yield tp, sp, pp, n // (tp * sp * pp)


def _base(model: ModelConfig, hw: HardwareConfig, tp, sp, pp, dp, **kw) -> LayoutConfig:
    dtype = "bfloat16" if hw.platform == "gpu" else "float32"
    lay = LayoutConfig(dp=dp, tp=tp, pp=pp, sp=sp, compute_dtype=dtype, reduce_dtype="float32")
    return dataclasses.replace(lay, **kw)


def _lower_bound_fits(model, hw, tp, sp, pp, dp, shape) -> bool:
    """Whether the leanest variant of this split (ZeRO-3, offload, full remat, b=1) fits."""
    lean = []
    for m in (1, max(1, shape.global_batch // dp)):  # one micro-batch, or the most
        lay = _base(model, hw, tp, sp, pp, dp, zero=3, remat="full", offload="params")
        lay.microbatches, lay.sequence_parallel = m, tp > 1
        lean.append(M.memory(model, lay, shape, 1)["total"])
    return min(lean) <= hw.device_memory_bytes * HEADROOM


def candidates(
    model: ModelConfig,
    hw: HardwareConfig,
    n: int,
    shape: M.Shape,
    offload: bool = True,
    counter: dict[str, int] | None = None,
) -> Iterator[Candidate]:
    """Every layout that fits (per the pruning rules); the leanest misfits when none fit is
    the caller's business (:func:`smallest_shortfall`). ``counter["costed"]`` counts the
    layouts costed, fitting or not."""
    counter = {} if counter is None else counter
    counter.setdefault("costed", 0)
    for tp, sp, pp, dp in shapes(model, hw, n, shape.seq):
        if shape.global_batch % dp or not _lower_bound_fits(model, hw, tp, sp, pp, dp, shape):
            continue
        per_dp = shape.global_batch // dp
        pipes = PIPE_CHOICES if pp > 1 else (("1f1b", 1),)
        for b in microbatch_sizes(per_dp, shape.seq):
            m = per_dp // b
            for kind, v in pipes:
                if pp > 1 and (model.n_layers % (pp * v) or schedule_error(kind, pp, m, v)):
                    continue
                for zero in (0, 1, 2, 3):
                    if zero and dp == 1:
                        continue
                    yield from _first_fitting(
                        model, hw, shape, offload, counter,
                        dict(tp=tp, sp=sp, pp=pp, dp=dp, zero=zero, microbatches=m,
                             schedule=kind, virtual=v, sequence_parallel=tp > 1),
                    )  # fmt: skip


def _first_fitting(model, hw, shape, offload: bool, counter, kw: dict) -> Iterator[Candidate]:
    offloads = ("none", "optimizer", "params") if offload else ("none",)
    for off in offloads:
        for remat in REMATS:
            counter["costed"] += 1
            lay = _base(model, hw, remat=remat, offload=off, **kw)
            stashes = figures(lay.schedule, lay.pp, lay.microbatches, lay.virtual).peak_stashes
            if M.memory(model, lay, shape, stashes)["total"] > hw.device_memory_bytes * HEADROOM:
                continue  # memory first: the time terms only for layouts that fit
            yield evaluate(model, hw, lay, shape)
            return


def smallest_shortfall(model: ModelConfig, hw: HardwareConfig, n: int, shape: M.Shape) -> dict:
    """The leanest layout over all splits (for the 'fits no layout' verdict)."""
    best = None
    for tp, sp, pp, dp in shapes(model, hw, n, shape.seq):
        lay = _base(model, hw, tp, sp, pp, dp, zero=3 if dp > 1 else 0, remat="full")
        lay.offload, lay.sequence_parallel = "params", tp > 1
        lay.microbatches = max(1, shape.global_batch // dp) if shape.global_batch % dp == 0 else 1
        mem = M.memory(model, lay, shape, 1)
        if best is None or mem["total"] < best[1]["total"]:
            best = (lay, mem)
    assert best is not None
    return {"layout": best[0], "memory": best[1]}


def baseline_layout(
    model: ModelConfig, hw: HardwareConfig, n: int, shape: M.Shape
) -> tuple[LayoutConfig | None, str]:
    """The rule of thumb: pure DP if the model states (16Ψ as jaxpar stores them) fit one
    device; TP = one node if they fit a node; else TP = one node + the fewest pipeline stages
    that fit + DP over the rest (1F1B, micro-batch 1, ZeRO-1). Remat: first that fits.
    Returns (layout, rule applied) or (None, why the rule gives no layout)."""
    usable = hw.device_memory_bytes * HEADROOM
    psi = model.param_count()
    node = min(hw.devices_per_node, n)
    if 16 * psi <= usable:
        tp, pp, rule = 1, 1, "pure DP (model states fit one device)"
    else:
        tp = max(t for t in (1, 2, 4, 8, 16) if t <= node and model.n_heads % t == 0)
        pp, rule = 1, f"TP={tp} inside a node (model states fit a node)"
        if 16 * psi / tp > usable:
            need = math.ceil(16 * psi / (tp * usable))
            allowed = [p for p in _divisors(n // tp) if model.n_layers % p == 0]
            pp = next((p for p in allowed if p >= need), 0)
            if not pp:
                return None, (
                    f"TP={tp} + PP needs pp >= {need}, but pp must divide both "
                    f"{model.n_layers} layers and {n // tp} devices: pp in {allowed}"
                )
            rule = f"TP={tp} + PP={pp} (fewest stages that fit) + DP"
    dp = n // (tp * pp)
    if shape.global_batch % dp:
        return None, f"global batch {shape.global_batch} not divisible by dp={dp}"
    m = shape.global_batch // dp
    zero = 1 if dp > 1 and tp > 1 else 0
    for remat in REMATS:
        lay = _base(model, hw, tp, 1, pp, dp, zero=zero, microbatches=m if pp > 1 else 1)
        lay.remat = remat
        if pp > 1 and schedule_error("1f1b", pp, m, 1):
            return None, f"1F1B refuses pp={pp}, m={m}"
        if evaluate(model, hw, lay, shape).fits:
            return lay, rule
    return lay, rule


def tokens_per_step(shape: M.Shape) -> int:
    """Tokens one optimizer step trains on."""
    return shape.global_batch * shape.seq


def train_flops(model: ModelConfig, shape: M.Shape) -> float:
    """Model FLOPs of one step (6Ψ + 12·l·h·s per token, no recompute)."""
    return T.train_flops_per_token(model, shape.seq) * tokens_per_step(shape)
