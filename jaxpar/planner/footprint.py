"""Per-device memory of a layout as the compiled train step holds it.

One function, :func:`memory`, that ``jaxpar memory``, ``jaxpar plan``, the search and the tests
all call. Breakdown (bytes on the most loaded device; ``host`` apart):

* ``params``, ``optimizer``: what rests in the state arguments — params in ``param_dtype``
  and optax Adam's m and v, each sharded per tensor exactly as the trainer shards it
  (:mod:`jaxpar.planner.shapes`); ZeRO shards the optimizer from stage 1 and the params at 3.
  ``offload`` moves the optimizer (and with ``params`` the params) to host memory.
* ``grads``: the gradient of one micro-batch before the data-parallel reduction (full local
  size: stages 0-2 reduce after the backward; ZeRO-3 reduce-scatters each layer's gradient
  inside the backward, so a shard; a layer in flight is counted with the activations; without
  a pipeline on a GPU, ``Executor.reduce_in_backward``, stages 0-2 with one micro-batch and
  stage 2 with any: the layers reduced, a shard from stage 1 on, and one layer in flight) plus
  ``grad_accum`` (with micro-batches: full at stages 0/1, a shard at 2/3) and ``update``:
  the optimizer's temporaries, a share of the optimizer shard.
* ``activations``: the block's residuals (:mod:`jaxpar.planner.activations`) × layers per
  stage × stashes in flight (the schedule library's peak), plus while recomputing (remat
  ``selective``/``full``) a share of one layer's un-rematerialised residuals, and under ZeRO-3
  the embedding/head tables gathered whole and the layer sets in flight
  (``Executor.zero3_layers``: gathered weights and unreduced gradient; XLA:GPU only).
* ``head``: the loss's fp32 logits-sized buffers (``dense``), or a chunk of them.
* ``pipeline``: the executor's message slots, the stash-sized sets a tick holds beyond the
  schedule's peak (``Executor.tick_stashes``), a split backward's buffers from ``I`` to ``W``
  (:func:`pending_w_bytes`),
  and the head/embedding gradient accumulators
  (pp > 1: every rank carries one slot of each, live on its owner, :mod:`jaxpar.pipeline.rest`;
  stage 0 embeds each micro-batch in its forward, so no embedded batch is held).

The ``XLA_*`` constants are what XLA's buffer assignment adds over the counted tensors; they
were calibrated once on one device (15 compiles of the test model varying layers, vocabulary,
batch and sequence under each remat policy: ``scripts/bench_planner_memory.py --calibrate``)
and are checked on multi-device layouts (``scripts/bench_planner_memory.py``), none of which
they were fitted on.
"""

from __future__ import annotations

import dataclasses

from jaxpar.analysis.theory import DTYPE_BYTES, zero_model_states
from jaxpar.config import LayoutConfig, ModelConfig
from jaxpar.planner import moe as MOE
from jaxpar.planner.activations import block_residuals, kv_heads_local
from jaxpar.planner.cost import action_costs
from jaxpar.planner.frameworks import JAXPAR, Executor, for_model, reduces_layers_in_backward
from jaxpar.planner.pipe import PipeFigures, figures
from jaxpar.planner.shapes import param_counts
from jaxpar.planner.workload import Shape

__all__ = ["Shape", "memory", "paper_model_states", "pipe_figures"]

OPT_SCALAR_BYTES = 8  # optax Adam's step count and the schedule's count (int32 each)
XLA_UPDATE = 0.0  # optimizer temporaries, share of the optimizer shard (calibrated)
XLA_HEAD = 2.21  # fp32 logits-sized buffers alive at the loss (calibrated)
XLA_RECOMPUTE = 0.94  # share of one un-rematerialised layer alive while recomputing (calibrated)
XLA_BACKWARD = 0.85  # share of one layer's residuals alive as backward transients (calibrated)
# Megatron-SP's backward: activations gathered over tp for the weight gradients, a count of
# buffers: the input of a column-parallel matmul and the cotangent of a row-parallel one, alive
# together in XLA's backward schedule (measured on XLA:CPU's tp 4 + SP step, checked on the
# XLA:GPU grid's SP rows: BENCHMARKS.md).
SP_GATHERED = 2.0


def pipe_figures(lay: LayoutConfig, executor: Executor = JAXPAR) -> PipeFigures:
    """The schedule library's figures for ``lay`` (see :mod:`jaxpar.planner.pipe`)."""
    costs = action_costs(lay, executor)
    return figures(lay.schedule, lay.pp, lay.microbatches, lay.virtual, costs, executor.lockstep,
                   memory=lay.pipeline_memory)  # fmt: skip


def memory(
    model: ModelConfig,
    lay: LayoutConfig,
    shape: Shape,
    executor: Executor = JAXPAR,
    pipe: PipeFigures | None = None,
) -> dict[str, float]:
    """Per-device bytes by kind (see the module docstring), ``total`` and ``host``."""
    executor = for_model(model, executor)
    pc = param_counts(model, lay)
    wp = DTYPE_BYTES[lay.param_dtype]
    params = wp * pc.held("params")
    opt = 2 * wp * pc.held("optimizer") + OPT_SCALAR_BYTES
    host = 0.0
    if lay.offload in ("optimizer", "params"):
        host, opt = host + opt, 0.0
    if lay.offload == "params":
        host, params = host + params, 0.0
    pipe = pipe or pipe_figures(lay, executor)
    b = shape.microbatch_size(lay) or 1
    tokens = b * shape.seq / lay.sp  # local tokens of one micro-batch
    acts, per_layer, offloaded = _activations(model, lay, shape, executor, pipe, pc, tokens)
    host += offloaded

    grads = wp * (pc.sharded if lay.zero == 3 else pc.local)
    if reduces_layers_in_backward(executor, lay):
        # each layer's gradient reduced in the backward: the layers' reduced gradient (a shard
        # from stage 1 on) and one layer's whole one in flight; the embedding/head gradients
        # whole until their reduction after the backward
        shard = pc.sharded / max(pc.local, 1) if lay.zero else 1.0
        grads = wp * (pc.local - pc.blocks + pc.blocks * shard + pc.blocks / model.n_layers)
    accum = 0.0
    if lay.microbatches > 1 and lay.pp == 1:
        accum = wp * (pc.sharded if lay.zero >= 2 else pc.local)
    update = XLA_UPDATE * wp * pc.held("optimizer") * 2

    vocab = model.padded_vocab(lay.tp) / lay.tp  # padded when tp does not divide it
    head_tokens = tokens if executor.loss == "dense" else min(tokens, executor.loss_chunk)
    head = XLA_HEAD * 4 * head_tokens * vocab

    pipeline = _pipeline_bytes(model, lay, executor, pipe, pc, tokens, per_layer, acts + grads)
    pipeline += pending_w_bytes(model, lay, pipe, b, shape.seq)
    out = {
        "batch": 4 * (shape.global_batch // lay.dp) * (shape.seq + 1),  # int32 tokens shard
        "params": params,
        "grads": grads,
        "grad_accum": accum,
        "optimizer": opt,
        "update": update,
        "activations": acts,
        "head": head,
        "pipeline": pipeline,
    }
    out["total"] = sum(out.values())
    out["host"] = host
    return out


def _activations(model, lay, shape, executor, pipe, pc, tokens) -> tuple[float, float, float]:
    """(activation bytes on the device, one layer's stashed residuals, bytes parked on the
    host) — the ``activations`` entry of :func:`memory`."""
    wc = DTYPE_BYTES[lay.compute_dtype]
    layers = model.n_layers // lay.pp
    chunk = model.n_layers // (lay.pp * lay.virtual)
    host = 0.0
    remat = lay.remat  # one meaning per setting on every layout (jaxpar.train.remat)
    res = block_residuals(model, lay, shape.seq, executor.attention, remat)
    if lay.zero == 3:
        # ZeRO-3's remat policies save no weight (jaxpar.train.remat): the fused QKV and
        # gate/up matrices of the gathered weights are gathered again in the backward.
        res = dataclasses.replace(res, weights=0.0)
    per_layer = res.bytes(tokens, wc)
    acts = per_layer * chunk * max(pipe.peak_stashes) if lay.pp > 1 else per_layer * layers
    rows = shape.microbatch_size(lay) or 1
    if model.moe.enabled:  # the MoE blocks' residuals in place of the dense ones'
        held = model.moe_layers()  # without a pipeline: every layer's, once
        if lay.pp > 1:  # a chunk's MoE blocks, per stashed micro-batch (pp: first_dense 0)
            held = model.moe_layers() // (lay.pp * lay.virtual) * max(pipe.peak_stashes)
        acts += held * (_moe_layer(model, lay, shape, executor, remat, rows, wc) - per_layer)

    def layer_bytes(policy: str) -> float:
        dense = block_residuals(model, lay, shape.seq, executor.attention, policy).bytes(tokens, wc)
        if not model.moe.enabled:
            return dense
        return max(dense, _moe_layer(model, lay, shape, executor, policy, rows, wc))

    if remat == "offload":  # the matmul outputs of every layer park on the host
        host += layer_bytes("selective") * layers * pipe.peak_stashes[0]
    full_layer = layer_bytes("none")
    # Recompute re-runs one layer at a time, in a pipeline stage too (its stash holds each
    # layer's input: jaxpar.pipeline.stage).
    if remat in ("selective", "full"):
        acts += XLA_RECOMPUTE * full_layer
    else:
        acts += XLA_BACKWARD * full_layer
    if lay.sequence_parallel and lay.tp > 1:
        # Each weight gradient is one matmul over the whole sequence after its ring
        # (jaxpar.model.collective_matmul), as Megatron's waits for its all-gather.
        acts += SP_GATHERED * wc * tokens * model.d_model
    if lay.zero == 3:
        # The embedding and head tables are gathered whole (their layers are not scanned).
        acts += wc * (pc.local - pc.blocks)
        # Layer sets in flight (Executor.zero3_layers): XLA:GPU's pipelined all-gather and
        # reduce-scatter carry one layer's gathered weights (compute dtype) and unreduced
        # gradient (reduce dtype) across the layer loop — bf16[dp, w/dp] and f32[dp, w/dp]
        # loop state in the llama2-70b dp 64 program.
        wr = DTYPE_BYTES[lay.reduce_dtype]
        acts += executor.zero3_layers * (wc + wr) * pc.blocks / max(layers, 1)

    return acts, per_layer, host


def _moe_layer(model, lay, shape, executor, remat, rows, wc) -> float:
    """One MoE block's residuals: the block with its shared experts as the FFN, plus the
    dispatch slots and the router (:mod:`jaxpar.planner.moe`)."""
    res = block_residuals(MOE.shared_model(model), lay, shape.seq, executor.attention, remat)
    if lay.zero == 3:
        res = dataclasses.replace(res, weights=0.0)
    tokens = rows * shape.seq / lay.sp
    return res.bytes(tokens, wc) + MOE.slot_residual_bytes(model, lay, rows, shape.seq, wc, remat)


def _pipeline_bytes(model, lay, executor, pipe, pc, tokens, per_layer, carried) -> float:
    """The executor's message slots, tick stashes and accumulators (pp > 1; ``carried``: the
    stashes and gradients the scan carry holds)."""
    if lay.pp == 1:
        return 0.0
    wp, wc = DTYPE_BYTES[lay.param_dtype], DTYPE_BYTES[lay.compute_dtype]
    chunk = model.n_layers // (lay.pp * lay.virtual)
    msg = wc * tokens * model.d_model / (lay.tp if lay.sequence_parallel else 1)
    n_act, n_grad, n_cot = pipe.slots
    pipeline = msg * (n_act + n_grad + n_cot)  # receive slots and the loss cotangents
    pipeline += executor.tick_stashes * per_layer * chunk  # the tick's own residual sets
    pipeline += wp * (pc.local - pc.blocks)  # head/embedding grads accumulator
    # No chunk gradient: the backward adds each layer's gradient to the accumulator inside its
    # layer scan (jaxpar.pipeline.stage), so no tick holds a chunk's beside it.
    # The scan carries the stashes and the gradient accumulators (Executor.carry_copies).
    return pipeline + executor.carry_copies * (carried + pipeline)


def _dot_operands(model: ModelConfig, lay: LayoutConfig, tokens: float, slots: int,
                  moe: bool) -> tuple[float, float]:  # fmt: skip
    """(activation operand, output) values of one block's weight matmuls for ``tokens``
    local tokens in the compute dtype (:mod:`jaxpar.pipeline.split`: the taps and the dys),
    fp32 router values counted twice; a MoE block's routed experts on ``slots`` dispatch
    slots, its shared experts as its FFN."""
    d, t = model.d_model, lay.tp
    q, kv = model.n_heads * model.hd / t, kv_heads_local(model, lay) * model.hd
    taps, dys = d + q, (q + 2 * kv) + d  # fused QKV, output projection
    ff = model.d_ff / t
    if moe:
        e, f = model.moe, model.expert_ff / t
        ff = e.shared_experts * model.expert_ff / t
        taps, dys = taps + 2 * d, dys + 2 * e.experts  # router (fp32)
        routed_taps, routed_dys = slots * (2 * d + f), slots * (2 * f + d)
    if ff:  # fused gate/up, down
        taps, dys = taps + d + ff, dys + 2 * ff + d
    taps, dys = taps * tokens, dys * tokens
    if moe:
        taps, dys = taps + routed_taps, dys + routed_dys
    return taps, dys


def pending_w_bytes(model: ModelConfig, lay: LayoutConfig, pipe: PipeFigures, rows: int,
                    seq: int) -> float:  # fmt: skip
    """A split backward's buffers from ``I`` to ``W`` (zero-bubble schedules): per slot, every
    weight matmul's output cotangent (dys) of a chunk's layers, and its activation operand
    (taps) — in the forward's taps slots, or under recompute filed beside the dys; plus the
    set an ``I`` returns (stacked over the chunk's layers) before it is filed."""
    n_taps, n_dys = pipe.w_slots
    if lay.pp == 1 or not n_dys:
        return 0.0
    wc = DTYPE_BYTES[lay.compute_dtype]
    tokens = rows * seq / lay.sp
    _, n = model.stack()
    chunk = n // (lay.pp * lay.virtual)
    if model.moe.enabled:  # a group: its every-1 dense blocks, then its MoE block
        dense = _dot_operands(model, lay, tokens, 0, False)
        moe = _dot_operands(model, lay, tokens, MOE.slots(model, rows, seq), True)
        taps = moe[0] + (model.moe.every - 1) * dense[0]
        dys = moe[1] + (model.moe.every - 1) * dense[1]
    else:
        taps, dys = _dot_operands(model, lay, tokens, 0, False)
    if lay.remat == "full":
        return wc * chunk * (n_dys + 1) * (taps + dys)
    return wc * chunk * (n_taps * taps + (n_dys + 1) * dys)


def paper_model_states(model: ModelConfig, lay: LayoutConfig) -> dict[str, float]:
    """The ZeRO paper's convention (bf16 params and grads, K = 12) for the same tp/pp shard."""
    pc = param_counts(model, lay)
    return zero_model_states(pc.local, pc.zero_shards, lay.zero)
