"""The tick table: the contract between a schedule and the SPMD executor, as int32 arrays.

The executor runs one ``lax.scan`` over ticks ``t = 0 .. T-1``; in each tick every rank ``r``
(``P = p`` ranks) reads row ``[t, r]`` of each :class:`TickTable` field and runs two phases: a
**backward phase** (idle, ``B``, ``I``, ``W``, or the last stage's ``FB``) and then a **forward
phase** (idle or ``F``). A fused tick uses both; an unfused one leaves one idle. The backward
goes first because a fused tick's backward is never of its forward's micro-batch: the stash
slot it frees can take the forward's new stash, so the tick holds one stash set fewer. A table
whose cell runs a forward before an unrelated backward is refused.

**Sends** (``f_send``, ``b_send``): ``0`` nowhere, ``1`` to rank ``(r+1) % p``, ``2`` to rank
``(r-1) % p``, ``3`` local (the next/previous stage is on this same rank: every hop for
``p = 1``, the V's turn at rank ``p-1``). With ``p = 2`` both neighbours coincide and only code
1 is used.

**Receives** are filed at the end of the tick, after every read, so a slot read in tick ``t``
may be written again at its end. Channel ``c`` of ``recv_act``/``recv_grad``: ``0`` came from
rank ``(r-1) % p`` (its code 1), ``1`` from rank ``(r+1) % p`` (its code 2), ``2`` local. A
rank receives at most one message per channel per tick. The stash, taps, dys and cot buffers
are written at the end of the tick too.

**Slots**: per buffer, the same count on every rank (as SPMD needs), by interval colouring
(lowest free slot first, which is optimal). A (stage, micro-batch) occupies a stash slot from
the tick after its forward to its backward (``B``/``I``), so in a fused tick the forward's new
stash reuses the slot the backward frees: ``slots.stash`` is the lock-step peak
(:func:`jaxpar.pipeline.timing.peak_stashes`) of the ranks that stash (``FB`` stashes nothing).

Pure NumPy: the planner reads the same table without JAX.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from jaxpar.pipeline.schedules import backward_kind
from jaxpar.pipeline.types import Action, Kind, Schedule, ScheduleError

F_IDLE, F_RUN, F_FB = 0, 1, 2  # forward-phase codes (f_kind)
B_IDLE, B_FULL, B_INPUT, B_WEIGHT = 0, 1, 2, 3  # backward-phase codes (b_kind)
B_CODE = {Kind.B: B_FULL, Kind.I: B_INPUT, Kind.W: B_WEIGHT}
SEND_NONE, SEND_NEXT, SEND_PREV, SEND_LOCAL = 0, 1, 2, 3
FROM_PREV, FROM_NEXT, FROM_LOCAL = 0, 1, 2  # receive channels
CHANNEL_OF_SEND = {SEND_NEXT: FROM_PREV, SEND_PREV: FROM_NEXT, SEND_LOCAL: FROM_LOCAL}
BUFFERS = ("act", "grad", "stash", "taps", "dys", "cot")


@dataclass(frozen=True)
class SlotCounts:
    """Slots per buffer (module docstring); 0 where the table never uses the buffer."""

    act: int  # received activations waiting for their forward
    grad: int  # received cotangents waiting for their backward
    stash: int  # what a forward leaves for its backward
    taps: int  # split backward: the weight matmuls' activation operands, for W
    dys: int  # split backward: the weight matmuls' output cotangents, from I to W
    cot: int  # the last stage's loss cotangent, from its F to its B/I (unfused tables)


@dataclass(frozen=True, eq=False)
class TickTable:
    """A schedule's lock-step table for the executor: int32 ``[T, P]`` arrays (``recv_*``:
    ``[T, P, 3]``), -1 where a slot field does not apply. Read-only. Inside the executor's scan
    the same fields hold one rank's values at one tick (:mod:`jaxpar.pipeline.carry` registers
    it as a pytree: this module stays free of JAX)."""

    # Forward phase.
    f_kind: np.ndarray  # F_IDLE, F_RUN, or F_FB: forward and full backward of one (stage, mb)
    f_stage: np.ndarray  # global stage of the forward (or FB)
    f_chunk: np.ndarray  # its local chunk: index into the rank's stages in ascending order
    f_mb: np.ndarray  # its micro-batch
    f_in: np.ndarray  # act slot holding its input (stage 0: -1, it embeds the tokens)
    f_stash: np.ndarray  # stash slot it fills (FB: -1)
    f_taps: np.ndarray  # taps slot it fills (split backward only)
    f_cot: np.ndarray  # cot slot it fills with the loss cotangent (last stage, unfused)
    f_send: np.ndarray  # where its activation goes (SEND_*)
    # Backward phase.
    b_kind: np.ndarray  # B_IDLE, B_FULL, B_INPUT or B_WEIGHT (an FB is the forward's)
    b_stage: np.ndarray  # global stage of the backward piece
    b_chunk: np.ndarray  # its local chunk
    b_mb: np.ndarray  # its micro-batch
    b_in: np.ndarray  # grad slot holding the output cotangent (last stage: -1, see b_cot)
    b_stash: np.ndarray  # stash slot B/I reads and frees
    b_taps: np.ndarray  # taps slot B/W reads and frees (split backward)
    b_dys: np.ndarray  # dys slot I fills and W reads and frees
    b_cot: np.ndarray  # cot slot the last stage's B/I reads and frees
    b_send: np.ndarray  # where the input cotangent of a B/I/FB goes (SEND_*)
    # Receives: per channel, the slot the arriving message fills.
    recv_act: np.ndarray  # [T, P, 3] act slot per channel, -1: nothing arrives
    recv_grad: np.ndarray  # [T, P, 3] grad slot per channel
    slots: SlotCounts

    @property
    def num_ticks(self) -> int:
        return int(self.f_kind.shape[0])

    @property
    def training(self) -> bool:
        """Whether the table has backward work (else: forward only, the loss)."""
        return bool(np.any(self.f_kind == F_FB) or np.any(self.b_kind))

    def arrays(self) -> dict[str, np.ndarray]:
        """The array fields by name (every field but ``slots``)."""
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "slots"
        }

    def replace(self, **arrays: np.ndarray) -> TickTable:
        """A copy with some fields replaced (tests corrupt tables with it)."""
        return dataclasses.replace(self, **arrays)


def send_code(src: int, dst: int, p: int) -> int:
    """Direction code of a message from rank ``src`` to rank ``dst``."""
    if src == dst:
        return SEND_LOCAL
    if dst == (src + 1) % p:
        return SEND_NEXT
    if dst == (src - 1) % p:
        return SEND_PREV
    raise ScheduleError(f"rank {src} cannot send to non-neighbour rank {dst}")


def destination(src: int, code: int, p: int) -> int:
    """Rank a message with direction ``code`` from ``src`` arrives at."""
    return {SEND_LOCAL: src, SEND_NEXT: (src + 1) % p, SEND_PREV: (src - 1) % p}[code]


def _colour(intervals: list[tuple[int, int, object]]) -> tuple[dict[object, int], int]:
    """Assign slots to inclusive tick intervals ``(first, last, item)`` so none overlap."""
    slot_of: dict[object, int] = {}
    busy_until: list[int] = []  # per slot, last tick it is occupied
    for first, last, item in sorted(intervals, key=lambda x: (x[0], x[1])):
        free = [k for k, until in enumerate(busy_until) if until < first]
        k = free[0] if free else len(busy_until)
        if k == len(busy_until):
            busy_until.append(last)
        busy_until[k] = last
        slot_of[item] = k
    return slot_of, len(busy_until)


def fused_fb(schedule: Schedule) -> set[tuple[int, int]]:
    """(stage, micro-batch) whose forward and full backward share a tick (run as ``FB``)."""
    tick = schedule.tick_of()
    return {
        (a.stage, a.mb) for a, t in tick.items() if a.kind == Kind.B and tick[a.of(Kind.F)] == t
    }


def build_table(schedule: Schedule) -> TickTable:
    """The executor's table of ``schedule`` (module docstring). A table of forwards alone
    (evaluation) has no backward phase, cotangents or stashes."""
    fb = fused_fb(schedule)
    _refuse_forward_first(schedule, fb)
    T, p = schedule.num_ticks, schedule.p
    names = [f.name for f in dataclasses.fields(TickTable) if f.name != "slots"]
    out = {k: np.full((T, p, 3) if k.startswith("recv") else (T, p), -1, np.int32) for k in names}
    for k in ("f_kind", "b_kind", "f_send", "b_send"):
        out[k][:] = 0
    _fill_actions(schedule, fb, out)
    counts = _fill_messages(schedule, out)
    counts.update(_fill_buffers(schedule, fb, out))
    for a in out.values():
        a.flags.writeable = False
    return TickTable(**out, slots=SlotCounts(**counts))


def _refuse_forward_first(schedule: Schedule, fb: set[tuple[int, int]]) -> None:
    for r, row in enumerate(schedule.ticks):
        for t, cell in enumerate(row):
            first = cell[0] if len(cell) == 2 else None
            if first is not None and first.kind == Kind.F and (first.stage, first.mb) not in fb:
                raise ScheduleError(
                    f"tick {t} rank {r}: {first} before {cell[1]}; the executor runs a "
                    "tick's backward first unless it is the forward's own (FB)"
                )


def _fill_actions(schedule: Schedule, fb: set, out: dict[str, np.ndarray]) -> None:
    """Each action's kind, stage, chunk and micro-batch in its phase's fields."""
    chunk = [schedule.chunk_of(s) for s in range(schedule.num_stages)]
    for a, t in schedule.tick_of().items():
        r, key = schedule.placement[a.stage], (a.stage, a.mb)
        if a.kind == Kind.F:
            ph, code = "f_", F_FB if key in fb else F_RUN
        elif key in fb:
            continue  # the FB of the forward phase does it
        else:
            ph, code = "b_", B_CODE[a.kind]
        out[ph + "kind"][t, r], out[ph + "stage"][t, r] = code, a.stage
        out[ph + "chunk"][t, r], out[ph + "mb"][t, r] = chunk[a.stage], a.mb


def _fill_messages(schedule: Schedule, out: dict[str, np.ndarray]) -> dict[str, int]:
    """Sends, receive slots and reader slots of both message kinds; their slot counts.

    One message per (stage boundary, micro-batch) in each direction. The activation for stage
    ``s >= 1`` is sent by ``F(s-1)`` and read by ``F(s)``; the cotangent for stage ``s < S-1``
    is sent by the ``B``/``I`` (or ``FB``) of ``s+1`` and read by the ``B``/``I`` of ``s``. Each
    occupies its receiver's slot from the tick after it is sent until the tick that reads it.
    """
    p, S, m, place = schedule.p, schedule.num_stages, schedule.m, schedule.placement
    tick, bwd = schedule.tick_of(), backward_kind(schedule.orders)
    counts = {}
    for buf, reader, sender in (("act", "f_in", "f_send"), ("grad", "b_in", "b_send")):
        msgs = []  # (src, dst, send tick, read tick, reader)
        for s in range(S):
            for j in range(m):
                if buf == "act" and s > 0:
                    sent, read = Action(Kind.F, s - 1, j), Action(Kind.F, s, j)
                elif buf == "grad" and s < S - 1 and bwd:  # (none in a forward-only table)
                    sent, read = Action(bwd[(s + 1, j)], s + 1, j), Action(bwd[(s, j)], s, j)
                else:
                    continue
                msgs.append((place[sent.stage], place[s], tick[sent], tick[read], (s, j)))
        counts[buf] = 0
        for r in range(p):
            mine = [x for x in msgs if x[1] == r]
            slot_of, n = _colour([(ts + 1, tr, item) for _, _, ts, tr, item in mine])
            counts[buf] = max(counts[buf], n)
            for src, dst, ts, tr, item in mine:
                code = send_code(src, dst, p)
                out[sender][ts, src] = code
                out["recv_" + buf][ts, dst, CHANNEL_OF_SEND[code]] = slot_of[item]
                out[reader][tr, dst] = slot_of[item]
    return counts


def _spans(
    bwd: dict, split: bool, last: int, fb: set, buf: str, s: int, j: int
) -> tuple[Action, Action] | None:
    """The (writer, last reader) of ``buf`` for (stage ``s``, micro-batch ``j``), or None."""
    if not bwd or (s, j) in fb:  # forward only, or an FB: nothing waits for a backward
        return None
    b = bwd[(s, j)]
    fwd = Action(Kind.F, s, j)
    back = fwd.of(b)
    if buf == "stash":
        return fwd, back
    if buf == "taps" and split:
        return fwd, back if b == Kind.B else fwd.of(Kind.W)
    if buf == "dys" and b == Kind.I:
        return back, fwd.of(Kind.W)
    if buf == "cot" and s == last:
        return fwd, back
    return None


def _fill_buffers(schedule: Schedule, fb: set, out: dict[str, np.ndarray]) -> dict[str, int]:
    """Per-rank buffers: the slot of each (writer, last reader) span in both ends' fields."""
    tick, counts, bwd = schedule.tick_of(), {}, backward_kind(schedule.orders)
    split = Kind.I in bwd.values()
    for buf in ("stash", "taps", "dys", "cot"):
        counts[buf] = 0
        for r in range(schedule.p):
            items = {}
            for s in schedule.stages_of(r):
                for j in range(schedule.m):
                    ends = _spans(bwd, split, schedule.num_stages - 1, fb, buf, s, j)
                    if ends:
                        items[(s, j)] = ends
            slot_of, n = _colour([(tick[w] + 1, tick[rd], it) for it, (w, rd) in items.items()])
            counts[buf] = max(counts[buf], n)
            for it, (w, rd) in items.items():
                for a in (w, rd):
                    ph = "f_" if a.kind == Kind.F else "b_"
                    out[ph + buf][tick[a], r] = slot_of[it]
    return counts
