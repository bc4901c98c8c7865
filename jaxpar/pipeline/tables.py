"""The tick table as integer arrays: the contract between schedules and the SPMD executor.

The executor runs one ``lax.scan`` over ticks ``t = 0 .. T-1``; in each tick every rank ``r``
(``P = p`` ranks) looks up row ``[t, r]`` and runs two phases, a forward and a backward (a
fused tick uses both; an unfused one leaves one idle). It runs the backward phase first (and
the ``FB`` with it): a fused tick's backward is never of its forward's micro-batch, so the
stash slot it frees can take the forward's new stash and the tick holds one stash set fewer.
A table whose cell runs a forward before an unrelated backward is refused.

1. **forward phase** ``f_kind[t, r]``: 0 idle, 1 ``F``, 2 ``FB`` — the forward and the full
   backward of the same (stage, micro-batch) in one tick (the last stage of a fused schedule:
   no stash, its cotangent comes from its own loss). Stage ``f_stage``, local chunk
   ``f_chunk`` (index into the rank's stages in ascending order: interleaved chunk ``c`` is
   stage ``c*p + r``; V-shaped chunk 0 is stage ``r``, chunk 1 is ``2p-1-r``), micro-batch
   ``f_mb``. ``F`` reads its input from activation slot ``f_in`` (stage 0: -1, it embeds the
   micro-batch's tokens) and leaves what its backward needs in stash slot ``f_stash`` (and, for
   schedules with a split backward, the weight matmuls' inputs in taps slot ``f_taps``); the
   last stage runs the head and loss and files the output cotangent in cot slot ``f_cot``.
2. **backward phase** ``b_kind[t, r]``: 0 idle, 1 ``B`` (full backward), 2 ``I`` (input
   gradient), 3 ``W`` (weight gradient), on ``b_stage``/``b_chunk``/``b_mb``. ``B``/``I`` read
   the output cotangent from cotangent slot ``b_in`` (last stage: -1, from cot slot ``b_cot``)
   and the stash from ``b_stash`` (freed). ``I`` files the weight matmuls' output cotangents in
   dys slot ``b_dys``; ``W`` reads them there (and the taps from ``b_taps``) and frees both. A
   ``B`` of a schedule with split backwards reads ``b_taps`` too (it is ``I`` then ``W``).

**Sends.** ``f_send[t, r]`` says where the forward's activation goes (to the next stage),
``b_send[t, r]`` where the input cotangent of a ``B``/``I``/``FB`` goes (to the previous
stage): ``0`` nowhere (``F`` of the last stage, backward of stage 0), ``1`` to rank
``(r+1) % p``, ``2`` to rank ``(r-1) % p``, ``3`` local (the next/previous stage is on this
same rank: every hop for ``p = 1``, the V's turn at rank ``p-1``). With ``p = 2`` both
neighbours coincide and only code 1 is used.

**Receives** are filed at the end of the tick, after every read, so a slot read in tick ``t``
may be written again at its end. ``recv_act[t, r, c]`` / ``recv_grad[t, r, c]`` name the slot
for the message on channel ``c``: ``0`` came from rank ``(r-1) % p`` (its code 1), ``1`` from
rank ``(r+1) % p`` (its code 2), ``2`` local; -1 where nothing arrives. A rank receives at most
one message per channel per tick (a sender runs one forward and one backward per tick). The
stash, taps, dys and cot buffers are written at the end of the tick too.

Buffer sizes (same on every rank, as SPMD needs) are the ``n_<buffer>_slots`` 0-d arrays, by
interval colouring (lowest free slot first, which is optimal). A (stage, micro-batch) occupies
a stash slot from the tick after its forward to its backward (``B``/``I``), so in a fused tick
the forward's new stash reuses the slot the backward frees: ``n_stash_slots`` is the lock-step
peak (:func:`jaxpar.pipeline.timing.peak_stashes`) of the ranks that stash (the last stage's
``FB`` stashes nothing).
"""

from __future__ import annotations

import numpy as np

from jaxpar.pipeline.schedules import Schedule, ScheduleError, backward_kind

F_CODE = {"F": 1, "FB": 2}
B_CODE = {"B": 1, "I": 2, "W": 3}
SEND_NONE, SEND_NEXT, SEND_PREV, SEND_LOCAL = 0, 1, 2, 3
FROM_PREV, FROM_NEXT, FROM_LOCAL = 0, 1, 2  # receive channels
CHANNEL_OF_SEND = {SEND_NEXT: FROM_PREV, SEND_PREV: FROM_NEXT, SEND_LOCAL: FROM_LOCAL}
BUFFERS = ("act", "grad", "stash", "taps", "dys", "cot")
PER_TICK = (
    "f_kind", "f_stage", "f_chunk", "f_mb", "f_in", "f_stash", "f_taps", "f_cot", "f_send",
    "b_kind", "b_stage", "b_chunk", "b_mb", "b_in", "b_stash", "b_taps", "b_dys", "b_cot",
    "b_send",
)  # fmt: skip


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
    return {(s, j) for (k, s, j), t in tick.items() if k == "B" and tick[("F", s, j)] == t}


def as_arrays(schedule: Schedule) -> dict[str, np.ndarray]:
    """Integer arrays of ``schedule`` for the executor (layout in the module docstring).

    Keys: :data:`PER_TICK` (int32 ``[T, P]``); ``recv_act``, ``recv_grad`` (int32
    ``[T, P, 3]``); ``n_<buffer>_slots`` for :data:`BUFFERS` (int32 scalars). A table of
    forwards alone (evaluation) has no backward phase, cotangents or stashes.
    """
    p, T, S, m = schedule.p, schedule.num_ticks, schedule.num_stages, schedule.m
    tick, place = schedule.tick_of(), schedule.placement
    bwd = backward_kind(schedule.orders)
    split = any(k == "I" for k in bwd.values())
    fb = fused_fb(schedule)
    for r, row in enumerate(schedule.ticks):
        for t, cell in enumerate(row):
            if len(cell) == 2 and cell[0].kind == "F" and (cell[0].stage, cell[0].mb) not in fb:
                raise ScheduleError(
                    f"tick {t} rank {r}: {cell[0]} before {cell[1]}; the executor runs a "
                    "tick's backward first unless it is the forward's own (FB)"
                )
    out = {k: np.full((T, p), -1, np.int32) for k in PER_TICK}
    for k in ("f_kind", "b_kind", "f_send", "b_send"):
        out[k][:] = 0
    out["recv_act"] = np.full((T, p, 3), -1, np.int32)
    out["recv_grad"] = np.full((T, p, 3), -1, np.int32)
    chunk = [schedule.chunk_of(s) for s in range(S)]
    for (kind, s, j), t in tick.items():
        r = place[s]
        if kind == "F":
            ph, code = "f_", F_CODE["FB" if (s, j) in fb else "F"]
        elif (s, j) in fb:
            continue  # the FB of the forward phase does it
        else:
            ph, code = "b_", B_CODE[kind]
        out[ph + "kind"][t, r], out[ph + "stage"][t, r] = code, s
        out[ph + "chunk"][t, r], out[ph + "mb"][t, r] = chunk[s], j

    # One message per (stage boundary, micro-batch) in each direction. The activation for
    # stage s >= 1 is sent by F(s-1) and read by F(s); the cotangent for stage s < S-1 is sent
    # by the B/I(s+1) (or FB) and read by B/I(s). Each occupies its receiver's slot from the
    # tick after it is sent until the tick that reads it.
    counts = {}
    for buf in ("act", "grad"):
        msgs = []  # (src, dst, send tick, read tick, reader)
        for s in range(S):
            for j in range(m):
                if buf == "act" and s > 0:
                    msgs.append((place[s - 1], place[s], tick[("F", s - 1, j)],
                                 tick[("F", s, j)], (s, j)))  # fmt: skip
                if buf == "grad" and s < S - 1 and bwd:  # (none in a forward-only table)
                    msgs.append((place[s + 1], place[s], tick[(bwd[(s + 1, j)], s + 1, j)],
                                 tick[(bwd[(s, j)], s, j)], (s, j)))  # fmt: skip
        counts[buf] = 0
        reader_field = "f_in" if buf == "act" else "b_in"
        send_field = "f_send" if buf == "act" else "b_send"
        for r in range(p):
            mine = [x for x in msgs if x[1] == r]
            slot_of, n = _colour([(ts + 1, tr, item) for _, _, ts, tr, item in mine])
            counts[buf] = max(counts[buf], n)
            for src, dst, ts, tr, item in mine:
                code = send_code(src, dst, p)
                out[send_field][ts, src] = code
                out["recv_" + buf][ts, dst, CHANNEL_OF_SEND[code]] = slot_of[item]
                out[reader_field][tr, dst] = slot_of[item]

    # Per-rank buffers: (write tick, last read tick, item) -> slot fields of both ends.
    def spans(buf: str, s: int, j: int):
        if not bwd:  # forward only: nothing waits for a backward
            return None
        b = bwd[(s, j)]
        last = ("B" if b == "B" else "W", s, j)
        if (s, j) in fb:
            return None
        if buf == "stash":
            return ("F", s, j), (b, s, j)
        if buf == "taps" and split:
            return ("F", s, j), last
        if buf == "dys" and b == "I":
            return ("I", s, j), ("W", s, j)
        if buf == "cot" and s == S - 1:
            return ("F", s, j), (b, s, j)
        return None

    for buf in ("stash", "taps", "dys", "cot"):
        counts[buf] = 0
        for r in range(p):
            items = {}
            for s in schedule.stages_of(r):
                for j in range(m):
                    ends = spans(buf, s, j)
                    if ends:
                        items[(s, j)] = ends
            slot_of, n = _colour([(tick[w] + 1, tick[rd], it) for it, (w, rd) in items.items()])
            counts[buf] = max(counts[buf], n)
            for it, (w, rd) in items.items():
                for key in (w, rd):
                    ph = "f_" if key[0] == "F" else "b_"
                    out[ph + buf][tick[key], r] = slot_of[it]
    for buf in BUFFERS:
        out[f"n_{buf}_slots"] = np.asarray(counts[buf], np.int32)
    return out


def check_slots(schedule: Schedule, arrays: dict[str, np.ndarray]) -> None:
    """Replay ``arrays`` tick by tick as the executor would; raise on any misuse of a slot.

    Checks that every read finds the (stage, micro-batch) it expects, that no write lands on a
    live slot or outside the buffer, that every message has a receiving slot and nothing else
    is received, and that every buffer is empty at the end.
    """
    p, S = schedule.p, schedule.num_stages
    size = {b: int(arrays[f"n_{b}_slots"]) for b in BUFFERS}
    bufs = {b: [[None] * size[b] for _ in range(p)] for b in BUFFERS}
    split = "I" in backward_kind(schedule.orders).values()
    at = {k: arrays[k] for k in PER_TICK}

    def take(buf: str, r: int, k: int, want: tuple[int, int], free: bool, t: int) -> None:
        if not 0 <= k < size[buf] or bufs[buf][r][k] != want:
            raise ScheduleError(f"tick {t} rank {r}: {buf} slot {k} lacks {want}")
        if free:
            bufs[buf][r][k] = None

    def put(buf: str, r: int, k: int, item: tuple[int, int], t: int) -> None:
        if not 0 <= k < size[buf] or bufs[buf][r][k] is not None:
            raise ScheduleError(f"tick {t} rank {r}: {buf} slot {k} is live or out of range")
        bufs[buf][r][k] = item

    def no_slot(t: int, r: int, *fields: str) -> None:
        for f in fields:
            if at[f][t, r] != -1:
                raise ScheduleError(f"tick {t} rank {r}: {f} is set for an action without one")

    def send(t: int, buf: str, r: int, s_to: int, j: int, field: str, writes, expected) -> None:
        code = int(at[field][t, r])
        dst = schedule.placement[s_to]
        if code != send_code(r, dst, p) or destination(r, code, p) != dst:
            raise ScheduleError(f"tick {t} rank {r}: wrong {field} {code}")
        ch = CHANNEL_OF_SEND[code]
        writes.append((buf, dst, int(arrays["recv_" + buf][t, dst, ch]), (s_to, j)))
        expected[buf][dst, ch] = 0

    for t in range(at["f_kind"].shape[0]):
        writes: list[tuple[str, int, int, tuple[int, int]]] = []
        expected = {"act": np.full((p, 3), -1), "grad": np.full((p, 3), -1)}

        for r in range(p):
            fk, bk = int(at["f_kind"][t, r]), int(at["b_kind"][t, r])
            sends = {"f_send": False, "b_send": False}
            if fk:
                s, j = int(at["f_stage"][t, r]), int(at["f_mb"][t, r])
                if s > 0:
                    take("act", r, int(at["f_in"][t, r]), (s, j), True, t)
                else:
                    no_slot(t, r, "f_in")
                if fk == F_CODE["FB"]:
                    no_slot(t, r, "f_stash", "f_taps", "f_cot")
                else:
                    writes.append(("stash", r, int(at["f_stash"][t, r]), (s, j)))
                    if split:
                        writes.append(("taps", r, int(at["f_taps"][t, r]), (s, j)))
                    if s == S - 1:
                        writes.append(("cot", r, int(at["f_cot"][t, r]), (s, j)))
                if s < S - 1:
                    send(t, "act", r, s + 1, j, "f_send", writes, expected)
                    sends["f_send"] = True
                if fk == F_CODE["FB"] and s > 0:
                    send(t, "grad", r, s - 1, j, "b_send", writes, expected)
                    sends["b_send"] = True
            if bk:
                s, j = int(at["b_stage"][t, r]), int(at["b_mb"][t, r])
                kind = {c: k for k, c in B_CODE.items()}[bk]
                if kind in ("B", "I"):
                    if s < S - 1:
                        take("grad", r, int(at["b_in"][t, r]), (s, j), True, t)
                    else:
                        take("cot", r, int(at["b_cot"][t, r]), (s, j), True, t)
                    take("stash", r, int(at["b_stash"][t, r]), (s, j), True, t)
                    if s > 0:
                        send(t, "grad", r, s - 1, j, "b_send", writes, expected)
                        sends["b_send"] = True
                if kind == "I":
                    writes.append(("dys", r, int(at["b_dys"][t, r]), (s, j)))
                if kind == "W":
                    take("dys", r, int(at["b_dys"][t, r]), (s, j), True, t)
                if split and kind in ("B", "W"):
                    take("taps", r, int(at["b_taps"][t, r]), (s, j), True, t)
            for field, used in sends.items():
                if not used and int(at[field][t, r]) != SEND_NONE:
                    raise ScheduleError(f"tick {t} rank {r}: {field} without a message")
        # Messages and stashes are filed after every rank has read: a slot read this tick
        # may be reused at its end.
        for buf, r, k, item in writes:
            put(buf, r, k, item, t)
        for buf in ("act", "grad"):
            stray = (arrays["recv_" + buf][t] >= 0) & (expected[buf] < 0)
            if stray.any():
                raise ScheduleError(f"tick {t}: {buf} receive slot without a message")
    for buf, per_rank in bufs.items():
        if any(x is not None for row in per_rank for x in row):
            raise ScheduleError(f"{buf} buffer not empty at the end of the step")
