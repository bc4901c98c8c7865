"""Step time of one layout: every term stated, in seconds per optimizer step.

The busiest device's view (the first pipeline rank; ``L`` layers per rank, ``m`` micro-batches
of ``b`` sequences of ``s`` tokens per dp rank, ``tokens = b·s/sp`` local tokens):

* **One layer's forward** ``t_f``: each of its four weight matmuls (fused QKV, attention out,
  gate/up, down — local shapes after tp) takes FLOPs / (peak × efficiency at its smallest
  dimension) from the mesh file's curve (:mod:`jaxpar.planner.hardware`); the attention core's
  QKᵀ and PV run at the efficiency of the sequence length for a ``blockwise`` kernel, which also
  skips the masked half, and at that of the head dimension for ``dense``, which computes the
  whole s×s and moves its scores through HBM (``Executor.score_bytes`` per score); the
  elementwise work (norms, residual adds, rope, activations) is memory-bound:
  ``ELEMENTWISE_PASSES`` × the layer's saved activation bytes / HBM bandwidth. Backward = 2 ×
  forward. Full recompute repeats the forward (and its tp/sp collectives) in the backward.
* **Collectives** (:mod:`jaxpar.planner.traffic`) on the link their group spans: tp and sp
  inside every action (``overlap_tp`` of the tp time hidden), exposed; dp once per step,
  hidden up to ``overlap_dp`` of the backward (and of the forward for ZeRO ≥ 1, whose param
  gathers overlap it) — with a pipeline only the last micro-batch's backward of each chunk can
  hide it; pipeline messages per send of the schedule table.
* **Pipeline**: the schedule library's makespan (lock-step for jaxpar's executor, asynchronous
  for other frameworks: :class:`jaxpar.planner.executor.Executor`) with the real action costs
  F, B (3F under full recompute), I and W (:func:`action_costs`), in units of the stage's
  forward; the last stage's head and loss sit on the critical path once per micro-batch.
* **Host transfers**: offloaded optimizer/params and activations over ``host_to_device_bw``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxpar.analysis.theory import DTYPE_BYTES
from jaxpar.config import HardwareConfig, LayoutConfig, ModelConfig
from jaxpar.planner import traffic as TR
from jaxpar.planner.activations import block_residuals, kv_heads_local
from jaxpar.planner.executor import JAXPAR, Executor, for_model
from jaxpar.planner.hardware import crosses_nodes, link_bw, matmul_efficiency
from jaxpar.planner.memory import Shape
from jaxpar.planner.pipe import ActionCosts, PipeFigures, figures

ELEMENTWISE_PASSES = 2.0  # HBM passes over a layer's activations per forward (fitted)


@dataclass
class Cost:
    """Step time by term (seconds), traffic by link (bytes per device per step), flags."""

    terms: dict[str, float]
    traffic: dict[str, float]
    efficiency: float  # FLOP-weighted matmul efficiency of a layer
    pipe: PipeFigures | None = None
    flags: list[str] = field(default_factory=list)

    @property
    def step_time(self) -> float:
        """Sum of the exposed terms."""
        return sum(self.terms.values())


@dataclass(frozen=True)
class LayerTime:
    """One layer, one micro-batch, on one device (seconds)."""

    compute: float  # forward FLOPs and memory-bound work
    tp_fwd: float
    tp_bwd: float
    sp_fwd: float
    sp_bwd: float
    efficiency: float
    recompute: float = 0.0  # forward work the backward re-runs (remat full: all of it)


def _matmul(hw: HardwareConfig, m: float, k: float, n: float) -> tuple[float, float]:
    """(seconds, FLOPs) of an [m, k] @ [k, n] matmul."""
    flops = 2 * m * k * n
    return flops / (hw.peak_flops_bf16 * matmul_efficiency(hw, min(m, k, n))), flops


def layer_time(
    model: ModelConfig,
    hw: HardwareConfig,
    lay: LayoutConfig,
    shape: Shape,
    ex: Executor,
    elementwise_passes: float = ELEMENTWISE_PASSES,
) -> LayerTime:
    """Forward time of one layer and its collectives (module docstring)."""
    b = shape.microbatch_size(lay) or 1
    tokens, s, t, d, hd = b * shape.seq / lay.sp, shape.seq, lay.tp, model.d_model, model.hd
    q = model.n_heads * hd / t
    kv = kv_heads_local(model, lay) * hd
    ff = model.d_ff / t * (2 if model.mlp == "swiglu" else 1)
    mats = [(tokens, d, q + 2 * kv), (tokens, q, d), (tokens, d, ff), (tokens, model.d_ff / t, d)]
    secs, flops = zip(*(_matmul(hw, *x) for x in mats), strict=True)
    eff = sum(flops) / sum(secs) / hw.peak_flops_bf16
    ring = lay.sp > 1 and lay.sp_mode == "ring"
    visible = (lay.sp + 1) / (2 * lay.sp) if ring else 1.0  # ring skips fully masked blocks
    if ex.attention == "blockwise":  # masked blocks skipped: half of a causal s×s
        attn = 2 * tokens * s * q / (hw.peak_flops_bf16 * matmul_efficiency(hw, s))
    else:
        attn_flops = 4 * tokens * s * q * visible
        scores = tokens * s * model.n_heads / t * ex.score_bytes * visible
        attn = attn_flops / (hw.peak_flops_bf16 * matmul_efficiency(hw, hd)) + scores / hw.hbm_bw
    res = block_residuals(model, lay, s, "blockwise", "none")
    act_bytes = (
        res.bytes(tokens, DTYPE_BYTES[lay.compute_dtype])
        - res.weights * DTYPE_BYTES[lay.compute_dtype]
    )
    elementwise = elementwise_passes * act_bytes / hw.hbm_bw
    tp = TR.tp_traffic(model, lay, shape)
    sp = TR.sp_traffic(model, lay, shape)
    tp_bw, sp_bw = link_bw(hw, 1, lay.tp), link_bw(hw, lay.tp, lay.sp)
    hide = 1.0 - ex.overlap_tp
    compute = sum(secs) + attn + elementwise
    recompute = 0.0  # forward work the backward re-runs
    if lay.remat == "full":
        recompute = compute
    elif lay.remat == "selective" and ex.attention == "blockwise" and ex.selective_reruns_kernel:
        # selective keeps matmul outputs only: the blockwise kernel's forward (a custom_vjp,
        # no dot of its own) runs again in the backward
        recompute = attn
    return LayerTime(
        compute=compute,
        tp_fwd=tp["forward"] / tp_bw * hide,
        tp_bwd=(tp["backward"] - (tp["forward"] if lay.remat == "full" else 0)) / tp_bw * hide,
        sp_fwd=sp["forward"] / sp_bw,
        sp_bwd=(sp["backward"] - (sp["forward"] if lay.remat == "full" else 0)) / sp_bw,
        efficiency=eff,
        recompute=recompute,
    )


def head_time(model: ModelConfig, hw: HardwareConfig, lay: LayoutConfig, shape: Shape) -> float:
    """Head matmul, fp32 loss work and backward of one micro-batch (last pipeline stage)."""
    b = shape.microbatch_size(lay) or 1
    tokens, vocab = b * shape.seq / lay.sp, model.vocab_size / lay.tp
    fwd, _ = _matmul(hw, tokens, model.d_model, vocab)
    loss = 6 * tokens * vocab * 4 / hw.hbm_bw  # logits, softmax and its gradient in fp32
    return 3 * fwd + loss


def action_costs(
    lay: LayoutConfig, executor: Executor = JAXPAR, lt: LayerTime | None = None
) -> ActionCosts:
    """F, B, I, W of a stage in units of its forward (communication included when ``lt``)."""
    full = lay.remat == "full"
    if lt is None:
        r = 1.0 if full else 0.0
        i = executor.i_cost + (r if executor.recompute_in_i else 0.0)
        return ActionCosts(b=2.0 + r, i=i, w=executor.w_cost)
    f = lt.compute + lt.tp_fwd + lt.sp_fwd
    bwd_comm = lt.tp_bwd + lt.sp_bwd
    recompute = f if full else lt.recompute
    b = 2 * lt.compute + bwd_comm + recompute
    i = executor.i_cost * lt.compute + bwd_comm + (recompute if executor.recompute_in_i else 0)
    return ActionCosts(b=b / f, i=i / f, w=executor.w_cost * lt.compute / f)


def step_cost(
    model: ModelConfig,
    hw: HardwareConfig,
    lay: LayoutConfig,
    shape: Shape,
    executor: Executor = JAXPAR,
    activation_host_bytes: float = 0.0,
    elementwise_passes: float = ELEMENTWISE_PASSES,
) -> Cost:
    """Cost terms of ``lay`` on ``hw`` (module docstring)."""
    executor = for_model(model, executor)
    lt = layer_time(model, hw, lay, shape, executor, elementwise_passes)
    layers, m = model.n_layers // lay.pp, lay.microbatches
    full = lay.remat == "full"
    f_stage = layers * (lt.compute + lt.tp_fwd + lt.sp_fwd)
    head = head_time(model, hw, lay, shape)
    costs = action_costs(lay, executor, lt)
    pf = None
    flags: list[str] = []
    compute = m * (layers * 3 * lt.compute + head)
    recompute = m * layers * lt.recompute
    tp_comm = m * layers * (lt.tp_fwd + lt.tp_bwd + (lt.tp_fwd if full else 0.0))
    sp_comm = m * layers * (lt.sp_fwd + lt.sp_bwd + (lt.sp_fwd if full else 0.0))
    busy = compute + recompute + tp_comm + sp_comm
    bubble = 0.0
    traffic = {"intra": 0.0, "inter": 0.0, "host": 0.0}
    pp_p2p = 0.0
    if lay.pp > 1:
        pf = figures(lay.schedule, lay.pp, m, lay.virtual, costs, executor.lockstep,
                     memory=lay.pipeline_memory)  # fmt: skip
        bubble = max(0.0, (pf.makespan - pf.busy) * f_stage)
        stride = lay.dp * lay.sp * lay.tp
        nbytes = pf.sends * TR.pp_message_bytes(model, lay, shape)
        traffic["inter" if crosses_nodes(hw, stride, lay.pp) else "intra"] += nbytes
        pp_p2p = nbytes / link_bw(hw, stride, lay.pp)
    for name, stride, size, nbytes in (
        ("tp", 1, lay.tp, TR.tp_traffic(model, lay, shape)["total"]),
        ("sp", lay.tp, lay.sp, TR.sp_traffic(model, lay, shape)["total"]),
    ):
        inter = crosses_nodes(hw, stride, size)
        traffic["inter" if inter else "intra"] += nbytes
        if inter:
            flags.append(f"{name} group of {size} spans nodes ({hw.devices_per_node} per node)")
    dp_comm = 0.0
    if lay.dp > 1:
        stride = lay.sp * lay.tp
        dp = TR.dp_traffic(model, lay)
        traffic["inter" if crosses_nodes(hw, stride, lay.dp) else "intra"] += dp["total_bytes"]
        backward = m * layers * 2 * lt.compute
        window = backward + (m * layers * lt.compute if lay.zero >= 1 else 0.0)
        if lay.pp > 1:
            window = window * lay.virtual / m  # the last micro-batch of each chunk
        dp_time = dp["total_bytes"] / link_bw(hw, stride, lay.dp)
        dp_comm = max(0.0, dp_time - executor.overlap_dp * window)
    host = TR.host_traffic(model, lay, shape, activation_host_bytes)
    traffic["host"] += host
    terms = {
        "compute": compute,
        "recompute": recompute,
        "tp_comm": tp_comm,
        "sp_comm": sp_comm,
        "bubble": bubble,
        "pp_p2p": pp_p2p,
        "dp_comm": dp_comm,
        "offload": host / hw.host_to_device_bw,
    }
    del busy
    return Cost(terms, traffic, lt.efficiency, pf, flags)
