"""Blockwise (flash-style) attention with its own backward: the score matrix never exists.

Queries and keys are cut into blocks of ``c`` positions. A *tile* is one (query block, key
block) pair; the forward folds a row's tiles into an online softmax (running max ``m``,
denominator ``l`` and numerator ``acc``, all fp32: FlashAttention, Dao et al. 2022) and keeps
only the output and its log-sum-exp ``lse``. The backward recomputes each tile's probabilities
from q, k and ``lse`` (FlashAttention-2, Dao 2023): with ``delta = rowsum(dO ∘ O)``,
``dS = P ∘ (dO·Vᵀ − delta)``, ``dQ = dS·K``, ``dK = dSᵀ·Q``, ``dV = Pᵀ·dO``. Saved per layer:
q, k, v, o and lse — linear in the sequence — instead of the ``[B, H, S, S]`` probabilities.

Causal tiles above the diagonal are never computed (row ``i`` visits key blocks ``0..i``);
that skips about half of the score FLOPs. Every visited tile goes through the same masked code
(positions from iotas, so only the diagonal tile actually hides pairs): one tile's code in the
program, half the compile time of a separate diagonal path, no measurable runtime cost.

Layout. The kernel works block-major and head-major: q ``[N, B, K, G·C, Dh]`` (N blocks of C
positions; a block's rows are the G query heads grouped under kv head k, C positions each, so
row r holds head k·G + r // C at position r % C), k and v ``[N, B, K, C, Dh]``. The G heads are
merged into the rows in the layout itself, so a tile's matmuls see G·C rows whatever fusion XLA
forms around them (XLA's default CPU pipeline merged them by folding bitcasts around the dots;
with YNNPACK's reduce fusions, which jaxpar does not enable, it left G a batch
dimension of its own and the tile matmuls took 1.2–1.4× as long).
A tile's matmuls (2 forward, 5 backward) are then plain batched matmuls over (B, K) reading
their operands in place (see :func:`tile_grads`), and GQA never materialises repeated k/v
(``dK``/``dV`` sum over G inside the contraction). The transpositions into and out of this
layout are per call, on q/k/v/o/dO only.

The tiles run in loops — a ``fori_loop`` over query rows, inside it one over the row's key
blocks — so the program is one tile's code whatever the sequence length, and one tile's
temporaries are live at a time. Measured on 2 CPU cores (B 16, S 256, 8/4 heads, forward and
backward): 0.41-0.47 of the time of the same tiles written out at trace time, whose
independent rows XLA runs side by side, and a fraction of their compile time.

A sequence that the block size does not divide is padded at the end: under the causal mask no
real query sees a padded key (padded rows are dropped); for full (non-causal) tiles, used by
ring attention, the padded keys are masked.

:mod:`jaxpar.model.attention` builds the causal core (:func:`blockwise_attention`) and ring
attention's steps from :func:`forward` / :func:`backward` here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

NEG = float(jnp.finfo(jnp.float32).min)

# (running max, denominator, numerator) of each query row (R = G·C a block): [.., R], [.., R],
# [.., R, Dh], fp32
State = tuple[jax.Array, jax.Array, jax.Array]


@dataclass(frozen=True)
class Blocks:
    """A sequence of ``s`` positions cut into ``n`` blocks of ``c`` (padded to ``n·c``)."""

    n: int
    c: int
    s: int

    @staticmethod
    def of(s: int, block: int) -> Blocks:
        """Blocks of ``min(block, s)`` positions covering ``s``."""
        if block < 1:
            raise ValueError(f"attention block {block}: must be a positive integer")
        c = min(block, s)
        return Blocks(-(-s // c), c, s)

    @property
    def pad(self) -> int:
        """Positions added at the end."""
        return self.n * self.c - self.s


# --------------------------------------------------------------------------------------------
# Into and out of the block-major, head-major layout


def _pad_seq(x: jax.Array, bl: Blocks) -> jax.Array:
    if not bl.pad:
        return x
    return jnp.pad(x, [(0, 0), (0, bl.pad)] + [(0, 0)] * (x.ndim - 2))


def q_blocks(q_BxSxHxDh: jax.Array, kv_heads: int, bl: Blocks) -> jax.Array:
    """``[B, S, H, Dh] -> [N, B, K, G·C, Dh]`` (query head h = k·G + g, row g·C + position)."""
    b, _, h, dh = q_BxSxHxDh.shape
    g = h // kv_heads
    x = _pad_seq(q_BxSxHxDh, bl).reshape(b, bl.n, bl.c, kv_heads, g, dh)
    return x.transpose(1, 0, 3, 4, 2, 5).reshape(bl.n, b, kv_heads, g * bl.c, dh)


def kv_blocks(k_BxSxKxDh: jax.Array, bl: Blocks) -> jax.Array:
    """``[B, S, K, Dh] -> [N, B, K, C, Dh]``."""
    b, _, kvh, dh = k_BxSxKxDh.shape
    return _pad_seq(k_BxSxKxDh, bl).reshape(b, bl.n, bl.c, kvh, dh).transpose(1, 0, 3, 2, 4)


def q_unblocks(x_NxBxKxRxDh: jax.Array, bl: Blocks) -> jax.Array:
    """Inverse of :func:`q_blocks` (padding dropped)."""
    n, b, kvh, r, dh = x_NxBxKxRxDh.shape
    g = r // bl.c
    x = x_NxBxKxRxDh.reshape(n, b, kvh, g, bl.c, dh)
    return x.transpose(1, 0, 4, 2, 3, 5).reshape(b, n * bl.c, kvh * g, dh)[:, : bl.s]


def kv_unblocks(x_NxBxKxCxDh: jax.Array, s: int) -> jax.Array:
    """Inverse of :func:`kv_blocks` (padding dropped)."""
    n, b, kvh, c, dh = x_NxBxKxCxDh.shape
    return x_NxBxKxCxDh.transpose(1, 0, 3, 2, 4).reshape(b, n * c, kvh, dh)[:, :s]


# --------------------------------------------------------------------------------------------
# One tile


def scaled(q: jax.Array) -> jax.Array:
    """Queries times ``Dh^-1/2``: the tiles take them so, and no tile multiplies its logits
    (or dS) by the scale; dq comes out for the scaled queries (times the scale once more).
    Exact when Dh is a power of 4 (the scale a power of 2); otherwise one more rounding of q in
    its own dtype than scaling the fp32 logits (bf16: a relative 2^-8 at most)."""
    return q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)


def _scores(q_i: jax.Array, kt_j: jax.Array) -> jax.Array:
    """Logits of one tile ``[B, K, G·Cq, Ck]`` in fp32 (``q_i`` :func:`scaled`, ``kt_j``: k
    transposed)."""
    return jnp.einsum("bkrd,bkds->bkrs", q_i, kt_j, preferred_element_type=jnp.float32)


def init_state(q_NxBxKxRxDh: jax.Array) -> State:
    """Empty online-softmax state of every row block."""
    # *_like: inside shard_map the state varies over the manual axes as q does.
    row = q_NxBxKxRxDh[..., 0]
    return (
        jnp.full_like(row, NEG, jnp.float32),
        jnp.zeros_like(row, jnp.float32),
        jnp.zeros_like(q_NxBxKxRxDh, jnp.float32),
    )


def fold(state: State, q_i: jax.Array, kt_j: jax.Array, v_j: jax.Array, vis) -> State:
    """Fold one key block (``kt_j`` = kᵀ ``[B, K, Dh, Ck]``) into a row's online softmax;
    ``vis`` ``[G·Cq, Ck]``: which pairs are visible (None: all)."""
    top, den, acc = state
    s = _scores(q_i, kt_j)
    if vis is None:
        top_new = jnp.maximum(top, s.max(axis=-1))
        p = jnp.exp(s - top_new[..., None])
    else:
        # The mask is applied inside each consumer of s (the row max, then the exponent: a
        # hidden pair's exp(-inf) is 0), so no masked copy of the tile is written and read.
        top_new = jnp.maximum(top, jnp.where(vis, s, NEG).max(axis=-1))
        p = jnp.exp(jnp.where(vis, s - top_new[..., None], -jnp.inf))
    alpha = jnp.exp(top - top_new)
    f32 = jnp.float32
    pv = jnp.einsum("bkrs,bksd->bkrd", p.astype(v_j.dtype), v_j, preferred_element_type=f32)
    return top_new, den * alpha + p.sum(axis=-1), acc * alpha[..., None] + pv


def finish(state: State) -> tuple[jax.Array, jax.Array]:
    """Output (fp32) and log-sum-exp of folded rows."""
    top, den, acc = state
    return acc / den[..., None], top + jnp.log(den)


def tile_grads(q_i, qt_i, k_j, kt_j, v_j, do_i, dot_i, lse_i, delta_i, vis_t):
    """``(dqᵀ_i, dk_j, dv_j)`` contributions of one tile, fp32, from the recomputed scores.

    The tile is recomputed transposed, ``Sᵀ [B, K, Ck, G·Cq]``, and every operand comes in
    the layout its matmul reads in place (``*t_*``: transposed copies made once per call):
    XLA's CPU dot takes ``[M, K] x [K, N]`` row-major operands and copies any other form, which
    per tile would be P and dS (or k and dO). dq comes out transposed ``[B, K, Dh, G·Cq]``.
    ``vis_t`` ``[Ck, G·Cq]``: which pairs are visible (None: all).
    """
    f32 = jnp.float32
    st = jnp.einsum("bksd,bkdr->bksr", k_j, qt_i, preferred_element_type=f32)
    zt = st - lse_i[:, :, None]
    # Masked inside the exponent (exp(-inf) = 0): one fusion writes P, not a second masked copy.
    pt = jnp.exp(zt if vis_t is None else jnp.where(vis_t, zt, -jnp.inf))
    dv = jnp.einsum("bksr,bkrd->bksd", pt.astype(do_i.dtype), do_i, preferred_element_type=f32)
    dpt = jnp.einsum("bksd,bkdr->bksr", v_j, dot_i, preferred_element_type=f32)
    dst = (pt * (dpt - delta_i[:, :, None])).astype(q_i.dtype)
    dk = jnp.einsum("bksr,bkrd->bksd", dst, q_i, preferred_element_type=f32)
    dqt = jnp.einsum("bkds,bksr->bkdr", kt_j, dst, preferred_element_type=f32)
    return dqt, dk, dv


def _t(x: jax.Array) -> jax.Array:
    """Transposed blocks: ``[.., rows, Dh] -> [.., Dh, rows]`` (q-like or k-like)."""
    return jnp.swapaxes(x, -1, -2)


# --------------------------------------------------------------------------------------------
# Which tiles a row visits


def _rows_keys(i, bl: Blocks, causal: bool):
    """Key blocks ``0..hi-1`` that query block ``i`` (traced) visits."""
    return i + 1 if causal else bl.n


def _visible(i, j, bl: Blocks, causal: bool, rows: int):
    """Visible (query, key) pairs of tile (i, j), ``[rows, Ck]`` (``rows`` = G·Cq, row r at
    position r % Cq): key ≤ query when causal (which also hides the padded keys from every
    real query), else key < s; None when all are."""
    if not causal and not bl.pad:
        return None
    q_pos = i * bl.c + (jnp.arange(rows) % bl.c)[:, None]
    k_pos = j * bl.c + jnp.arange(bl.c)[None, :]
    return k_pos <= q_pos if causal else jnp.broadcast_to(k_pos < bl.s, (rows, bl.c))


def _take(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


def forward(qb, kb, vb, bl: Blocks, causal: bool, state: State | None = None) -> State:
    """Fold key/value blocks ``kb``/``vb`` into every query row of ``qb`` (:func:`scaled`
    queries in :func:`q_blocks` layout); returns the state.

    ``causal``: key block j is visible to query block i iff j ≤ i (the diagonal masked);
    otherwise every key block is visible (the queries follow the keys in the sequence).
    """
    state = init_state(qb) if state is None else state
    ktb = _t(kb)  # kᵀ blocks [N, B, K, Dh, C], once per call
    rows = qb.shape[3]

    def row(i, carry):
        q_i = qb[i]

        def tile(j, st):
            return fold(st, q_i, ktb[j], vb[j], _visible(i, j, bl, causal, rows))

        st = jax.lax.fori_loop(0, _rows_keys(i, bl, causal), tile, _take(carry, i))
        return jax.tree.map(lambda c, x: c.at[i].set(x), carry, st)

    return jax.lax.fori_loop(0, bl.n, row, state)


def backward(qb, kb, vb, dob, lse, delta, bl: Blocks, causal: bool):
    """Gradients ``(dq, dk, dv)`` (fp32, block layout; dq for the :func:`scaled` queries
    ``qb``) of the tiles :func:`forward` visits, against the *final* log-sum-exp ``lse`` and
    ``delta = rowsum(dO ∘ O)`` of the rows."""
    zeros = partial(jnp.zeros_like, dtype=jnp.float32)  # varying as its argument (shard_map)
    qtb, ktb, dotb = _t(qb), _t(kb), _t(dob)  # once per call
    rows = qb.shape[3]

    def row(i, carry):
        dqt, dk, dv = carry
        q_i, qt_i, do_i, dot_i = qb[i], qtb[i], dob[i], dotb[i]

        def tile(j, c):
            dqt_i, dk, dv = c
            vis = _visible(i, j, bl, causal, rows)
            vis_t = None if vis is None else vis.T
            g = tile_grads(q_i, qt_i, kb[j], ktb[j], vb[j], do_i, dot_i, lse[i], delta[i], vis_t)
            return dqt_i + g[0], dk.at[j].add(g[1]), dv.at[j].add(g[2])

        c = jax.lax.fori_loop(0, _rows_keys(i, bl, causal), tile, (zeros(qt_i), dk, dv))
        return dqt.at[i].set(c[0]), c[1], c[2]

    dqt, dk, dv = jax.lax.fori_loop(0, bl.n, row, (zeros(qtb), zeros(kb), zeros(vb)))
    return _t(dqt), dk, dv  # dq back to [N, B, K, G·C, Dh]


# --------------------------------------------------------------------------------------------
# The causal core


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def blockwise_attention(
    q_BxSxHxDh: jax.Array, k_BxSxKxDh: jax.Array, v_BxSxKxDh: jax.Array, block: int = 64
) -> jax.Array:
    """Causal grouped-query attention (H = K·G) in blocks of ``block`` positions."""
    return _fwd(q_BxSxHxDh, k_BxSxKxDh, v_BxSxKxDh, block)[0]


def _fwd(q, k, v, block):
    bl = Blocks.of(q.shape[1], block)
    qb, kb, vb = q_blocks(scaled(q), k.shape[2], bl), kv_blocks(k, bl), kv_blocks(v, bl)
    ob, lse = finish(forward(qb, kb, vb, bl, True))
    ob = ob.astype(q.dtype)
    return q_unblocks(ob, bl), (qb, kb, vb, ob, lse)


def _bwd(block, res, do_BxSxHxDh):
    qb, kb, vb, ob, lse = res
    s = do_BxSxHxDh.shape[1]
    bl = Blocks.of(s, block)
    dob = q_blocks(do_BxSxHxDh, kb.shape[2], bl)
    delta = jnp.sum(dob.astype(jnp.float32) * ob.astype(jnp.float32), axis=-1)
    dq, dk, dv = backward(qb, kb, vb, dob, lse, delta, bl, True)
    return (
        scaled(q_unblocks(dq, bl)).astype(qb.dtype),
        kv_unblocks(dk, s).astype(kb.dtype),
        kv_unblocks(dv, s).astype(vb.dtype),
    )


blockwise_attention.defvjp(_fwd, _bwd)
