"""Per-device memory of a layout, as jaxpar stores it (and in the ZeRO paper's convention).

Breakdown (bytes, the most loaded device — the first pipeline rank):

* ``params``, ``grads``, ``optimizer``: :func:`jaxpar.analysis.theory.stored_model_states` —
  what jaxpar holds: params and grads in ``param_dtype`` (fp32), optax Adam m and v in fp32,
  each sharded per tensor by tp/pp and by ZeRO over dp. Offload moves the optimizer (and with
  ``offload=params`` the params too) to host memory.
* ``activations``: the stashes of jaxpar's own decoder block (not Korthikanti's fused-kernel
  figure): jaxpar's attention is unfused, so its fp32 logits and probabilities (a·s per token
  each) are stored. Values per token per layer, by what is kept for the backward:

  - ``remat=none``: layer input, two norm outputs, attention output and MLP input (5d, split
    by tp only under sequence parallelism), q/k/v and the roped q/k (2d + 3·kv), the attention
    context (d), the MLP's four ff-wide tensors (SwiGLU; GELU two), and 2·a·s scores in fp32
    (all but the replicated d terms split by tp);
  - ``selective`` (``checkpoint_dots``): matmul outputs only — q, k, v, scores, context, the
    two projections' outputs and the MLP matmuls;
  - ``full``: the layer input (d), plus one layer's worth of recompute transient at a time.

  ×``ACT_OVERHEAD`` (XLA's extra copies, calibrated once on one device: 5 compiles of the test
  model, see BENCHMARKS.md), × layers per stage × in-flight stashes (schedule library), ÷ sp.
* ``head``: logits-sized workspace of the loss (fp32 logits, log-softmax, their gradients:
  ``HEAD_COPIES`` × tokens × V/tp × 4 bytes) plus 4·d·4 bytes per token, one micro-batch.

Not modelled: XLA's fragmentation, pipeline receive buffers, collectives' scratch space.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxpar.analysis import theory as T
from jaxpar.config import LayoutConfig, ModelConfig

ACT_OVERHEAD = 1.22  # measured XLA copies over the counted stash (test model, one device)
HEAD_COPIES = 6  # fp32 logits-sized buffers alive at the loss (measured, one device)
FULL_TRANSIENT = 0.25  # share of one un-rematerialised layer alive while recomputing (measured)
BYTES = T.DTYPE_BYTES


@dataclass(frozen=True)
class Shape:
    """The workload a layout is costed for."""

    global_batch: int
    seq: int

    def microbatch_size(self, lay: LayoutConfig) -> int:
        """Sequences per micro-batch per dp rank (0 when it does not divide)."""
        per_dp, r = divmod(self.global_batch, lay.dp)
        if r or per_dp % lay.microbatches:
            return 0
        return per_dp // lay.microbatches


def layer_values_per_token(model: ModelConfig, lay: LayoutConfig, seq: int) -> tuple[float, float]:
    """(compute-dtype values, fp32 values) one layer keeps per token per device."""
    d, t, s = model.d_model, lay.tp, seq
    kv = model.n_kv_heads * model.hd
    kv_t = kv / t if model.n_kv_heads % t == 0 else kv
    ff = model.d_ff / t
    n_ff = 4 if model.mlp == "swiglu" else 2
    scores = model.n_heads / t * s  # a·s per token, per tp shard
    rep = d / t if lay.sequence_parallel else d
    if lay.remat == "full":
        return rep, 0.0
    if lay.remat == "selective":
        # q, k, v, context, attention-out, MLP up/gate, MLP down; scores (fp32 logits)
        return d / t + 2 * kv_t + d / t + 2 * rep + (n_ff // 2) * ff, scores
    return 5 * rep + 3 * d / t + 3 * kv_t + n_ff * ff, 2 * scores


def layer_bytes(model: ModelConfig, lay: LayoutConfig, seq: int, b: int) -> float:
    """Activation bytes one layer stashes for one micro-batch of ``b`` sequences."""
    cval, fval = layer_values_per_token(model, lay, seq)
    tokens = b * seq / lay.sp
    return ACT_OVERHEAD * tokens * (cval * BYTES[lay.compute_dtype] + fval * 4)


_STATES: dict[tuple, dict[str, float]] = {}


def _states(model: ModelConfig, lay: LayoutConfig, zero: int) -> dict[str, float]:
    """:func:`theory.stored_model_states`, memoised (the search asks for it ~10⁵ times)."""
    key = (model.n_layers, model.d_model, model.n_heads, model.n_kv_heads, model.d_ff,
           model.vocab_size, model.hd, model.mlp, model.tied_embeddings, lay.tp, lay.pp,
           lay.dp, lay.dp_shard, zero, lay.param_dtype)  # fmt: skip
    if key not in _STATES:
        if len(_STATES) > 100_000:
            _STATES.clear()
        _STATES[key] = T.stored_model_states(model, dataclasses.replace(lay, zero=zero))
    return _STATES[key]


def memory(
    model: ModelConfig, lay: LayoutConfig, shape: Shape, peak_stashes: int
) -> dict[str, float]:
    """Per-device bytes by kind (see the module docstring) and ``total``.

    ``peak_stashes``: most (stage, micro-batch) activations alive on one rank (1 without a
    pipeline); each stash holds ``n_layers / (pp·virtual)`` layers.
    """
    st = _states(model, lay, lay.zero)
    params, grads, opt = st["params"], st["grads"], st["optimizer"]
    host = 0.0
    if lay.offload in ("optimizer", "params"):
        host += opt
        opt = 0.0
    if lay.offload == "params":
        host += params
        params = 0.0
    b = shape.microbatch_size(lay) or 1
    per_layer = layer_bytes(model, lay, shape.seq, b)
    chunk_layers = model.n_layers / (lay.pp * lay.virtual)
    acts = per_layer * chunk_layers * peak_stashes
    if lay.remat == "full":
        full = dataclasses.replace(lay, remat="none")
        acts += FULL_TRANSIENT * layer_bytes(model, full, shape.seq, b)
    if lay.remat == "offload":
        acts = 0.0
    tokens = b * shape.seq / lay.sp
    head = tokens * (HEAD_COPIES * model.vocab_size / lay.tp * 4 + 4 * model.d_model * 4)
    accum = _states(model, lay, 0)["grads"]
    out = {
        "params": params,
        "grads": grads,
        "grad_accum": accum if lay.microbatches > 1 else 0.0,
        "optimizer": opt,
        "activations": acts,
        "head": head,
    }
    out["total"] = sum(out.values())
    out["host"] = host
    return out


def paper_model_states(model: ModelConfig, lay: LayoutConfig) -> dict[str, float]:
    """The ZeRO paper's convention (bf16 params and grads, K = 12) for the same tp/pp shard."""
    local = T.param_shard_count(model, lay)["local"]
    return T.zero_model_states(local, lay.dp_shard or lay.dp, lay.zero)
