"""The SPMD pipeline executor: one program runs any schedule's tick table (GPipe ... DualPipeV).

Layout of one step (``p`` ranks on mesh axis ``pp``, ``v`` chunks per rank, ``m`` micro-batches),
inside the gradient path's ``shard_map`` (manual over ``pp`` and the dp axes; tp/sp stay
automatic, so the stage code is the same Megatron/ZeRO code as without a pipeline):

* One ``lax.scan`` over the ticks of a :class:`~jaxpar.pipeline.tables.TickTable` (compile
  time does not depend on ``m``), carrying a :class:`Carry`. A tick runs a **backward phase**
  (idle, ``B``, ``I``, ``W``, or ``FB``: the last stage's forward and backward of one
  micro-batch), then a **forward phase** (idle or ``F``), then the sends: its input
  cotangent's, then its activation's. The backward goes first: its stash slot is free by the
  time the forward's stash exists. The forward's parameters and input wait behind the backward
  (:meth:`_Program._behind`), the sends behind the forward: one order of collectives on every
  device. A send holds a rank until its peers reach it, so a cotangent sent before the forward
  and waited for before it would hold each rank's forward until its neighbours' backward
  phases had ended — the last stage's ``FB``, forward, backward, head and loss in one tick,
  the longest of them — and a tick would last longer than its slowest rank
  (:mod:`jaxpar.pipeline.coupled`). Each phase
  is one ``lax.switch``/``lax.cond`` on the rank's row; the backward is explicit
  (:mod:`jaxpar.pipeline.stage`): never autodiff through a switch.
* **Nothing replicated that one rank uses**: stage 0 embeds each micro-batch's tokens in its
  forward and takes the embedding's gradient in its backward; the last stage runs the head and
  loss; their parameters arrive as this rank's slot of stage-owned stacks
  (:mod:`jaxpar.pipeline.rest`), so their gradients leave unsummed over ``pp``.
* **Nothing copied that a tick does not touch**: the branches return only their own action's
  values (:class:`ForwardOut`, :class:`BackwardOut`); the buffers enter the backward's switch
  read-only and are written after it, in place in the carry, each write ordered after the reads
  by a data dependency. (A buffer that passes through a switch is copied by XLA's CPU compile
  in every branch, jax-ml/jax#38145; an unordered in-place write is copied twice.) The
  gradient accumulators and the stash and taps buffers are the exception, and pass through
  without a copy: only two-branch conditionals, the pass-through branch first
  (:func:`~jaxpar.pipeline.branches.when`). ``F`` writes its stash and taps slots in place in
  the forward's conditional (:class:`~jaxpar.pipeline.carry.ForwardKept`), its slot index
  depending on the backward's output; an idle forward reads and writes no slot of them.
* **Sends**: per :class:`~jaxpar.pipeline.step_tables.SendRoute` (message kind and ring
  direction) one collective-permute per tick, with exactly that tick's pairs, or none (a
  ``lax.switch`` over the route's pair sets), at the tick's end. A collective-permute inside
  a switch branch starts and completes inside it, with nothing beside it: the sends are the
  tick's barrier, each holding a rank until its peers reach it. A cotangent route sent every
  tick outside the conditionals, started after the backward to be in flight during the
  forward, was slower on every pp 4 row of the GPU grid (BENCHMARKS.md): XLA:GPU placed its end
  before the forward, so each rank's forward waited for its neighbours' backward phases.
* **Gradients added where they exist**: the accumulators (:class:`~jaxpar.pipeline.carry.Grads`)
  enter the conditionals of the phases that add to them, and only the branch that computed a
  gradient adds it, in place (a full backward — ``B``, ``W`` or ``FB`` — to its chunk's slot
  in the one layer scan they all end in, ``I`` only its non-dot leaves, stage 0's ``B``/``I``
  to the embedding's, the last stage's head to the head's); idle
  branches and other ranks hand them back untouched, with no zero gradient made
  (:mod:`jaxpar.pipeline.backward`). Adding every tick's gradient, zeros included, on every
  rank was the largest memory-bound cost of a pipelined step on XLA:GPU (llama3-8b pp 4 ZB-V:
  0.55 of 1.39 s of memory-bound kernels).
* Weight gradients accumulate per local chunk, layer by layer inside the backward's layer
  scans (:meth:`~jaxpar.pipeline.backward.BackwardActions.sink`), unreduced over dp (ZeRO-2:
  reduce-scattered per micro-batch and layer by :attr:`PipelineModel.reduce`); the caller
  reduces them once after the schedule.

Every conditional runs under a named scope stating how often the table takes each branch
(:class:`~jaxpar.pipeline.branches.BranchWeights`, computed once beside the program). What a
layer (a MoE layer included) must satisfy to run in a stage: :mod:`jaxpar.pipeline.stage`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.pipeline import carry as ops
from jaxpar.pipeline.backward import BackwardActions
from jaxpar.pipeline.branches import FB_BRANCH, cond, switch, when
from jaxpar.pipeline.carry import (
    BackwardIn,
    BackwardOut,
    Carry,
    ForwardKept,
    ForwardOut,
    Grads,
    StageParams,
    TickIn,
)
from jaxpar.pipeline.stage import Chunk, Stage, StagePieces
from jaxpar.pipeline.step_tables import StepTables
from jaxpar.pipeline.tables import B_INPUT, CHANNEL_OF_SEND, F_FB, F_RUN, SEND_LOCAL, TickTable


@dataclass(frozen=True)
class PipelineModel:
    """The model pieces the executor runs, with the layout's hooks applied.

    ``embed(embed_params, tokens_BxS) -> x``; ``head_loss(head_params, y, targets) -> loss``;
    ``reduce[k](g)``: the per-micro-batch reduction of one layer's gradient of chunk leaf
    ``k`` (ZeRO-2's reduce-scatter; identity otherwise), in the order of the chunk tree's
    leaves;
    ``forward_collectives``: whether a stage's forward (or the head) runs collectives of its
    own (tp, sp, ep, ZeRO-3 gathers): every collective of the backward phase (the
    embedding's gradient reduction included) is then issued before it.
    """

    pieces: StagePieces
    embed: Callable[[Any, jax.Array], jax.Array]
    head_loss: Callable[[Any, jax.Array, jax.Array], jax.Array]
    reduce: tuple[Callable[[jax.Array], jax.Array], ...]
    forward_collectives: bool = True


def run_local(tables: StepTables, model: PipelineModel, local: Any, embed_params: Any,
              head_params: Any, tokens_MxBxS: jax.Array, targets_MxBxS: jax.Array):  # fmt: skip
    """Run the schedule on this rank (inside a ``shard_map`` manual over ``pp``).

    ``local`` is this rank's ``[v, Lc, ...]`` layer tree, ``tokens``/``targets`` all
    micro-batches' rows of this dp rank. Returns ``(loss, d local, d embed, d head, stats)``
    — the loss (mean over micro-batches, summed over ``pp``), this rank's gradients: of its
    chunks, of the embedding (nonzero on the first stage's rank only) and of the head (the last
    stage's), and its chunks' layer statistics ``[v, Lc, ...]`` summed over the micro-batches
    (None when the layers report none) — or ``(loss, stats)`` for a forward-only table.
    """
    params = StageParams(local, embed_params, head_params)
    prog = _Program(tables, model, params, tokens_MxBxS, targets_MxBxS)
    me = jax.lax.axis_index("pp")
    per_rank = tables.rank_rows  # this rank's row of each field, in the table's field order
    rows = per_rank.replace(**{k: jnp.asarray(a)[me] for k, a in per_rank.arrays().items()})
    xs = TickIn(rows, tuple(jnp.asarray(r.index) for r in tables.sends))
    c, _ = jax.lax.scan(prog.tick, prog.carry0(), xs)
    loss = jax.lax.psum(c.loss, "pp")
    if not tables.training:
        return loss, c.stats
    # Not summed over pp: the embedding and head are stage-owned at rest
    # (jaxpar.pipeline.rest), so each gradient stays on the rank that computed it.
    return loss, c.acc, c.acc_embed, c.acc_head, c.stats


class _Program(BackwardActions):
    """One rank's tick: its branches, sends and writes (see the module docstring); the
    backward phase's actions are :class:`~jaxpar.pipeline.backward.BackwardActions`."""

    def __init__(self, tables: StepTables, model: PipelineModel, params: StageParams,
                 tokens: jax.Array, targets: jax.Array):  # fmt: skip
        self.tables, self.model, self.params = tables, model, params
        self.tokens, self.targets = tokens, targets
        self.w, self.n, self.train = tables.weights, tables.table.slots, tables.training
        t = tables.table
        if self.train and np.any(t.f_stash[t.f_kind == F_RUN] < 0):
            # F writes its stash with ops.put_all, unconditionally (at slot 0 for -1)
            raise ValueError("pipeline table: a training forward (F) without a stash slot")
        x0 = jax.eval_shape(model.embed, params.embed, tokens[0])
        self.dtype, self.msg0 = x0.dtype, jnp.zeros(x0.shape, x0.dtype)
        self.stage = Stage(model.pieces, params.local, self.msg0)
        leaves, self.tree = jax.tree.flatten(Chunk.layer_shapes(params.local))
        # Per chunk leaf, one layer's gradient as its accumulator holds it (ZeRO-2: a shard).
        self.acc_shapes = [jax.eval_shape(r, x) for r, x in zip(model.reduce, leaves, strict=True)]
        self.embed_shapes = self._embed_grad_shapes() if self.train else None
        # The backward kinds the table runs, and per chunk leaf whether I computes its gradient
        # (a split backward's non-dot leaves; none without I).
        t = tables.table
        self.ran = set(np.where(t.f_kind == F_FB, FB_BRANCH, t.b_kind).flat)
        split = self.stage.split
        self.in_i = (tuple(split.input_grad_mask) if split and B_INPUT in self.ran
                     else (False,) * len(leaves))  # fmt: skip
        self.in_big = tuple(not i for i in self.in_i)  # added in the full backward's layer scans
        # What each phase returns, as shapes: a branch's outputs are `fresh` values of these,
        # the zeros made inside the branch (carry.fresh says why).
        msg, loss = jax.ShapeDtypeStruct(x0.shape, x0.dtype), jax.ShapeDtypeStruct((), jnp.float32)
        self.head_shapes = jax.eval_shape(lambda h: h, params.head) if self.train else None
        train, fb, stats = self.train, tables.has_fb, self.stage.stats_shapes
        self.f_shapes = ForwardOut(y=msg, loss=loss, cot=msg if self.n.cot else None,
                                   stats=stats)  # fmt: skip
        self.b_shapes = BackwardOut(
            dx=msg, wpend=list(self.stage.wpend_shapes), loss=loss if fb else None,
            stats=stats if fb else None,
        ) if train else None  # fmt: skip

    def _embed_grad_shapes(self) -> Any:
        def grad_of(e, t):
            return jax.vjp(lambda q: self.model.embed(q, t), e)[1](self.msg0)[0]

        return jax.eval_shape(grad_of, self.params.embed, self.tokens[0])

    def chunk(self, c) -> Chunk:
        """Local chunk ``c`` of this rank's layers, read layer by layer (never sliced out
        whole: :class:`~jaxpar.pipeline.stage.Chunk`)."""
        return Chunk(self.params.local, 0 if self.tables.schedule.v == 1 else jnp.maximum(c, 0))

    def _loss_of(self, j: jax.Array) -> Callable:
        tg = self.targets[j]
        m = self.tables.schedule.m
        return lambda hp, h: self.model.head_loss(hp, h, tg) / m  # the mean over micro-batches

    # ---- forward phase ----------------------------------------------------------------------

    def _keep(self, stats: Any) -> Any:
        """A stage's statistics as the phase outputs hold them: None where its layers report
        none (a dense layer's ``()``), so every branch returns one structure."""
        return stats if self.stage.stats_shapes is not None else None

    def f_idle(self, xs: TickIn, x_in: jax.Array, kept: ForwardKept | None,
               acc_head: Any) -> tuple[ForwardOut, ForwardKept | None, Any]:  # fmt: skip
        """No forward: the stash and taps buffers and ``acc_head`` handed back untouched."""
        return ops.fresh(self.f_shapes), kept, acc_head

    def f_fwd(self, xs: TickIn, x_in: jax.Array, kept: ForwardKept | None,
              acc_head: Any) -> tuple[ForwardOut, ForwardKept | None, Any]:  # fmt: skip
        """``F``; in training its stash and taps written in place into their slots of
        ``kept``'s buffers, and the last stage's head adds its gradient to ``acc_head`` (with
        the head in the forward phase; ``None`` otherwise, handed back)."""
        row, train = xs.row, self.train
        s, j = row.f_stage, row.f_mb
        embed = lambda: self.model.embed(self.params.embed, self.tokens[j]).astype(self.dtype)  # noqa: E731
        x_in = cond(s == 0, embed, lambda: x_in, self.w.embed)
        if train:
            y, stash, taps, stats = self.stage.forward(self.chunk(row.f_chunk), x_in)
            out = ops.fresh(self.f_shapes, y=y, stats=self._keep(stats))
            kept = dataclasses.replace(kept, stash=ops.put_all(kept.stash, kept.k_stash, stash),
                                       taps=ops.put_all(kept.taps, kept.k_taps, taps))  # fmt: skip
        else:
            y, stats = self.stage.apply(self.chunk(row.f_chunk), x_in)
            out = ops.fresh(self.f_shapes, y=y, stats=self._keep(stats))
        loss_of = self._loss_of(j)

        def at_head(y, acc_head):
            if not train:
                return loss_of(self.params.head, y), None, acc_head
            loss, (d_head, dy) = jax.value_and_grad(loss_of, argnums=(0, 1))(self.params.head, y)
            return loss, dy, ops.add(acc_head, d_head)

        def not_head(y, acc_head):
            return jnp.zeros((), jnp.float32), (y * 0 if train else None), acc_head

        if not self.tables.head_in_forward:  # training with FB on the last stage
            return out, kept, acc_head
        last = self.tables.last_stage
        if train:  # the head's accumulator passes the other ranks' branch untouched
            loss, dy, acc_head = when(s == last, not_head, at_head, self.w.head, out.y, acc_head)
        else:
            loss, dy, acc_head = cond(s == last, at_head, not_head, self.w.head, out.y, acc_head)
        if not train:
            return dataclasses.replace(out, loss=loss), kept, acc_head
        out = dataclasses.replace(out, loss=loss, cot=dy if self.n.cot else out.cot)
        return out, kept, acc_head

    # ---- the tick ---------------------------------------------------------------------------

    def send(self, message: str, value: jax.Array, xs: TickIn) -> dict[int, jax.Array]:
        """Arrivals per receive channel, per route one collective-permute (module docstring)
        with exactly this tick's pairs, or none."""
        out = {CHANNEL_OF_SEND[SEND_LOCAL]: value}  # the local hop
        for k, (route, weights) in enumerate(zip(self.tables.sends, self.w.sends, strict=True)):
            if route.message != message:
                continue
            perms = [jnp.zeros_like] + [
                lambda x, ps=ps: jax.lax.ppermute(x, "pp", list(ps)) for ps in route.pair_sets
            ]
            out[CHANNEL_OF_SEND[route.direction]] = (
                perms[1](value) if weights[0] == 0 and len(route.pair_sets) == 1
                else switch(xs.send_index[k], perms, weights, value)
            )  # fmt: skip
        return out

    def tick(self, c: Carry, xs: TickIn) -> tuple[Carry, None]:
        """One scan step: backward phase, forward phase, the cotangent's send, the
        activation's send, the writes."""
        row, bo, after, prog, acc, arr_grad = xs.row, None, 0, self, None, None
        if self.train:
            bo, acc = self._backward_phase(c, xs)
            prog, (bo,) = self._behind(bo)
            after = ops.zero_after(bo.dx)  # the forward (and its slot writes) after the backward
        # The stash and taps buffers enter the forward's conditional, with the slots this
        # tick's forward fills: F writes them in place, an idle forward hands them back
        # untouched (the pass-through branch first, as the accumulators pass, branches.when).
        # The slot index depends on the backward's output: the write is ordered after the
        # backward's reads of the buffers.
        kept = ForwardKept(c.stash, c.taps, row.f_stash + after,
                           row.f_taps + after) if self.train else None  # fmt: skip
        act_in = ops.slot(c.act, row.f_in + after)
        if self.train:
            head_in = self.tables.head_in_forward  # the last stage's F adds to acc_head
            fo, kept, head = when(row.f_kind == F_RUN, prog.f_idle, prog.f_fwd, self.w.forward,
                                  xs, act_in, kept, acc.head if head_in else None)  # fmt: skip
            acc = dataclasses.replace(acc, head=head) if head_in else acc
        else:
            fo, _, _ = cond(row.f_kind == F_RUN, prog.f_fwd, prog.f_idle, self.w.forward, xs,
                            act_in, None, None)  # fmt: skip
        if self.train:
            # The cotangent's send after the forward, beside the activation's (module
            # docstring): the forward's collectives first, then the two sends in one order on
            # every device (on XLA:CPU never two waiting at once), each behind what precedes it.
            fo, dx = jax.lax.optimization_barrier((fo, bo.dx))
            arr_grad = self.send("grad", dx, xs)
            fo, arr_grad = jax.lax.optimization_barrier((fo, arr_grad))
        arr_act = self.send("act", fo.y, xs)
        loss = fo.loss + bo.loss if self.tables.has_fb else fo.loss  # FB's loss: backward's
        c = dataclasses.replace(c, loss=c.loss + loss, stats=self._add_stats(c.stats, row, fo, bo))
        if self.train:
            c = self._writes(c, row, fo, bo, acc, after, arr_grad)
            c = dataclasses.replace(c, stash=kept.stash, taps=kept.taps)
        act = ops.file_arrivals(c.act, self.tables.table.recv_act, row.recv_act, arr_act)
        return dataclasses.replace(c, act=act), None

    def _behind(self, *done):
        """This program with parameters that exist only once ``done`` (the backward phase)
        does, and ``done``.
        Without it the forward's collectives (ZeRO-3 gathers, ring attention's all-to-alls)
        could start while the backward's were still being issued, in different orders on
        different devices: XLA's CPU runtime runs independent work concurrently and a device
        blocked in a rendezvous holds its thread (dp 2 × sp 2 × pp 2, ring, ZeRO-3: 3 of 7 runs
        aborted; behind the barrier 0 of 3)."""
        prog = copy.copy(self)
        prog.params, done = jax.lax.optimization_barrier((self.params, done))
        return prog, done

    def _backward_phase(self, c: Carry, xs: TickIn):
        """The backward switch (B, I, W or FB); returns its outputs and the gradient
        accumulators (added to in the branch that computed a gradient)."""
        row, fb = xs.row, self.tables.has_fb
        g = ops.slot(c.grad, row.b_in)
        if self.n.cot:
            g = jnp.where(row.b_stage == self.tables.last_stage, ops.slot(c.cot, row.b_cot), g)
        ins = BackwardIn(g=g, stash=c.stash, taps=c.taps, wpend=c.wpend,
                         x=ops.slot(c.act, row.f_in) if fb else None)  # fmt: skip
        kind, chunk = row.b_kind, row.b_chunk
        if fb:  # an FB is the forward phase's action: its chunk is the forward's
            kind = jnp.where(row.f_kind == F_FB, FB_BRANCH, kind)
            chunk = jnp.where(row.f_kind == F_FB, row.f_chunk, chunk)
        # The head's accumulator enters the backward only where an FB adds to it (else the
        # forward's head does), the embedding's only its own conditional.
        acc = Grads(c.acc, None, c.acc_head if fb else None)
        bo, acc = self.backward_switch(kind, chunk, xs, ins, acc)
        embed = self.embed_grad(row, bo.dx, c.acc_embed)
        if self.model.forward_collectives:
            # ZeRO-3's reduce-scatter of the embedding's gradient is issued before the forward's
            # collectives, as every backward collective is (one order of collectives on every
            # device, _behind).
            bo, embed = jax.lax.optimization_barrier((bo, embed))
        acc = dataclasses.replace(acc, embed=embed, head=c.acc_head if not fb else acc.head)
        return bo, acc

    def _add_stats(self, acc: Any, row: TickTable, fo: ForwardOut, bo: BackwardOut | None):
        """The layers' statistics of this tick's forward (a plain F's, or an FB's) added to
        its local chunk's (an idle phase's are zeros)."""
        if acc is None:
            return None
        v = self.tables.schedule.v
        acc = ops.accumulate(acc, row.f_chunk, fo.stats, v)
        if bo is not None and bo.stats is not None:  # FB: the forward ran in the backward
            acc = ops.accumulate(acc, row.f_chunk, bo.stats, v)
        return acc

    def _writes(self, c: Carry, row: TickTable, fo: ForwardOut, bo: BackwardOut, acc: Grads,
                after, arr_grad):  # fmt: skip
        # The forward's cot write (as its stash and taps writes, in the forward's conditional)
        # lands after the backward has read that buffer (the forward itself runs after it): its
        # slot index depends on the backward's output. Without that data dependency XLA cannot
        # order the read before the in-place write and copies each buffer twice per tick.
        i_write = jnp.where(row.b_kind == B_INPUT, row.b_dys, -1)
        c = dataclasses.replace(
            c,
            wpend=ops.write_all(c.wpend, i_write, bo.wpend),
            acc=acc.chunks,
            acc_embed=acc.embed,
            acc_head=acc.head,
            grad=ops.file_arrivals(c.grad, self.tables.table.recv_grad, row.recv_grad, arr_grad),
        )
        if self.n.cot:
            c = dataclasses.replace(c, cot=ops.write_if(c.cot, row.f_cot + after, fo.cot))
        return c

    def carry0(self) -> Carry:
        """The scan's initial carry: empty buffers and zero accumulators."""
        n, msg0, st = self.n, self.msg0, self.stage
        slots = lambda k, shapes: [jnp.zeros((k, *s.shape), s.dtype) for s in shapes]  # noqa: E731
        stats = st.stats_shapes
        if stats is not None:
            v = self.tables.schedule.v
            stats = jax.tree.map(lambda s: jnp.zeros((v, *s.shape), s.dtype), stats)
        c = Carry(act=slots(max(n.act, 1), [msg0])[0], loss=jnp.zeros((), jnp.float32),
                  stats=stats)  # fmt: skip
        if not self.train:
            return c
        layers = [jax.ShapeDtypeStruct((st.n_layers, *s.shape), s.dtype) for s in self.acc_shapes]
        # The buffers the forward's conditional writes in place: each its own (distinct_zeros).
        kept = [jax.ShapeDtypeStruct((k, *s.shape), s.dtype)
                for k, shapes in ((n.stash, st.stash_shapes), (n.taps, st.taps_shapes))
                for s in shapes]  # fmt: skip
        kept = ops.distinct_zeros(kept, jax.lax.axis_index("pp"))
        return dataclasses.replace(
            c,
            grad=slots(max(n.grad, 1), [msg0])[0],
            stash=kept[: len(st.stash_shapes)],
            taps=kept[len(st.stash_shapes) :],
            wpend=slots(n.dys, st.wpend_shapes),
            acc=jax.tree.unflatten(self.tree, slots(self.tables.schedule.v, layers)),
            acc_embed=ops.fresh_zeros(self.embed_shapes),
            acc_head=ops.fresh_zeros(self.head_shapes),
            cot=slots(n.cot, [msg0])[0] if n.cot else None,
        )
