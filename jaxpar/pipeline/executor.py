"""The SPMD pipeline executor: one program runs any schedule table (GPipe ... DualPipeV).

Layout of one step (``p`` ranks on mesh axis ``pp``, ``v`` chunks per rank, ``m`` micro-batches),
inside the one gradient path's ``shard_map`` (manual over ``pp`` and the dp axes; tp/sp stay
automatic, so the stage code is the same Megatron/ZeRO code as without a pipeline):

* One ``lax.scan`` over the ticks of :mod:`jaxpar.pipeline.tables` (compile time does not
  depend on ``m``). A tick runs a **forward phase** (idle, ``F``, or ``FB``: the last stage's
  forward and backward of one micro-batch), sends the forward's activation, then runs a
  **backward phase** (idle, ``B``, ``I`` or ``W``) and sends its input cotangent — a fused
  tick uses both phases, and F's output is on the wire while B computes. Each phase is one
  ``lax.switch`` on the rank's row of the table. Backward is explicit
  (:mod:`jaxpar.pipeline.stage`): never autodiff through a switch.
* **Nothing replicated that one rank uses**: stage 0 embeds each micro-batch's tokens in its
  forward and takes the embedding's gradient in its backward; the last stage runs the head and
  loss. Only tokens and targets enter every rank.
* **Nothing copied that a tick does not touch**: the switch branches take and return only the
  values of their own action (one message, one stash slot's leaves, one chunk's gradient), never
  the buffers; slots are read before the switches and written after them, in place in the scan
  carry. (A buffer passed through a ``lax.switch`` is copied in every branch by XLA's CPU
  compile, jax-ml/jax#38145.)
* **Sends only where the table sends**: per message kind and ring direction, the ticks' sets of
  (source, destination) pairs are enumerated from the table, and each tick runs one
  collective-permute with exactly its set (a ``lax.switch`` on a per-tick index, the same on
  every rank), or none.
* Weight gradients accumulate per local chunk, unreduced over dp (ZeRO-2: reduce-scattered per
  micro-batch by the caller's ``reduce``); the caller reduces them once after the schedule.

Every ``lax.switch``/``lax.cond`` here runs under a named scope that states how often the table
takes each branch (:func:`jaxpar.analysis.hlo_text.branch_scope`), so the HLO analysis counts
the collectives, flops and copies inside a branch as often as it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.analysis.hlo_text import branch_scope
from jaxpar.pipeline.schedules import Schedule, lockstep, make_schedule
from jaxpar.pipeline.stage import Stage, StagePieces
from jaxpar.pipeline.tables import (
    B_CODE,
    CHANNEL_OF_SEND,
    F_CODE,
    PER_TICK,
    SEND_NEXT,
    SEND_PREV,
    as_arrays,
    destination,
)

_ROW_KEYS = (*PER_TICK, "recv_act", "recv_grad")


def forward_schedule(schedule: Schedule) -> Schedule:
    """The forwards of ``schedule`` alone, same placement and order (evaluation)."""
    steps = tuple(tuple((a,) for a in row if a.kind == "F") for row in schedule.orders)
    out = Schedule(f"{schedule.kind}-forward", schedule.p, schedule.m, schedule.v,
                   schedule.placement, steps)  # fmt: skip
    out.ticks = tuple(map(tuple, lockstep(out.steps, out.num_stages)))
    return out


@dataclass(frozen=True)
class Plan:
    """A schedule and what the executor derives from it."""

    schedule: Schedule
    n_layers: int

    @staticmethod
    def make(kind: str, p: int, m: int, v: int, n_layers: int, forward_only=False) -> Plan:
        """Build the schedule (``ConfigError`` one-liners for bad arguments)."""
        sched = make_schedule(kind, p, m, v)
        return Plan(forward_schedule(sched) if forward_only else sched, n_layers)

    @cached_property
    def arrays(self) -> dict[str, np.ndarray]:
        """Tick tables (``tables.as_arrays``)."""
        return as_arrays(self.schedule)

    @property
    def training(self) -> bool:
        """Whether the table has backward actions (else: forward only, the loss)."""
        return bool(np.any(self.arrays["b_kind"]))

    @property
    def per_chunk(self) -> int:
        """Layers per virtual stage."""
        return self.n_layers // self.schedule.num_stages

    @cached_property
    def order(self) -> np.ndarray:
        """Canonical layer index at each position of the stack at rest (placement order:
        rank-major, then the rank's chunks, then the chunk's layers)."""
        s, lc = self.schedule, self.per_chunk
        stages = [st for r in range(s.p) for st in s.stages_of(r)]
        return np.array([st * lc + i for st in stages for i in range(lc)], np.int32)

    @property
    def identity(self) -> bool:
        """Whether placement order is canonical order (one stage per rank)."""
        return bool(np.all(self.order == np.arange(self.n_layers)))

    def rank_tables(self) -> dict[str, np.ndarray]:
        """Per-rank rows ``[p, T, ...]`` of the tick table (scanned over ``T`` on each rank)."""
        return {k: np.swapaxes(self.arrays[k], 0, 1).copy() for k in _ROW_KEYS}

    @cached_property
    def sends(self) -> dict[tuple[str, int], tuple[list[tuple], np.ndarray]]:
        """Per (buffer, direction code): the distinct per-tick pair sets and each tick's index
        into them (0: no send this tick)."""
        p, out = self.schedule.p, {}
        for buf, field in (("act", "f_send"), ("grad", "b_send")):
            codes = self.arrays[field]
            for d in (SEND_NEXT, SEND_PREV):
                per_tick = [
                    tuple((r, destination(r, d, p)) for r in range(p) if codes[t, r] == d)
                    for t in range(codes.shape[0])
                ]
                sets = sorted({s for s in per_tick if s})
                if sets:
                    idx = np.array([sets.index(s) + 1 if s else 0 for s in per_tick], np.int32)
                    out[(buf, d)] = (sets, idx)
        return out

    def fraction(self, field: str, n: int, among: np.ndarray | None = None) -> list[float]:
        """How often each value ``0..n-1`` of ``field`` occurs (per device, over ``among``)."""
        a = self.arrays[field] if among is None else self.arrays[field][among]
        total = max(a.size, 1)
        return [float(np.sum(a == k)) / total for k in range(n)]


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


def _slot(buf: jax.Array, k: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(buf, jnp.maximum(k, 0), keepdims=False)


def _write_if(buf: jax.Array, k: jax.Array, value: jax.Array) -> jax.Array:
    """``buf[k] = value`` when ``k >= 0``; a dynamic-update-slice of one slot either way (it
    rewrites the slot's own contents when masked off: no select over the buffer)."""
    i = jnp.maximum(k, 0)
    new = jnp.where(k >= 0, value.astype(buf.dtype), _slot(buf, i))
    return jax.lax.dynamic_update_index_in_dim(buf, new, i, 0)


def _read_slots(ins: dict, row) -> dict:
    """The backward's slots of the stash, taps and dys buffers (read inside the branch: the
    buffers enter the switch read-only, so no slot-sized copy is made before it)."""
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


def _write_all(bufs: list[jax.Array], k: jax.Array, values: list[jax.Array]) -> list[jax.Array]:
    return [_write_if(b, k, x) for b, x in zip(bufs, values, strict=True)]


def _zeros(shapes) -> list[jax.Array]:
    return [jnp.zeros(s.shape, s.dtype) for s in shapes]


def _switch(index, branches, weights, *args):
    with jax.named_scope(branch_scope(weights)):
        return jax.lax.switch(index, branches, *args)


def _cond(pred, true_fn, false_fn, p_true: float, *args):
    with jax.named_scope(branch_scope([1.0 - p_true, p_true])):
        return jax.lax.cond(pred, true_fn, false_fn, *args)


def run_local(
    plan: Plan,
    model: PipelineModel,
    local: Any,
    embed_params: Any,
    head_params: Any,
    tokens_MxBxS: jax.Array,
    targets_MxBxS: jax.Array,
):
    """Run the schedule on this rank (inside a ``shard_map`` manual over ``pp``).

    ``local`` is this rank's ``[v, Lc, ...]`` layer tree, ``tokens``/``targets`` all
    micro-batches' rows of this dp rank. Returns ``(loss, d local, d embed, d head)`` — the
    loss (mean over micro-batches) and the embed/head gradients summed over ``pp``, the chunk
    gradients of this rank — or just the loss for a forward-only plan.
    """
    sched, arrays = plan.schedule, plan.arrays
    m, v, last = sched.m, sched.v, sched.num_stages - 1
    n = {b: int(arrays[f"n_{b}_slots"]) for b in ("act", "grad", "stash", "taps", "dys", "cot")}
    train = plan.training
    has_fb = bool(np.any(arrays["f_kind"] == F_CODE["FB"]))
    me = jax.lax.axis_index("pp")
    rows = {k: jnp.asarray(a)[me] for k, a in plan.rank_tables().items()}
    sends = plan.sends
    rows["send_idx"] = {key: jnp.asarray(idx) for key, (_, idx) in sends.items()}

    def chunk(c):
        if v == 1:
            return jax.tree.map(lambda a: a[0], local)
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, c, keepdims=False), local)

    x0 = jax.eval_shape(model.embed, embed_params, tokens_MxBxS[0])
    msg0 = jnp.zeros(x0.shape, x0.dtype)
    stage = Stage(model.pieces, chunk(0), msg0)
    chunk_leaves, chunk_tree = jax.tree.flatten(chunk(0))

    def reduce(d, keep=None):
        """Per-micro-batch reduction of a chunk gradient; leaves outside ``keep`` are known
        zeros and become zeros of the reduced shape without a collective."""
        leaves = jax.tree.leaves(d)
        out = [
            r(x) if keep is None or keep[k] else jnp.zeros(s.shape, s.dtype)
            for k, (x, r, s) in enumerate(zip(leaves, model.reduce, acc_shapes, strict=True))
        ]
        return jax.tree.unflatten(chunk_tree, out)

    acc_shapes = [
        jax.eval_shape(r, x) for r, x in zip(model.reduce, chunk_leaves, strict=True)
    ] if train else []  # fmt: skip
    embed_grad_shape = (
        jax.eval_shape(lambda e, t: jax.vjp(lambda q: model.embed(q, t), e)[1](msg0)[0],
                       embed_params, tokens_MxBxS[0]) if train else None
    )  # fmt: skip

    def head(y, j):
        tg = targets_MxBxS[j]
        f = lambda hp, h: model.head_loss(hp, h, tg) / m  # noqa: E731  mean over micro-batches
        if not train:
            return f(head_params, y), None, None
        loss, (d_head, dy) = jax.value_and_grad(f, argnums=(0, 1))(head_params, y)
        return loss, d_head, dy

    zero_head = jax.tree.map(jnp.zeros_like, head_params) if train else None
    f_out0 = {
        "y": msg0, "stash": _zeros(stage.stash_shapes) if train else [],
        "taps": _zeros(stage.taps_shapes) if train else [],
        "cot": msg0 if n["cot"] else None, "loss": jnp.zeros((), jnp.float32),
        "d_head": zero_head, "dx": msg0 if has_fb else None,
        "d_chunk": jax.tree.unflatten(chunk_tree, _zeros(acc_shapes)) if has_fb else None,
    }  # fmt: skip
    f_last = plan.fraction("f_stage", last + 1, arrays["f_kind"] == F_CODE["F"])[-1]
    f_first = plan.fraction("f_stage", 1, arrays["f_kind"] == F_CODE["F"])[0]

    def f_idle(row, x_in):
        return f_out0

    def f_fwd(row, x_in):
        s, j = row["f_stage"], row["f_mb"]
        x_in = _cond(s == 0, lambda: model.embed(embed_params, tokens_MxBxS[j]).astype(x0.dtype),
                     lambda: x_in, f_first)  # fmt: skip
        if train:
            y, stash_l, taps_l = stage.forward(chunk(row["f_chunk"]), x_in)
            out = dict(f_out0, y=y, stash=stash_l, taps=taps_l)
        else:
            out = dict(f_out0, y=stage.apply(chunk(row["f_chunk"]), x_in))

        def at_head(y):
            loss, d_head, dy = head(y, j)
            return (loss, d_head, dy) if train else (loss,)

        def not_head(y):
            return (f_out0["loss"], zero_head, y * 0) if train else (f_out0["loss"],)

        res = _cond(s == last, at_head, not_head, f_last, y)
        out["loss"] = res[0]
        if train:
            out["d_head"] = res[1]
            if n["cot"]:
                out["cot"] = res[2]
        return out

    def f_fb(row, x_in):
        # The last stage's forward and full backward of one micro-batch in one tick: one VJP,
        # nothing stashed.
        c, tg = row["f_chunk"], targets_MxBxS[row["f_mb"]]

        def loss_of(ch, hp, x):
            return model.head_loss(hp, stage.apply(ch, x), tg) / m

        loss, (d_chunk, d_head, dx) = jax.value_and_grad(loss_of, argnums=(0, 1, 2))(
            chunk(c), head_params, x_in
        )
        return dict(f_out0, loss=loss, d_head=d_head, dx=dx, d_chunk=reduce(d_chunk))

    used_f = set(np.unique(arrays["f_kind"]).tolist())
    f_branches = [b if k in used_f else f_idle for k, b in enumerate((f_idle, f_fwd, f_fb))]

    b_out0 = {
        "dx": msg0, "d_chunk": jax.tree.unflatten(chunk_tree, _zeros(acc_shapes)),
        "d_embed": jax.tree.map(jnp.zeros_like, embed_grad_shape) if train else None,
        "wpend": _zeros(stage.wpend_shapes),
    }  # fmt: skip
    b_first = plan.fraction("b_stage", 1, (arrays["b_kind"] == 1) | (arrays["b_kind"] == 2))[0]
    keep = stage.split.input_grad_mask if stage.split else None

    def embed_grad(row, dx):
        # Stage 0's input cotangent is the embedding's: its gradient is taken here (ZeRO-3: the
        # gather's transpose reduce-scatters it).
        def grad(dx):
            tokens = tokens_MxBxS[row["b_mb"]]
            return jax.vjp(lambda e: model.embed(e, tokens), embed_params)[1](dx.astype(x0.dtype))[
                0
            ]

        return _cond(row["b_stage"] == 0, grad, lambda dx: b_out0["d_embed"], b_first, dx)

    def b_idle(row, ins):
        return b_out0

    def b_bwd(row, ins):
        ins = _read_slots(ins, row)
        d_chunk, dx = stage.backward(chunk(row["b_chunk"]), ins["stash"], ins["taps"], ins["g"])
        return dict(b_out0, dx=dx, d_chunk=reduce(d_chunk), d_embed=embed_grad(row, dx))

    def b_inp(row, ins):
        ins = _read_slots(ins, row)
        d_small, dx, wpend = stage.input_grads(chunk(row["b_chunk"]), ins["stash"], ins["g"])
        return dict(b_out0, dx=dx, d_chunk=reduce(d_small, keep), d_embed=embed_grad(row, dx),
                    wpend=wpend)  # fmt: skip

    def b_wgt(row, ins):
        ins = _read_slots(ins, row)
        d = stage.weight_grads(chunk(row["b_chunk"]), ins["taps"], ins["wpend"])
        return dict(b_out0, d_chunk=reduce(d))

    used_b = set(np.unique(arrays["b_kind"]).tolist())
    b_branches = [b if k in used_b else b_idle for k, b in enumerate((b_idle, b_bwd, b_inp, b_wgt))]

    def send(buf: str, value: jax.Array, row) -> dict[int, jax.Array]:
        """Arrivals per receive channel: one collective-permute per direction with exactly
        this tick's pairs (none when nobody sends that way)."""
        out = {}
        for d in (SEND_NEXT, SEND_PREV):
            if (buf, d) not in sends:
                continue
            sets, idx = sends[(buf, d)]
            perms = [lambda x: jnp.zeros_like(x)] + [
                lambda x, ps=ps: jax.lax.ppermute(x, "pp", list(ps)) for ps in sets
            ]
            weights = [float(np.mean(idx == k)) for k in range(len(perms))]
            out[CHANNEL_OF_SEND[d]] = (
                perms[1](value) if weights[0] == 0 and len(sets) == 1
                else _switch(row["send_idx"][(buf, d)], perms, weights, value)
            )  # fmt: skip
        out[CHANNEL_OF_SEND[3]] = value  # local hop
        return out

    def file(buf_arr, recv, arrivals, row):
        """File this tick's arrivals into their slots (channels the table never uses: none)."""
        for ch, value in arrivals.items():
            if np.any(arrays[recv][:, :, ch] >= 0):
                buf_arr = _write_if(buf_arr, row[recv][ch], value)
        return buf_arr

    def tick(c, row):
        # ---- forward phase: F's output leaves as soon as it exists
        x_in = _slot(c["act"], row["f_in"])
        f_w = plan.fraction("f_kind", 3)
        fo = _switch(row["f_kind"], f_branches, f_w, row, x_in)
        arr_act = send("act", fo["y"], row)
        c = dict(c, loss=c["loss"] + fo["loss"])
        if train:
            # ---- backward phase: its inputs read before anything is written
            ins = {
                "g": jnp.where(row["b_stage"] == last, _slot(c["cot"], row["b_cot"]),
                               _slot(c["grad"], row["b_in"])) if n["cot"]
                else _slot(c["grad"], row["b_in"]),
                "stash": c["stash"],
                "taps": c["taps"],
                "wpend": c["wpend"],
            }  # fmt: skip
            bo = _switch(row["b_kind"], b_branches, plan.fraction("b_kind", 4), row, ins)
            dx = (
                jnp.where(row["f_kind"] == F_CODE["FB"], fo["dx"], bo["dx"]) if has_fb else bo["dx"]
            )
            arr_grad = send("grad", dx, row)
            # ---- end of tick: every write, in place. The forward's stash, taps and cot writes
            # land after the backward has read those buffers: their slot index depends on the
            # backward's output. Without that data dependency XLA cannot order the read before
            # the in-place write and copies each buffer twice per tick.
            after = _after(bo["dx"])
            i_write = jnp.where(row["b_kind"] == B_CODE["I"], row["b_dys"], -1)
            c = dict(
                c,
                stash=_write_all(c["stash"], row["f_stash"] + after, fo["stash"]),
                taps=_write_all(c["taps"], row["f_taps"] + after, fo["taps"]),
                wpend=_write_all(c["wpend"], i_write, bo["wpend"]),
                acc=_accumulate(c["acc"], row, bo["d_chunk"], fo["d_chunk"] if has_fb else None, v),
                acc_embed=jax.tree.map(jnp.add, c["acc_embed"], bo["d_embed"]),
                acc_head=jax.tree.map(jnp.add, c["acc_head"], fo["d_head"]),
                grad=file(c["grad"], "recv_grad", arr_grad, row),
            )  # fmt: skip
            if n["cot"]:
                c["cot"] = _write_if(c["cot"], row["f_cot"] + after, fo["cot"])
        c["act"] = file(c["act"], "recv_act", arr_act, row)
        return c, None

    carry0 = {
        "act": jnp.zeros((max(n["act"], 1), *msg0.shape), msg0.dtype),
        "loss": jnp.zeros((), jnp.float32),
    }
    if train:
        carry0.update(
            grad=jnp.zeros((max(n["grad"], 1), *msg0.shape), msg0.dtype),
            cot=jnp.zeros((n["cot"], *msg0.shape), msg0.dtype),
            stash=[jnp.zeros((n["stash"], *s.shape), s.dtype) for s in stage.stash_shapes],
            taps=[jnp.zeros((n["taps"], *s.shape), s.dtype) for s in stage.taps_shapes],
            wpend=[jnp.zeros((n["dys"], *s.shape), s.dtype) for s in stage.wpend_shapes],
            acc=jax.tree.unflatten(chunk_tree, [jnp.zeros((v, *a.shape), a.dtype)
                                                for a in acc_shapes]),
            acc_embed=jax.tree.map(jnp.zeros_like, embed_grad_shape),
            acc_head=zero_head,
        )  # fmt: skip
        if not n["cot"]:
            del carry0["cot"]
    c, _ = jax.lax.scan(tick, carry0, rows)
    loss = jax.lax.psum(c["loss"], "pp")
    if not train:
        return loss
    # Only stage 0's rank holds embedding gradients and only the last stage's head gradients;
    # the other pp ranks contribute zeros.
    d_embed, d_head = jax.lax.psum((c["acc_embed"], c["acc_head"]), "pp")
    return loss, c["acc"], d_embed, d_head


def _accumulate(acc: Any, row, d_b: Any, d_f: Any | None, v: int) -> Any:
    """Add this tick's chunk gradients (B/I/W of the backward phase, FB of the forward phase)."""
    if v == 1:
        d = d_b if d_f is None else jax.tree.map(jnp.add, d_b, d_f)
        return jax.tree.map(lambda a, x: a + x[None].astype(a.dtype), acc, d)

    def add(acc, c, d):
        return jax.tree.map(lambda a, x: a.at[c].add(x.astype(a.dtype)), acc, d)

    acc = add(acc, jnp.maximum(row["b_chunk"], 0), d_b)
    return acc if d_f is None else add(acc, jnp.maximum(row["f_chunk"], 0), d_f)
