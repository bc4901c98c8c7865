"""Step time of one layout: every term stated, in seconds per optimizer step.

The busiest device's view (the first pipeline rank; ``L`` layers per rank, ``m`` micro-batches
of ``b`` sequences of ``s`` tokens per dp rank, ``tokens = b·s/sp`` local tokens):

* **One layer's forward** ``t_f``: each of its four weight matmuls (fused QKV, attention out,
  gate/up, down — local shapes after tp) takes FLOPs / (peak × efficiency at the size of the
  square matmul with its FLOPs per byte, :func:`matmul_size`) from the mesh file's curve
  (:mod:`jaxpar.planner.hardware`); the attention core's QKᵀ and PV run at the efficiency
  of the sequence length for a ``blockwise`` kernel, which also skips the masked half, and at
  that of the head dimension for ``dense``, which computes the whole s×s and moves its scores
  through HBM (``Executor.score_bytes`` per score); the memory-bound remainder (norms,
  residual adds, rope, activations, casts) is ``Executor.elementwise_passes`` × the layer's
  saved activation bytes / (HBM bandwidth × the GPU generation's ``elementwise_share``).
  Backward = 2 × forward; full recompute repeats the forward (and its tp/sp collectives).
* **Optimizer**: Adam reads params, gradients and both moments and writes three of them back
  (plus the compute-dtype copy): ``OPTIMIZER_BYTES`` per parameter the device updates, over
  the same memory-bound bandwidth.
* **Collectives** (:mod:`jaxpar.planner.comm`): every call priced with its latency
  (:mod:`jaxpar.planner.collectives`), for as many calls as the program makes, and hidden only
  behind the compute the schedule places beside it, up to that compute's length.
* **Pipeline**: the schedule library's makespan (lock-step for jaxpar's executor, asynchronous
  for other frameworks: :class:`jaxpar.planner.frameworks.Executor`) with the real action costs
  F, B (3F under full recompute), I and W (:func:`action_costs`), in units of the stage's
  forward, and the last stage's head and loss on that stage's actions (a third in its
  forward, two thirds in its backward): the last stage is the slowest, and a lock-step tick
  lasts as long as it.
* **Host transfers**: offloaded optimizer/params and activations over ``host_to_device_bw``.
* **Pipeline tick weights** (jaxpar's executor): each tick casts its chunk's weights and the
  backward adds its gradient into the fp32 accumulator (:func:`tick_weights`).
* **FP8** (``layout.fp8``): the weight matmuls at the FP8 peak, their operands' quantization,
  FP8 gathers and the scale all-reduces (:mod:`jaxpar.planner.fp8`).
* **jaxpar's program on a GPU** (:func:`jaxpar.planner.frameworks.for_target`): the kernels at
  the time model's published ceilings (``Executor.kernels``: :mod:`jaxpar.gpu.costs`, not the
  mesh curve fitted on published runs), memory-bound work at the HBM peak, the layer's passes
  and the per-parameter weight work its compiled program moves (:func:`weight_work`,
  :data:`jaxpar.planner.frameworks.PROGRAM_BYTES`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from jaxpar import sharding as shd
from jaxpar.analysis.theory import DTYPE_BYTES
from jaxpar.config import HardwareConfig, LayoutConfig, ModelConfig
from jaxpar.planner import comm as CM
from jaxpar.planner import fp8 as F8
from jaxpar.planner import moe as MOE
from jaxpar.planner import traffic as TR
from jaxpar.planner.activations import block_residuals, kv_heads_local
from jaxpar.planner.collectives import latencies
from jaxpar.planner.frameworks import JAXPAR, PROGRAM_BYTES, Executor, for_model
from jaxpar.planner.hardware import crosses_nodes, elementwise_share, matmul_efficiency
from jaxpar.planner.layer import LayerTime
from jaxpar.planner.pipe import ActionCosts, PipeFigures, figures
from jaxpar.planner.shapes import param_counts
from jaxpar.planner.workload import Shape

COMM_TERMS = ("tp_comm", "sp_comm", "pp_p2p", "dp_comm", "ep_comm")
OPTIMIZER_BYTES = 30.0  # Adam: read p, g, m, v (fp32), write p, m, v, and the bf16 copy
# HBM bytes per local parameter and micro-batch that jaxpar's pipeline tick program moves for
# its chunks' weights: the fp32 -> bf16 cast in the forward tick (read 4, write 2) and again in
# the backward tick (its recompute and input gradient read the bf16 copy; 6), and the fp32
# gradient accumulation of the backward (read the accumulator and the gradient, write: 12).
# The tick loop cannot hoist them: each layer's slice of the stack is cast where the layer
# uses it, in the forward and again in the backward, and its gradient added in the backward's
# layer scan (jaxpar.pipeline.stage). Checked against the time
# model's trace of a pipelined llama3-8b (BENCHMARKS.md, "The planner held to the program").
CAST_BYTES, ADD_BYTES = 6.0, 12.0
TICK_WEIGHT_BYTES = 2 * CAST_BYTES + ADD_BYTES


@dataclass
class Cost:
    """Step time by term (seconds), traffic by link (bytes per device per step), each
    communication term's exposed and hidden time, flags and the defaults taken."""

    terms: dict[str, float]
    traffic: dict[str, float]
    efficiency: float  # FLOP-weighted matmul efficiency of a layer
    comm: list[CM.CommTerm] = field(default_factory=list)
    pipe: PipeFigures | None = None
    flags: list[str] = field(default_factory=list)
    assumed: list[str] = field(default_factory=list)

    @property
    def step_time(self) -> float:
        """Sum of the exposed terms."""
        return sum(self.terms.values())


def matmul_size(m: float, k: float, n: float) -> float:
    """The side of the square matmul with the same FLOPs per byte as [m, k] @ [k, n]:
    ``3·mkn / (mk + kn + mn)`` (a g×g×g matmul does g/3 FLOPs per bf16 byte). A tp-sliced
    [tokens, d] @ [d, f/t] is as compute-bound as its larger dimensions make it, not as its
    smallest one."""
    return 3 * m * k * n / (m * k + k * n + m * n)


def matmul_share(hw: HardwareConfig, size: float, ex: Executor = JAXPAR, fp8: bool = False
                 ) -> float:  # fmt: skip
    """Share of peak a matmul of ``size`` (:func:`matmul_size`) sustains for ``ex``: the time
    model's published ceilings under the roofline (:func:`jaxpar.gpu.costs.matmul_share`, FP8's
    for an FP8 GEMM) when ``ex.kernels`` is ``published``, else the mesh file's curve (on a
    GPU, its ceiling fitted on published runs: ``Executor.kernels``)."""
    if ex.kernels == "published":
        from jaxpar.gpu import costs

        return (costs.fp8_matmul_share if fp8 else costs.matmul_share)(hw, size)
    return matmul_efficiency(hw, size)


def _matmul(hw: HardwareConfig, m: float, k: float, n: float, peak: float | None = None,
            ex: Executor = JAXPAR) -> tuple[float, float]:  # fmt: skip
    """(seconds, FLOPs) of an [m, k] @ [k, n] matmul against ``peak`` (default: bf16's)."""
    flops = 2 * m * k * n
    fp8 = bool(peak) and peak != hw.peak_flops_bf16
    peak = peak or hw.peak_flops_bf16
    return flops / (peak * matmul_share(hw, matmul_size(m, k, n), ex, fp8)), flops


def memory_bound_bw(hw: HardwareConfig, share: float | None = None, ex: Executor | None = None
                    ) -> float:  # fmt: skip
    """Bytes/s the memory-bound remainder sustains: ``hbm_bw`` × the generation's
    ``elementwise_share`` (or ``share``); the HBM peak for an executor whose kernels are the
    time model's (``Executor.kernels`` = ``published``: :mod:`jaxpar.gpu.costs` prices a fusion's
    bytes at ``hbm_bw``)."""
    if ex is not None and ex.kernels == "published":
        return hw.hbm_bw
    return hw.hbm_bw * (elementwise_share(hw) if share is None else share)


# A flash attention backward runs 2.5x its forward's FLOPs (FlashAttention-2, Dao 2023, §3.1:
# five matmuls against two); jaxpar.gpu.costs prices cuDNN's backward so.
FLASH_BACKWARD = 2.5


def _attention(model, hw, lay, ex, tokens: float, s: int, q: float, mem_bw: float) -> float:
    """Seconds of the attention core's forward for ``tokens`` local tokens."""
    ring = lay.sp > 1 and lay.sp_mode == "ring"
    visible = (lay.sp + 1) / (2 * lay.sp) if ring else 1.0  # ring skips fully masked blocks
    if ex.attention == "blockwise":  # masked blocks skipped: half of a causal s×s
        if ex.kernels == "published":
            from jaxpar.gpu.costs import attention_share

            return 2 * tokens * s * q / (hw.peak_flops_bf16 * attention_share(hw, s))
        return 2 * tokens * s * q / (hw.peak_flops_bf16 * matmul_efficiency(hw, s))
    attn_flops = 4 * tokens * s * q * visible
    scores = tokens * s * model.n_heads / lay.tp * ex.score_bytes * visible
    return attn_flops / (hw.peak_flops_bf16 * matmul_efficiency(hw, model.hd)) + scores / mem_bw


def layer_time(
    model: ModelConfig,
    hw: HardwareConfig,
    lay: LayoutConfig,
    shape: Shape,
    ex: Executor,
    mem_bw: float | None = None,
) -> LayerTime:
    """Forward time of one layer and its tp/sp collectives (module docstring)."""
    mem_bw = mem_bw or memory_bound_bw(hw, None, ex)
    b = shape.microbatch_size(lay) or 1
    tokens, s, t, d, hd = b * shape.seq / lay.sp, shape.seq, lay.tp, model.d_model, model.hd
    q = model.n_heads * hd / t
    kv = kv_heads_local(model, lay) * hd
    ff = model.d_ff / t * (2 if model.mlp == "swiglu" else 1)
    mats = [(tokens, d, q + 2 * kv), (tokens, q, d), (tokens, d, ff), (tokens, model.d_ff / t, d)]
    peak = F8.gemm_peak(hw, lay)  # FP8's under layout.fp8 (jaxpar.planner.fp8)
    secs, flops = zip(*(_matmul(hw, *x, peak, ex) for x in mats), strict=True)
    if peak != hw.peak_flops_bf16 and (f8 := F8.share(model, lay)) < 1:  # bf16 end blocks
        bf16 = [_matmul(hw, *x, None, ex)[0] for x in mats]
        secs = tuple(f8 * a + (1 - f8) * b_ for a, b_ in zip(secs, bf16, strict=True))
    eff = sum(flops) / sum(secs) / peak
    attn = _attention(model, hw, lay, ex, tokens, s, q, mem_bw)
    res = block_residuals(model, lay, s, "blockwise", "none")
    wc = DTYPE_BYTES[lay.compute_dtype]
    act_bytes = res.bytes(tokens, wc) - res.weights * wc
    passes, transposes, unsaved = ex.elementwise_passes, 0.0, 0.0
    # Megatron-SP's tp collectives: the bf16 collective matmul's rings (not inside a
    # pipeline's ticks: jaxpar.model.collective_matmul.axes), the FP8 rings where ZeRO-3
    # crosses nodes (jaxpar.sharding.fp8_rings), else GSPMD's gathers and reduce-scatters
    sp_ = lay.sequence_parallel and lay.tp > 1
    bf16_rings = sp_ and not F8.on(lay) and lay.pp == 1
    gspmd8 = F8.on(lay) and not shd.fp8_rings(lay, hw)
    if ex.program_bytes:  # what XLA's fusions of jaxpar's layer move (frameworks.PROGRAM_BYTES)
        # Megatron-SP's passes: the bf16 rings', the FP8 rings' (chunks of one byte), GSPMD's
        # FP8 gathers', or GSPMD's bf16 gathers' inside a pipeline's ticks
        if bf16_rings:
            sp_passes = PROGRAM_BYTES.sp_act_passes
        elif F8.on(lay):
            sp_passes = (
                PROGRAM_BYTES.fp8_sp_act_passes if gspmd8 else PROGRAM_BYTES.fp8_ring_act_passes
            )
        else:
            sp_passes = PROGRAM_BYTES.pipe_sp_act_passes
            if sp_ and b > 1:
                # a gather over tp along the sequence of [b, s, d] lands sequence-major and is
                # transposed for its consumer (and the reverse for a reduce-scatter's input):
                # PROGRAM_BYTES.sp_transpose_passes of the gathered hidden state a layer
                transposes = PROGRAM_BYTES.sp_transpose_passes * tokens * d * wc
        # each measured without recompute; a backward that does not read saved residuals
        # back moves fewer passes, the recompute's own memory-bound work included (measured
        # on dense layers, not on a MoE layer)
        if not model.moe.enabled:
            unsaved = PROGRAM_BYTES.unsaved_passes(lay.remat)
        passes = ((sp_passes if sp_ else PROGRAM_BYTES.act_passes) - unsaved) / 3
    quant = F8.quant_bytes(model, lay, tokens)
    elementwise = (passes * act_bytes + transposes / 3 + quant) / mem_bw
    recompute = 0.0  # forward work the backward re-runs
    compute = sum(secs) + attn + elementwise
    if lay.remat == "full":
        recompute = compute
        if unsaved:  # its memory-bound work is in the passes; its quantization is not
            recompute = sum(secs) + attn + quant / mem_bw
        if ex.recompute_drops_dead and not model.moe.enabled:
            # the output and down projections' products are dead in the backward (XLA drops
            # them): llama3-70b dp 1024 ZeRO-3 on h100-1024 at 8 layers, the program's matmuls
            # 0.613 s against 0.677 s priced with them (Executor.recompute_drops_dead)
            recompute -= secs[1] + secs[3]
    elif lay.remat == "selective" and ex.attention == "blockwise" and ex.selective_reruns_kernel:
        # selective keeps matmul outputs only: the blockwise kernel's forward (a custom_vjp,
        # no dot of its own) runs again in the backward
        recompute = attn
    tp, sp = CM.tp_calls(model, hw, lay, shape), CM.sp_calls(model, hw, lay, shape)
    # the collective matmul's rings hide a share of the tp calls inside one node
    # (frameworks.RING_HIDDEN: across nodes a ring step's send outlasts its chunk matmul); under
    # FP8 without the rings XLA's scheduler hides a share of GSPMD's gathers and
    # reduce-scatters (frameworks.FP8_TP_HIDDEN, measured inside one node only)
    # without SP, GSPMD's all-reduces hide behind the kernels that do not need their result
    # (frameworks.NOSP_TP_HIDDEN; measured with bf16 GEMMs inside one node only)
    ring = 0.0
    if lay.tp > 1 and not crosses_nodes(hw, 1, lay.tp):
        if lay.sequence_parallel and not F8.on(lay) and not bf16_rings:
            # GSPMD's bf16 gathers inside a pipeline's ticks
            ring = ex.pipe_sp_share(lay.tp, lay.zero == 3 and lay.dp > 1)
        elif lay.sequence_parallel:
            ring = ex.fp8_tp_hidden if gspmd8 else ex.ring_hidden
        elif not F8.on(lay):
            ring = ex.nosp_tp_hidden
    # a flash kernel's backward beyond twice its forward, as the time model prices it
    extra = (FLASH_BACKWARD - 2) * attn if ex.kernels == "published" else 0.0
    # the weight groups ZeRO-3 gathers one at a time (jaxpar.planner.zero3): QKV with the
    # attention core after it, the output, then the MLP's gate and up (two weights, two
    # gathers) and down; the memory-bound work spread evenly over them
    params = [d * (q + 2 * kv), q * d, d * ff, model.d_ff / t * d]
    groups = [(secs[0] + attn, params[0]), (secs[1], params[1])]
    halves = 2 if model.mlp == "swiglu" else 1
    groups += [(secs[2] / halves, params[2] / halves)] * halves + [(secs[3], params[3])]
    groups = [(s_ + elementwise / len(groups), p_) for s_, p_ in groups]
    # ZeRO-3's gathers start at a group's last ring chunk under the bf16 rings; beside the FP8
    # rings' chunks the program's dp waits are GSPMD's (llama3-70b dp 128 x tp 8 + SP delayed
    # on h100-1024, 8 layers: dp exposed 0.089 s with GSPMD's FP8 gathers, 0.093 s with rings)
    rings = bf16_rings
    return LayerTime(compute=compute, matmul=sum(secs) + attn, attention=attn, tp=tp, sp=sp,
                     efficiency=eff, recompute=recompute, overlap_tp=ex.overlap_tp,
                     ring_hidden=ring, backward_extra=extra, weight_groups=tuple(groups),
                     chunks=lay.tp if rings else 1)  # fmt: skip


def moe_ffn_delta(model: ModelConfig, hw: HardwareConfig, lay: LayoutConfig, shape: Shape,
                  ex: Executor = JAXPAR) -> float:  # fmt: skip
    """Forward seconds a MoE block adds over the dense block :func:`layer_time` prices: the
    routed experts' einsums on every dispatch slot (padding included, :mod:`jaxpar.planner.
    moe`), the shared experts and the router, less the dense FFN."""
    b = shape.microbatch_size(lay) or 1
    tokens, d, t = b * shape.seq / lay.sp, model.d_model, lay.tp
    slots = MOE.slots(model, b, shape.seq)
    e = model.moe
    f, shared = model.expert_ff / t, e.shared_experts * model.expert_ff / t

    def mm(m: float, k: float, n: float) -> float:
        return _matmul(hw, m, k, n, None, ex)[0]

    secs = mm(slots, d, 2 * f) + mm(slots, f, d)
    if shared:
        secs += mm(tokens, d, 2 * shared) + mm(tokens, shared, d)
    secs += mm(tokens, d, e.experts)
    dense_f = model.d_ff / t
    dense = mm(tokens, d, 2 * dense_f) + mm(tokens, dense_f, d)
    return secs - dense


def head_time(model: ModelConfig, hw: HardwareConfig, lay: LayoutConfig, shape: Shape,
              mem_bw: float, ex: Executor = JAXPAR) -> float:  # fmt: skip
    """Head matmul, fp32 loss work and backward of one micro-batch (last pipeline stage). A
    ``chunked`` loss over more than one chunk keeps no logits: each chunk's backward computes
    its logits again (``jaxpar.model.llama``: the chunk body saves nothing), a fourth matmul."""
    b = shape.microbatch_size(lay) or 1
    # the padded vocabulary when tp does not divide it (ModelConfig.padded_vocab)
    tokens, vocab = b * shape.seq / lay.sp, model.padded_vocab(lay.tp) / lay.tp
    fwd, _ = _matmul(hw, tokens, model.d_model, vocab, None, ex)
    loss = 6 * tokens * vocab * 4 / mem_bw  # logits, softmax and its gradient in fp32
    again = ex.loss == "chunked" and shape.seq > ex.loss_chunk
    return (4 if again else 3) * fwd + loss


def unsplit(lay: LayoutConfig, executor: Executor = JAXPAR) -> bool:
    """Whether ``executor``'s split backward leaves every weight gradient of ``lay``'s layers in
    ``I`` (``Executor.split_sees_plain_dots``: jaxpar's weight matmuls are each inside a custom
    VJP of their own under Megatron-SP with tp > 1 — the collective matmul's rings — and under
    an FP8 recipe)."""
    if not executor.split_sees_plain_dots:
        return False
    return (lay.sequence_parallel and lay.tp > 1) or F8.on(lay)


def action_costs(
    lay: LayoutConfig, executor: Executor = JAXPAR, lt: LayerTime | None = None
) -> ActionCosts:
    """F, B, I, W of a stage in units of its forward (exposed communication included when
    ``lt``). Where the split backward cannot separate the weight matmuls (:func:`unsplit`),
    ``I`` is the whole backward and ``W`` nothing (its gradient accumulation is added by
    :func:`_pipeline`)."""
    full = lay.remat == "full"
    if lt is None:
        r = 1.0 if full else 0.0
        i = executor.i_cost + (r if executor.recompute_in_i else 0.0)
        if unsplit(lay, executor):
            return ActionCosts(b=2.0 + r, i=2.0 + r, w=0.0)
        return ActionCosts(b=2.0 + r, i=i, w=executor.w_cost)
    f = lt.forward
    bwd_comm = lt.backward_comm
    # a full recompute repeats the forward's exposed calls and its (live) compute
    recompute = f - lt.compute + lt.recompute if full else lt.recompute
    b = lt.backward + bwd_comm + recompute
    if unsplit(lay, executor):
        return ActionCosts(b=b / f, i=b / f, w=0.0)
    i = (executor.i_cost * lt.compute + lt.backward_extra + bwd_comm
         + (recompute if executor.recompute_in_i else 0))  # fmt: skip
    return ActionCosts(b=b / f, i=i / f, w=executor.w_cost * lt.compute / f)


def optimizer_time(model: ModelConfig, lay: LayoutConfig, mem_bw: float) -> float:
    """Seconds of the Adam update on the device (0 when the optimizer lives on the host)."""
    if lay.offload != "none":
        return 0.0
    held = param_counts(model, lay).held("optimizer")
    return OPTIMIZER_BYTES * held / mem_bw


def weight_work(model: ModelConfig, lay: LayoutConfig, mem_bw: float, ex: Executor) -> float:
    """Seconds jaxpar's compiled step (no pipeline) spends on its weights beyond the optimizer
    update (:func:`optimizer_time`) and the activations: per local parameter of the blocks and
    the head, :data:`~jaxpar.planner.frameworks.PROGRAM_BYTES`'s bytes for the ZeRO stage and
    the micro-batches (weight slices and casts, weight-gradient writes and accumulation), less
    the optimizer's ``OPTIMIZER_BYTES`` per parameter it updates, which those bytes include.
    Zero for other executors and for pipelines (their tick program's weight work is
    :func:`tick_weights`)."""
    if not ex.program_bytes or lay.pp > 1:
        return 0.0
    pc = param_counts(model, lay)
    stage = lay.zero if pc.zero_shards > 1 else 0  # one device in the dp group: nothing sharded
    n = pc.blocks + pc.local_of("head")
    per = PROGRAM_BYTES.weight_bytes(stage).per_param(lay.microbatches)
    optimizer = 0.0 if lay.offload != "none" else OPTIMIZER_BYTES * pc.held("optimizer") / pc.local
    return max(0.0, n * (per - optimizer)) / mem_bw


def tick_params(model: ModelConfig, lay: LayoutConfig) -> float:
    """Parameters whose weights the busiest rank of a pipeline casts, and whose gradients it
    adds, every micro-batch: its layers, and the embedding or the head, whichever is larger
    (stage-owned: each lives on the rank of the stage that uses it, jaxpar.pipeline.rest).
    Under ZeRO-3 their shards: each gather casts the shard it sends, and the accumulated
    gradients are shards."""
    pc = param_counts(model, lay)
    n = pc.blocks + max(pc.local_of("embed"), pc.local_of("head"))
    return n * (pc.sharded / pc.local if lay.zero >= 3 else 1.0)


def tick_weights(model: ModelConfig, lay: LayoutConfig, mem_bw: float, ex: Executor) -> float:
    """Seconds a jaxpar pipeline's tick program spends casting its chunks' weights and
    accumulating their gradients on its busiest rank (``TICK_WEIGHT_BYTES`` per parameter of
    :func:`tick_params` and micro-batch). Not priced outside a pipeline (not measured there)
    or for other frameworks."""
    if lay.pp == 1 or not ex.follows_model:
        return 0.0
    return lay.microbatches * TICK_WEIGHT_BYTES * tick_params(model, lay) / mem_bw


def tick_slots(
    model: ModelConfig,
    lay: LayoutConfig,
    shape: Shape,
    mem_bw: float,
    ex: Executor,
    pf: PipeFigures | None,
) -> float:
    """Seconds jaxpar's pipeline tick spends outside its actions, on every rank each tick
    (slot reads, arrivals filed, ``I``'s cotangents written): ``PROGRAM_BYTES.tick_passes``
    (``split_tick_passes`` for a split backward) times the saved activations of one chunk's
    layers, per tick of the table. Only for jaxpar's program on a GPU (``program_bytes``)."""
    if pf is None or lay.pp == 1 or not ex.program_bytes:
        return 0.0
    b = shape.microbatch_size(lay) or 1
    res = block_residuals(model, lay, shape.seq, "blockwise", "none")
    wc = DTYPE_BYTES[lay.compute_dtype]
    act = res.bytes(b * shape.seq / lay.sp, wc) - res.weights * wc
    chunk = model.n_layers / (lay.pp * lay.virtual)
    passes = PROGRAM_BYTES.split_tick_passes if pf.split else PROGRAM_BYTES.tick_passes
    return pf.ticks * passes * chunk * act / mem_bw


def _pipeline(model, hw, lay, shape, ex, lt, costs, moe_fwd=0.0, head=0.0, mem_bw=None) -> tuple:
    """(figures, bubble seconds, pipeline comm terms) of a pipeline layout; ``moe_fwd``: a
    rank's MoE forward beyond its dense FFNs for one micro-batch; ``head``: the last stage's
    head and loss for one micro-batch (:func:`head_time`); ``mem_bw`` the memory-bound
    bandwidth (:func:`memory_bound_bw`)."""
    if lay.pp == 1:
        return None, 0.0, []
    layers = model.n_layers // lay.pp
    f_stage = layers * lt.forward + moe_fwd
    costs = replace(costs, head=(head / 3 / f_stage, 2 * head / 3 / f_stage))
    if tick_weights(model, lay, 1.0, ex) > 0:
        # The tick's weight work lands on the actions that do it (a lock-step tick lasts as
        # long as its costliest rank's action): a cast in F and in I (or B), the gradient's
        # accumulation in W (or B). Its seconds are the tick_weights term; here it shapes the
        # schedule's makespan.
        mem_bw = mem_bw or memory_bound_bw(hw, None, ex)
        local = tick_params(model, lay) / mem_bw / f_stage
        cast, add = CAST_BYTES * local, ADD_BYTES * local
        in_i = add if unsplit(lay, ex) else 0.0  # I computes (and adds) every weight gradient
        costs = replace(costs, f=1.0 + cast, b=costs.b + cast + add, i=costs.i + cast + in_i,
                        w=costs.w + add - in_i)  # fmt: skip
    pf = figures(lay.schedule, lay.pp, lay.microbatches, lay.virtual, costs, ex.lockstep,
                 memory=lay.pipeline_memory)  # fmt: skip
    bubble = max(0.0, (pf.makespan - pf.busy) * f_stage)
    tick = f_stage / lay.virtual  # one chunk's forward: the compute beside a send
    return pf, bubble, [CM.pp_term(model, hw, lay, shape, pf.sends, tick, ex.overlap_p2p)]


def step_cost(
    model: ModelConfig,
    hw: HardwareConfig,
    lay: LayoutConfig,
    shape: Shape,
    executor: Executor = JAXPAR,
    activation_host_bytes: float = 0.0,
    elementwise: float | None = None,
) -> Cost:
    """Cost terms of ``lay`` on ``hw`` (module docstring); ``elementwise`` replaces the GPU
    generation's ``elementwise_share`` (the fit of :mod:`jaxpar.planner.published`)."""
    executor = for_model(model, executor)
    mem_bw = memory_bound_bw(hw, elementwise, executor)
    lt = layer_time(model, hw, lay, shape, executor, mem_bw)
    layers, m = model.n_layers // lay.pp, lay.microbatches
    head = head_time(model, hw, lay, shape, mem_bw, executor)
    costs = action_costs(lay, executor, lt)
    moe_fwd = 0.0  # this rank's MoE layers (a pipeline stage holds pp-th of them)
    if model.moe.enabled:
        moe_fwd = model.moe_layers() // lay.pp * moe_ffn_delta(model, hw, lay, shape, executor)
    pf, bubble, pp_terms = _pipeline(model, hw, lay, shape, executor, lt, costs, moe_fwd, head,
                                     mem_bw)  # fmt: skip
    comm = [*CM.layer_terms(lt, layers * m, lay.remat == "full"), *pp_terms]
    comm += CM.dp_terms(model, hw, lay, shape, lt, executor)
    comm += CM.sp_grad_terms(model, hw, lay, executor)
    if model.moe.enabled and lay.ep > 1:
        comm.append(CM.ep_term(model, hw, lay, shape))
    host = TR.host_traffic(model, lay, shape, activation_host_bytes)
    terms = {
        "compute": m * (layers * (lt.compute + lt.backward) + 3 * moe_fwd + head),
        "recompute": m * (layers * lt.recompute + (moe_fwd if lay.remat == "full" else 0.0)),
        "optimizer": optimizer_time(model, lay, mem_bw),
        "weights": weight_work(model, lay, mem_bw, executor),
        "tick_weights": tick_weights(model, lay, mem_bw, executor),
        "tick_slots": tick_slots(model, lay, shape, mem_bw, executor, pf),
        "bubble": bubble,
        "offload": host / hw.host_to_device_bw,
        **{name: 0.0 for name in COMM_TERMS},
    }
    traffic = {"intra": 0.0, "inter": 0.0, "host": host}
    flags: list[str] = []
    for c in comm:
        terms[c.name] = terms.get(c.name, 0.0) + c.exposed_s
        traffic[c.link] += c.bytes
        if c.link == "inter" and c.name in ("tp_comm", "sp_comm") and c.bytes:
            flags.append(f"{c.name[:2]} group spans nodes ({hw.devices_per_node} per node)")
    assumed = latencies(hw)[2] if any(c.calls for c in comm) else []
    return Cost(terms, traffic, lt.efficiency, comm, pf, flags, assumed)
