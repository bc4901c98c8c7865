"""The backward phase's actions and how their gradients reach the accumulators.

A tick's backward phase runs one action per rank (idle, ``B``, ``I``, ``W``, or ``FB``: the last
stage's forward and backward of one micro-batch). Each action computes its outputs
(:class:`~jaxpar.pipeline.carry.BackwardOut`) and its chunk gradient, reduced per micro-batch;
:meth:`BackwardActions.backward_switch` dispatches on the action and adds the gradient to the
accumulators (:class:`~jaxpar.pipeline.carry.Grads`) in the branch that computed it, and
:meth:`BackwardActions.embed_grad` adds stage 0's embedding gradient in a conditional of its own.

Every conditional an accumulator enters has two branches, the one that hands it back untouched
first (:func:`~jaxpar.pipeline.branches.when` says why): so an idle tick reads and writes no
gradient-sized buffer and makes no zero one, and XLA copies none.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.pipeline import carry as ops
from jaxpar.pipeline.branches import FB_BRANCH, when
from jaxpar.pipeline.carry import BackwardIn, BackwardOut, Grads, Leaves, TickIn
from jaxpar.pipeline.stage import Chunk, GradSink
from jaxpar.pipeline.tables import B_FULL, B_IDLE, B_INPUT, B_WEIGHT, F_FB, TickTable


class BackwardActions:
    """The backward phase of :class:`jaxpar.pipeline.executor._Program` (a mixin: it reads the
    program's stage, parameters, tables, branch weights and shapes)."""

    def sink(self, chunk: jax.Array, in_scan: tuple[bool, ...]) -> GradSink:
        """How a backward piece of local chunk ``chunk`` files each layer's gradient (a
        :data:`~jaxpar.pipeline.stage.GradSink`): each leaf reduced per micro-batch (ZeRO-2's
        reduce-scatter; the identity otherwise); the leaves in ``in_scan`` added in place to
        their accumulators, which the layer scan carries (one layer's slot read and written),
        the leaves ``I`` computes (:attr:`in_i`) returned for the caller to add; other leaves'
        gradients (known zeros) dropped."""
        v, reduce = self.tables.schedule.v, self.model.reduce

        def sink(acc, i, d, computed):
            it, acc_out, rest = iter(acc), [], []
            for k, x in enumerate(jax.tree.leaves(d)):
                if in_scan[k]:
                    a = next(it)
                    acc_out.append(ops.add_layer(a, chunk, i, reduce[k](x), v) if computed[k]
                                   else a)  # fmt: skip
                elif self.in_i[k]:
                    s = self.acc_shapes[k]
                    rest.append(reduce[k](x) if computed[k] else jnp.zeros(s.shape, s.dtype))
            return acc_out, rest

        return sink

    def b_idle(self, xs: TickIn, ins: BackwardIn, acc: Grads) -> tuple[BackwardOut, Grads]:
        return ops.fresh(self.b_shapes), acc

    # ---- the full backward: what differs per kind, then one layer scan that adds ----------
    #
    # B, W and FB each end in the same piece: a non-split stage's backward, or a split one's
    # weight half (W). That piece, the one that adds the weight-dot leaves to their
    # accumulators in its layer scan, runs once after the conditional over the kinds, which
    # only prepares its operands: the accumulators pass that conditional untouched, so no
    # branch but one writes them and XLA copies none (branches.when). Each preparation returns
    # ``(out, small, head, operands)``: the outputs so far, the I leaves' gradients (a split
    # stage's, stacked ``[Lc, ...]``), the head's accumulator, and the operands of the common
    # piece: ``[g, *stash]`` (non-split) or ``[*taps, *wpend]`` (split).

    def _input_half(self, ch: Chunk, chunk: jax.Array, stash: Leaves, g: jax.Array):
        """A split stage's I: ``(small, dx, wpend)``."""
        none = (False,) * len(self.in_i)
        _, small, dx, wpend = self.stage.input_grads(ch, stash, g, [], self.sink(chunk, none))
        return small, dx, wpend

    def _no_small(self) -> Leaves:
        n = self.stage.n_layers
        return [jnp.zeros((n, *s.shape), s.dtype)
                for s, i in zip(self.acc_shapes, self.in_i, strict=True) if i]  # fmt: skip

    def pre_b(self, xs: TickIn, ins: BackwardIn, head: Any):
        """B: the stash slot and the received cotangent (split: after I, the taps slot and
        what I files)."""
        row, ins = xs.row, ops.read_slots(ins, xs.row)
        if self.stage.split is None:
            return ops.fresh(self.b_shapes), [], head, [ins.g, *ins.stash]
        small, dx, wpend = self._input_half(self.chunk(row.b_chunk), row.b_chunk, ins.stash,
                                            ins.g)  # fmt: skip
        return ops.fresh(self.b_shapes, dx=dx), small, head, [*ins.taps, *wpend]

    def pre_w(self, xs: TickIn, ins: BackwardIn, head: Any):
        """W: the taps slot and what an earlier I filed."""
        ins = ops.read_slots(ins, xs.row)
        return ops.fresh(self.b_shapes), self._no_small(), head, [*ins.taps, *ins.wpend]

    def pre_fb(self, xs: TickIn, ins: BackwardIn, acc_head: Any):
        """FB: the last stage's forward of one micro-batch (the table's f_* fields name it),
        keeping what its backward needs in the tick itself, not in a stash slot; the head's
        loss, its gradient added to ``acc_head``, and its output cotangent (split: then I)."""
        row, loss_of = xs.row, self._loss_of(xs.row.f_mb)
        ch = self.chunk(row.f_chunk)
        y, stash, taps, stats = self.stage.forward(ch, ins.x)
        loss, (d_head, dy) = jax.value_and_grad(loss_of, argnums=(0, 1))(self.params.head, y)
        dy, head = dy.astype(y.dtype), ops.add(acc_head, d_head)
        out = ops.fresh(self.b_shapes, loss=loss, stats=self._keep(stats))
        if self.stage.split is None:
            return out, [], head, [dy, *stash]
        small, dx, wpend = self._input_half(ch, row.f_chunk, stash, dy)
        return dataclasses.replace(out, dx=dx), small, head, [*taps, *wpend]

    def common(self, ch: Chunk, chunk: jax.Array, operands: Leaves, big: Leaves):
        """The piece every full backward ends in, adding to the weight-dot leaves ``big`` in
        its layer scan: ``(big, small, dx)`` (``dx`` None for a split stage: I made it)."""
        sink = self.sink(chunk, self.in_big)
        if self.stage.split is None:
            big, small, dx = self.stage.backward(ch, operands[1:], [], operands[0], big, sink)
            return big, small, dx
        n = len(self.stage.taps_shapes)
        big, small = self.stage.weight_grads(ch, operands[:n], operands[n:], big, sink)
        return big, small, None

    def b_inp(self, xs: TickIn, ins: BackwardIn):
        """I: outputs and the gradient of the leaves it computes (``self.in_i``) only."""
        row, ins = xs.row, ops.read_slots(ins, xs.row)
        small, dx, wpend = self._input_half(self.chunk(row.b_chunk), row.b_chunk, ins.stash,
                                            ins.g)  # fmt: skip
        return ops.fresh(self.b_shapes, dx=dx, wpend=wpend), small

    def backward_switch(self, kind: jax.Array, chunk: jax.Array, xs: TickIn, ins: BackwardIn,
                        acc: Grads) -> tuple[BackwardOut, Grads]:  # fmt: skip
        """The backward action ``kind`` of the table's (idle, B, I, W, FB), its gradients added
        to ``acc`` (the chunks' and, FB, the head's) by the branch that computed them.

        A tree of two-branch conditionals (:func:`~jaxpar.pipeline.branches.when`: an
        accumulator passes through the first branch and is written in the second): idle or
        busy; busy: I or a full gradient (B, W, FB). A full gradient prepares its operands in
        a conditional over its kinds (the head's accumulator written in FB's branch, the last)
        and then runs the one piece that adds the weight-dot leaves, in its layer scan
        (comment above :meth:`pre_b`). The chunk leaves only ``I`` computes (a split
        backward's non-dot leaves) are added once after the I-or-full choice, from the
        gradient either side returns. So an idle tick touches no accumulator and an ``I``
        none of the weight-dot leaves."""
        ran, w, v = self.ran, self.w, self.tables.schedule.v
        leaves, in_i = jax.tree.leaves(acc.chunks), self.in_i
        pick = lambda d, side: [x for x, i in zip(d, in_i, strict=True) if i == side]  # noqa: E731
        pres = {B_WEIGHT: self.pre_w, B_FULL: self.pre_b, FB_BRANCH: self.pre_fb}
        full_kinds = [k for k in pres if k in ran]  # FB last: its branch writes acc_head

        def prepare(kinds, xs, ins, head):
            if len(kinds) == 1:
                return pres[kinds[0]](xs, ins, head)
            *rest, last = kinds
            return when(kind == last, lambda *a: prepare(rest, *a), pres[last],
                        w.split(rest, [last]), xs, ins, head)  # fmt: skip

        def full(xs, ins, big, head):
            out, small, head, operands = prepare(full_kinds, xs, ins, head)
            big, more, dx = self.common(self.chunk(chunk), chunk, operands, big)
            small = [a + b for a, b in zip(small, more, strict=True)] if more else small
            out = out if dx is None else dataclasses.replace(out, dx=dx)
            return out, small, big, head

        def inp(xs, ins, big, head):
            out, small = self.b_inp(xs, ins)
            return out, small, big, head

        def busy(xs, ins, acc):
            big = pick(leaves, False)
            if B_INPUT in ran:
                out, small, big, head = when(kind != B_INPUT, inp, full,
                                             w.split([B_INPUT], full_kinds),
                                             xs, ins, big, acc.head)  # fmt: skip
            else:
                out, small, big, head = full(xs, ins, big, acc.head)
            small = [ops.add_slot(a, chunk, x, v)
                     for a, x in zip(pick(leaves, True), small, strict=True)]  # fmt: skip
            it = {False: iter(big), True: iter(small)}
            chunks = jax.tree.unflatten(self.tree, [next(it[i]) for i in in_i])
            return out, dataclasses.replace(acc, chunks=chunks, head=head)

        if B_IDLE not in ran:
            return busy(xs, ins, acc)
        return when(kind != B_IDLE, self.b_idle, busy, w.split([B_IDLE], full_kinds + (
            [B_INPUT] if B_INPUT in ran else [])), xs, ins, acc)  # fmt: skip

    def embed_grad(self, row: TickTable, dx: jax.Array, acc_embed: Any) -> Any:
        """``acc_embed`` plus, after stage 0's B or I, the embedding's gradient: stage 0's input
        cotangent is the embedding's (ZeRO-3: the gather's transpose reduce-scatters it). Taken
        in its own conditional after the backward's, from the ``dx`` that goes on to be sent:
        no other rank or tick makes a zero table or reads the accumulator."""

        def grad(dx, acc_embed):
            tokens = self.tokens[row.b_mb]
            pullback = jax.vjp(lambda e: self.model.embed(e, tokens), self.params.embed)[1]
            return ops.add(acc_embed, pullback(dx.astype(self.dtype))[0])

        def keep(dx, acc_embed):
            return acc_embed

        takes = (row.b_stage == 0) & ((row.b_kind == B_FULL) | (row.b_kind == B_INPUT))
        if self.tables.has_fb:  # an FB tick's backward is the forward's stage's
            takes = takes & (row.f_kind != F_FB)
        return when(takes, keep, grad, self.w.embed_grad, dx, acc_embed)
