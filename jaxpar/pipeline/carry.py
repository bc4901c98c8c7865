"""The executor's typed state: the scan's carry, each phase's outputs, and slot operations.

Every type here is a pytree (a dataclass registered with ``jax.tree_util``) whose optional
fields are ``None`` where the table never needs them (evaluation, a table without ``FB`` or
without loss-cotangent slots): ``None`` is an empty subtree, so a ``lax.switch``'s branches
all return one structure. Buffers lead with their slot axis
(:class:`~jaxpar.pipeline.tables.SlotCounts`); the slot operations below read and write one
slot in place, so a tick never copies a buffer it does not touch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.pipeline.tables import TickTable

Leaves = list[jax.Array]


def _pytree(cls, order: str = "sorted"):
    """Register dataclass ``cls`` as a pytree; leaves flatten in field-name order (the order a
    dict of the same keys flattens in: the compiled program's operands keep their order)."""
    names = [f.name for f in dataclasses.fields(cls)]
    jax.tree_util.register_dataclass(cls, sorted(names) if order == "sorted" else names, [])
    return cls


@_pytree
@dataclass(frozen=True)
class Carry:
    """The scan's state on one rank. Buffers lead with their slot axis (``TickTable.slots``)."""

    act: jax.Array  # [act slots, *message] received activations
    loss: jax.Array  # () this rank's sum of micro-batch losses (each already / m)
    # Training only (None in evaluation):
    grad: jax.Array | None = None  # [grad slots, *message] received cotangents
    stash: Leaves | None = None  # per stash leaf [stash slots, ...]
    taps: Leaves | None = None  # per tap leaf [taps slots, ...] (split backward)
    wpend: Leaves | None = None  # per dys (recompute: and tap) leaf [dys slots, ...], I to W
    cot: jax.Array | None = None  # [cot slots, *message]; None also when the table has none
    acc: Any = None  # chunk-gradient tree [v, Lc, ...]
    acc_embed: Any = None  # embedding gradient (nonzero on stage 0's rank)
    acc_head: Any = None  # head gradient (nonzero on the last stage's rank)
    stats: Any = None  # the layers' statistics [v, Lc, ...] summed over forwards; None: none


@_pytree
@dataclass(frozen=True)
class ForwardOut:
    """What the forward phase returns (every branch the same structure); its stash and taps
    are written in place in the branch itself (:class:`ForwardKept`)."""

    y: jax.Array  # the activation to send
    loss: jax.Array  # the head's loss (last stage), else 0
    cot: jax.Array | None  # the head's output cotangent; None when the table has no cot slots
    stats: Any  # the stage's layers' statistics [Lc, ...]; None when its layers report none


@_pytree
@dataclass(frozen=True)
class BackwardOut:
    """What the backward phase returns besides the gradients (every branch the same
    structure); its gradients are added to the :class:`Grads` in the branch itself."""

    dx: jax.Array  # the input cotangent to send
    wpend: Leaves  # what an I files for its W
    loss: jax.Array | None  # FB's loss; None when the table has no FB
    stats: Any  # FB's forward's statistics; None without FB or statistics


@_pytree
@dataclass(frozen=True)
class Grads:
    """The gradient accumulators, through the conditionals of the phases that add to them
    (``None``: one a phase never adds to). The branch that computed a gradient adds it in place
    (:func:`add_slot`); every other branch, rank and tick hands the buffers back untouched,
    without a copy (:func:`jaxpar.pipeline.branches.when`) and without a zero gradient."""

    chunks: Any  # chunk-gradient tree [v, Lc, ...]
    embed: Any  # the embedding's gradient (stage 0 adds to it)
    head: Any  # the head's gradient (the last stage adds to it)


@_pytree
@dataclass(frozen=True)
class BackwardIn:
    """The backward switch's operands: the buffers enter whole and read-only."""

    g: jax.Array  # the output cotangent (from the grad or cot buffer)
    stash: Leaves
    taps: Leaves
    wpend: Leaves
    x: jax.Array | None  # FB's input activation; None when the table has no FB


@_pytree
@dataclass(frozen=True)
class ForwardKept:
    """The buffers the forward's conditional writes in training: the stash and taps, with the
    slots this tick's forward fills. ``F`` writes its values there in place (:func:`put_all`);
    an idle forward hands the buffers back untouched, without a copy (the pass-through branch
    first, :func:`jaxpar.pipeline.branches.when`) and without reading a slot."""

    stash: Leaves
    taps: Leaves
    k_stash: jax.Array
    k_taps: jax.Array


@_pytree
@dataclass(frozen=True)
class TickIn:
    """One tick's scanned input on one rank: its table row and each send route's choice."""

    row: TickTable
    send_index: tuple[jax.Array, ...]


@dataclass(frozen=True)
class StageParams:
    """This rank's parameters: its ``[v, Lc, ...]`` layers, the embedding's and the head's."""

    local: Any
    embed: Any
    head: Any


_pytree(StageParams, order="declared")  # the order the barrier in _behind has always had
# The table's rows are scanned as they are: its arrays are the leaves, the slot counts static.
jax.tree_util.register_dataclass(
    TickTable, sorted(TickTable.__dataclass_fields__.keys() - {"slots"}), ["slots"]
)


def slot(buf: jax.Array, k: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(buf, jnp.maximum(k, 0), keepdims=False)


def write_if(buf: jax.Array, k: jax.Array, value: jax.Array) -> jax.Array:
    """``buf[k] = value`` when ``k >= 0``; a dynamic-update-slice of one slot either way (it
    rewrites the slot's own contents when masked off: no select over the buffer)."""
    i = jnp.maximum(k, 0)
    new = jnp.where(k >= 0, value.astype(buf.dtype), slot(buf, i))
    return jax.lax.dynamic_update_index_in_dim(buf, new, i, 0)


def write_all(bufs: Leaves, k: jax.Array, values: Leaves) -> Leaves:
    return [write_if(b, k, x) for b, x in zip(bufs, values, strict=True)]


def put_all(bufs: Leaves, k: jax.Array, values: Leaves) -> Leaves:
    """``buf[max(k, 0)] = value`` for each buffer, unconditionally: called only in the branch
    that computed the values (``F`` writing its stash, :class:`ForwardKept`). A write masked
    outside the branch instead (:func:`write_if`) reads the slot outside the phase to write it
    back, and XLA:GPU materialises that read, one slot of every stash leaf per tick; an
    unconditional write outside it needs the slot's own contents from a phase that wrote
    nothing, one slot of every stash leaf read and written per idle forward."""
    return [
        jax.lax.dynamic_update_index_in_dim(b, x.astype(b.dtype), jnp.maximum(k, 0), 0)
        for b, x in zip(bufs, values, strict=True)
    ]


def file_arrivals(buf: jax.Array, used: np.ndarray, slots: jax.Array, arrivals: dict) -> jax.Array:
    """This tick's arrivals (per receive channel) into their slots ``slots[channel]``; a channel
    the table never uses (by ``used``, its ``[T, P, 3]`` receive field) writes nothing."""
    for ch, value in arrivals.items():
        if np.any(used[:, :, ch] >= 0):
            buf = write_if(buf, slots[ch], value)
    return buf


def read_slots(ins: BackwardIn, row: TickTable) -> BackwardIn:
    """The backward's slots of the stash, taps and dys buffers, read inside the branch (the
    buffers enter the switch read-only: no slot-sized copy is made before it)."""
    return dataclasses.replace(
        ins,
        stash=[slot(b, row.b_stash) for b in ins.stash],
        taps=[slot(b, row.b_taps) for b in ins.taps],
        wpend=[slot(b, row.b_dys) for b in ins.wpend],
    )


def zero_after(x: jax.Array) -> jax.Array:
    """An int32 zero that data-depends on ``x`` (``0·x`` is not folded for floats, and a
    non-finite ``x`` converts to 0 too)."""
    return (jnp.ravel(x)[0] * 0).astype(jnp.int32)


def zeros(shapes) -> Leaves:
    return [jnp.zeros(s.shape, s.dtype) for s in shapes]


def fresh_zeros(shapes: Any) -> Any:
    """Zeros of a tree of shapes (``jax.ShapeDtypeStruct`` leaves; ``None`` stays ``None``)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def distinct_zeros(shapes: list, seed: jax.Array) -> Leaves:
    """Zeros of each shape, each array its own buffer: a broadcast of a zero made at run time
    from ``seed`` (any integer scalar) and the array's position.

    XLA merges constant zeros of one shape into one buffer, or folds them into a read-only
    literal. A buffer that a conditional writes in place in one branch and passes through the
    other (the stash's, :class:`ForwardKept`) must be its own: where XLA:GPU's while-loop double
    buffering peels the scan's first tick out of the loop, that tick's conditional copied every
    shared or constant one, whole, in both branches."""
    base = jnp.asarray(seed, jnp.float32)
    return [jnp.broadcast_to(((base + i) * 0.0).astype(s.dtype), s.shape)  # 0·x is not folded
            for i, s in enumerate(shapes)]  # fmt: skip


def fresh(shapes: Any, **given: Any) -> Any:
    """A phase's outputs (:class:`ForwardOut`/:class:`BackwardOut`) from their ``shapes``: the
    fields in ``given``, zeros made here for the rest.

    Called inside the branch that returns them, so the zeros are that branch's own. Zeros made
    once outside the scan are loop-invariant operands of every switch instead: XLA:GPU
    materialises them (a zero chunk gradient, stash, embedding and head gradient) and copies
    them into the switch's outputs, one more gradient-sized set alive beside the accumulators
    at the peak (llama3-8b tp 4 × pp 2, 1F1B over 8 micro-batches: 9.7 against 8.5 GiB).
    """
    out = {f.name: given.pop(f.name) if f.name in given else fresh_zeros(getattr(shapes, f.name))
           for f in dataclasses.fields(shapes)}  # fmt: skip
    if given:
        raise TypeError(f"{type(shapes).__name__} has no field {sorted(given)[0]!r}")
    return type(shapes)(**out)


def add_slot(a: jax.Array, chunk: jax.Array, x: jax.Array, v: int) -> jax.Array:
    """``a[chunk] += x`` for one ``[v, ...]`` accumulator leaf (in place: one slot read and
    written)."""
    if v == 1:
        return a + x[None].astype(a.dtype)
    return a.at[jnp.maximum(chunk, 0)].add(x.astype(a.dtype))


def add_layer(a: jax.Array, chunk: jax.Array, i: jax.Array, x: jax.Array, v: int) -> jax.Array:
    """``a[chunk, i] += x`` for one ``[v, Lc, ...]`` accumulator leaf and one layer's gradient
    ``x`` (in place: one layer's slot read and written)."""
    at = (0 if v == 1 else jnp.maximum(chunk, 0), i) + (0,) * (a.ndim - 2)
    cur = jax.lax.dynamic_slice(a, at, (1, 1, *a.shape[2:]))
    return jax.lax.dynamic_update_slice(a, cur + x.astype(a.dtype)[None, None], at)


def accumulate(acc: Any, chunk: jax.Array, d: Any, v: int) -> Any:
    """Add ``d`` (a tree like one local chunk's) to local chunk ``chunk``'s."""
    return jax.tree.map(lambda a, x: add_slot(a, chunk, x, v), acc, d)


def add(acc: Any, d: Any) -> Any:
    """``acc + d`` leaf by leaf (``None`` when ``acc`` is)."""
    return None if acc is None else jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, d)
