"""The ragged MoE dispatch: a device's assignments sorted by expert and exchanged with a ragged
all-to-all over ``ep``, so only the kept rows cross the wire.

The padded dispatch (:func:`jaxpar.model.moe.routed`) sends an ``[E, b·C, D]`` buffer each way:
dropless, ``E / top_k`` times the real rows. Here:

1. **Sort.** Each assignment's expert is ``slot // C`` (``E`` for one the capacity dropped, so
   dropped rows sort last and are never sent); a stable argsort gives the send buffer
   ``[k·b·S, D]`` grouped by expert, and ``counts[E]`` the rows per expert.
2. **Sizes.** One all-gather over ``ep`` of the counts (``[ep, E]`` int32, a few bytes) tells
   every device the whole exchange: source ``i`` sends owner ``j`` the rows of ``j``'s
   ``E/ep`` experts, from offset ``in_off[i, j]`` of its buffer to offset ``out_off[i, j]``
   of ``j``'s (after the rows of the sources before ``i``).
3. **Exchange.** :func:`jax.lax.ragged_all_to_all` into a receive buffer of the most rows an
   owner can get, ``ep · min(k·b·S, (E/ep)·b·C)`` (``C = S`` dropless): the op's shapes are
   static, what crosses the wire is the real rows.
4. **Experts.** Each received row goes to slot (local expert, rank among that expert's rows)
   of an ``[E/ep, ep·b·C, D]`` buffer and the experts run as the padded path's batched
   einsums, so the expert FLOPs equal the padded path's. ``lax.ragged_dot`` would multiply
   only the real rows, but XLA:GPU (jax-cuda12-plugin 0.10.2) rewrites ``ragged-dot`` into a
   dense dot of every group over every row (``f32[E, rows, F]``): ``top_k`` times the padded
   compute dropless, so it is not used.
5. **Return.** The inverse ragged all-to-all (sizes and offsets swapped) brings every row back
   to its source's sorted buffer; unsorted and summed with the gates, as the padded path.

Both dispatches route with :func:`jaxpar.model.moe.route` and apply the same experts to the
same kept rows, so they compute the same loss and gradients (``tests/test_moe_ragged.py``).
Gradients: the transpose of a ragged all-to-all is the ragged all-to-all with the roles
swapped (JAX's rule), so an expert's cotangents reach its owner as in the padded path. Without
an exchange (``ep = 1``) there is nothing ragged to send and the padded path runs.

XLA:CPU has no ``ragged-all-to-all`` (jax-ml/jax#34755), so this path is for GPU targets
(``model.moe.dispatch = auto`` picks it there, :meth:`MoeConfig.ragged`); forced on CPU
devices it is refused before compiling (:func:`check`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.config import MoeConfig

EP_AXIS = "ep"

# The collective, as a module attribute: tests run the path on CPU with an all-gather
# emulation of the op's documented semantics in its place.
ragged_all_to_all = jax.lax.ragged_all_to_all


def check(moe: MoeConfig, ep: int, platform: str) -> None:
    """Refuse a ragged exchange where XLA cannot compile one (before compiling; the rule is
    :func:`jaxpar.validation.check_dispatch`, which ``--dry-run`` runs too)."""
    from jaxpar.validation import check_dispatch

    check_dispatch(moe, ep, platform)


def receive_rows(n_rows: int, experts: int, ep: int, rows_b: int, c: int) -> int:
    """Rows of an owner's receive buffer: from each of ``ep`` sources at most all its
    ``n_rows`` assignments, and at most ``c`` per row and local expert."""
    return ep * min(n_rows, (experts // ep) * rows_b * c)


def _permute(order_N: jax.Array) -> jax.Array:
    """The inverse of the permutation ``order_N`` (an int scatter, no second sort)."""
    n = order_N.shape[0]
    return jnp.zeros((n,), jnp.int32).at[order_N].set(jnp.arange(n, dtype=jnp.int32))


def _exclusive(a: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(a, axis=axis) - a


def _exchange(x_TxD, count_E, ws, apply, n_experts: int, rows_b: int, c: int):
    """Send each expert's rows to its owner, apply the owner's experts, bring them back."""
    t, d = x_TxD.shape
    ep = jax.lax.axis_size(EP_AXIS)
    e_l = n_experts // ep
    me = jax.lax.axis_index(EP_AXIS)
    blk = jax.lax.all_gather(count_E, EP_AXIS).reshape(ep, ep, e_l)  # [source, owner, expert]
    send = jnp.sum(blk, axis=-1)  # [source, owner] rows
    in_off, out_off = _exclusive(send, 1), _exclusive(send, 0)
    n_recv = receive_rows(t, n_experts, ep, rows_b, c)
    recv = ragged_all_to_all(
        x_TxD, jnp.zeros((n_recv, d), x_TxD.dtype),
        in_off[me], send[me], out_off[me], send[:, me], axis_name=EP_AXIS,
    )  # fmt: skip
    # Received rows: source-major, each source's rows by local expert, then padding. Row r of
    # segment (i, l) takes slot l·cap + (rows sources < i sent l) + (r − the segment's start).
    mine = blk[:, me, :]  # [source, local expert]
    sizes = mine.reshape(-1)
    seg = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(n_recv), side="right")
    real = seg < ep * e_l
    seg = jnp.minimum(seg, ep * e_l - 1)
    local = seg % e_l
    base = _exclusive(mine, 0).reshape(-1)  # rows of earlier sources, per (source, expert)
    cap = ep * rows_b * c
    pos = base[seg] + jnp.arange(n_recv) - _exclusive(sizes, 0)[seg]
    slot = jnp.where(real, local * cap + pos, e_l * cap)
    buf = jnp.zeros((e_l * cap + 1, d), recv.dtype).at[slot].set(recv)[:-1]
    y = apply(buf.reshape(e_l, cap, d), *ws).reshape(e_l * cap, d)
    y = jnp.concatenate([y, jnp.zeros((1, d), y.dtype)])[slot]  # padding rows: 0
    # The inverse: what came from source i goes back to where i had it.
    return ragged_all_to_all(
        y, jnp.zeros((t, d), y.dtype),
        out_off[:, me], send[:, me], in_off[:, me], send[me], axis_name=EP_AXIS,
    )  # fmt: skip


def routed(x_BxSxD, slot_BxSxK, gate_BxSxK, ws, apply, n_experts: int, c: int):
    """The ragged form of :func:`jaxpar.model.moe.routed` over the manual ``ep`` axis (same
    result); ``apply``: the experts as batched einsums over ``[E/ep, N, D]``."""
    b, s, d = x_BxSxD.shape
    k = slot_BxSxK.shape[-1]
    t = b * s * k
    expert_T = (slot_BxSxK // c).reshape(t)  # token-major, choice-minor; E where dropped
    order = jnp.argsort(expert_T, stable=True)
    x_TxD = x_BxSxD.reshape(b * s, d)[order // k]
    ones = jnp.ones((t,), jnp.int32)
    count_E = jax.ops.segment_sum(ones, expert_T, num_segments=n_experts)  # drops E
    y_TxD = _exchange(x_TxD, count_E, ws, apply, n_experts, b, c)[_permute(order)]
    gates = gate_BxSxK.astype(x_BxSxD.dtype).reshape(t, 1)
    return jnp.sum((y_TxD * gates).reshape(b, s, k, d), axis=2)
