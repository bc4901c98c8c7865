"""The attention core and its sequence-parallel forms: dense causal, Ulysses, ring.

* Dense (:func:`causal_attention`): softmax attention with a causal mask, grouped-query.
* Ulysses (DeepSpeed-Ulysses, Jacobs et al. 2023): no code of its own here. The layer
  constrains q/k/v from sequence-sharded to head-sharded (``attn_seq``/``attn_heads``); GSPMD
  turns each constraint into an all-to-all over ``sp``, the dense core runs on full sequences
  of ``H/(tp·sp)`` heads, and the output constraint is the all-to-all back.
* Ring (Liu et al. 2023, "Ring Attention with Blockwise Transformers"):
  :func:`ring_attention` is a ``jax.shard_map`` manual over ``sp`` only (``dp``/``tp`` stay
  with GSPMD, and it nests inside the pipeline's ``shard_map`` over ``pp``). Each device keeps
  its query block and passes its K/V block around the ring with ``ppermute``, accumulating an
  online softmax (running max, denominator and numerator in fp32). With a contiguous sequence
  layout, rank ``r`` at step ``i`` holds the block of rank ``r − i``: step 0 is the diagonal
  (masked), steps ``1..r`` are fully visible, later steps fully masked and skipped with
  ``lax.cond`` (no FLOPs; the ring still forwards the block). Autodiff goes through the ring
  (``ppermute`` transposes to the reverse ``ppermute``): the backward sends dK/dV back around
  once, the received K/V blocks are kept as residuals (no second K/V pass).

GQA: kv heads fewer than the head shards are repeated (:func:`kv_repeat`; the layer repeats the
kv projection weights, head k → k·r … k·r + r − 1) so that each device's query heads find their
kv head locally; the math is unchanged (query head h of group size G uses repeated head
h // (G/r), i.e. head h // G), and the gradient of a repeated head sums over its copies.

Shape suffixes: B batch, S sequence (C a local block), H query heads, K kv heads, G = H/K,
Dh head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

NEG = float(jnp.finfo(jnp.float32).min)


def kv_repeat(n_heads: int, n_kv_heads: int, shards: int) -> int | None:
    """Smallest ``r`` with ``n_kv_heads·r`` divisible by ``shards`` and ``r`` dividing the group
    size ``n_heads/n_kv_heads``, so that kv heads split as evenly as query heads; None if none.
    """
    group = n_heads // n_kv_heads
    for r in range(1, group + 1):
        if group % r == 0 and (n_kv_heads * r) % shards == 0:
            return r
    return None


def _scores(q_BxCxHxDh: jax.Array, k_BxCxKxDh: jax.Array) -> jax.Array:
    """Scaled grouped-query logits ``[B, K, G, Cq, Ck]`` in fp32."""
    b, c, h, dh = q_BxCxHxDh.shape
    kvh = k_BxCxKxDh.shape[2]
    q_BxCxKxGxDh = q_BxCxHxDh.reshape(b, c, kvh, h // kvh, dh)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", q_BxCxKxGxDh, k_BxCxKxDh).astype(jnp.float32)
    return logits * (dh**-0.5)


def causal_attention(q_BxSxHxDh: jax.Array, k_BxSxKxDh: jax.Array, v_BxSxKxDh: jax.Array):
    """Softmax attention with a causal mask, grouped-query (H = K·G), softmax in fp32."""
    b, s, h, dh = q_BxSxHxDh.shape
    logits = _scores(q_BxSxHxDh, k_BxSxKxDh)
    logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, NEG)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_BxSxKxDh.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v_BxSxKxDh)
    return out.reshape(b, s, h, dh)


# --------------------------------------------------------------------------------------------
# Ring attention


def _block_update(carry, q, k, v, mask):
    """One online-softmax step: fold the block (k, v) into (m, l, acc)."""
    m_BxKxGxC, l_BxKxGxC, acc_BxKxGxCxDh = carry
    s = _scores(q, k)
    if mask is not None:
        s = jnp.where(mask, s, NEG)
    m_new = jnp.maximum(m_BxKxGxC, s.max(axis=-1))
    alpha = jnp.exp(m_BxKxGxC - m_new)
    p = jnp.exp(s - m_new[..., None])
    l_new = l_BxKxGxC * alpha + p.sum(axis=-1)
    pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), v).astype(jnp.float32)
    return m_new, l_new, acc_BxKxGxCxDh * alpha[..., None] + pv


def _shift_up(x: jax.Array, axis: str, p: int, rank: jax.Array) -> jax.Array:
    """Rank ``r``'s ``x`` to rank ``r + 1`` (mod ``p``) of ``axis``.

    A collective-permute, except inside a pipeline (``pp`` manual): there ranks of different
    pipeline stages run different branches at once, and XLA's CPU runtime meets every
    collective-permute over the devices of *all* its pairs (every sp group of every stage; all
    of them share one channel id), so the ring of one stage would wait for, or swap buffers
    with, another stage's. An all-to-all is grouped per sp group and is met by that group
    alone: the block goes in the slot of rank ``r + 1``, zeros in the others (the same wire
    bytes at ``p = 2``, ``p - 1`` times them beyond).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if "pp" not in mesh.manual_axes or mesh.shape.get("pp", 1) == 1:
        return jax.lax.ppermute(x, axis, [(i, (i + 1) % p) for i in range(p)])
    slots_PxX = jnp.zeros((p, *x.shape), x.dtype).at[(rank + 1) % p].set(x)
    got_PxX = jax.lax.all_to_all(slots_PxX, axis, 0, 0)  # got[i]: what rank i sent here
    return got_PxX[(rank - 1) % p]


def _ring_local(q_BxCxHxDh: jax.Array, k_BxCxKxDh: jax.Array, v_BxCxKxDh: jax.Array, axis: str):
    """Per-device body of :func:`ring_attention` (inside ``shard_map`` manual over ``axis``)."""
    p = jax.lax.axis_size(axis)
    rank = jax.lax.axis_index(axis)
    b, c, h, dh = q_BxCxHxDh.shape
    kvh = k_BxCxKxDh.shape[2]
    g = h // kvh
    # Step 0: the diagonal block, causally masked; every row sees its own token, so the
    # running max is finite from here on (no -inf arithmetic in later steps).
    carry = (
        jnp.full((b, kvh, g, c), NEG, jnp.float32),
        jnp.zeros((b, kvh, g, c), jnp.float32),
        jnp.zeros((b, kvh, g, c, dh), jnp.float32),
    )
    diag_CxC = jnp.tril(jnp.ones((c, c), bool))
    carry = _block_update(carry, q_BxCxHxDh, k_BxCxKxDh, v_BxCxKxDh, diag_CxC)
    # Each step sends the K/V block one rank up the ring: collective-permute over `axis`.
    kv = (k_BxCxKxDh, v_BxCxKxDh)
    for step in range(1, p):
        kv = jax.tree.map(lambda x: _shift_up(x, axis, p, rank), kv)
        # Held block comes from rank − step: visible iff step <= rank, else fully masked.
        carry = jax.lax.cond(
            step <= rank,
            lambda cr, kv_: _block_update(cr, q_BxCxHxDh, kv_[0], kv_[1], None),
            lambda cr, kv_: cr,
            carry,
            kv,
        )
    _, l_BxKxGxC, acc = carry
    out_BxKxGxCxDh = acc / l_BxKxGxC[..., None]
    out = jnp.transpose(out_BxKxGxCxDh, (0, 3, 1, 2, 4)).reshape(b, c, h, dh)
    return out.astype(q_BxCxHxDh.dtype)


def ring_attention(
    q_BxSxHxDh: jax.Array, k_BxSxKxDh: jax.Array, v_BxSxKxDh: jax.Array, axis: str = "sp"
) -> jax.Array:
    """Causal attention with the sequence sharded over mesh axis ``axis`` (contiguous blocks).

    Runs as ``jax.shard_map`` manual over ``axis`` alone on the mesh set by ``jax.set_mesh``
    (inside another ``shard_map``, on what remains of it), so other mesh axes keep their GSPMD
    shardings (heads over ``tp``, batch over ``dp``) inside the ring.
    """
    spec = P(None, axis, None, None)
    fn = jax.shard_map(
        lambda q, k, v: _ring_local(q, k, v, axis),
        in_specs=(spec, spec, spec),
        out_specs=spec,
        axis_names={axis},
    )
    return fn(q_BxSxHxDh, k_BxSxKxDh, v_BxSxKxDh)
