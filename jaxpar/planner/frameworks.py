"""What the program that runs a layout does, as the cost model needs it.

One :class:`Executor` describes jaxpar's own train step (the planner's default) and another
describes a framework that published a large run (see :mod:`jaxpar.planner.published`); the
formulas are the same, only these facts differ. Each field names a property of the program, not
a fitted constant.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from jaxpar.xla_limit import XLA_DEFAULT, slop_factor

ATTENTION = ("dense", "blockwise")
# HBM passes over a layer's saved activations per forward for the memory-bound remainder:
# fused kernels (XLA's fusions, Megatron/Transformer Engine's fused norms and activations)
# write each saved activation once and read it once; eager PyTorch launches every elementwise
# op (the norm's square, mean, rsqrt and scale; rotary's halves; silu and its product; casts)
# as its own kernel, about three round trips per saved value (torchtitan's own H100 table:
# torch.compile, which fuses them, +16% on the same run).
FUSED_PASSES = 2.0
EAGER_PASSES = 6.0


@dataclass(frozen=True)
class Executor:
    """Properties of the train step the cost model describes.

    * ``attention``: ``dense`` keeps the s×s probabilities for the backward (jaxpar's
      ``model.attention=dense``); ``blockwise`` keeps q, k, v, o and the log-sum-exp only
      (flash-style: cuDNN, FlashAttention, jaxpar's blockwise and native kernels; the native
      one's per-thread scratch is linear in the sequence too) and skips fully masked
      blocks, so it runs half the score FLOPs of a causal sequence.
    * ``loss``: ``dense`` materialises fp32 logits ``[tokens, V/tp]`` (and their gradient);
      ``chunked`` processes ``loss_chunk`` tokens at a time.
    * ``score_bytes``: HBM bytes moved per s×s score element in a ``dense`` forward (jaxpar:
      six fp32 passes — logits, mask, max, exp, sum, normalise — 24 bytes; a fused masked
      softmax in bf16 reads the scores and writes the probabilities: 4 bytes, plus a dropout
      mask).
    * ``lockstep``: pipeline ticks last as long as the slowest rank's work (jaxpar's SPMD
      executor scans the tick table); ``False``: each rank runs its order asynchronously.
    * ``i_cost``, ``w_cost``: input- and weight-gradient halves of a split backward, in units of
      the stage forward (zero-bubble schedules). ``recompute_in_i``: under full recompute the
      input-gradient half also re-runs the forward.
    * ``split_sees_plain_dots``: the split backward separates only the weight matmuls it sees
      as a plain dot (jaxpar: :mod:`jaxpar.pipeline.split` rewrites a ``dot_general`` or a
      custom VJP around one dot). A weight matmul inside a custom VJP of its own — the
      collective matmul's rings under Megatron-SP (tp > 1), an FP8 GEMM — keeps its weight
      gradient in ``I``, which then costs a full backward and leaves ``W`` the gradient
      accumulation alone (:func:`jaxpar.planner.cost.split_backward`). llama2-70b's layer
      shape, tp 8 + SP × pp 8, ZB-V (16 layers, a100-64), by the time model: ``I`` 1.96 ``F``,
      ``W`` 0.04 ``F`` (BENCHMARKS.md, "Split backward measured per action").
    * ``overlap_tp``: share of the tensor- and sequence-parallel collective time hidden behind
      matmuls (collective matmuls, userbuffers, context-parallel p2p overlapped with
      attention); ``overlap_dp``: share of the compute beside a data-parallel call that can
      hide it (:mod:`jaxpar.planner.comm`: a ZeRO-3 gather behind its neighbour layer, a
      gradient bucket behind one micro-batch's backward).
    * ``overlap_p2p``: pipeline sends run beside the tick's compute (asynchronous runtimes);
      jaxpar's lock-step ticks send after the compute. ``overlap_param_gather``: ZeRO 1/2's
      all-gather of the updated params runs behind the next step's first forward (Megatron's
      distributed optimizer); jaxpar gathers after the update.
    * ``elementwise_passes``: HBM passes of the memory-bound remainder (``FUSED_PASSES`` or
      ``EAGER_PASSES``).
    * ``bucket_bytes``: the framework's gradient bucket (0: XLA's combiner threshold from
      the mesh's ``xla_flags``).
    * ``carry_copies``: extra copies of the pipeline scan's carry (stashes, accumulators) the
      compiled tick holds — XLA's CPU compile copies the carry in every switch branch that
      passes it through (jax-ml/jax#38145). jaxpar's branches touch only their own slots and
      its slot writes are ordered after the reads: 0 (the HLO's copy bytes per tick,
      ``scripts/bench_pipeline.py``).
    * ``selective_reruns_kernel``: under selective remat the backward re-runs a blockwise
      attention kernel's forward (jaxpar: the kernel is a custom_vjp with no dot of its own, so
      ``checkpoint_dots`` keeps none of it).
    * ``recompute_drops_dead``: a full recompute runs the forward less the matmuls whose
      outputs the backward never reads, attention's output projection and the MLP's down
      projection (their inputs are what their gradients need): XLA removes them from the
      rematerialized forward as dead code (jaxpar, dense layers). An eager framework's
      checkpointed forward runs whole.
    * ``follows_model``: ``attention`` and ``loss_chunk`` come from the model being costed
      (jaxpar's own step: :func:`for_model`); a published framework's are fixed.
    * ``tick_stashes``: stash-sized residual sets a tick holds beyond the schedule's peak (the
      backward's slot read out of the buffer and its working set); calibrated on one pipeline
      layout (``scripts/bench_planner_memory.py``).
    * ``zero3_layers``: ZeRO-3 layer sets (one layer's all-gathered weights in the compute
      dtype and its gradient before the reduce-scatter in the reduce dtype) alive at the
      memory peak. XLA:CPU: 0 (the ZeRO-3 rows of ``scripts/bench_planner_memory.py`` are
      within 3% without it). XLA:GPU with the mesh files' pipelined all-gather/reduce-scatter:
      1 — the layer loop carries the next layer's gathered weights and the previous layer's
      unreduced gradient (:func:`for_target`).
    * ``ring_hidden``: share of Megatron-SP's tp all-gather/reduce-scatter time that the
      collective matmul's ``ppermute`` rings hide behind their chunk matmuls, inside one node
      (:mod:`jaxpar.model.collective_matmul`; :func:`for_target` sets it from the compiled
      XLA:GPU program). Unlike ``overlap_tp`` it is a share of the calls, not of the matmuls:
      what stays exposed is structural (a backward ring step's two sends share one window and
      XLA:GPU runs one collective-permute at a time), so it scales with the traffic.
    * ``fp8_tp_hidden``: under an FP8 recipe with Megatron-SP and no rings (GSPMD places the
      FP8 gathers and the reduce-scatters, :mod:`jaxpar.planner.fp8`; the rings run only where
      ZeRO-3 crosses nodes, :func:`jaxpar.sharding.fp8_rings`, and hide ``ring_hidden``):
      the share of those tp calls XLA:GPU's latency-hiding scheduler hides behind the layer's
      other kernels, inside one node (:data:`FP8_TP_HIDDEN`; :func:`for_target`).
    * ``pipe_sp_hidden``: inside a pipeline's ticks Megatron-SP's bf16 tp calls are GSPMD's
      gathers and reduce-scatters (the rings' permutes would meet other stages' branches);
      the share XLA:GPU's scheduler hides, inside one node, by tp degree (:data:`PIPE_SP_HIDDEN`,
      :meth:`pipe_sp_share`); ``pipe_sp_zero3_hidden`` the share where ZeRO-3's per-layer
      gathers share the collective stream with them (:data:`PIPE_SP_ZERO3_HIDDEN`).
    * ``nosp_tp_hidden``: without Megatron-SP the tp calls are GSPMD's all-reduces, which
      cannot hide behind their own matmul; the share of them XLA:GPU's latency-hiding
      scheduler hides behind the kernels that do not need their result (the backward's
      weight-gradient matmuls, the forward's residual saves and a pipeline's stash writes),
      inside one node, bf16 GEMMs (:data:`NOSP_TP_HIDDEN`; :func:`for_target`).
    * ``zero3_window``: share of the neighbouring layer's compute a ZeRO-3 per-layer all-gather
      or reduce-scatter has beside it (times ``overlap_dp``): 1 for the published frameworks'
      prefetch. ``zero3_stream``: instead, each weight group's gather and each layer's
      reduce-scatter walked on one collective stream with the window XLA:GPU gives it, one
      kernel ahead of its consumer (:mod:`jaxpar.planner.zero3`; jaxpar on a GPU,
      :func:`for_target`).
    * ``reduce_after_backward``: ZeRO 0/1 reduce the accumulated gradient after the last
      micro-batch's backward (jaxpar: one ``psum``/``psum_scatter`` of the accumulator, after a
      pipeline's last tick too), so nothing in the backward hides it; ``False``: the framework
      reduces buckets during the backward (Megatron's and DeepSpeed's gradient buckets).
    * ``reduce_in_backward``: without a pipeline, ZeRO 0-2 with one micro-batch and ZeRO-2
      with any reduce each layer's gradient in the backward, inside the layer scan (jaxpar
      on a GPU:
      :meth:`jaxpar.train.reduce.DPReduction.reduces_in_backward`, :func:`for_target`): the
      calls hide behind the backward of the layers below, and the reduced gradient is a ZeRO
      shard from stage 1 on, with one layer's whole gradient in flight.
    * ``kernels``: where the kernels' speeds come from. ``fitted``: the mesh file's matmul
      curve, whose GPU ceiling (``matmul_share_max``) and memory-bound share
      (``elementwise_share``) :mod:`jaxpar.planner.published` fitted on published runs — a
      property of those frameworks' kernels and clusters (eager PyTorch, Megatron 2021 without
      flash attention, NeMo), kept for their executors. ``published``: the time model's
      published ceilings (:mod:`jaxpar.gpu.costs`: Bekman's measured matmul maximum, flash
      attention's papers, each under the roofline; a flash backward 2.5x its forward) and
      memory-bound work at the HBM peak, as :mod:`jaxpar.gpu.timing` costs jaxpar's compiled
      program (:func:`for_target` on a GPU).
    * ``program_bytes``: the memory-bound remainder is what XLA's fusions of jaxpar's own
      program move (:data:`PROGRAM_BYTES`, measured on compiled programs), not
      ``elementwise_passes`` alone: Megatron-SP's ring passes, the per-parameter weight work
      (weight slices and casts, weight-gradient writes and their accumulation, the optimizer)
      per micro-batch and per step (:func:`for_target` on a GPU).
    * ``sp_grads_per_layer``: the weight gradients' partial sums over ``sp`` are all-reduced
      per layer and micro-batch in the compute dtype (jaxpar: GSPMD places them at the weight
      matmuls, :func:`jaxpar.planner.comm.sp_grad_terms`); a framework with context
      parallelism reduces them with the data-parallel gradients instead (Megatron's dp × cp
      group), which the dp terms already price.
    """

    name: str = "jaxpar"
    attention: str = "dense"
    loss: str = "dense"
    loss_chunk: int = 1024
    lockstep: bool = True
    i_cost: float = 1.0
    w_cost: float = 1.0
    split_sees_plain_dots: bool = False
    recompute_in_i: bool = True
    score_bytes: float = 24.0
    overlap_tp: float = 0.0
    overlap_dp: float = 1.0
    overlap_p2p: bool = False
    overlap_param_gather: bool = False
    bucket_bytes: float = 0.0
    elementwise_passes: float = FUSED_PASSES
    carry_copies: float = 0.0
    tick_stashes: float = 1.0
    selective_reruns_kernel: bool = False
    recompute_drops_dead: bool = False
    follows_model: bool = False
    zero3_layers: float = 0.0
    sp_grads_per_layer: bool = False
    ring_hidden: float = 0.0
    fp8_tp_hidden: float = 0.0
    nosp_tp_hidden: float = 0.0
    pipe_sp_hidden: tuple[tuple[int, float], ...] = ()
    pipe_sp_zero3_hidden: float = 0.0
    reduce_after_backward: bool = False
    zero3_window: float = 1.0
    zero3_stream: bool = False
    reduce_in_backward: bool = False
    kernels: str = "fitted"
    program_bytes: bool = False

    def with_(self, **kw) -> Executor:
        """A copy with some fields changed."""
        return replace(self, **kw)

    def pipe_sp_share(self, tp: int, zero3: bool) -> float:
        """The share of Megatron-SP's GSPMD tp calls hidden inside a pipeline's ticks at
        ``tp`` (the measured degree nearest it, the lower on a tie), or beside ZeRO-3's gathers
        (``zero3``: a ZeRO-3 group over more than one rank)."""
        if not self.pipe_sp_hidden:
            return 0.0
        share = min(self.pipe_sp_hidden, key=lambda p: (abs(p[0] - tp), p[0]))[1]
        return min(share, self.pipe_sp_zero3_hidden) if zero3 else share


# jaxpar's train step as it compiles by default: a flash-style attention core (``model.attention``
# auto → cuDNN, the native CPU kernel or the blockwise kernel), the cross entropy in
# ``loss_chunk`` chunks, lock-step ticks. W costs one forward once the pipeline keeps each
# weight matmul's own cotangent; XLA's async collectives with the latency-hiding scheduler
# (meshes/*.yaml xla_flags) overlap the data-parallel reduction with the backward, nothing
# overlaps the tensor-parallel all-reduces.
JAXPAR = Executor(
    attention="blockwise",
    split_sees_plain_dots=True,
    loss="chunked",
    selective_reruns_kernel=True,
    recompute_drops_dead=True,
    follows_model=True,
    sp_grads_per_layer=True,
    reduce_after_backward=True,
)


def for_model(model, executor: Executor = JAXPAR) -> Executor:
    """``executor`` as it runs ``model`` (a :class:`~jaxpar.config.ModelConfig`): one that
    ``follows_model`` takes the model's ``attention`` and ``loss_chunk`` settings; any other is
    returned unchanged."""
    if not executor.follows_model:
        return executor
    attention = "dense" if model.attention == "dense" else "blockwise"
    return executor.with_(attention=attention, loss="chunked", loss_chunk=model.loss_chunk)


# XLA:GPU flags that make the layer loop carry a ZeRO-3 layer set across iterations.
PIPELINED_COLLECTIVES = (
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
)


# What jaxpar's compiled XLA:GPU programs hide, read by the time model of the scheduled program
# (jaxpar.gpu.timing over scripts/bench_gpu_grid.py's rows). Each is calibrated on one grid row
# and checked on others (BENCHMARKS.md, "The planner held to the program"):
#
# ZeRO-3 (Executor.zero3_stream): no share of the layer is calibrated. XLA:GPU gathers a layer's
# weights one group at a time, each one kernel ahead of its consumer, and the calls share one
# stream (jaxpar.planner.zero3); a share fitted on one program (0.2 on llama2-70b dp 32 x tp 2
# + SP at the fitted ceilings) did not describe another (0.45 on llama3-8b dp 8): BENCHMARKS.md,
# "ZeRO-3 exposure walked per weight group". Under full recompute, which that walk was not
# checked on (and a llama2-70b dp 64 program exposes 78% of its dp time), the share stays:
# ZERO3_WINDOW, calibrated on llama2-70b dp 32 x tp 2 + SP at the fitted ceilings.
ZERO3_WINDOW = 0.2
# RING_HIDDEN: Executor.ring_hidden. Calibrated on llama3-8b tp 8 + SP, h100-8; checked on the
# 70B dp 32 x tp 2 rings (a pipeline's ticks have no rings, their permutes would meet other
# stages' branches: PIPE_SP_HIDDEN there). Across nodes the rings hide nothing (dp 4 x tp 16
# + SP on a100-64: a ring step's send outlasts its chunk matmul), so it is not applied there.
RING_HIDDEN = 0.68
# FP8_TP_HIDDEN: Executor.fp8_tp_hidden. Measured by scripts/calibrate_program_bytes.py on one
# program of another shape than the rows it is checked on: llama3-8b's layer shape, dp 2 x tp 4
# + SP, --fp8 delayed, h100-8, 2 and 4 layers; one layer's tp collective seconds (comm_s["tp"],
# scale all-reduces included) and their exposed part (exposed_s["tp"]), each the difference
# over two layers of the simulated programs: hidden = 1 - exposed / comm, on programs that
# reduce each layer's dp gradient in the backward (BENCHMARKS.md, "PROGRAM_BYTES refit").
FP8_TP_HIDDEN = 0.67
# NOSP_TP_HIDDEN: Executor.nosp_tp_hidden. Measured on one program of another shape than the
# rows it is checked on, as FP8_TP_HIDDEN: llama3-8b tp 8 without SP, 8 x 4096, h100-8, 4 and 8
# layers; one layer's tp all-reduce seconds and their exposed part, each the difference over
# the two depths of the simulated programs: 1 - 0.00383 / 0.01760 = 0.78. Checked on
# llama3-8b pp 2 x tp 4 (the grid row: 0.86 of the step's tp seconds hidden) and llama2-70b's
# layer shape at tp 8, dp 8 (0.97 per layer, 4 and 8 layers): BENCHMARKS.md, "tp all-reduces
# without SP" (2026-12-07).
NOSP_TP_HIDDEN = 0.78
# PIPE_SP_HIDDEN: Executor.pipe_sp_hidden, (tp, share) pairs. Inside a pipeline's ticks
# Megatron-SP's tp calls are GSPMD's bf16 all-gathers and reduce-scatters (no collective-matmul
# rings there: jaxpar.model.collective_matmul.axes); the share XLA:GPU hides, measured on
# programs that are not grid rows, one layer's tp seconds and their exposed part by difference
# over two depths. tp 4: llama3-8b pp 2 x tp 4 + SP, 8 x 4096, 8 micro-batches, h100-8, 8 and
# 16 layers: 1 - 0.0087 / 0.0233 = 0.63 (BENCHMARKS.md, "No rings inside a pipeline's ticks";
# 0.74, 0.57 and 0.64 at 4 micro-batches of 1, 2 and 4 sequences, 4 and 8 layers). tp 8: the
# same layer shape, pp 2 x tp 8 + SP over 16 GPUs, 4 micro-batches of 1 and 2 sequences, 4
# and 8 layers: 0.34 and 0.42, so 0.38. With tp 8 a rank's matmuls beside each call are half
# tp 4's while the call's bytes stay. Between and beyond the two, the nearer one's share.
PIPE_SP_HIDDEN = ((4, 0.63), (8, 0.38))
# PIPE_SP_ZERO3_HIDDEN: Executor.pipe_sp_zero3_hidden. ZeRO-3 inside a pipeline's ticks puts
# each layer's weight gathers on the collective stream the tp gathers hide on, and they queue
# behind them: llama3-8b pp 2 x dp 2 x tp 4 + SP, ZeRO-3, 4 micro-batches of 1 sequence over
# 16 GPUs (dp and tp inside a node), 4 and 8 layers: 0.791 ms of tp a layer and micro-batch,
# 0.703 exposed, so 0.11.
PIPE_SP_ZERO3_HIDDEN = 0.11


@dataclass(frozen=True)
class WeightBytes:
    """HBM bytes per local parameter of the blocks and the head that jaxpar's compiled step
    moves for its weights at one ZeRO stage, beyond the activations: ``step`` once a step,
    ``microbatch`` per micro-batch, ``loop`` once when there is a micro-batch loop (m > 1)."""

    step: float
    microbatch: float
    loop: float = 0.0

    def per_param(self, microbatches: int) -> float:
        """Bytes per local parameter in a step of ``microbatches`` micro-batches."""
        m = max(1, microbatches)
        return self.step + m * self.microbatch + (self.loop if m > 1 else 0.0)


@dataclass(frozen=True)
class ProgramBytes:
    """The memory-bound bytes of jaxpar's train step as XLA:GPU compiles it (no pipeline),
    measured by ``scripts/calibrate_program_bytes.py`` (figures in BENCHMARKS.md): llama3-8b's
    layer shape compiled for h100-8 at 2 and 4 layers, each program simulated by the time model
    (:mod:`jaxpar.gpu.timing`), the compute stream's memory-bound kernels summed, one layer's
    bytes the difference over two. Not fitted to the grid of ``scripts/bench_gpu_grid.py``
    (whose llama3-8b rows share this layer shape: they are not independent checks of it).
    Every figure is from programs where ZeRO 0-2 reduce each layer's gradient in the backward
    (BENCHMARKS.md, "PROGRAM_BYTES refit", which gives the figures measured before it).

    * ``act_passes``: a layer's bytes that grow with its micro-batch's tokens, forward and
      backward, in units of its saved activations (``block_residuals``): 7.05 measured (1 and 2
      sequences per device, dp 8, ZeRO-1);
      ``sp_act_passes``: the same under Megatron-SP (tp 8): 15.1 — the collective matmul's
      rings slice, pad and add their chunks through HBM. ``fp8_sp_act_passes``: the same under
      an FP8 recipe with Megatron-SP (GSPMD gathers the FP8 operands; priced for the FP8
      rings too, whose chunks are one byte an element),
      beyond the quantization bytes the planner prices apart (3 × :func:`jaxpar.planner.fp8.
      quant_bytes`, delayed's 2.58 bytes an element): measured on dp 2 × tp 4 + SP ``--fp8
      delayed`` at 1 and 2 sequences per device (``tp4-fp8``, ``tp4-fp8-2seq``); the same
      programs measured 8.84 on 2026-12-08 (left at 10.30: the FP8 changes since were not
      refit).
    * ``pipe_sp_act_passes``, ``sp_transpose_passes``: Megatron-SP inside a pipeline's ticks,
      where the tp calls are GSPMD's bf16 all-gathers and reduce-scatters (no rings). With
      more than one sequence in a micro-batch, a gather of ``[b, s, d]`` along ``s`` lands
      sequence-major and XLA transposes it for its consumer (and a reduce-scatter's input the
      other way): measured by the time model on llama3-8b pp 2 × tp 4 + SP, 1F1B, 4
      micro-batches of 1, 2 and 4 sequences, 4 and 8 layers (h100-8), the transpose fusions
      move nothing at one sequence and 36.0 passes of the gathered hidden state (``b·s·d``
      elements in the compute dtype) a layer at two and four, forward and backward; pp 2 ×
      tp 8 + SP (16 GPUs) at two sequences 30.0; so 33.0. On llama2-70b dp 2 × tp 8 + SP ×
      pp 4, 16 micro-batches of 2 (a100-64) they are 34.5 passes, 0.73 s of its step. The
      remaining passes, 6.13: the 10.30 that priced the tp 4 pipeline programs at 2 and 4
      sequences within 1% (as ``fp8_sp_act_passes`` did), less the transposes in its units
      there (4.17); the tp 8 programs' other memory-bound bytes then plan within 0.06 ms a
      layer and micro-batch.
    * ``weights``: :class:`WeightBytes` per ZeRO stage, from 1, 2 and 4 micro-batches of one
      sequence per device: ZeRO 0/1 slice each layer's fp32 weights out of the stack and cast
      them, write each weight gradient into the stacked fp32 gradient and add it to the
      accumulator, every micro-batch; ZeRO-3 does it on the gathered bf16 weights and the
      gradient shards. ZeRO-2 takes ZeRO-1's figures (the two compile to the same program at
      one micro-batch), and a stage whose dp group is one device ZeRO-0's (nothing to shard;
      tp 8 + SP at ZeRO-1 over dp 1 measured 66.9 bytes per parameter at one micro-batch,
      ZeRO-0 over dp 8 77.6, its per-layer all-reduces' buffers included). Each is what
      remains of a layer's bytes after ``act_passes``, so the two are refit together. The
      optimizer update is inside these figures.
    * ``fp8_ring_act_passes``: the same under an FP8 recipe whose tp collectives are the
      collective matmul's rings (where ZeRO-3 crosses nodes, :func:`jaxpar.sharding.
      fp8_rings`), quantization bytes apart: 13.73, measured on dp 2 × tp 4 + SP, ZeRO-3,
      ``--fp8 delayed`` over nodes of 4 GPUs (``-o hardware.devices_per_node=4``) at 1 and 2
      sequences per device. Selective and full recompute measured 8.17 and 8.30 there; the
      common ``unsaved`` gives 10.24 and 9.45, and prices llama3-70b's FP8 ring layouts on
      h100-1024 within 4% (BENCHMARKS.md, "Activation passes under recompute").
    * ``unsaved``: the activation passes a layer no longer moves under recompute, by
      ``layout.remat``, the recompute's own memory-bound work included: every passes figure
      above is measured without recompute, where the forward writes each residual into the
      layer stack and the backward reads it back. Measured on ``z1`` at 1 and 2 sequences
      with ``--remat none``, ``selective`` and ``full`` (llama3-8b's layer, 2 and 4 layers,
      h100-8): 7.05, 3.56 and 2.77 passes, so 3.49 and 4.28. Checked on ZeRO-3 (``z3``, full:
      7.89 → 2.67), on tp 8 + SP's rings (15.08 → 11.75 selective, 11.71 full: 11.59 and
      10.80 priced) and on the FP8 rings (above). Not applied to MoE layers (not measured).
      The bytes that do not grow with the tokens grow too on these programs, full less
      none: 10.0 per layer parameter on ``z1``, 12.5 on ``z3``. Not priced: on llama3-70b
      dp 1024 ZeRO-3, full (h100-1024, 8 layers) the program's memory-bound kernels take
      0.062 s, which the passes and ``weights`` without that growth already reach (0.063 s).
    * ``loss_bytes``: bytes per logit of a micro-batch's loss, forward and backward (the
      planner's six fp32 passes: 24).
    * ``tick_passes``, ``split_tick_passes``: a pipeline tick's executor work outside its
      actions — reading the tick's slots out of the message, stash and (split backward) ``dys``
      buffers, filing the arrivals, writing ``I``'s weight-matmul cotangents — in units of
      the saved activations of the chunk's layers, every tick on every rank whatever it runs
      (:func:`jaxpar.planner.cost.tick_slots`). Measured by the time model on llama3-8b's
      layer shape, pp 4 × dp 2 on h100-8 at 8 and 16 layers (1 to 4 layers a chunk; the
      grid's pp 4 rows have 32), the compute stream's kernels in the tick loop outside every
      action's branch, per tick and chunk layer, fitted through the origin: 1.94 for fused
      tables (1F1B, interleaved), 3.09 for split ones (ZB-H1, ZB-V, DualPipeV), whose ``dys``
      buffer holds every weight matmul's output cotangent (BENCHMARKS.md, "Split backward
      measured per action").
    """

    act_passes: float = 7.05
    sp_act_passes: float = 15.07
    fp8_sp_act_passes: float = 10.30
    pipe_sp_act_passes: float = 6.13
    fp8_ring_act_passes: float = 13.73
    sp_transpose_passes: float = 33.0
    weights: tuple[tuple[int, WeightBytes], ...] = (
        (0, WeightBytes(step=33.27, microbatch=44.35, loop=11.34)),
        (1, WeightBytes(step=5.23, microbatch=44.35, loop=20.54)),
        (3, WeightBytes(step=0.30, microbatch=12.41, loop=1.40)),
    )
    unsaved: tuple[tuple[str, float], ...] = (("selective", 3.49), ("full", 4.28))
    loss_bytes: float = 24.0
    tick_passes: float = 1.94
    split_tick_passes: float = 3.09

    def weight_bytes(self, zero: int) -> WeightBytes:
        """The figures of ZeRO stage ``zero`` (2 takes 1's)."""
        table = dict(self.weights)
        return table[1 if zero == 2 else zero]

    def unsaved_passes(self, remat: str) -> float:
        """Activation passes a layer does not move under ``remat`` (``unsaved``; 0 for none
        and offload)."""
        return dict(self.unsaved).get(remat, 0.0)


PROGRAM_BYTES = ProgramBytes()


def reduces_layers_in_backward(executor: Executor, lay) -> bool:
    """Whether ``executor`` reduces each layer's data-parallel gradient inside the backward
    for the layout ``lay`` (``Executor.reduce_in_backward``; the trainer's rule,
    :meth:`jaxpar.train.reduce.DPReduction.reduces_in_backward`): no pipeline, ZeRO 0-2 over
    more than one rank, one micro-batch or ZeRO-2."""
    return (executor.reduce_in_backward and lay.pp == 1 and lay.zero < 3 and lay.dp > 1
            and (lay.microbatches == 1 or lay.zero == 2))  # fmt: skip


def for_target(hw, executor: Executor = JAXPAR) -> Executor:
    """``executor`` as XLA compiles jaxpar's step for ``hw`` (a
    :class:`~jaxpar.config.HardwareConfig`): on a GPU whose ``xla_flags`` pipeline the
    all-gather or reduce-scatter, ``zero3_layers`` = 1 (a llama2-70b dp 64 ZeRO-3 step on a100-64
    compiles to 1.01x the planner with it, 1.08x without; a 4-layer d 512 model over h100-8
    1.06x and 1.57x, ``tests/test_gpu_compile.py``); on every GPU the overlap the compiled
    program has (``zero3_stream``, ``RING_HIDDEN``, ``FP8_TP_HIDDEN``, ``NOSP_TP_HIDDEN``,
    ``reduce_in_backward``);
    and its kernels as the
    time model costs the compiled program: ``kernels="published"`` (the ceilings of
    :mod:`jaxpar.gpu.costs`, not the mesh curve fitted on published runs) and ``program_bytes``
    (:data:`PROGRAM_BYTES`). Published frameworks' executors (not ``follows_model``) are
    returned unchanged: their fitted ceiling describes their runs."""
    if not executor.follows_model or hw.platform != "gpu":
        return executor
    pipelined = any(f in (hw.xla_flags or ()) for f in PIPELINED_COLLECTIVES)
    return executor.with_(zero3_layers=1.0 if pipelined else executor.zero3_layers,
                          zero3_stream=True, zero3_window=ZERO3_WINDOW, ring_hidden=RING_HIDDEN,
                          reduce_in_backward=True,
                          fp8_tp_hidden=FP8_TP_HIDDEN, nosp_tp_hidden=NOSP_TP_HIDDEN,
                          pipe_sp_hidden=PIPE_SP_HIDDEN,
                          pipe_sp_zero3_hidden=PIPE_SP_ZERO3_HIDDEN,
                          kernels="published",
                          program_bytes=True)  # fmt: skip


# XLA:GPU's latency-hiding scheduler plans for SCHEDULER_BASE of the device's memory less the
# program's arguments and outputs, times the slop factor (GetSchedulerMemoryLimit in
# xla/service/gpu/gpu_hlo_schedule.cc; --xla_gpu_memory_limit_slop_factor, default 95:
# jaxpar.xla_limit.XLA_DEFAULT). Past that limit it schedules for memory and overlaps nothing:
# the llama2-70b ZeRO-3 steps on a100-64 whose temporaries exceed it mark 98-99% of their
# collective bytes is_sync, those under it 3-4%.
SCHEDULER_BASE = 0.80


def scheduler_limit(hw, io_bytes: float) -> float:
    """Bytes of temporaries XLA:GPU's scheduler allows itself on ``hw`` beside ``io_bytes``
    of arguments and (unaliased) outputs, for the program that runs. A mesh may raise the slop
    factor above XLA's default (the GPU meshes' 300 keeps XLA's rematerialization out of
    programs that fit); past the limit the default sets, the scheduler then holds more in
    flight, and a program that no longer fits is compiled again at the default
    (:mod:`jaxpar.xla_limit`: llama2-70b dp 16 x tp 4 + SP ZeRO-3 on a100-64, 79.1 GiB at 300,
    72.9 GiB at 95 with nothing overlapped). So a factor above the default counts as the
    default here; a lower one is taken as set."""
    slop = min(slop_factor(" ".join(hw.xla_flags or ())) or XLA_DEFAULT, XLA_DEFAULT)
    return max(0.0, (SCHEDULER_BASE * hw.device_memory_bytes - io_bytes) * slop / 100)


def memory_pressure(hw, mem: dict[str, float]) -> tuple[float, float] | None:
    """(temporaries, the scheduler's limit) when a GPU program's temporaries exceed the limit
    of :func:`scheduler_limit`, else None. ``mem`` is :func:`jaxpar.planner.footprint.memory`'s
    breakdown: the arguments are the batch, params and optimizer state (donated, so the
    outputs alias them)."""
    if hw.platform != "gpu":
        return None
    io = mem["batch"] + mem["params"] + mem["optimizer"]
    temps, limit = mem["total"] - io, scheduler_limit(hw, io)
    return (temps, limit) if temps > limit else None
