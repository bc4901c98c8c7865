"""What one decoder block keeps for its backward, per remat policy and attention kernel.

Counted from jaxpar's own block (:mod:`jaxpar.model.layers`) the way JAX's autodiff saves it
(``jax.ad_checkpoint`` residuals; ``tests/test_planner.py`` compares these formulas with the
residuals JAX reports for the block). Per *local token* — one of the ``b·s/sp`` tokens of a
device's sequence shard — in three widths: compute-dtype values, fp32 values and bytes; plus
per-layer values that do not scale with tokens (fused weights kept as residuals).

Notation: d model width, H query heads, K kv heads (repeated ``r`` times when tp or Ulysses'
head shards exceed them, as the layer does), hd head dim, f FFN width, t = tp, s sequence
length. Under Megatron-SP the residual stream (block input, norms) is split over tp too.

* ``none``: block input x and the residual after attention; each RMSNorm's ``x·rsqrt`` and
  scaled output in fp32 (with its two per-token statistics); roped q (grouped), roped k, v;
  the attention output o; the MLP's six f-wide values (gate, up, the three of silu, their
  product); and the kernel's own residuals — ``dense``: a boolean mask, the masked logits or
  (bf16) the probabilities' cast, and two fp32 s×s tensors (exp, probabilities) per head;
  ``blockwise``: q, k, v, o and an fp32 log-sum-exp per head. The fused QKV and gate/up
  weights are residuals too (per layer): with ZeRO-3 under GSPMD they are the gathered ones.
* ``selective`` (``checkpoint_dots``): the matmul outputs — fused QKV, the scores and the
  attention context (dense; the blockwise kernel is a custom_vjp without a dot of its own, so
  its forward runs again in the backward), the row-parallel projection's output (split over tp
  under Megatron-SP, the full-width partial sum without), gate/up — and the block input.
* ``full``: the block input only.
* ``offload``: the matmul outputs go to host memory; nothing stays on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpar.config import LayoutConfig, ModelConfig


@dataclass(frozen=True)
class Residuals:
    """Values one block keeps per local token (by width) and per layer."""

    compute: float  # values in the compute dtype, per local token
    fp32: float  # fp32 values per local token
    bytes1: float  # one-byte values (boolean masks) per local token
    weights: float = 0.0  # compute-dtype values per layer, independent of tokens

    def bytes(self, tokens: float, compute_bytes: int) -> float:
        """Bytes for ``tokens`` local tokens of one layer."""
        per_token = self.compute * compute_bytes + 4 * self.fp32 + self.bytes1
        return tokens * per_token + self.weights * compute_bytes


def kv_heads_local(model: ModelConfig, lay: LayoutConfig) -> float:
    """kv heads per device inside the attention core (repeated as the layer repeats them)."""
    from jaxpar.model.attention import kv_repeat

    ulysses = lay.sp > 1 and lay.sp_mode == "ulysses"
    shards = lay.tp * (lay.sp if ulysses else 1)
    r = kv_repeat(model.n_heads, model.n_kv_heads, shards) or 1
    return model.n_kv_heads * r / lay.tp


def block_residuals(
    model: ModelConfig, lay: LayoutConfig, seq: int, attention: str = "dense", remat: str = ""
) -> Residuals:
    """Residuals of one block for ``lay`` (``remat`` overrides ``lay.remat``)."""
    remat = remat or lay.remat
    if attention not in ("dense", "blockwise"):
        raise ValueError(f"attention={attention!r}: must be dense or blockwise")
    t, hd, f = lay.tp, model.hd, model.d_ff / lay.tp
    stream = model.d_model / t if lay.sequence_parallel and t > 1 else model.d_model
    q = model.n_heads * hd / t  # roped q, and the attention output o
    kv = kv_heads_local(model, lay) * hd  # roped k, or v
    heads = model.n_heads / t  # per device inside the core (Ulysses: full s, H/(t·sp) heads)
    scores = heads * seq  # one s×s row per head and local token
    swiglu = model.mlp == "swiglu"
    if remat == "full":
        return Residuals(stream, 0.0, 0.0)
    if remat == "offload":
        return Residuals(0.0, 0.0, 0.0)
    ring = lay.sp > 1 and lay.sp_mode == "ring" and attention == "dense"
    if attention == "blockwise":
        kernel_c, kernel_f, kernel_b = 2 * q + 2 * kv, heads, 0.0
    elif ring:
        # Autodiff through the ring keeps every step's block residuals: the diagonal step's
        # mask and three s/sp-wide score tensors, two for each later step, and per step the
        # received K/V block, two q-wide accumulators and six per-head statistics.
        block = heads * seq / lay.sp
        kernel_c = 0.0
        kernel_f = block * (2 * lay.sp + 1) + lay.sp * (2 * kv + 2 * q + 6 * heads) - 2 * heads
        kernel_b = block
    else:
        kernel_c, kernel_f, kernel_b = scores, 2 * scores, scores
    if remat == "selective":
        # fused QKV out, kernel, context, row-parallel output, gate/up (or up)
        qkv = q + 2 * kv
        # the blockwise kernel is a custom_vjp with no dot of its own: the policy keeps none of
        # its residuals nor its output (the backward re-runs its forward)
        if attention == "dense":
            core = (scores + (lay.sp - 1) * q if ring else kernel_c) + q
        else:
            core = 0.0
        # the row-parallel projection's output is saved as the partitioned program holds it:
        # reduce-scattered over tp under Megatron-SP (XLA:GPU's llama2-70b tp 8 + SP step
        # stores bf16[80, b, s/8, d]), the full-width partial sum otherwise
        c = stream + qkv + core + stream + (2 if swiglu else 1) * f
        return Residuals(c, 0.0, 0.0)
    if remat != "none":
        raise ValueError(f"layout.remat={remat!r}: must be none, selective, full or offload")
    norms_f = 4 * stream + 4 * (stream / model.d_model)  # x·rsqrt and output, 2 stats, ×2
    if attention == "dense":
        attn_c, attn_f, attn_b = q + 2 * kv + kernel_c, kernel_f + 2 * heads, kernel_b
    else:
        attn_c, attn_f, attn_b = kernel_c, kernel_f, 0.0
    c = 2 * stream + attn_c + q + 6 * f
    fused = model.d_model * (q + 2 * kv + (2 * f if swiglu else 0))  # fused QKV and gate/up
    if lay.pp > 1:  # a stage's policy recomputes the weights' casts (jaxpar.train.remat)
        fused = 0.0
    return Residuals(c, norms_f + attn_f, attn_b, fused)
