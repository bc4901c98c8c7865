"""Pipeline schedules as tables: ``make_schedule``, lock-step simulation, validation.

Vocabulary
----------
* ``p`` ranks (pipeline devices), ``m`` micro-batches, ``v`` virtual stages (chunks) per rank;
  the model is cut into ``S = p * v`` *global virtual stages* ``s = 0 .. S-1``.
* An :class:`~jaxpar.pipeline.types.Action` (the data model: :mod:`jaxpar.pipeline.types`)
  is ``F`` (forward), ``B`` (full backward), ``I`` (input-gradient backward) or ``W``
  (weight-gradient backward) of one stage on one micro-batch; text form ``F3.5`` is the
  forward of stage 3 on micro-batch 5. Each (stage, micro-batch) gets either one ``B`` or one
  ``I`` followed (later, same rank) by one ``W``.
* ``placement[s]`` is the rank holding stage ``s``: standard ``s`` (v = 1), interleaved
  (Megatron) ``s mod p``, V-shaped (ZB-V, DualPipeV; v = 2) rank ``r`` holds ``r`` and
  ``2p-1-r``, so stages ``p-1`` and ``p`` sit on the same rank and that hop is local.
* ``steps[r]`` is what rank ``r`` executes, strictly in that order: each step is one action,
  or a *fused* pair — a forward and a backward (``B``/``I``) that share one tick, run in the
  order written: the backward first unless it is the last stage's own micro-batch (``FB``).
  ``orders[r]`` is the same work flattened to actions (what asynchronous timing runs).
* ``ticks[r][t]`` is the lock-step table derived from the steps: at tick ``t`` a rank runs its
  next step if every dependency on another action ran at a tick ``< t`` (data sent during tick
  ``t-1`` is there at tick ``t``) or precedes it in the same step (the last stage's backward
  after its own forward), otherwise it idles (an empty tuple). A cell is a tuple of the tick's
  actions in the order they run. This table is what the SPMD executor scans over; see
  :mod:`jaxpar.pipeline.tables` for its integer-array form.
* ``memory``: ``"fast"`` (fused ticks, the asynchronous makespan) or ``"lean"`` (stashes
  capped at ``p - r``, a longer lock step); see :mod:`jaxpar.pipeline.generators`.

Dependencies: ``F(s,j)`` after ``F(s-1,j)``; ``B/I(s,j)`` after ``F(s,j)`` and after
``B/I(s+1,j)`` (the last stage starts its backward from its own loss); ``W(s,j)`` after
``I(s,j)``.

What DualPipeV models: DeepSeek's cut-in-half DualPipe (V placement, v = 2). Its steady phase
overlaps the forward of one chunk with the full backward of the other on one rank (to hide
expert-parallel all-to-all); here such an overlapped pair is two consecutive actions, forward
first. Backwards in the zero-bubble phases are split into ``I`` and a deferred ``W`` (weights
drained FIFO, as DualPipeV's weight-gradient queue does); the others are full ``B``.

ZB-H1 memory: the paper keeps 1F1B's peak of ``p`` stashes (rank 0's), but because every rank
defers its ``W`` by ``p-1`` micro-batches, every rank reaches ``p`` (1F1B: ``p-r`` on rank r).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxpar.pipeline.generators import KINDS, V_SHAPED, check_arguments, generator, placement_for
from jaxpar.pipeline.types import Action, Cell, Kind, Schedule, ScheduleError, Step

__all__ = [
    "KINDS", "V_SHAPED", "Action", "Cell", "Kind", "Schedule", "ScheduleError", "Step",
    "forward_schedule", "lockstep", "make_schedule", "validate",
]  # fmt: skip


_SENDS_DX = (Kind.B, Kind.I)  # the backward pieces that send the stage's input cotangent
_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W
_new = tuple.__new__


def backward_kind(orders: Sequence[Sequence[Action]]) -> dict[tuple[int, int], Kind]:
    """For each (stage, mb), the action that sends its input cotangent: ``B`` or ``I``."""
    return {(a.stage, a.mb): a.kind for row in orders for a in row if a.kind in _SENDS_DX}


def dependencies(a: Action, num_stages: int, bwd: dict[tuple[int, int], Kind]) -> list[Action]:
    """Actions that must finish before ``a`` may start (data and same-micro-batch order)."""
    kind, s, j = a
    # Built with tuple.__new__ (see Action.of): this runs for every action of every walk.
    if kind == _F:
        return [_new(Action, (_F, s - 1, j))] if s > 0 else []
    if kind == _W:
        return [_new(Action, (_I, s, j))]
    deps = [_new(Action, (_F, s, j))]
    if s < num_stages - 1:
        deps.append(_new(Action, (bwd.get((s + 1, j), _B), s + 1, j)))
    return deps


def check_cell(cell: Sequence[Action], where: str) -> None:
    """A tick's work on one rank: one action, or one forward and one backward piece in either
    order (whether the order respects the dependencies is :func:`validate`'s check)."""
    kinds = sorted(a.kind == Kind.F for a in cell)
    if len(cell) > 2 or (len(cell) == 2 and kinds != [False, True]):
        raise ScheduleError(
            f"{where}: a tick holds one action or a forward and a backward, not "
            f"{[a.kind for a in cell]}"
        )


def lockstep(steps: Sequence[Sequence[Cell]], num_stages: int) -> list[list[Cell]]:
    """Lock-step table of ``steps``: each tick every rank runs its next step if it is ready.

    A step is ready at tick ``t`` when each dependency of each action ran at a tick ``< t``
    or precedes that action in the same step.
    """
    p = len(steps)
    bwd = backward_kind([[a for st in row for a in st] for row in steps])
    done: dict[Action, int] = {}
    ptr, rows = [0] * p, [[] for _ in range(p)]  # type: list[int], list[list[Cell]]
    remaining, t = sum(len(o) for o in steps), 0
    while remaining:
        ready = []
        for r in range(p):
            if ptr[r] < len(steps[r]):
                step = steps[r][ptr[r]]
                deps = [d for i, a in enumerate(step) for d in dependencies(a, num_stages, bwd)
                        if d not in step[:i]]  # fmt: skip
                if all(done.get(d, t) < t for d in deps):
                    ready.append((r, tuple(step)))
        if not ready:
            waiting = [
                "+".join(map(str, steps[r][ptr[r]])) for r in range(p) if ptr[r] < len(steps[r])
            ]
            raise ScheduleError(f"deadlock at tick {t}: ranks wait on {', '.join(waiting)}")
        for row in rows:
            row.append(())
        for r, step in ready:
            rows[r][t] = step
            for a in step:
                done[a] = t
            ptr[r] += 1
        remaining -= len(ready)
        t += 1
    return rows


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is complete, placed and causal.

    Checks every dependency across ticks (strictly earlier) and inside a fused tick, in the
    order the tick runs its two actions (an action may use only what precedes it in its own
    tick: the last stage's backward after its own forward; a backward run before the forward
    of its own micro-batch is refused).
    """
    s_count, m = schedule.num_stages, schedule.m
    if len(schedule.placement) != s_count or len(schedule.steps) != schedule.p:
        raise ScheduleError("placement/steps do not match p*v stages and p ranks")
    for r, row in enumerate(schedule.steps):
        for step in row:
            if not step:
                raise ScheduleError(f"rank {r}: an empty step")
            check_cell(step, f"rank {r}")
    seen: dict[Action, int] = {}
    for r, row in enumerate(schedule.orders):
        for a in row:
            if not (0 <= a.stage < s_count and 0 <= a.mb < m):
                raise ScheduleError(f"rank {r}: action {a} is out of range")
            if schedule.placement[a.stage] != r:
                raise ScheduleError(f"rank {r}: {a} belongs to rank {schedule.placement[a.stage]}")
            if a in seen:
                raise ScheduleError(f"action {a} appears twice")
            seen[a] = r
    for s in range(s_count):
        for j in range(m):
            has = {str(k) for k in Kind if Action(k, s, j) in seen}
            if has not in ({"F", "B"}, {"F", "I", "W"}):
                raise ScheduleError(
                    f"stage {s} micro-batch {j}: has {sorted(has)}, needs F and B, or F, I and W"
                )
    rows = schedule.ticks
    if len(rows) != schedule.p or len({len(row) for row in rows}) != 1:
        raise ScheduleError("tick table must have one row per rank, all of one length")
    for r, row in enumerate(rows):
        if tuple(cell for cell in row if cell) != tuple(schedule.steps[r]):
            raise ScheduleError(f"rank {r}: tick table does not follow the rank's steps")
    tick, bwd = schedule.tick_of(), backward_kind(schedule.orders)
    for r, row in enumerate(rows):
        for t, cell in enumerate(row):
            check_cell(cell, f"tick {t} rank {r}")
            for i, a in enumerate(cell):
                same = cell[:i]  # run before it in this tick, same rank
                for d in dependencies(a, s_count, bwd):
                    if tick[d] > t or (tick[d] == t and d not in same):
                        raise ScheduleError(f"{a} at tick {t} needs {d} earlier (tick {tick[d]})")


def make_schedule(
    kind: str, p: int, m: int, v: int | None = None, memory: str = "fast"
) -> Schedule:
    """Build, simulate and validate a schedule.

    ``v`` defaults to 2 for ``interleaved``, ``zbv`` and ``dualpipev`` and to 1 otherwise;
    ``interleaved`` with ``v=1`` is plain 1F1B (as in Megatron). ``memory``: ``"fast"`` or
    ``"lean"`` (1F1B capped at ``p - r`` stashes). Raises :class:`ConfigError` for inputs the
    schedule does not support.
    """
    v = check_arguments(kind, p, m, v, memory)
    steps = tuple(tuple(tuple(step) for step in row) for row in generator(kind, memory)(p, m, v))
    sched = Schedule(kind, p, m, v, placement_for(kind, p, v), steps, memory=memory)
    sched.ticks = tuple(map(tuple, lockstep(sched.steps, sched.num_stages)))
    validate(sched)
    return sched


def forward_schedule(schedule: Schedule) -> Schedule:
    """The forwards of ``schedule`` alone, same placement and order (evaluation)."""
    steps = tuple(tuple((a,) for a in row if a.kind == Kind.F) for row in schedule.orders)
    out = Schedule(f"{schedule.kind}-forward", schedule.p, schedule.m, schedule.v,
                   schedule.placement, steps, memory=schedule.memory)  # fmt: skip
    out.ticks = tuple(map(tuple, lockstep(out.steps, out.num_stages)))
    return out
