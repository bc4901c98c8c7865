"""Costing a schedule: asynchronous (event-driven) and lock-step timing, bubble, memory.

Costs are per full pipeline stage (``f``, ``b``, ``i``, ``w``; ``b`` defaults to ``i + w``);
a chunk of a schedule with ``v`` virtual stages per rank costs ``1/v`` of that, so every
schedule does the same total work ``m * (f + b)`` per rank and bubbles compare directly.
``head`` (forward, backward) is what the last stage adds to each micro-batch's forward and to
its backward (``B``, or ``I``: the loss's gradient comes first): the output head and loss,
which make the last stage the slowest (the time model of the compiled program walks each
rank's branches and sees it; :mod:`jaxpar.gpu.ranks`).

* Asynchronous: each rank runs its order; an action starts when the rank is free and its
  dependencies have ended (communication is free). ``bubble_fraction`` is
  ``1 - busy / (p * makespan)``; ``span_bubble`` is per rank, over the rank's own span from its
  first start to its last end (zero-bubble schedules make this zero; what remains is the
  ``start_skew`` before the last rank gets its first input).
* Lock-step: the tick table, each tick lasting as long as its slowest rank's work (a fused
  tick's forward and backward add up).
* ``peak_inflight[r]``: most (stage, micro-batch) stashes alive at once on rank ``r`` — from the
  forward until the last backward piece that reads it (``B``, or ``W`` when split) — in the
  rank's order. ``peak_stashes[r]``: the same in the lock-step table, each tick's actions in
  the order the executor runs them: a tick that runs a backward and then a forward frees the
  backward's stash before the forward makes one; the last stage's forward and backward of one
  micro-batch (``FB``) hold its residuals within the tick. This is what the executor holds:
  its stash buffer has ``max(peak_stashes)`` slots, bar the ``FB`` ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from jaxpar.pipeline.schedules import backward_kind, dependencies
from jaxpar.pipeline.types import Action, Kind, Schedule, ScheduleError


@dataclass(frozen=True)
class ScheduleStats:
    """Timing and memory figures of one schedule under one cost model."""

    makespan: float
    bubble_fraction: float
    span_bubble: list[float]  # per rank, over the rank's first-start..last-end span
    start_skew: float  # last rank's first start minus the first rank's
    busy_per_rank: float
    lockstep_ticks: int
    lockstep_makespan: float
    lockstep_bubble_fraction: float
    peak_inflight: list[int]
    peak_stashes: list[int]

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (for JSON)."""
        return asdict(self)


def action_costs(
    schedule: Schedule, f: float = 1.0, b: float | None = None, i: float = 1.0, w: float = 1.0
) -> dict[str, float]:
    """Per-chunk cost of each action kind: the stage costs divided by ``v``."""
    b = i + w if b is None else b
    return {k: c / schedule.v for k, c in (("F", f), ("B", b), ("I", i), ("W", w))}


def simulate_async(
    schedule: Schedule, costs: dict[str, float] | Callable[[Action], float]
) -> dict[Action, tuple[float, float]]:
    """Event-driven timing: ``(start, end)`` of every action, ranks in their own order;
    ``costs`` per action kind, or a function of the action."""
    cost = costs if callable(costs) else (lambda a: costs[a.kind])
    orders, p = schedule.orders, schedule.p
    bwd = backward_kind(orders)
    times: dict[Action, tuple[float, float]] = {}
    ptr, free = [0] * p, [0.0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            # Advance rank r as far as its dependencies are already timed; a rank can only
            # wait on actions of other ranks, which later sweeps resolve.
            while ptr[r] < len(orders[r]):
                a = orders[r][ptr[r]]
                deps = dependencies(a, schedule.num_stages, bwd)
                if any(d not in times for d in deps):
                    break
                start = max([free[r]] + [times[d][1] for d in deps])
                free[r] = start + cost(a)
                times[a] = (start, free[r])
                ptr[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError("orders deadlock under asynchronous timing")
    return times


def peak_inflight(schedule: Schedule) -> list[int]:
    """Most stashes alive at once per rank (forward run, last backward piece not yet)."""
    return _peaks(schedule.orders, schedule)


def peak_stashes(schedule: Schedule) -> list[int]:
    """Most stashes alive at once in the lock-step table, per rank (module docstring)."""
    return _peaks([[a for cell in row for a in cell] for row in schedule.ticks], schedule)


def _peaks(rows, schedule: Schedule) -> list[int]:
    """Per rank, the most stashes alive while ``rows[r]``'s actions run in that order: a
    forward makes one, the last backward piece (``B``, or ``W`` after ``I``) frees it once it
    has run."""
    bwd = backward_kind(schedule.orders)
    peaks = []
    for row in rows:
        live = peak = 0
        for a in row:
            if a.kind == Kind.F:
                live += 1
            peak = max(peak, live)
            if a.kind == Kind.W or (a.kind == Kind.B and bwd[(a.stage, a.mb)] == Kind.B):
                live -= 1
        peaks.append(peak)
    return peaks


def stats(
    schedule: Schedule,
    f: float = 1.0,
    b: float | None = None,
    i: float = 1.0,
    w: float = 1.0,
    head: tuple[float, float] = (0.0, 0.0),
) -> ScheduleStats:
    """Asynchronous and lock-step statistics of ``schedule`` (see the module docstring)."""
    kinds = action_costs(schedule, f, b, i, w)
    head_stage = schedule.num_stages - 1
    extra = {Kind.F: head[0], Kind.B: head[1], Kind.I: head[1]}

    def cost(a: Action) -> float:
        return kinds[a.kind] + (extra.get(a.kind, 0.0) if a.stage == head_stage else 0.0)

    times = simulate_async(schedule, cost)
    busy = [sum(cost(a) for a in row) for row in schedule.orders]
    makespan = max(end for _, end in times.values())
    firsts, spans = [], []
    for r, row in enumerate(schedule.orders):
        first = times[row[0]][0]
        last = times[row[-1]][1]
        firsts.append(first)
        spans.append(1.0 - busy[r] / (last - first))
    tick_len = [
        max(sum(cost(a) for a in cell) for cell in col) for col in zip(*schedule.ticks, strict=True)
    ]
    lock_makespan = sum(tick_len)
    total_busy = sum(busy)
    return ScheduleStats(
        makespan=makespan,
        bubble_fraction=1.0 - total_busy / (schedule.p * makespan),
        span_bubble=spans,
        start_skew=max(firsts) - min(firsts),
        busy_per_rank=max(busy),
        lockstep_ticks=schedule.num_ticks,
        lockstep_makespan=lock_makespan,
        lockstep_bubble_fraction=1.0 - total_busy / (schedule.p * lock_makespan),
        peak_inflight=peak_inflight(schedule),
        peak_stashes=peak_stashes(schedule),
    )
