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
from jaxpar.pipeline.carry import BackwardIn, BackwardOut, Grads, TickIn
from jaxpar.pipeline.tables import B_FULL, B_IDLE, B_INPUT, B_WEIGHT, F_FB, TickTable


class BackwardActions:
    """The backward phase of :class:`jaxpar.pipeline.executor._Program` (a mixin: it reads the
    program's stage, parameters, tables, branch weights and shapes)."""

    def reduce(self, d: Any, keep: tuple[bool, ...] | None = None) -> list[jax.Array]:
        """The leaves of chunk gradient ``d``, each with its per-micro-batch reduction; leaves
        outside ``keep`` are known zeros (a split backward's weight-dot leaves in ``I``): not
        reduced, and zeros here (only their shapes are read)."""
        return [
            r(x) if keep is None or keep[k] else jnp.zeros(s.shape, s.dtype)
            for k, (x, r, s) in enumerate(zip(jax.tree.leaves(d), self.model.reduce,
                                              self.acc_shapes, strict=True))
        ]  # fmt: skip

    def b_idle(self, xs: TickIn, ins: BackwardIn, acc: Grads) -> tuple[BackwardOut, Grads]:
        return ops.fresh(self.b_shapes), acc

    def b_fb(self, xs: TickIn, ins: BackwardIn, acc_head: Any):
        """FB: outputs and chunk gradient; the head's gradient added to ``acc_head``."""
        # The last stage's forward and full backward of one micro-batch in one tick (the
        # table's f_* fields name it): one VJP, nothing stashed; under recompute the forward
        # keeps the layer inputs and each layer's backward re-runs it (one layer's residuals
        # at a time, as in B).
        row, loss_of = xs.row, self._loss_of(xs.row.f_mb)
        if self.stage.p.recompute:
            ch = self.chunk(row.f_chunk)
            y, stash, _, stats = self.stage.forward(ch, ins.x)
            loss, (d_head, dy) = jax.value_and_grad(loss_of, argnums=(0, 1))(self.params.head, y)
            d_chunk, dx = self.stage.backward(ch, stash, [], dy.astype(y.dtype))
        else:

            def fb_loss(ch, hp, x):
                y, stats = self.stage.apply(ch, x)
                return loss_of(hp, y), stats

            (loss, stats), (d_chunk, d_head, dx) = jax.value_and_grad(
                fb_loss, argnums=(0, 1, 2), has_aux=True
            )(self.chunk(row.f_chunk), self.params.head, ins.x)
        out = ops.fresh(self.b_shapes, loss=loss, dx=dx, stats=self._keep(stats))
        return out, self.reduce(d_chunk), ops.add(acc_head, d_head)

    def b_bwd(self, xs: TickIn, ins: BackwardIn):
        row, ins = xs.row, ops.read_slots(ins, xs.row)
        d, dx = self.stage.backward(self.chunk(row.b_chunk), ins.stash, ins.taps, ins.g)
        return ops.fresh(self.b_shapes, dx=dx), self.reduce(d)

    def b_inp(self, xs: TickIn, ins: BackwardIn):
        """I: outputs and the gradient of the leaves it computes (``self.in_i``) only."""
        row, ins = xs.row, ops.read_slots(ins, xs.row)
        d_small, dx, wpend = self.stage.input_grads(self.chunk(row.b_chunk), ins.stash, ins.g)
        return ops.fresh(self.b_shapes, dx=dx, wpend=wpend), self.reduce(d_small, self.in_i)

    def b_wgt(self, xs: TickIn, ins: BackwardIn):
        row, ins = xs.row, ops.read_slots(ins, xs.row)
        d = self.stage.weight_grads(self.chunk(row.b_chunk), ins.taps, ins.wpend)
        return ops.fresh(self.b_shapes), self.reduce(d)

    def backward_switch(self, kind: jax.Array, chunk: jax.Array, xs: TickIn, ins: BackwardIn,
                        acc: Grads) -> tuple[BackwardOut, Grads]:  # fmt: skip
        """The backward action ``kind`` of the table's (idle, B, I, W, FB), its gradients added
        to ``acc`` (the chunks' and, FB, the head's) by the branch that computed them.

        A tree of two-branch conditionals (:func:`~jaxpar.pipeline.branches.when`: an
        accumulator passes through the first branch and is written in the second): idle or
        busy; busy: I or a full gradient (B, W, FB); full: B/W or FB (the head's gradient);
        B or W. The chunk leaves only ``I`` computes (a split backward's non-dot leaves) are
        added once after the I-or-full choice, from the gradient either side returns; all the
        others in the full branch. So an idle tick touches no accumulator and an ``I`` none
        of the weight-dot leaves."""
        ran, w, v = self.ran, self.w, self.tables.schedule.v
        leaves, in_i = jax.tree.leaves(acc.chunks), self.in_i
        pick = lambda d, side: [x for x, i in zip(d, in_i, strict=True) if i == side]  # noqa: E731
        bw_kinds = [k for k in (B_FULL, B_WEIGHT) if k in ran]
        full_kinds = bw_kinds + ([FB_BRANCH] if FB_BRANCH in ran else [])

        def b_or_w(xs, ins, head):
            if len(bw_kinds) == 2:
                out, d = when(kind == B_WEIGHT, self.b_bwd, self.b_wgt,
                              w.split([B_FULL], [B_WEIGHT]), xs, ins)  # fmt: skip
            else:
                out, d = (self.b_bwd if bw_kinds == [B_FULL] else self.b_wgt)(xs, ins)
            return out, d, head

        def full(xs, ins, big, head):
            if FB_BRANCH in ran and bw_kinds:
                out, d, head = when(kind == FB_BRANCH, b_or_w, self.b_fb,
                                    w.split(bw_kinds, [FB_BRANCH]), xs, ins, head)  # fmt: skip
            else:
                out, d, head = (self.b_fb if FB_BRANCH in ran else b_or_w)(xs, ins, head)
            big = [ops.add_slot(a, chunk, x, v) for a, x in zip(big, pick(d, False), strict=True)]
            return out, pick(d, True), big, head

        def inp(xs, ins, big, head):
            out, d = self.b_inp(xs, ins)
            return out, pick(d, True), big, head

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
