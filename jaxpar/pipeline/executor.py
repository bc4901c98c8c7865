"""The SPMD pipeline executor: one program runs any schedule table (GPipe ... DualPipeV).

Layout of one step (``p`` ranks on mesh axis ``pp``, ``v`` chunks per rank, ``m`` micro-batches),
inside the one gradient path's ``shard_map`` (manual over ``pp`` and the dp axes; tp/sp stay
automatic, so the stage code is the same Megatron/ZeRO code as without a pipeline):

* One ``lax.scan`` over the ticks of :mod:`jaxpar.pipeline.tables` (compile time does not
  depend on ``m``). A tick runs a **backward phase** (idle, ``B``, ``I``, ``W``, or ``FB``: the
  last stage's forward and backward of one micro-batch) and sends its input cotangent, then a
  **forward phase** (idle or ``F``) and sends its activation — a fused tick uses both phases.
  The backward goes first because a fused tick's backward is never of its forward's
  micro-batch: the stash slot it reads is free by the time the forward's stash exists, so a
  tick holds one stash set fewer than the other order. The forward's parameters and input
  wait behind the backward and its send (:meth:`_Program._behind`: one order of collectives on
  every device). Each phase is one ``lax.switch`` on the rank's row of the table.
  Backward is explicit (:mod:`jaxpar.pipeline.stage`): never autodiff through a switch.
* **Nothing replicated that one rank uses**: stage 0 embeds each micro-batch's tokens in its
  forward and takes the embedding's gradient in its backward; the last stage runs the head and
  loss. Only tokens and targets enter every rank; the embedding and head parameters arrive as
  this rank's slot of their stage-owned stacks (:mod:`jaxpar.pipeline.rest`), so their
  gradients leave unsummed over ``pp``.
* **Nothing copied that a tick does not touch**: the branches return only the values of their
  own action (one message, one stash's leaves, one chunk's gradient); the buffers enter the
  backward's switch read-only and are written after it, in place in the scan carry, each write
  ordered after the reads by a data dependency. (A buffer that passes through a switch is
  copied by XLA's CPU compile in every branch, jax-ml/jax#38145; an in-place write that XLA
  cannot order after a read of the same buffer is copied twice.)
* **Sends only where the table sends**: per message kind and ring direction, each tick runs one
  collective-permute with exactly that tick's (source, destination) pairs, or none
  (:attr:`jaxpar.pipeline.plan.Plan.sends`; a ``lax.switch`` on a per-tick index, the same on
  every rank).
* Weight gradients accumulate per local chunk, unreduced over dp (ZeRO-2: reduce-scattered per
  micro-batch by the caller's reductions); the caller reduces them once after the schedule.

Every ``lax.switch``/``lax.cond`` here runs under a named scope that states how often the table
takes each branch (:func:`jaxpar.analysis.hlo_text.branch_scope`), so the HLO analysis counts
the collectives and copies inside a branch as often as it runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.analysis.hlo_text import branch_scope
from jaxpar.pipeline.plan import Plan
from jaxpar.pipeline.stage import Stage, StagePieces
from jaxpar.pipeline.tables import B_CODE, BUFFERS, CHANNEL_OF_SEND, F_CODE, SEND_LOCAL

FB_INDEX = len(B_CODE) + 1  # the backward switch's branch for a forward-phase FB


@dataclass(frozen=True)
class PipelineModel:
    """The model pieces the executor runs, with the layout's hooks applied.

    ``embed(embed_params, tokens_BxS) -> x``; ``head_loss(head_params, y, targets) -> loss``;
    ``reduce[k](g)``: the per-micro-batch reduction of chunk-gradient leaf ``k`` (ZeRO-2's
    reduce-scatter; identity otherwise), in the order of the chunk tree's leaves.
    """

    pieces: StagePieces
    embed: Callable[[Any, jax.Array], jax.Array]
    head_loss: Callable[[Any, jax.Array, jax.Array], jax.Array]
    reduce: tuple[Callable[[jax.Array], jax.Array], ...]


def run_local(plan: Plan, model: PipelineModel, local: Any, embed_params: Any,
              head_params: Any, tokens_MxBxS: jax.Array, targets_MxBxS: jax.Array):  # fmt: skip
    """Run the schedule on this rank (inside a ``shard_map`` manual over ``pp``).

    ``local`` is this rank's ``[v, Lc, ...]`` layer tree, ``tokens``/``targets`` all
    micro-batches' rows of this dp rank. Returns ``(loss, d local, d embed, d head)`` — the
    loss (mean over micro-batches, summed over ``pp``), and this rank's gradients: of its
    chunks, of the embedding (nonzero on the first stage's rank only) and of the head (the last
    stage's) — or just the loss for a forward-only plan.
    """
    prog = _Program(plan, model, local, embed_params, head_params, tokens_MxBxS, targets_MxBxS)
    me = jax.lax.axis_index("pp")
    rows = {k: jnp.asarray(a)[me] for k, a in plan.rank_tables().items()}
    rows["send_idx"] = {key: jnp.asarray(idx) for key, (_, idx) in plan.sends.items()}
    c, _ = jax.lax.scan(prog.tick, prog.carry0(), rows)
    loss = jax.lax.psum(c["loss"], "pp")
    if not plan.training:
        return loss
    # Not summed over pp: the embedding and head are stage-owned at rest
    # (jaxpar.pipeline.rest), so each gradient stays on the rank that computed it.
    return loss, c["acc"], c["acc_embed"], c["acc_head"]


class _Program:
    """One rank's tick: its branches, sends and writes (see the module docstring)."""

    def __init__(self, plan, model, local, embed_params, head_params, tokens, targets):
        self.plan, self.model, self.local = plan, model, local
        self.embed_p, self.head_p, self.tokens, self.targets = (
            embed_params,
            head_params,
            tokens,
            targets,
        )
        a = plan.arrays
        self.m, self.v, self.last = plan.schedule.m, plan.schedule.v, plan.schedule.num_stages - 1
        self.n = {b: int(a[f"n_{b}_slots"]) for b in BUFFERS}
        self.train = plan.training
        self.has_fb = bool(np.any(a["f_kind"] == F_CODE["FB"]))
        # Whether a plain F ever runs on the last stage (GPipe, lean 1F1B, zero-bubble): only
        # then does the forward phase take the head's loss and gradient. A fused table's last
        # stage always runs FB, and a head-sized zero out of every forward branch would be
        # copied into the switch's output each tick (a [V, D] buffer at scale).
        last_f = (a["f_kind"] == F_CODE["F"]) & (a["f_stage"] == plan.schedule.num_stages - 1)
        self.f_head = bool(np.any(last_f)) or not plan.training
        x0 = jax.eval_shape(model.embed, embed_params, tokens[0])
        self.dtype = x0.dtype
        self.msg0 = jnp.zeros(x0.shape, x0.dtype)
        self.stage = Stage(model.pieces, self.chunk(0), self.msg0)
        leaves, self.tree = jax.tree.flatten(self.chunk(0))
        self.acc_shapes = [jax.eval_shape(r, x) for r, x in zip(model.reduce, leaves, strict=True)]
        self.zero_head = jax.tree.map(jnp.zeros_like, head_params)
        if self.train:
            grad_of = lambda e, t: jax.vjp(lambda q: model.embed(q, t), e)[1](self.msg0)[0]  # noqa: E731
            self.zero_embed = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_of, embed_params,
                                                                          tokens[0]))  # fmt: skip
        self.f_out0 = {
            "y": self.msg0, "loss": jnp.zeros((), jnp.float32),
            "stash": _zeros(self.stage.stash_shapes) if self.train else [],
            "taps": _zeros(self.stage.taps_shapes) if self.train else [],
            "cot": self.msg0 if self.n["cot"] else None,
            "d_head": self.zero_head if self.train and self.f_head else None,
        }  # fmt: skip
        if self.train:
            wpend0 = _zeros(self.stage.wpend_shapes)
            self.b_out0 = {"dx": self.msg0, "d_chunk": self._zero_chunk(),
                           "d_embed": self.zero_embed, "wpend": wpend0,
                           "loss": self.f_out0["loss"] if self.has_fb else None,
                           "d_head": self.zero_head if self.has_fb else None}  # fmt: skip

    # ---- helpers ----------------------------------------------------------------------------

    def chunk(self, c):
        """Local chunk ``c``'s ``[Lc, ...]`` params."""
        if self.v == 1:
            return jax.tree.map(lambda a: a[0], self.local)
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, c, keepdims=False),
                            self.local)  # fmt: skip

    def _zero_chunk(self):
        return jax.tree.unflatten(self.tree, _zeros(self.acc_shapes))

    def reduce(self, d, keep=None):
        """Per-micro-batch reduction of a chunk gradient; leaves outside ``keep`` are known
        zeros (a split backward's weight-dot leaves in ``I``) and are not reduced."""
        out = [
            r(x) if keep is None or keep[k] else jnp.zeros(s.shape, s.dtype)
            for k, (x, r, s) in enumerate(zip(jax.tree.leaves(d), self.model.reduce,
                                              self.acc_shapes, strict=True))
        ]  # fmt: skip
        return jax.tree.unflatten(self.tree, out)

    def weights(self, field: str, n: int, among=None) -> list[float]:
        return self.plan.fraction(field, n, among)

    # ---- forward phase ----------------------------------------------------------------------

    def f_idle(self, row, x_in):
        return self.f_out0

    def f_fwd(self, row, x_in):
        s, j = row["f_stage"], row["f_mb"]
        is_f = self.plan.arrays["f_kind"] == F_CODE["F"]
        embed = lambda: self.model.embed(self.embed_p, self.tokens[j]).astype(self.dtype)  # noqa: E731
        x_in = _cond(s == 0, embed, lambda: x_in, self.weights("f_stage", 1, is_f)[0])
        if self.train:
            y, stash, taps = self.stage.forward(self.chunk(row["f_chunk"]), x_in)
            out = dict(self.f_out0, y=y, stash=stash, taps=taps)
        else:
            out = dict(self.f_out0, y=self.stage.apply(self.chunk(row["f_chunk"]), x_in))
        tg = self.targets[j]

        def loss_of(hp, h):
            return self.model.head_loss(hp, h, tg) / self.m  # the mean over micro-batches

        def at_head(y):
            if not self.train:
                return loss_of(self.head_p, y), None, None
            loss, (d_head, dy) = jax.value_and_grad(loss_of, argnums=(0, 1))(self.head_p, y)
            return loss, d_head, dy

        def not_head(y):
            return self.f_out0["loss"], self.f_out0["d_head"], (y * 0 if self.train else None)

        if not self.f_head:  # training with FB on the last stage: no head in a plain F
            return out
        p_last = self.weights("f_stage", self.last + 1, is_f)[-1]
        out["loss"], d_head, dy = _cond(s == self.last, at_head, not_head, p_last, out["y"])
        if self.train:
            out["d_head"] = d_head
            if self.n["cot"]:
                out["cot"] = dy
        return out

    # ---- backward phase ---------------------------------------------------------------------

    def b_fb(self, row, ins):
        # The last stage's forward and full backward of one micro-batch in one tick (the
        # table's f_* fields name it): one VJP, nothing stashed.
        tg = self.targets[row["f_mb"]]

        def loss_of(ch, hp, x):
            return self.model.head_loss(hp, self.stage.apply(ch, x), tg) / self.m

        loss, (d_chunk, d_head, dx) = jax.value_and_grad(loss_of, argnums=(0, 1, 2))(
            self.chunk(row["f_chunk"]), self.head_p, ins["x"]
        )
        return dict(self.b_out0, loss=loss, d_head=d_head, dx=dx, d_chunk=self.reduce(d_chunk))

    def embed_grad(self, row, dx):
        # Stage 0's input cotangent is the embedding's: its gradient is taken here (ZeRO-3: the
        # gather's transpose reduce-scatters it).
        def grad(dx):
            tokens = self.tokens[row["b_mb"]]
            pullback = jax.vjp(lambda e: self.model.embed(e, tokens), self.embed_p)[1]
            return pullback(dx.astype(self.dtype))[0]

        b_kind = self.plan.arrays["b_kind"]
        among = (b_kind == B_CODE["B"]) | (b_kind == B_CODE["I"])
        p0 = self.weights("b_stage", 1, among)[0]
        return _cond(row["b_stage"] == 0, grad, lambda dx: self.zero_embed, p0, dx)

    def b_idle(self, row, ins):
        return self.b_out0

    def b_bwd(self, row, ins):
        ins = _read_slots(ins, row)
        d, dx = self.stage.backward(self.chunk(row["b_chunk"]), ins["stash"], ins["taps"],
                                    ins["g"])  # fmt: skip
        return dict(self.b_out0, dx=dx, d_chunk=self.reduce(d), d_embed=self.embed_grad(row, dx))

    def b_inp(self, row, ins):
        ins = _read_slots(ins, row)
        d_small, dx, wpend = self.stage.input_grads(self.chunk(row["b_chunk"]), ins["stash"],
                                                    ins["g"])  # fmt: skip
        keep = self.stage.split.input_grad_mask
        return dict(self.b_out0, dx=dx, d_chunk=self.reduce(d_small, keep), wpend=wpend,
                    d_embed=self.embed_grad(row, dx))  # fmt: skip

    def b_wgt(self, row, ins):
        ins = _read_slots(ins, row)
        d = self.stage.weight_grads(self.chunk(row["b_chunk"]), ins["taps"], ins["wpend"])
        return dict(self.b_out0, d_chunk=self.reduce(d))

    # ---- the tick ---------------------------------------------------------------------------

    def send(self, buf: str, value: jax.Array, row) -> dict[int, jax.Array]:
        """Arrivals per receive channel: per direction one collective-permute with exactly
        this tick's pairs, or none."""
        out = {CHANNEL_OF_SEND[SEND_LOCAL]: value}  # the local hop
        for (b, d), (sets, idx) in self.plan.sends.items():
            if b != buf:
                continue
            perms = [jnp.zeros_like] + [
                lambda x, ps=ps: jax.lax.ppermute(x, "pp", list(ps)) for ps in sets
            ]
            weights = [float(np.mean(idx == k)) for k in range(len(perms))]
            out[CHANNEL_OF_SEND[d]] = (
                perms[1](value) if weights[0] == 0 and len(sets) == 1
                else _switch(row["send_idx"][(b, d)], perms, weights, value)
            )  # fmt: skip
        return out

    def file(self, buf_arr, recv: str, arrivals, row):
        """This tick's arrivals into their slots (channels the table never uses: none)."""
        for ch, value in arrivals.items():
            if np.any(self.plan.arrays[recv][:, :, ch] >= 0):
                buf_arr = _write_if(buf_arr, row[recv][ch], value)
        return buf_arr

    def tick(self, c, row):
        """One scan step: backward phase, its send, forward phase, its send, the writes."""
        bo, after = None, 0
        prog = self
        if self.train:
            bo, arr_grad = self._backward_phase(c, row)
            prog, (bo, arr_grad) = self._behind(bo, arr_grad)
            after = _after(bo["dx"])  # the forward (and its slot writes) after the backward
        is_f = self.plan.arrays["f_kind"] == F_CODE["F"]
        fo = _cond(row["f_kind"] == F_CODE["F"], prog.f_fwd, prog.f_idle, float(np.mean(is_f)),
                   row, _slot(c["act"], row["f_in"] + after))  # fmt: skip
        arr_act = self.send("act", fo["y"], row)
        loss = fo["loss"] + bo["loss"] if self.has_fb else fo["loss"]  # FB's loss: backward's
        c = dict(c, loss=c["loss"] + loss)
        if self.train:
            c = self._writes(c, row, fo, bo, after, arr_grad)
        c["act"] = self.file(c["act"], "recv_act", arr_act, row)
        return c, None

    def _behind(self, *done):
        """This program with parameters that exist only once ``done`` (the backward phase and
        its send) does, and ``done``.

        XLA's CPU runtime runs a device's independent work concurrently, and a device blocked in
        a collective's rendezvous holds its thread. The forward phase reads nothing the backward
        wrote except its input slot, so its collectives (the ZeRO-3 gathers of the chunk's
        weights, ring attention's all-to-alls) could start while the backward's were still
        being issued, in different orders on different devices of one group. Measured at dp 2 ×
        sp 2 × pp 2, ring, ZeRO-3: 3 of 7 runs aborted on a rendezvous timeout, with devices
        parked in different all-gathers, an all-to-all over sp and the pp collective-permute.
        Behind the barrier every collective of the forward phase is issued after every
        collective of the backward phase and its send, on every device; 0 of 3 runs aborted.
        The price, on every backend: the cotangent's send no longer overlaps the forward (not
        measured on a GPU; on CPU, with the barrier, pp 2 × 1F1B still runs within 1.1× of one
        device).
        """
        prog = copy.copy(self)
        params = (self.local, self.embed_p, self.head_p)
        (prog.local, prog.embed_p, prog.head_p), done = jax.lax.optimization_barrier((params, done))
        return prog, done

    def _backward_phase(self, c, row):
        """The backward switch (B, I, W or FB) and its send; returns its outputs and arrivals."""
        g = _slot(c["grad"], row["b_in"])
        if self.n["cot"]:
            g = jnp.where(row["b_stage"] == self.last, _slot(c["cot"], row["b_cot"]), g)
        ins = {"g": g, "stash": c["stash"], "taps": c["taps"], "wpend": c["wpend"],
               "x": _slot(c["act"], row["f_in"]) if self.has_fb else None}  # fmt: skip
        kind = np.where(self.plan.arrays["f_kind"] == F_CODE["FB"], FB_INDEX,
                        self.plan.arrays["b_kind"])  # fmt: skip
        every = (self.b_idle, self.b_bwd, self.b_inp, self.b_wgt, self.b_fb)
        branches = [b if k in set(kind.flat) else self.b_idle for k, b in enumerate(every)]
        index = jnp.where(row["f_kind"] == F_CODE["FB"], FB_INDEX, row["b_kind"])
        weights = [float(np.mean(kind == k)) for k in range(len(every))]
        bo = _switch(index, branches, weights, row, ins)
        return bo, self.send("grad", bo["dx"], row)

    def _writes(self, c, row, fo, bo, after, arr_grad):
        # The forward's stash, taps and cot writes land after the backward has read those
        # buffers (the forward itself runs after it): their slot index depends on the
        # backward's output. Without that data dependency XLA cannot order the read before the
        # in-place write and copies each buffer twice per tick.
        i_write = jnp.where(row["b_kind"] == B_CODE["I"], row["b_dys"], -1)
        chunk = row["b_chunk"]
        if self.has_fb:  # the FB's chunk is the forward's
            chunk = jnp.where(row["f_kind"] == F_CODE["FB"], row["f_chunk"], chunk)
        # The head's gradient: of a plain F on the last stage, or of an FB (the backward's).
        d_heads = [fo["d_head"]] if self.f_head else []
        d_heads += [bo["d_head"]] if self.has_fb else []
        c = dict(
            c,
            stash=_write_all(c["stash"], row["f_stash"] + after, fo["stash"]),
            taps=_write_all(c["taps"], row["f_taps"] + after, fo["taps"]),
            wpend=_write_all(c["wpend"], i_write, bo["wpend"]),
            acc=_accumulate(c["acc"], chunk, bo["d_chunk"], self.v),
            acc_embed=jax.tree.map(jnp.add, c["acc_embed"], bo["d_embed"]),
            acc_head=jax.tree.map(lambda a, *d: sum(d, a), c["acc_head"], *d_heads),
            grad=self.file(c["grad"], "recv_grad", arr_grad, row),
        )
        if self.n["cot"]:
            c["cot"] = _write_if(c["cot"], row["f_cot"] + after, fo["cot"])
        return c

    def carry0(self) -> dict:
        """The scan's initial carry: empty buffers and zero accumulators."""
        n, msg0 = self.n, self.msg0
        slots = lambda k, shapes: [jnp.zeros((k, *s.shape), s.dtype) for s in shapes]  # noqa: E731
        out = {"act": slots(max(n["act"], 1), [msg0])[0], "loss": jnp.zeros((), jnp.float32)}
        if self.train:
            out.update(
                grad=slots(max(n["grad"], 1), [msg0])[0],
                stash=slots(n["stash"], self.stage.stash_shapes),
                taps=slots(n["taps"], self.stage.taps_shapes),
                wpend=slots(n["dys"], self.stage.wpend_shapes),
                acc=jax.tree.unflatten(self.tree, slots(self.v, self.acc_shapes)),
                acc_embed=self.zero_embed,
                acc_head=self.zero_head,
            )
            if n["cot"]:
                out["cot"] = slots(n["cot"], [msg0])[0]
        return out


def _slot(buf: jax.Array, k: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(buf, jnp.maximum(k, 0), keepdims=False)


def _write_if(buf: jax.Array, k: jax.Array, value: jax.Array) -> jax.Array:
    """``buf[k] = value`` when ``k >= 0``; a dynamic-update-slice of one slot either way (it
    rewrites the slot's own contents when masked off: no select over the buffer)."""
    i = jnp.maximum(k, 0)
    new = jnp.where(k >= 0, value.astype(buf.dtype), _slot(buf, i))
    return jax.lax.dynamic_update_index_in_dim(buf, new, i, 0)


def _write_all(bufs: list[jax.Array], k: jax.Array, values: list[jax.Array]) -> list[jax.Array]:
    return [_write_if(b, k, x) for b, x in zip(bufs, values, strict=True)]


def _read_slots(ins: dict, row) -> dict:
    """The backward's slots of the stash, taps and dys buffers, read inside the branch (the
    buffers enter the switch read-only: no slot-sized copy is made before it)."""
    return dict(
        ins,
        stash=[_slot(b, row["b_stash"]) for b in ins["stash"]],
        taps=[_slot(b, row["b_taps"]) for b in ins["taps"]],
        wpend=[_slot(b, row["b_dys"]) for b in ins["wpend"]],
    )


def _after(x: jax.Array) -> jax.Array:
    """An int32 zero that data-depends on ``x`` (``0·x`` is not folded for floats, and a
    non-finite ``x`` converts to 0 too)."""
    return (jnp.ravel(x)[0] * 0).astype(jnp.int32)


def _zeros(shapes) -> list[jax.Array]:
    return [jnp.zeros(s.shape, s.dtype) for s in shapes]


def _switch(index, branches, weights, *args):
    with jax.named_scope(branch_scope(weights)):
        return jax.lax.switch(index, branches, *args)


def _cond(pred, true_fn, false_fn, p_true: float, *args):
    with jax.named_scope(branch_scope([1.0 - p_true, p_true])):
        return jax.lax.cond(pred, true_fn, false_fn, *args)


def _accumulate(acc: Any, chunk: jax.Array, d: Any, v: int) -> Any:
    """Add this tick's chunk gradient (of its B, I, W or FB) to local chunk ``chunk``'s."""
    if v == 1:
        return jax.tree.map(lambda a, x: a + x[None].astype(a.dtype), acc, d)
    c = jnp.maximum(chunk, 0)
    return jax.tree.map(lambda a, x: a.at[c].add(x.astype(a.dtype)), acc, d)
