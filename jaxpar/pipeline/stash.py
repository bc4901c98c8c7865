"""What a forward leaves behind for its backward: VJP residuals in fixed slot buffers.

The executor runs a stage's forward in one tick and its backward (``B``, or ``I`` then ``W``)
in a later one. Between the two, the VJP residuals of that (stage, micro-batch) live in a
*stash slot*: one buffer per residual leaf with a leading ``[n_stash]`` axis, ``n_stash`` being
the schedule's peak in-flight count (``tables.as_arrays``). Two modes:

* **residuals** (default): ``jax.vjp(stage, params, x)`` returns a ``VJP`` object that is a
  pytree; its leaves are the residuals (layer inputs, attention probabilities, MLP hiddens,
  ... stacked over the chunk's layer scan) *and* the primal parameters themselves. The
  parameters are recognised by identity and left out of the stash — the backward puts the
  chunk's current parameters back — so a slot costs activations only. The tree structure (it
  holds the linearised backward jaxpr) is probed once per trace and reused to rebuild the
  pullback from stashed leaves in the backward branch.
* **recompute**: the slot holds only the stage input; the backward recomputes the forward
  under ``jax.vjp``. Cheaper in memory, one extra forward per backward.

``I``/``W`` split: ``I`` calls the pullback and keeps only the input cotangent, ``W`` calls it
again (from the same residuals and the cotangent ``I`` filed) and keeps only the weight
cotangent. The pullback is the transpose of the stage's linearisation, so this *is* transposing
with respect to the input and the weights separately; XLA removes the unused half of each call
as dead code. We use it instead of ``jax.linearize`` + ``jax.linear_transpose`` because the
``VJP`` pytree already separates residuals from parameters, which the memory saving needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

StageFn = Callable[[Any, jax.Array], jax.Array]  # (chunk params, x [b, s, d]) -> y


@dataclass
class Stash:
    """Residual layout of one stage function, probed at trace time."""

    fn: StageFn
    recompute: bool
    treedef: Any = None  # structure of the VJP pytree (residual mode)
    param_pos: tuple[int, ...] = ()  # per VJP leaf: index into the param leaves, -1 = stashed
    shapes: tuple[jax.ShapeDtypeStruct, ...] = ()  # of the stashed leaves

    @staticmethod
    def probe(fn: StageFn, params: Any, x: jax.Array, recompute: bool) -> Stash:
        """Trace ``jax.vjp(fn, params, x)`` once to learn which leaves are residuals."""
        st = Stash(fn, recompute)
        if recompute:
            st.shapes = (jax.ShapeDtypeStruct(x.shape, x.dtype),)
            return st
        _, pullback = jax.vjp(fn, params, x)
        leaves, st.treedef = jax.tree_util.tree_flatten(pullback)
        plist = jax.tree_util.tree_leaves(params)
        st.param_pos = tuple(
            next((i for i, q in enumerate(plist) if q is leaf), -1) for leaf in leaves
        )
        st.shapes = tuple(
            jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
            for leaf, pos in zip(leaves, st.param_pos, strict=True)
            if pos < 0
        )
        return st

    def empty(self, n_slots: int) -> list[jax.Array]:
        """Zero buffers ``[n_slots, *leaf]`` for every stashed leaf."""
        return [jnp.zeros((n_slots, *s.shape), s.dtype) for s in self.shapes]

    def slot_bytes(self) -> int:
        """Bytes of one stash slot (per device, before any dp/tp sharding inside)."""
        return sum(s.size * s.dtype.itemsize for s in self.shapes)

    def forward(self, params: Any, x: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        """Stage output and the leaves to stash."""
        if self.recompute:
            return self.fn(params, x), [x]
        y, pullback = jax.vjp(self.fn, params, x)
        leaves = jax.tree_util.tree_leaves(pullback)
        if len(leaves) != len(self.param_pos):
            raise RuntimeError("stage VJP structure changed between traces")
        return y, [leaf for leaf, pos in zip(leaves, self.param_pos, strict=True) if pos < 0]

    def pullback(self, params: Any, stashed: list[jax.Array]) -> Callable:
        """``g -> (d params, d x)`` from stashed leaves and the current parameters."""
        if self.recompute:
            _, pb = jax.vjp(self.fn, params, stashed[0])
            return pb
        plist = jax.tree_util.tree_leaves(params)
        it = iter(stashed)
        leaves = [plist[pos] if pos >= 0 else next(it) for pos in self.param_pos]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def read_slot(bufs: list[jax.Array], slot: jax.Array) -> list[jax.Array]:
    """Slot ``slot`` of every buffer (index clamped into range)."""
    return [jax.lax.dynamic_index_in_dim(b, slot, keepdims=False) for b in bufs]


def write_slot(bufs: list[jax.Array], slot: jax.Array, values: list[jax.Array]) -> list[jax.Array]:
    """Write ``values`` into slot ``slot`` of every buffer (in place inside the scan)."""
    return [
        jax.lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), slot, 0)
        for b, v in zip(bufs, values, strict=True)
    ]


def write_if(buf: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """Write ``value`` at ``slot`` when ``slot >= 0``; otherwise leave ``buf`` unchanged.

    Rewrites the slot's own contents when masked off, so the update stays a
    ``dynamic-update-slice`` of one slot (no select over the whole buffer).
    """
    k = jnp.maximum(slot, 0)
    old = jax.lax.dynamic_index_in_dim(buf, k, keepdims=False)
    new = jnp.where(slot >= 0, value.astype(buf.dtype), old)
    return jax.lax.dynamic_update_index_in_dim(buf, new, k, 0)
