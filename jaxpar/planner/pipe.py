"""Pipeline figures for the planner, from the schedule library (cached, extrapolated in m).

The planner needs, per (schedule, p, m, v): the lock-step bubble fraction (jaxpar's executor
runs the tick table in lock step), the number of ticks (one point-to-point exchange each) and the
peak number of stashed (stage, micro-batch) activations on the busiest rank. Building a schedule
with many micro-batches costs tens of milliseconds, so figures for ``m`` beyond ``2p`` are
extrapolated from ``m0 = 2p + m mod p``: past the warm-up the steady phase repeats, so each extra
period of ``p`` micro-batches adds a fixed makespan and tick count (measured from the exact
figures at ``m0`` and ``m0 + p``: lock-step ticks last as long as their slowest action, so the
steady increment is not just the work), while the fill/drain idle time and the peak stash count
stay fixed (GPipe's peak, m·v, is the exception). Tested against exact figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from jaxpar.errors import ConfigError
from jaxpar.pipeline.generators import check_arguments
from jaxpar.pipeline.schedules import make_schedule

WORK_PER_MB = 3.0  # f + i + w (or f + b) per micro-batch per rank, in forward units


@dataclass(frozen=True)
class PipeFigures:
    """What the cost model takes from a schedule."""

    bubble_fraction: float  # idle share of the step (lock-step table, or asynchronous)
    makespan_over_busy: float  # lock-step makespan / per-rank busy time (1 / (1 - bubble))
    ticks: int  # lock-step ticks (each carries one p2p exchange per rank)
    peak_stashes: int  # most (stage, micro-batch) activations alive on one rank
    extrapolated: bool


def schedule_error(kind: str, p: int, m: int, v: int) -> str | None:
    """One-line reason the schedule library refuses (kind, p, m, v), else None."""
    try:
        check_arguments(kind, p, m, v)
    except ConfigError as e:
        return str(e)
    return None


@lru_cache(maxsize=4096)
def _exact(kind: str, p: int, m: int, v: int, lockstep: bool) -> tuple[float, int, int]:
    sched = make_schedule(kind, p, m, v)
    st = sched.stats(f=1.0, i=1.0, w=1.0)
    makespan = st.lockstep_makespan if lockstep else st.makespan
    return makespan, st.lockstep_ticks, max(st.peak_inflight)


@lru_cache(maxsize=65536)
def figures(
    kind: str, p: int, m: int, v: int, exact: bool = False, lockstep: bool = True
) -> PipeFigures:
    """Figures of schedule ``kind`` with ``p`` ranks, ``m`` micro-batches, ``v`` chunks per rank.

    ``lockstep``: time the tick table as jaxpar's executor runs it (each tick as long as its
    slowest action); ``False`` gives the asynchronous (event-driven) makespan other frameworks
    approach, used when comparing with published results.

    ``p == 1`` (no pipeline): no bubble, one tick per micro-batch, one stash at a time.
    Raises :class:`ConfigError` for combinations the library refuses.
    """
    if p == 1:
        return PipeFigures(0.0, 1.0, m, 1, False)
    check_arguments(kind, p, m, v)
    m0 = m if exact or m <= 2 * p else 2 * p + m % p
    makespan, ticks, peak = _exact(kind, p, m0, v, lockstep)
    extra = m - m0
    if extra:
        mk2, t2, _ = _exact(kind, p, m0 + p, v, lockstep)
        makespan += (mk2 - makespan) * extra / p
        ticks += round((t2 - ticks) * extra / p)
    if kind == "gpipe":
        peak = m * v
    busy = m * WORK_PER_MB
    return PipeFigures(1.0 - busy / makespan, makespan / busy, ticks, peak, extra > 0)
