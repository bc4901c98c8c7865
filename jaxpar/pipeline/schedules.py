"""Pipeline schedules as tables: data model, ``make_schedule``, lock-step simulation, validation.

Vocabulary
----------
* ``p`` ranks (pipeline devices), ``m`` micro-batches, ``v`` virtual stages (chunks) per rank;
  the model is cut into ``S = p * v`` *global virtual stages* ``s = 0 .. S-1``.
* An :class:`Action` is ``F`` (forward), ``B`` (full backward), ``I`` (input-gradient backward)
  or ``W`` (weight-gradient backward) of one stage on one micro-batch; text form ``F3.5`` is the
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxpar.pipeline.generators import (
    KINDS,
    V_SHAPED,
    Key,
    Step,
    check_arguments,
    generator,
    placement_for,
)

if TYPE_CHECKING:
    import numpy as np

    from jaxpar.pipeline.timing import ScheduleStats

__all__ = [
    "KINDS", "V_SHAPED", "Action", "Cell", "Schedule", "ScheduleError", "Step", "make_schedule",
    "validate",
]  # fmt: skip

ACTION_KINDS = ("F", "B", "I", "W")


class ScheduleError(ValueError):
    """A schedule table breaks a rule (a bug in a generator, or a hand-made table)."""


@dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work: ``kind`` of global virtual ``stage`` on micro-batch ``mb``."""

    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"

    @staticmethod
    def parse(text: str) -> Action:
        """Inverse of ``str``: ``"I3.5"`` -> ``Action("I", 3, 5)``."""
        stage, mb = text[1:].split(".")
        return Action(text[0], int(stage), int(mb))


Cell = tuple[Action, ...]  # one rank's work in one tick: (), (a,), (F, backward), (backward, F)


@dataclass
class Schedule:
    """A pipeline schedule: placement, per-rank steps (fused ticks) and the lock-step table."""

    kind: str
    p: int
    m: int
    v: int
    placement: tuple[int, ...]  # global stage -> rank
    steps: tuple[tuple[Cell, ...], ...]  # per rank, in execution order
    ticks: tuple[tuple[Cell, ...], ...] = field(default=())  # [rank][tick]
    memory: str = "fast"  # "fast" or "lean" (see the generators module)

    @property
    def orders(self) -> tuple[tuple[Action, ...], ...]:
        """Per rank, the actions in execution order (the steps flattened)."""
        return tuple(tuple(a for step in row for a in step) for row in self.steps)

    @property
    def num_stages(self) -> int:
        """Global virtual stages ``p * v``."""
        return self.p * self.v

    @property
    def num_ticks(self) -> int:
        """Length of the lock-step table."""
        return len(self.ticks[0]) if self.ticks else 0

    def stages_of(self, rank: int) -> list[int]:
        """Stages held by ``rank``, ascending; a stage's index here is its local chunk."""
        return [s for s, r in enumerate(self.placement) if r == rank]

    def chunk_of(self, stage: int) -> int:
        """Local chunk index of ``stage`` on its rank."""
        return self.stages_of(self.placement[stage]).index(stage)

    def tick_of(self) -> dict[Key, int]:
        """Tick at which each action runs in the lock-step table."""
        return {
            (a.kind, a.stage, a.mb): t
            for row in self.ticks
            for t, cell in enumerate(row)
            for a in cell
        }

    def as_arrays(self) -> dict[str, np.ndarray]:
        """Integer arrays for the executor; see :func:`jaxpar.pipeline.tables.as_arrays`."""
        from jaxpar.pipeline.tables import as_arrays

        return as_arrays(self)

    def stats(self, **costs: float) -> ScheduleStats:
        """Timing statistics; see :func:`jaxpar.pipeline.timing.stats`."""
        from jaxpar.pipeline.timing import stats

        return stats(self, **costs)


def backward_kind(orders: Sequence[Sequence[Action]]) -> dict[tuple[int, int], str]:
    """For each (stage, mb), the action that sends its input cotangent: ``"B"`` or ``"I"``."""
    return {(a.stage, a.mb): a.kind for row in orders for a in row if a.kind in ("B", "I")}


def dependencies(a: Action, num_stages: int, bwd: dict[tuple[int, int], str]) -> list[Key]:
    """Actions that must finish before ``a`` may start (data and same-micro-batch order)."""
    if a.kind == "F":
        return [("F", a.stage - 1, a.mb)] if a.stage > 0 else []
    if a.kind == "W":
        return [("I", a.stage, a.mb)]
    deps: list[Key] = [("F", a.stage, a.mb)]
    if a.stage < num_stages - 1:
        deps.append((bwd.get((a.stage + 1, a.mb), "B"), a.stage + 1, a.mb))
    return deps


def _key(a: Action) -> Key:
    return (a.kind, a.stage, a.mb)


def check_cell(cell: Sequence[Action], where: str) -> None:
    """A tick's work on one rank: one action, or one forward and one backward piece in either
    order (whether the order respects the dependencies is :func:`validate`'s check)."""
    kinds = sorted(a.kind == "F" for a in cell)
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
    done: dict[Key, int] = {}
    ptr, rows = [0] * p, [[] for _ in range(p)]  # type: list[int], list[list[Cell]]
    remaining, t = sum(len(o) for o in steps), 0
    while remaining:
        ready = []
        for r in range(p):
            if ptr[r] < len(steps[r]):
                step = steps[r][ptr[r]]
                deps = [d for i, a in enumerate(step) for d in dependencies(a, num_stages, bwd)
                        if d not in {_key(b) for b in step[:i]}]  # fmt: skip
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
                done[_key(a)] = t
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
    seen: dict[Key, int] = {}
    for r, row in enumerate(schedule.orders):
        for a in row:
            key = (a.kind, a.stage, a.mb)
            if a.kind not in ACTION_KINDS or not (0 <= a.stage < s_count and 0 <= a.mb < m):
                raise ScheduleError(f"rank {r}: action {a} is out of range")
            if schedule.placement[a.stage] != r:
                raise ScheduleError(f"rank {r}: {a} belongs to rank {schedule.placement[a.stage]}")
            if key in seen:
                raise ScheduleError(f"action {a} appears twice")
            seen[key] = r
    for s in range(s_count):
        for j in range(m):
            has = {k for k in ACTION_KINDS if (k, s, j) in seen}
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
                same = {_key(b) for b in cell[:i]}  # run before it in this tick, same rank
                for d in dependencies(a, s_count, bwd):
                    if tick[d] > t or (tick[d] == t and d not in same):
                        raise ScheduleError(
                            f"{a} at tick {t} needs {Action(*d)} earlier (tick {tick[d]})"
                        )


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
    steps = tuple(
        tuple(tuple(Action(*key) for key in step) for step in row)
        for row in generator(kind, memory)(p, m, v)
    )
    sched = Schedule(kind, p, m, v, placement_for(kind, p, v), steps, memory=memory)
    sched.ticks = tuple(map(tuple, lockstep(sched.steps, sched.num_stages)))
    validate(sched)
    return sched
