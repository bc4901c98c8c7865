"""Every collective a step issues, per call, and how much of it hides behind compute.

Calls are counted as the compiled program makes them and priced by
:func:`jaxpar.planner.collectives.call_time` (latency per step + bytes over bandwidth). Overlap
is not assumed: a call hides only behind the compute the schedule places beside it, up to that
compute's length; the rest is exposed and adds to the step.

* **tp** (per layer and micro-batch): two all-reduces in the forward and two in the backward
  (Megatron-SP: an all-gather and a reduce-scatter each, and in the backward the two
  column-parallel inputs all-gathered again for their weight gradients — the remat policies
  recompute data movement rather than keep the gathered copy, as Megatron-LM does — unless a
  full recompute gathered them already). A full recompute repeats the forward's calls, less
  the second all-reduce without SP (the layer's output is dead in the backward; under SP
  XLA:GPU keeps its reduce-scatter). The embedding lookup's one all-reduce per micro-batch is
  not counted. Hidden only by an executor that overlaps them with the matmuls
  (``Executor.overlap_tp``, collective matmuls). jaxpar's step does so under SP since its
  collective matmul (:mod:`jaxpar.model.collective_matmul`), inside one node: the share
  of the calls its rings hide in the compiled XLA:GPU program is ``Executor.ring_hidden``
  (:data:`jaxpar.planner.frameworks.RING_HIDDEN`). Without SP an all-reduce cannot hide
  behind its own matmul, but XLA:GPU's scheduler hides most of them behind the kernels that do
  not need their result (``Executor.nosp_tp_hidden``,
  :data:`jaxpar.planner.frameworks.NOSP_TP_HIDDEN`), inside one node.
  As compiled by XLA:GPU (llama3-8b, tp 8, per layer): with SP 6 all-gathers and 4
  reduce-scatters under none and selective, 6 and 6 under full; without SP 4 all-reduces under
  none, 5 under full.
* **sp**: Ulysses' four all-to-alls per pass, or ring attention's ``sp − 1`` K/V sends; and
  the weight gradients: replicated over sp, each device's are partial sums over its sequence
  shard, which GSPMD all-reduces over sp where the weight-gradient matmuls produce them — per
  layer and micro-batch, in the compute dtype, the embedding and head tables too (XLA:GPU,
  llama3-8b Ulysses sp 8: 26.2 GiB of bf16 all-reduces a step, 6× the all-to-alls), exposed.
* **dp, ZeRO-3**: per layer and micro-batch an all-gather in the forward (the next layer's,
  prefetched behind this layer's forward), an all-gather and a reduce-scatter in the backward
  (behind this layer's backward); the first gather of each pass and the last reduce-scatter
  have nothing before them and are exposed, as are the embedding/head gathers. jaxpar's
  program on a GPU (``Executor.zero3_stream``): one gather per weight group, each one kernel
  ahead of its consumer, and the layer's reduce-scatter, walked on one collective stream
  (:mod:`jaxpar.planner.zero3`).
* **dp, ZeRO 0-2**: the gradient reduction split into buckets by XLA's combiner thresholds
  (:func:`jaxpar.planner.collectives.combined_calls`), hidden behind one micro-batch's backward
  (ZeRO 0/1 reduce after the last micro-batch; ZeRO-2 after each), the last bucket exposed;
  for an executor that reduces ZeRO 0/1's accumulator after the last backward
  (``Executor.reduce_after_backward``, jaxpar) nothing hides it;
  ZeRO 1/2's all-gather of the updated params exposed unless the executor overlaps it with the
  next step's first forward. Hybrid sharding adds an exposed all-reduce across the groups.
* **ep** (MoE, :mod:`jaxpar.planner.moe`): per MoE layer and micro-batch the dispatch and
  combine all-to-alls of the padded ``[E, b, C, D]`` buffer forward, their transposes backward
  (and the forward pair again under any remat policy), over the ep group (``sp·tp`` apart);
  exposed: the experts' einsums wait for the dispatch and the combine waits for them.
* **pp**: one send per message the schedule table makes, hidden behind the tick's compute only
  for an executor that overlaps point-to-point with compute.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from jaxpar.analysis import theory as T
from jaxpar.analysis.theory import DTYPE_BYTES
from jaxpar.config import HardwareConfig, LayoutConfig, ModelConfig
from jaxpar.planner import fp8 as F8
from jaxpar.planner import moe as MOE
from jaxpar.planner import zero3 as Z3
from jaxpar.planner.activations import kv_heads_local
from jaxpar.planner.collectives import call_time, combined_calls
from jaxpar.planner.frameworks import Executor, reduces_layers_in_backward
from jaxpar.planner.hardware import crosses_nodes
from jaxpar.planner.layer import Calls, LayerTime
from jaxpar.planner.shapes import param_counts
from jaxpar.planner.traffic import pp_message_bytes
from jaxpar.planner.workload import Shape


@dataclass(frozen=True)
class CommTerm:
    """One kind of collective of a step, on the busiest device."""

    name: str  # the step term it adds to: tp_comm, sp_comm, dp_comm or pp_p2p
    label: str  # what the calls are
    bytes: float  # wire bytes per device per step
    calls: float  # calls per step
    seconds: float  # all of them, latency included
    latency_s: float  # the latency part of ``seconds``
    hidden_s: float  # behind compute the schedule places beside them
    link: str  # "intra" (NVLink) or "inter" (the network)
    algorithm: str  # NCCL's choice for one call (ring/tree, simple/ll128)
    behind: str  # the compute that hides it

    @property
    def exposed_s(self) -> float:
        """Seconds the step waits for these calls."""
        return max(0.0, self.seconds - self.hidden_s)

    def to_dict(self) -> dict:
        """The JSON object (``exposed_s`` included)."""
        return {**asdict(self), "exposed_s": self.exposed_s}


def _tokens(lay: LayoutConfig, shape: Shape) -> float:
    """A micro-batch's local tokens on one device (before Megatron-SP's split)."""
    return (shape.microbatch_size(lay) or 1) * shape.seq / lay.sp


def _link(hw: HardwareConfig, stride: int, size: int) -> str:
    return "inter" if crosses_nodes(hw, stride, size) else "intra"


def _calls(hw, kinds: list[tuple[str, float]], size: int, stride: int) -> tuple:
    """(seconds, latency, wire bytes, algorithm) of a sequence of (kind, wire bytes) calls."""
    secs = lat = nbytes = 0.0
    algo = "none"
    for kind, wire in kinds:
        ct = call_time(hw, kind, wire, size, stride)
        secs, lat, nbytes = secs + ct.seconds, lat + ct.latency_s, nbytes + wire
        algo = f"{ct.algorithm}/{ct.protocol}"
    return secs, lat, nbytes, algo


def _pass_calls(hw, kinds, size: int, stride: int, label: str) -> Calls:
    """A pass's calls, the same in forward and backward."""
    secs, lat, nbytes, algo = _calls(hw, kinds, size, stride)
    return Calls(secs, secs, lat, lat, len(kinds), len(kinds), nbytes, nbytes,
                 _link(hw, stride, size), algo, label)  # fmt: skip


def tp_calls(model: ModelConfig, hw: HardwareConfig, lay: LayoutConfig, shape: Shape) -> Calls:
    """One layer's tensor-parallel calls per micro-batch (module docstring)."""
    if lay.tp == 1:
        return Calls()
    b = shape.microbatch_size(lay) or 1
    elems = b * shape.seq / lay.sp * model.d_model
    buf = elems * DTYPE_BYTES[lay.compute_dtype]
    r, full = T.ring_factor(lay.tp), lay.remat == "full"
    amax = F8.amax_calls(model, lay, b * shape.seq / lay.sp).get("tp", F8.AmaxCalls())
    scale = ("all-reduce", 2 * amax.bytes * r)  # FP8 scales' max over tp (jaxpar.planner.fp8)
    if lay.sequence_parallel:
        # under FP8 the gathers move FP8 values (jaxpar.model.fp8), the reduce-scatters not
        gather = ("all-gather", elems * F8.gather_bytes(lay, DTYPE_BYTES[lay.compute_dtype]) * r)
        scatter = ("reduce-scatter", buf * r)
        fwd = [gather, scatter] * 2
        # backward: dx's reduce-scatters, dy's all-gathers, and the inputs gathered again
        # (by the full recompute, counted as the forward repeated, when there is one)
        bwd = [scatter, gather] * 2 + ([] if full else [gather] * 2)
        if lay.fp8 == "rowwise":  # dy gathered twice: per row for dx, per column for dW
            bwd += [gather] * 2
        kind = "all-gather + reduce-scatter (Megatron-SP)"
    else:
        fwd = [("all-reduce", 2 * buf * r)] * 2
        bwd = fwd[:1] if full else fwd  # the recompute's second all-reduce is dead
        kind = "all-reduce"
    fwd, bwd = fwd + [scale] * amax.fwd, bwd + [scale] * amax.bwd
    f, b = _calls(hw, fwd, lay.tp, 1), _calls(hw, bwd, lay.tp, 1)
    # Current scaling (tensorwise, rowwise) quantizes with the max it has just taken: its GEMMs
    # wait for these calls. A delayed recipe's maxes go to the history, off the GEMMs' path.
    on_path = F8.on(lay) and lay.fp8 != "delayed"
    sync = [_calls(hw, [scale] * k, lay.tp, 1)[0] if on_path and k else 0.0
            for k in (amax.fwd, amax.bwd)]  # fmt: skip
    return Calls(f[0], b[0], f[1], b[1], len(fwd), len(bwd), f[2], b[2], _link(hw, 1, lay.tp),
                 f[3], kind, *sync)  # fmt: skip


def sp_calls(model: ModelConfig, hw: HardwareConfig, lay: LayoutConfig, shape: Shape) -> Calls:
    """One layer's sequence-parallel calls per micro-batch: Ulysses or ring."""
    if lay.sp == 1:
        return Calls()
    w, b = DTYPE_BYTES[lay.compute_dtype], shape.microbatch_size(lay) or 1
    q = model.n_heads * model.hd // lay.tp
    kv = int(kv_heads_local(model, lay) * model.hd)
    if lay.sp_mode == "ulysses":
        el = T.ulysses_comm_elements_per_layer(b * shape.seq, q, lay.sp, kv)
        per = el["wire"] / 2 * w / 4  # q, k, v in and o out: four all-to-alls a pass
        return _pass_calls(hw, [("all-to-all", per)] * 4, lay.sp, lay.tp, "all-to-all (Ulysses)")
    el = T.ring_attention_comm_elements_per_layer(b * shape.seq, kv, lay.sp, False)
    steps = lay.sp - 1
    fwd = _calls(hw, [("send", el["forward"] * w / steps)] * steps, lay.sp, lay.tp)
    bwd = _calls(hw, [("send", el["backward"] * w / steps)] * steps, lay.sp, lay.tp)
    return Calls(fwd[0], bwd[0], fwd[1], bwd[1], steps, steps, fwd[2], bwd[2],
                 _link(hw, lay.tp, lay.sp), fwd[3], "K/V sends (ring attention)")  # fmt: skip


def _tables(pc, lay: LayoutConfig) -> float:
    """Parameters of the embedding, head and final norm on the busiest device: all of them,
    or inside a pipeline the larger of the first stage's embedding and the last's head."""
    if lay.pp > 1:
        return float(max(pc.local_of("embed"), pc.local_of("head")))
    return float(pc.local - pc.blocks)


def sp_grad_terms(model: ModelConfig, hw: HardwareConfig, lay: LayoutConfig,
                  ex: Executor) -> list[CommTerm]:  # fmt: skip
    """The all-reduce over sp of every weight gradient's partial sum (module docstring): one
    per layer and one per table, each micro-batch, nothing beside them; none for an executor
    that reduces them with the data-parallel gradients (``Executor.sp_grads_per_layer``)."""
    if lay.sp == 1 or not ex.sp_grads_per_layer:
        return []
    pc, layers, m = param_counts(model, lay), model.n_layers // lay.pp, lay.microbatches
    tables = _tables(pc, lay)
    r, wc = T.ring_factor(lay.sp), DTYPE_BYTES[lay.compute_dtype]
    calls = [("all-reduce", 2 * pc.blocks / layers * r * wc)] * layers
    n_tables = 1 if model.tied_embeddings or lay.pp > 1 else 2
    calls += [("all-reduce", 2 * tables / n_tables * r * wc)] * n_tables if tables else []
    secs, lat, wire, algo = _calls(hw, calls, lay.sp, lay.tp)
    return [CommTerm("sp_comm", "weight-gradient all-reduce over sp (per layer)", m * wire,
                     m * len(calls), m * secs, m * lat, 0.0, _link(hw, lay.tp, lay.sp), algo,
                     "nothing (not overlapped)")]  # fmt: skip


def layer_terms(lt: LayerTime, n: int, full_remat: bool) -> list[CommTerm]:
    """The tp and sp terms of ``n`` layer-micro-batches (a full recompute repeats the
    forward's calls, exposed as the forward's are)."""
    out = []
    for name, c in (("tp_comm", lt.tp), ("sp_comm", lt.sp)):
        reps, axis = 2 if full_remat else 1, name[:2]
        hid = reps * lt.hidden(axis) + lt.hidden(axis, True)
        out.append(CommTerm(
            name, c.kind or "none", n * (reps * c.fwd_bytes + c.bwd_bytes),
            n * (reps * c.fwd_calls + c.bwd_calls), n * (reps * c.fwd_s + c.bwd_s),
            n * (reps * c.fwd_latency_s + c.bwd_latency_s), n * hid, c.link, c.algorithm,
            "the compute they pair with" if hid else "nothing (not overlapped)"))  # fmt: skip
    return out


def pp_term(model, hw, lay, shape, sends: int, tick: float, overlap: bool) -> CommTerm:
    """Pipeline sends of one step; hidden behind a tick's compute when ``overlap``."""
    stride = lay.dp * lay.sp * lay.tp
    msg = pp_message_bytes(model, lay, shape)
    ct = call_time(hw, "send", msg, lay.pp, stride)
    hidden = sends * min(ct.seconds, tick) if overlap else 0.0
    return CommTerm("pp_p2p", "activation/cotangent sends", sends * msg, sends,
                    sends * ct.seconds, sends * ct.latency_s, hidden, _link(hw, stride, lay.pp),
                    f"{ct.algorithm}/{ct.protocol}",
                    "the tick's compute" if overlap else "nothing (lock-step ticks)")  # fmt: skip


def ep_term(model: ModelConfig, hw: HardwareConfig, lay: LayoutConfig, shape: Shape) -> CommTerm:
    """The MoE all-to-alls over ep of one step (module docstring), all exposed."""
    wc = DTYPE_BYTES[lay.compute_dtype]
    fig = MOE.figures(model, lay, shape.microbatch_size(lay) or 1, shape.seq, wc, hw.platform)
    buffer = fig.moved * model.d_model * wc
    # this rank's MoE layers: a pipeline stage holds pp-th of them
    calls = round(fig.a2a_bytes / buffer) * (model.moe_layers() // lay.pp) * lay.microbatches
    stride = lay.sp * lay.tp
    wire = buffer * T.ring_factor(lay.ep)  # a tiled all-to-all keeps 1/ep, sends the rest
    ct = call_time(hw, "all-to-all", wire, lay.ep, stride)
    link, algo = _link(hw, stride, lay.ep), f"{ct.algorithm}/{ct.protocol}"
    return CommTerm("ep_comm", "MoE dispatch/combine all-to-all", calls * wire, calls,
                    calls * ct.seconds, calls * ct.latency_s, 0.0, link, algo,
                    "nothing (the experts wait for it)")  # fmt: skip


def _term(hw, label, kind, wire, calls, size, stride, window, last_exposed=True) -> CommTerm:
    """``calls`` calls of ``wire`` bytes each, hidden behind ``window`` seconds of compute
    (the last call exposed when ``last_exposed``: no compute follows it)."""
    ct = call_time(hw, kind, wire, size, stride)
    total = calls * ct.seconds
    floor = ct.seconds if last_exposed else 0.0
    exposed = max(floor, total - window) if total else 0.0
    return CommTerm("dp_comm", label, calls * wire, calls, total, calls * ct.latency_s,
                    total - exposed, _link(hw, stride, size), f"{ct.algorithm}/{ct.protocol}",
                    "one micro-batch's backward" if window else "nothing")  # fmt: skip


def dp_terms(model, hw, lay, shape, lt: LayerTime, ex: Executor) -> list[CommTerm]:
    """Data-parallel / ZeRO calls of one step (module docstring)."""
    if lay.dp == 1:
        return []
    pc = param_counts(model, lay)
    n, stride = pc.zero_shards if lay.zero else lay.dp, lay.sp * lay.tp
    if lay.zero and lay.ep > 1:
        stride *= lay.ep  # ZeRO's edp group is the outer factor of dp = edp × ep
    wr = DTYPE_BYTES[lay.reduce_dtype]
    layers, m = model.n_layers // lay.pp, lay.microbatches
    f_layer = lt.forward
    b_layer = lt.backward + lt.backward_comm + (f_layer if lay.remat == "full" else lt.recompute)
    if lay.zero == 3:
        wg = F8.zero3_gather_bytes(model, lay, DTYPE_BYTES[lay.compute_dtype])
        out = _zero3_terms(hw, lay, pc, n, stride, layers, m, lt, f_layer, b_layer, ex, wg)
        if wg < DTYPE_BYTES[lay.compute_dtype]:
            from jaxpar.model.fp8 import GEMM_GROUPS as F8_GEMMS

            # each FP8 gather's weight amaxes, a max over the weight's shards: tensorwise
            # quantizes with them (on the gather's path); delayed quantizes with its history's
            # scales and only records them (off the path, behind the layers' compute)
            size = lay.dp * lay.tp * lay.sp
            wire = 2 * F8.SCALE_BYTES * len(F8_GEMMS) * T.ring_factor(size)
            if lay.fp8 == "delayed":
                out.append(_term(hw, "FP8 weight amax all-reduce (max, recorded)", "all-reduce",
                                 wire, 2 * m * layers, size, 1, m * layers * (f_layer + b_layer),
                                 last_exposed=False))  # fmt: skip
            else:
                out.append(_term(hw, "FP8 weight scales all-reduce (max)", "all-reduce", wire,
                                 2 * m * layers, size, 1, 0.0))  # fmt: skip
    else:
        out = _bucketed_terms(hw, lay, pc, n, stride, layers, m, f_layer, b_layer, ex)
    groups = lay.dp // n
    if (amax := F8.amax_calls(model, lay, _tokens(lay, shape)).get("dp")) is not None:
        # each FP8 operand's scale, a max over the dp rows: on the critical path
        calls, wire = m * layers * (amax.fwd + amax.bwd), 2 * amax.bytes * T.ring_factor(lay.dp)
        out.append(_term(hw, "FP8 scale all-reduce (max)", "all-reduce", wire, calls, lay.dp,
                         stride, 0.0))  # fmt: skip
    if groups > 1 and lay.ep > 1:  # non-expert gradients all-reduced over ep once
        wire = 2 * (pc.sharded - pc.experts_sharded) * wr * T.ring_factor(groups)
        out.append(_term(hw, "non-expert all-reduce over ep", "all-reduce", wire, 1, groups,
                         lay.sp * lay.tp, 0.0))  # fmt: skip
    elif groups > 1:  # hybrid: the shard's gradient all-reduced across the groups once
        wire = 2 * pc.sharded * wr * T.ring_factor(groups)
        out.append(_term(hw, "all-reduce across shard groups", "all-reduce", wire, 1, groups,
                         stride * n, 0.0))  # fmt: skip
    return out


def _zero3_groups(hw, lt: LayerTime, wire: float, n: int, stride: int, f_layer: float,
                  b_layer: float) -> list[Z3.Group]:  # fmt: skip
    """A layer's weight groups (:attr:`LayerTime.weight_groups`) as :mod:`jaxpar.planner.zero3`
    walks them: each group's share of the layer's forward ``f_layer`` and backward ``b_layer``
    (exposed tp calls and recompute included) by its kernels' seconds, and its gather's
    seconds, ``wire`` (one layer's gather wire bytes) split by its parameters."""
    secs = sum(s for s, _ in lt.weight_groups)
    params = sum(p for _, p in lt.weight_groups)
    groups = [Z3.Group(f_layer * s / secs, b_layer * s / secs,
                       call_time(hw, "all-gather", wire * p / params, n, stride).seconds)
              for s, p in lt.weight_groups]  # fmt: skip
    return groups


def in_flight(hw: HardwareConfig, lay: LayoutConfig) -> int:
    """Collectives XLA:GPU keeps in flight at once in a run of ``lay`` on ``hw``: the overlap
    limit among the flags the run starts with (:func:`jaxpar.distributed.run_xla_flags`),
    1 by default."""
    from jaxpar.distributed import run_xla_flags

    for f in run_xla_flags(hw, lay):
        name, _, value = f.partition("=")
        if name == "--xla_gpu_experimental_parallel_collective_overlap_limit":
            return int(value or 1)
    return 1


def _zero3_terms(hw, lay, pc, n, stride, layers, m, lt, f_layer, b_layer, ex,
                 wg: float) -> list[CommTerm]:  # fmt: skip
    """ZeRO-3: per layer per pass, prefetched behind the neighbouring compute (module
    docstring; jaxpar on a GPU: :mod:`jaxpar.planner.zero3`); the layers' weights gathered at
    ``wg`` bytes an element (:func:`jaxpar.planner.fp8.zero3_gather_bytes`)."""
    r = T.ring_factor(n)
    wr, wc = DTYPE_BYTES[lay.reduce_dtype], DTYPE_BYTES[lay.compute_dtype]
    per_layer = pc.blocks / layers
    ag = call_time(hw, "all-gather", per_layer * r * wg, n, stride)
    rs = call_time(hw, "reduce-scatter", per_layer * r * wr, n, stride)
    pair = ag.seconds + rs.seconds  # backward: regather and reduce-scatter behind the layer's
    total = layers * (ag.seconds + pair)
    behind = "the neighbouring layer's forward/backward (prefetch)"
    calls = 3
    # checked on programs without full recompute; under it (llama2-70b dp 64, a100-64) XLA:GPU
    # started a layer's gathers together at its start and waited on each reduce-scatter at once,
    # which neither pricing describes (BENCHMARKS.md): the share stays there
    from jaxpar.distributed import zero3_across_nodes

    if lay.pp > 1 and ex.zero3_stream and zero3_across_nodes(lay, hw):
        # inside a pipeline's ticks the calls across nodes outlast what XLA places beside
        # them in the tick's branch: llama2-70b dp 4 x tp 8 + SP x pp 2 ZeRO-3 on a100-64
        # exposes 3.17 s of its 4.17 s of dp transfers (the walk below gave 0.32 s); priced
        # exposed. Inside one node the walk holds (dp 2 x tp 4 + SP x pp 8: 0.16 s exposed)
        fwd_exposed, bwd_exposed = layers * ag.seconds, layers * pair
        behind = "nothing (a pipeline tick's branch, across nodes)"
    elif ex.zero3_stream and ex.overlap_dp and lt.weight_groups and lay.remat != "full":
        # each weight group's gather one kernel ahead of its consumer, one stream; under
        # delayed scaling a layer's FP8 weights are one packed gather (jaxpar.train.reduce.
        # _gather_fp8) with nothing on its path, started at the previous layer's start
        # (llama3-70b dp 128 x tp 8 + SP on h100-1024: one 2.8 ms gather a layer, in flight
        # beside the whole previous layer). Tensorwise first takes the weights' max over the
        # shards, an all-reduce on the same stream: walked per group as bf16 (dp 256 x tp 4 +
        # SP, selective: 1.53 s of dp exposed in the program, 0.15 s walked as one group)
        if wg < wc and lay.fp8 == "delayed":
            groups = [Z3.Group(f_layer, b_layer, ag.seconds)]
        else:
            groups = _zero3_groups(hw, lt, per_layer * r * wg, n, stride, f_layer, b_layer)
        behind = "the kernel before each weight group's consumer (one stream)"
        # a pipeline runs each chunk's layers in a tick of their own, inside the tick's
        # conditionals: every chunk action starts its walk afresh (its first gather and last
        # reduce-scatter with nothing beside them)
        runs = lay.virtual if lay.pp > 1 else 1
        fwd_exposed, bwd_exposed = (runs * x for x in Z3.exposed(
            groups, layers // runs, rs.seconds, lt.chunks, in_flight(hw, lay) > 1))  # fmt: skip
        total = layers * (2 * sum(g.gather_s for g in groups) + rs.seconds)
        calls = 2 * len(groups) + 1
    else:
        ov = ex.overlap_dp * ex.zero3_window  # the compute the program places beside a call
        # forward: layer i+1's gather behind layer i's forward; the first has nothing before
        fwd_exposed = ag.seconds + (layers - 1) * max(0.0, ag.seconds - ov * f_layer)
        bwd_exposed = pair + (layers - 1) * max(0.0, pair - ov * b_layer)
    link = _link(hw, stride, n)
    algo = f"{ag.algorithm}/{ag.protocol}"
    out = [CommTerm("dp_comm", "ZeRO-3 per-layer all-gather ×2 + reduce-scatter",
                    m * layers * per_layer * r * (2 * wg + wr), m * layers * calls, m * total,
                    m * layers * (2 * ag.latency_s + rs.latency_s),
                    m * (total - fwd_exposed - bwd_exposed), link, algo, behind)]  # fmt: skip
    embed = _tables(pc, lay)
    if embed:
        # gathered before the first layer and reduced after the last: nothing beside them
        out.append(_term(hw, "ZeRO-3 embedding/head all-gather", "all-gather", embed * r * wc,
                         m, n, stride, 0.0))  # fmt: skip
        out.append(_term(hw, "ZeRO-3 embedding/head reduce-scatter", "reduce-scatter",
                         embed * r * wr, m, n, stride, 0.0))  # fmt: skip
    return out


def _bucketed_terms(hw, lay, pc, n, stride, layers, m, f_layer, b_layer, ex) -> list[CommTerm]:
    """ZeRO 0-2: the gradient reduction in combiner-sized buckets, then the param gather."""
    r = T.ring_factor(n)
    wr, wp = DTYPE_BYTES[lay.reduce_dtype], DTYPE_BYTES[lay.param_dtype]
    grads = pc.local * wr
    kind = "all-reduce" if lay.zero == 0 else "reduce-scatter"
    fold = 2 if lay.zero == 0 else 1
    if reduces_layers_in_backward(ex, lay):
        # Each layer's gradient reduced in the backward (its own calls, combined per layer),
        # behind the backward of the layers below it; the last layer's exposed. The
        # embedding/head/norm gradients after the layer scan: the last micro-batch's exposed,
        # ZeRO-2's earlier ones (one per micro-batch) behind the next micro-batch's forward.
        times = m if lay.zero == 2 else 1
        per_layer = pc.blocks * wr / layers
        lc = combined_calls(hw, kind, per_layer, ex.bucket_bytes)
        out = [_times(_term(hw, f"gradient {kind} per layer in the backward ({lc} per layer)",
                            kind, per_layer / lc * r * fold, lc * layers, n, stride,
                            ex.overlap_dp * layers * b_layer), times)]  # fmt: skip
        rest = (pc.local - pc.blocks) * wr
        if rest > 0:
            rc = combined_calls(hw, kind, rest, ex.bucket_bytes)
            label = f"embedding/head gradient {kind} after the backward" + (
                f" ×{times} micro-batches" if times > 1 else ""
            )
            out.append(_term(hw, label, kind, rest / rc * r * fold, rc * times, n, stride,
                             ex.overlap_dp * (times - 1) * layers * f_layer))  # fmt: skip
        return out + _param_gather_terms(hw, lay, pc, n, stride, layers, f_layer, ex, r, wp)
    calls = combined_calls(hw, kind, grads, ex.bucket_bytes)
    wire = grads / calls * r * fold
    window = ex.overlap_dp * layers * b_layer  # one micro-batch's backward
    if ex.reduce_after_backward and lay.zero < 2:
        window = 0.0  # one reduction of the accumulator after the last backward
    if ex.lockstep and lay.pp > 1 and lay.zero == 2:
        # jaxpar's pipeline reduce-scatters each micro-batch's gradient inside the tick's
        # backward branch: a collective in a conditional's branch starts and completes there,
        # with nothing beside it (XLA:GPU)
        window = 0.0
    times = m if lay.zero == 2 else 1
    t = _term(hw, f"gradient {kind} ({calls} bucket{'s' * (calls > 1)})", kind, wire, calls, n,
              stride, window)  # fmt: skip
    return [_times(t, times), *_param_gather_terms(hw, lay, pc, n, stride, layers, f_layer, ex,
                                                   r, wp)]  # fmt: skip


def _times(t: CommTerm, times: int) -> CommTerm:
    """ZeRO-2: ``t`` once per micro-batch, each behind its own backward."""
    if times == 1:
        return t
    return CommTerm(t.name, t.label + f" ×{times} micro-batches", t.bytes * times,
                    t.calls * times, t.seconds * times, t.latency_s * times, t.hidden_s * times,
                    t.link, t.algorithm, t.behind)  # fmt: skip


def _param_gather_terms(hw, lay, pc, n, stride, layers, f_layer, ex, r, wp) -> list[CommTerm]:
    """ZeRO 1/2: the all-gather of the updated params (none at stage 0)."""
    if lay.zero < 1:
        return []
    params = pc.local * wp
    pcalls = combined_calls(hw, "all-gather", params, ex.bucket_bytes)
    pwindow = ex.overlap_dp * layers * f_layer if ex.overlap_param_gather else 0.0
    t = _term(hw, "updated-param all-gather", "all-gather", params / pcalls * r, pcalls, n,
              stride, pwindow, last_exposed=not ex.overlap_param_gather)  # fmt: skip
    if ex.overlap_param_gather:
        t = CommTerm(**{**asdict(t), "behind": "the next step's first forward"})
    return [t]
