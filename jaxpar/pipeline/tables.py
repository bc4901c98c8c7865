"""The tick table as integer arrays: the contract between schedules and the SPMD executor.

The executor runs one ``lax.scan`` over ticks ``t = 0 .. T-1``; in each tick every rank ``r``
(``P = p`` ranks) looks up row ``[t, r]`` and does, in this order:

1. **compute**: ``kind[t, r]`` — 0 idle, 1 ``F``, 2 ``B`` (full backward), 3 ``I`` (input
   gradient), 4 ``W`` (weight gradient) — of global virtual stage ``stage[t, r]``, which is
   local chunk ``chunk[t, r]`` of the rank (index into the rank's stages in ascending order:
   interleaved chunk ``c`` is stage ``c*p + r``; V-shaped chunk 0 is stage ``r``, chunk 1 is
   ``2p-1-r``), on micro-batch ``mb[t, r]``. Idle rows hold -1 in every field.

   * ``F`` reads its input from activation slot ``in_slot[t, r]`` (stage 0: -1, read
     micro-batch ``mb`` of the data instead), and writes its residuals (VJP residuals, or just
     the input under remat) into stash slot ``stash_slot[t, r]``. The last stage also computes
     the loss here (its backward needs no received cotangent).
   * ``B``/``I`` read the output cotangent from cotangent slot ``in_slot[t, r]`` (last stage:
     -1, the cotangent comes from the loss) and the residuals from ``stash_slot[t, r]``.
     ``B`` frees the stash slot. ``I`` keeps it and files the output cotangent into it, so the
     later ``W`` finds both there (its cotangent slot is free as soon as ``I`` has run).
   * ``W`` reads stash slot ``stash_slot[t, r]`` and frees it; it sends nothing.
   A slot that is read in tick ``t`` may be written again at the end of tick ``t``.

2. **send**: ``send[t, r]`` says where this tick's output goes — the activation of an ``F``
   (to the next stage) or the input cotangent of a ``B``/``I`` (to the previous stage):
   ``0`` nothing (also: ``F`` of the last stage, ``B``/``I`` of stage 0), ``1`` to rank
   ``(r+1) % p``, ``2`` to rank ``(r-1) % p``, ``3`` local (next/previous stage is on this same
   rank: every hop for ``p = 1``, the V's turn at rank ``p-1``, ...). Codes 1 and 2 map to two
   ``ppermute`` ring shifts; with ``p = 2`` both neighbours coincide and only code 1 is used.

3. **receive**: what arrived this tick is filed at the end of the tick.
   ``recv_act[t, r, c]`` / ``recv_grad[t, r, c]`` give the activation / cotangent slot for the
   message on channel ``c``: ``0`` came from rank ``(r-1) % p`` (its code 1), ``1`` from rank
   ``(r+1) % p`` (its code 2), ``2`` local; -1 where nothing arrives. A rank receives at most
   one message per channel per tick (each sender runs one action per tick).

Buffer sizes (same on every rank, as SPMD needs): ``n_act_slots``, ``n_grad_slots`` and
``n_stash_slots`` (0-d arrays). ``n_stash_slots`` equals the peak in-flight count (max over
ranks); the receive buffers never need more (checked by :func:`check_slots` in the tests).
Slots are assigned by interval colouring (lowest free slot first), which is optimal.
"""

from __future__ import annotations

import numpy as np

from jaxpar.pipeline.schedules import Schedule, ScheduleError, backward_kind

KIND_CODE = {"F": 1, "B": 2, "I": 3, "W": 4}
CODE_KIND = {c: k for k, c in KIND_CODE.items()}
SEND_NONE, SEND_NEXT, SEND_PREV, SEND_LOCAL = 0, 1, 2, 3
FROM_PREV, FROM_NEXT, FROM_LOCAL = 0, 1, 2  # receive channels
_CHANNEL_OF_SEND = {SEND_NEXT: FROM_PREV, SEND_PREV: FROM_NEXT, SEND_LOCAL: FROM_LOCAL}


def send_code(src: int, dst: int, p: int) -> int:
    """Direction code of a message from rank ``src`` to rank ``dst``."""
    if src == dst:
        return SEND_LOCAL
    if dst == (src + 1) % p:
        return SEND_NEXT
    if dst == (src - 1) % p:
        return SEND_PREV
    raise ScheduleError(f"rank {src} cannot send to non-neighbour rank {dst}")


def _destination(src: int, code: int, p: int) -> int:
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


def as_arrays(schedule: Schedule) -> dict[str, np.ndarray]:
    """Integer arrays of ``schedule`` for the executor (layout in the module docstring).

    Keys: ``kind``, ``stage``, ``chunk``, ``mb``, ``in_slot``, ``stash_slot``, ``send``
    (int32 ``[T, P]``); ``recv_act``, ``recv_grad`` (int32 ``[T, P, 3]``); ``n_act_slots``,
    ``n_grad_slots``, ``n_stash_slots`` (int32 scalars).
    """
    p, T, S = schedule.p, schedule.num_ticks, schedule.num_stages
    tick, place = schedule.tick_of(), schedule.placement
    bwd = backward_kind(schedule.orders)
    out = {
        k: np.full((T, p), -1, np.int32)
        for k in ("kind", "stage", "chunk", "mb", "in_slot", "stash_slot")
    }
    out["kind"][:] = 0
    out["send"] = np.zeros((T, p), np.int32)
    out["recv_act"] = np.full((T, p, 3), -1, np.int32)
    out["recv_grad"] = np.full((T, p, 3), -1, np.int32)
    chunk = [schedule.chunk_of(s) for s in range(S)]
    for (kind, s, j), t in tick.items():
        r = place[s]
        out["kind"][t, r], out["stage"][t, r] = KIND_CODE[kind], s
        out["chunk"][t, r], out["mb"][t, r] = chunk[s], j

    # One message per (stage boundary, micro-batch) in each direction. Activation for stage
    # s >= 1 is sent by F(s-1) and read by F(s); the cotangent for stage s < S-1 is sent by
    # B/I(s+1) and read by B/I(s). Each occupies its receiver's slot from the tick after it is
    # sent until the tick that reads it.
    messages = {"act": [], "grad": []}  # type: dict[str, list[tuple[int, int, int, int, Key]]]
    for s in range(S):
        for j in range(schedule.m):
            b = bwd[(s, j)]
            if s > 0:
                messages["act"].append(
                    (place[s - 1], place[s], tick[("F", s - 1, j)], tick[("F", s, j)], ("F", s, j))
                )
            if s < S - 1:
                messages["grad"].append(
                    (
                        place[s + 1],
                        place[s],
                        tick[(bwd[(s + 1, j)], s + 1, j)],
                        tick[(b, s, j)],
                        (b, s, j),
                    )
                )
    counts = {}
    for buf, msgs in messages.items():
        counts[buf] = 0
        for r in range(p):
            mine = [(ts + 1, tr, reader) for src, dst, ts, tr, reader in msgs if dst == r]
            slot_of, n = _colour(mine)
            counts[buf] = max(counts[buf], n)
            for src, dst, ts, tr, reader in msgs:
                if dst != r:
                    continue
                code = send_code(src, dst, p)
                out["send"][ts, src] = code
                out["recv_" + buf][ts, dst, _CHANNEL_OF_SEND[code]] = slot_of[reader]
                out["in_slot"][tr, dst] = slot_of[reader]

    n_stash = 0
    for r in range(p):
        spans = []
        for s in schedule.stages_of(r):
            for j in range(schedule.m):
                last = ("B", s, j) if bwd[(s, j)] == "B" else ("W", s, j)
                spans.append((tick[("F", s, j)] + 1, tick[last], (s, j)))
        slot_of, n = _colour(spans)
        n_stash = max(n_stash, n)
        for (s, j), k in slot_of.items():
            for kind in ("F", "B", "I", "W"):
                if (kind, s, j) in tick:
                    out["stash_slot"][tick[(kind, s, j)], r] = k
    out["n_act_slots"] = np.asarray(counts["act"], np.int32)
    out["n_grad_slots"] = np.asarray(counts["grad"], np.int32)
    out["n_stash_slots"] = np.asarray(n_stash, np.int32)
    return out


def check_slots(schedule: Schedule, arrays: dict[str, np.ndarray]) -> None:
    """Replay ``arrays`` tick by tick as the executor would; raise on any misuse of a slot.

    Checks that every read finds the (stage, micro-batch) it expects, that no write lands on a
    live slot or outside the buffer, that every message has a receiving slot and nothing else
    is received, and that every buffer is empty at the end.
    """
    p, S = schedule.p, schedule.num_stages
    size = {b: int(arrays[f"n_{b}_slots"]) for b in ("act", "grad", "stash")}
    bufs = {b: [[None] * size[b] for _ in range(p)] for b in size}

    def take(buf: str, r: int, k: int, want: tuple[int, int], free: bool, t: int) -> None:
        if not 0 <= k < size[buf] or bufs[buf][r][k] != want:
            raise ScheduleError(f"tick {t} rank {r}: {buf} slot {k} lacks {want}")
        if free:
            bufs[buf][r][k] = None

    def put(buf: str, r: int, k: int, item: tuple[int, int], t: int) -> None:
        if not 0 <= k < size[buf] or bufs[buf][r][k] is not None:
            raise ScheduleError(f"tick {t} rank {r}: {buf} slot {k} is live or out of range")
        bufs[buf][r][k] = item

    kind, stage, mb = arrays["kind"], arrays["stage"], arrays["mb"]
    for t in range(kind.shape[0]):
        expected = {"act": np.full((p, 3), -1), "grad": np.full((p, 3), -1)}
        sent: list[tuple[str, int, int, tuple[int, int]]] = []
        for r in range(p):
            code = int(kind[t, r])
            if code == 0:
                if arrays["send"][t, r] != SEND_NONE:
                    raise ScheduleError(f"tick {t} rank {r}: idle rank sends")
                continue
            k, s, j = CODE_KIND[code], int(stage[t, r]), int(mb[t, r])
            slot, stash = int(arrays["in_slot"][t, r]), int(arrays["stash_slot"][t, r])
            has_input = s > 0 if k == "F" else (k != "W" and s < S - 1)
            if not has_input and slot != -1:
                raise ScheduleError(f"tick {t} rank {r}: {k}{s}.{j} has an input slot")
            if has_input:
                take("act" if k == "F" else "grad", r, slot, (s, j), True, t)
            if k == "F":
                put("stash", r, stash, (s, j), t)
            else:
                take("stash", r, stash, (s, j), k != "I", t)
            if k in ("F", "B", "I") and (0 < s if k != "F" else s < S - 1):
                nxt = s + 1 if k == "F" else s - 1
                dst = schedule.placement[nxt]
                send = int(arrays["send"][t, r])
                if send != send_code(r, dst, p) or _destination(r, send, p) != dst:
                    raise ScheduleError(f"tick {t} rank {r}: wrong send code {send}")
                buf = "act" if k == "F" else "grad"
                ch = _CHANNEL_OF_SEND[send]
                sent.append((buf, dst, int(arrays["recv_" + buf][t, dst, ch]), (nxt, j)))
                expected[buf][dst, ch] = 0
            elif int(arrays["send"][t, r]) != SEND_NONE:
                raise ScheduleError(f"tick {t} rank {r}: send without a message")
        # Messages are filed after every rank has read: a slot read this tick may be reused.
        for buf, dst, k, item in sent:
            put(buf, dst, k, item, t)
        for buf in ("act", "grad"):
            stray = (arrays["recv_" + buf][t] >= 0) & (expected[buf] < 0)
            if stray.any():
                raise ScheduleError(f"tick {t}: {buf} receive slot without a message")
    for buf, per_rank in bufs.items():
        if any(x is not None for row in per_rank for x in row):
            raise ScheduleError(f"{buf} buffer not empty at the end of the step")
