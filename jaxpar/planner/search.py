"""Enumerate runnable layouts on a cluster, cost them, keep those that fit, rank by step time.

Every candidate is drawn through :func:`jaxpar.validation.check_layout`, the predicate
``jaxpar.validation.validate`` applies before anything compiles, so the planner proposes only
layouts the trainer accepts (and, when the trainer learns a new combination, proposes it).

The space: tp (powers of two dividing the head count, up to two nodes), sp (Ulysses or ring),
pp (dividing the layers and the devices left), dp the rest, and for a MoE model ep (dividing
dp and the routed experts; the trainer refuses MoE with sp > 1, with pp > 1 when dense blocks
precede the first MoE group, and hybrid sharding with ep, and the predicate below drops
those); for pipelines every schedule with
its allowed virtual stages (1F1B in both memory modes from pp 3 on); ZeRO 0–3; the micro-batch size
(divisors of the per-dp batch up to ``MAX_MB_TOKENS`` tokens, and 1); Megatron sequence
parallelism with tp; remat and offload.
Pruning, so that a 1024-device cluster answers in seconds:

* a (tp, sp, pp) split whose leanest variant (ZeRO-3, full remat, params offloaded where the
  trainer allows it, micro-batch 1) does not fit is skipped whole;
* remat is tried cheapest first (none, selective, full) and the first that fits is kept — a
  slower remat of the same layout cannot rank higher; offload only when no remat fits;
* Megatron sequence parallelism is always on with tp > 1: it moves the same bytes as plain TP
  (all-gather + reduce-scatter instead of all-reduce) and stores less, so it never loses.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from jaxpar import validation as V
from jaxpar.analysis.theory import train_flops_per_token
from jaxpar.config import HardwareConfig, LayoutConfig, ModelConfig
from jaxpar.errors import ConfigError
from jaxpar.planner import footprint as M
from jaxpar.planner.cost import Cost, step_cost
from jaxpar.planner.frameworks import JAXPAR, Executor, for_model, for_target, memory_pressure

HEADROOM = 0.92  # share of device memory a layout may use (runtime, fragmentation, NCCL buffers)
MAX_MB_TOKENS = 65536  # past this many tokens per micro-batch, matmul efficiency is saturated
PIPE_CHOICES = (  # (schedule, virtual, pipeline_memory)
    ("1f1b", 1, "fast"),
    ("1f1b", 1, "lean"),
    ("gpipe", 1, "fast"),
    ("interleaved", 2, "fast"),
    ("interleaved", 4, "fast"),
    ("zb-h1", 1, "fast"),
    ("zbv", 2, "fast"),
    ("dualpipev", 2, "fast"),
)
NO_PIPE = (("1f1b", 1, "fast"),)


def pipe_choices(pp: int) -> tuple[tuple[str, int, str], ...]:
    """The (schedule, virtual, pipeline_memory) choices worth trying at ``pp`` ranks: lean 1F1B
    only past 2 ranks (at ``pp <= 2`` its table is the fast one, a duplicate candidate)."""
    if pp <= 1:
        return NO_PIPE
    return tuple(c for c in PIPE_CHOICES if pp > 2 or c[2] != "lean")


REMATS = ("none", "selective", "full")


@dataclass
class Candidate:
    """One costed layout."""

    layout: LayoutConfig
    memory: dict[str, float]
    cost: Cost
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

    @property
    def bubble(self) -> float:
        """Idle share of the step on the busiest pipeline rank (0 without a pipeline)."""
        return self.cost.terms["bubble"] / self.step_time if self.step_time else 0.0


def layout_dict(lay: LayoutConfig, shape: M.Shape) -> dict:
    """The ``layout`` JSON object."""
    keys = ("dp", "tp", "pp", "sp", "zero", "virtual", "microbatches", "remat", "offload",
            "sequence_parallel", "dp_shard", "ep", "fp8")  # fmt: skip
    out = {k: getattr(lay, k) for k in keys}
    out["schedule"] = lay.schedule if lay.pp > 1 else None
    out["pipeline_memory"] = lay.pipeline_memory if lay.pp > 1 else None
    out["sp_mode"] = lay.sp_mode if lay.sp > 1 else None
    out["microbatch_size"] = shape.microbatch_size(lay)
    return out


def usable(hw: HardwareConfig) -> float:
    """Bytes per device a layout may use."""
    return hw.device_memory_bytes * HEADROOM


def evaluate(
    model: ModelConfig,
    hw: HardwareConfig,
    lay: LayoutConfig,
    shape: M.Shape,
    executor: Executor = JAXPAR,
    mem: dict[str, float] | None = None,
) -> Candidate:
    """Memory and time of one layout (assumed valid: see :func:`runnable`)."""
    executor = for_target(hw, for_model(model, executor))
    mem = mem or M.memory(model, lay, shape, executor)
    pressure = memory_pressure(hw, mem) if executor.follows_model else None
    if pressure:  # XLA:GPU schedules for memory: no data-parallel call hides
        executor = executor.with_(overlap_dp=0.0)
    cost = step_cost(model, hw, lay, shape, executor, mem["host"])
    flags = list(cost.flags)
    if pressure:
        flags.append(
            f"XLA:GPU's scheduler under memory pressure: temporaries {pressure[0] / 2**30:.1f} "
            f"GiB over its {pressure[1] / 2**30:.1f} GiB limit, so no collective is overlapped"
        )
    if lay.pp > 1 and lay.microbatches < 4 * lay.pp:
        flags.append(
            f"few micro-batches for the schedule: m={lay.microbatches} < 4·pp={4 * lay.pp}"
        )
    return Candidate(lay, mem, cost, usable(hw), flags)


def runnable(model: ModelConfig, lay: LayoutConfig, shape: M.Shape, n: int) -> bool:
    """Whether the trainer accepts ``lay`` (``validation.check_layout``)."""
    try:
        V.check_layout(model, lay, shape.global_batch, shape.seq, n)
    except ConfigError:
        return False
    return True


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]


def splits(model: ModelConfig, hw: HardwareConfig, n: int, seq: int) -> Iterator[tuple]:
    """(tp, sp, pp, dp) splits of ``n`` devices worth trying (powers of two for tp and sp)."""
    for tp in _divisors(n, 2 * hw.devices_per_node):
        if tp & (tp - 1) or model.n_heads % tp:
            continue
        for sp in _divisors(n // tp, 8):
            if sp & (sp - 1) or seq % sp:
                continue
            for pp in _divisors(n // (tp * sp), 64):
                if model.n_layers % pp == 0:
                    yield tp, sp, pp, n // (tp * sp * pp)


def ep_sizes(model: ModelConfig, dp: int) -> list[int]:
    """Expert-parallel sizes worth trying: 1 and every ep dividing both dp and the routed
    experts (a dense model: 1 only)."""
    if not model.moe.enabled:
        return [1]
    return [e for e in _divisors(dp) if model.moe.experts % e == 0]


def base_layout(hw: HardwareConfig, tp: int, sp: int, pp: int, dp: int, **kw) -> LayoutConfig:
    """A layout of this split with the platform's compute dtype (bf16 under an FP8 recipe)
    and fp32 reductions."""
    fp8 = kw.get("fp8", "none") != "none"
    dtype = "bfloat16" if hw.platform == "gpu" or fp8 else "float32"
    fields = dict(dp=dp, tp=tp, pp=pp, sp=sp, zero=0, compute_dtype=dtype,
                  reduce_dtype="float32", sequence_parallel=tp > 1)  # fmt: skip
    return LayoutConfig(**{**fields, **kw})  # one construction: the search makes ~10^5


def _leanest(model, hw, shape, tp, sp, pp, dp, n, ep=1) -> tuple[LayoutConfig, dict] | None:
    """The runnable variant of a split with the least memory (micro-batch 1 or as few as
    allowed), or None when no variant of it runs."""
    best = None
    per_dp = shape.global_batch // dp if shape.global_batch % dp == 0 else 0
    executor = for_target(hw)
    for sp_mode in ("ulysses", "ring") if sp > 1 else ("ulysses",):
        for offload in ("params", "optimizer", "none"):
            for m in sorted({per_dp, 1} - {0}, reverse=True):
                for kind, v, pipe_mem in pipe_choices(pp):
                    lay = base_layout(hw, tp, sp, pp, dp, zero=3 if dp > 1 else 0,
                                      remat="full", offload=offload, microbatches=m,
                                      schedule=kind, virtual=v, pipeline_memory=pipe_mem,
                                      sp_mode=sp_mode, ep=ep)  # fmt: skip
                    if not runnable(model, lay, shape, n):
                        continue
                    mem = M.memory(model, lay, shape, executor)
                    if best is None or mem["total"] < best[1]["total"]:
                        best = (lay, mem)
                    break
    return best


def candidates(
    model: ModelConfig,
    hw: HardwareConfig,
    n: int,
    shape: M.Shape,
    counter: dict[str, int] | None = None,
    fp8: str = "none",
) -> Iterator[Candidate]:
    """Every runnable layout that fits (per the pruning rules), each with the FP8 recipe
    ``fp8``. ``counter['costed']`` counts the layouts whose memory was costed,
    ``counter['refused']`` those ``check_layout`` refused."""
    counter = {} if counter is None else counter
    counter.setdefault("costed", 0)
    counter.setdefault("refused", 0)
    room = usable(hw)
    for tp, sp, pp, dp in splits(model, hw, n, shape.seq):
        if shape.global_batch % dp:
            continue
        for ep in ep_sizes(model, dp):
            lean = _leanest(model, hw, shape, tp, sp, pp, dp, n, ep)
            if lean is None or lean[1]["total"] > room:
                continue
            yield from _split_candidates(model, hw, shape, n, (tp, sp, pp, dp, ep), counter,
                                         fp8)  # fmt: skip


def _split_candidates(model, hw, shape, n, split, counter, fp8="none") -> Iterator[Candidate]:
    """The candidates of one (tp, sp, pp, dp, ep) split: micro-batch size, pipe choice, sp
    mode and ZeRO stage, each with its first fitting remat/offload."""
    tp, sp, pp, dp, ep = split
    per_dp = shape.global_batch // dp
    for b in [b for b in _divisors(per_dp) if b == 1 or b * shape.seq <= MAX_MB_TOKENS]:
        for kind, v, pipe_mem in pipe_choices(pp):
            for sp_mode in ("ulysses", "ring") if sp > 1 else ("ulysses",):
                for zero in (0, 1, 2, 3) if dp > 1 else (0,):
                    kw = dict(zero=zero, microbatches=per_dp // b, schedule=kind, virtual=v,
                              pipeline_memory=pipe_mem, sp_mode=sp_mode, ep=ep,
                              fp8=fp8)  # fmt: skip
                    yield from _first_fitting(model, hw, shape, n, tp, sp, pp, dp, kw, counter)


def _first_fitting(model, hw, shape, n, tp, sp, pp, dp, kw, counter) -> Iterator[Candidate]:
    executor = for_target(hw)
    for offload in ("none", "optimizer", "params"):
        for remat in REMATS:
            lay = base_layout(hw, tp, sp, pp, dp, remat=remat, offload=offload, **kw)
            if not runnable(model, lay, shape, n):
                counter["refused"] += 1
                continue
            counter["costed"] += 1
            mem = M.memory(model, lay, shape, executor)
            if mem["total"] > usable(hw):
                continue  # memory first: the time terms only for layouts that fit
            yield evaluate(model, hw, lay, shape, mem=mem)
            return


def smallest_shortfall(model: ModelConfig, hw: HardwareConfig, n: int, shape: M.Shape) -> dict:
    """The leanest runnable layout over all splits (for the 'fits no layout' verdict); its
    ``layout`` is None when no split runs at all."""
    best: tuple[LayoutConfig, dict] | None = None
    for tp, sp, pp, dp in splits(model, hw, n, shape.seq):
        for ep in ep_sizes(model, dp):
            lean = _leanest(model, hw, shape, tp, sp, pp, dp, n, ep)
            if lean and (best is None or lean[1]["total"] < best[1]["total"]):
                best = lean
    return {"layout": best[0] if best else None, "memory": best[1] if best else None}


def baseline_layout(
    model: ModelConfig, hw: HardwareConfig, n: int, shape: M.Shape, fp8: str = "none"
) -> tuple[LayoutConfig | None, str]:
    """The rule of thumb: pure DP if the model states (16Ψ as jaxpar stores them) fit one
    device; TP = one node if they fit a node; else TP = one node + the fewest pipeline stages
    that fit + DP over the rest (1F1B, micro-batch 1, ZeRO-1). Remat: first that fits. With
    the FP8 recipe ``fp8``, as the search's candidates.
    Returns (layout, rule applied) or (None, why the rule gives no layout)."""
    room, psi = usable(hw), model.param_count()
    node = min(hw.devices_per_node, n)
    if 16 * psi <= room:
        tp, pp, rule = 1, 1, "pure DP (model states fit one device)"
    else:
        tp = max(t for t in (1, 2, 4, 8, 16) if t <= node and model.n_heads % t == 0)
        pp, rule = 1, f"TP={tp} inside a node (model states fit a node)"
        if 16 * psi / tp > room:
            need = math.ceil(16 * psi / (tp * room))
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
    m = shape.global_batch // dp if pp > 1 else 1
    lay = None
    for remat in REMATS:
        lay = base_layout(hw, tp, 1, pp, dp, zero=1 if dp > 1 and tp > 1 else 0,
                          microbatches=m, remat=remat, fp8=fp8)  # fmt: skip
        if not runnable(model, lay, shape, n):
            return None, f"the rule's layout is refused: {_refusal(model, lay, shape, n)}"
        if evaluate(model, hw, lay, shape).fits:
            return lay, rule
    return lay, rule


def _refusal(model: ModelConfig, lay: LayoutConfig, shape: M.Shape, n: int) -> str:
    try:
        V.check_layout(model, lay, shape.global_batch, shape.seq, n)
    except ConfigError as e:
        return str(e)
    return ""


def tokens_per_step(shape: M.Shape) -> int:
    """Tokens one optimizer step trains on."""
    return shape.global_batch * shape.seq


def train_flops(model: ModelConfig, shape: M.Shape) -> float:
    """Model FLOPs of one step (6Ψ + 12·l·h·s per token, no recompute)."""
    return train_flops_per_token(model, shape.seq) * tokens_per_step(shape)
