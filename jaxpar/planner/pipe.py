"""The planner's one adapter to the schedule library (:mod:`jaxpar.pipeline`).

Everything the cost model knows about a pipeline comes from the library's own tables and timing
functions, called here with the real per-action costs: the lock-step makespan (the ranks coupled
at each tick's sends, which is how jaxpar's executor runs the table:
:mod:`jaxpar.pipeline.coupled`) or the asynchronous one (other frameworks' runtimes), the
ticks, the messages each rank sends, the peak stashes per rank and the executor's buffer slots.
When the library changes how it builds its tables (fused ticks: one F and one B per rank and
tick), the planner sees the new figures without a model of its own. The library's function
names appear only in :func:`_measure`.

Building a schedule with many micro-batches costs tens of milliseconds, so figures for ``m``
beyond ``2p`` are extrapolated from ``m0 = 2p + m mod p``: past the warm-up the steady phase
repeats, so each extra period of ``p`` micro-batches adds a fixed makespan, tick count and
message count (measured from the exact figures at ``m0`` and ``m0 + p``), while the fill and
drain and the peak stash count stay fixed (GPipe's peak, m·v, grows: taken as such). Tested
against the exact figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from jaxpar.errors import ConfigError


@dataclass(frozen=True)
class ActionCosts:
    """Time of each action of one full stage (all its layers) in units of its forward F.

    ``b``: a full backward (2, or 3 when the forward is recomputed); ``i``/``w``: the two halves
    of a split backward (input gradient, weight gradient) for zero-bubble schedules; ``head``:
    what the last stage adds to each micro-batch's forward and backward (the output head and
    loss: :func:`jaxpar.pipeline.timing.stats`); ``f``: the forward, 1 but for what the
    executor adds to every forward action (jaxpar's weight casts, :mod:`jaxpar.planner.cost`).
    """

    b: float = 2.0
    i: float = 1.0
    w: float = 1.0
    head: tuple[float, float] = (0.0, 0.0)
    f: float = 1.0  # the forward itself: above 1 where an action carries more than its layers


@dataclass(frozen=True)
class PipeFigures:
    """What the cost model takes from one schedule (times in units of a full stage's F)."""

    makespan: float  # one step of the pipeline, lock-step or asynchronous
    busy: float  # work of the busiest rank (m·(F + B) in these units)
    ticks: int  # rows of the tick table (the executor's scan length)
    sends: int  # point-to-point messages the busiest rank sends per step (each way counted)
    peak_stashes: tuple[int, ...]  # per rank: most (stage, micro-batch) stashes alive at once
    # Message-sized executor buffers: received activations, received cotangents, and the last
    # stage's loss cotangents waiting for their backward.
    slots: tuple[int, int, int]
    extrapolated: bool
    # Split backward (zero-bubble schedules): slots of the weight matmuls' activation operands
    # kept for W (taps) and of their output cotangents filed by I (dys).
    w_slots: tuple[int, int] = (0, 0)
    split: bool = False  # the table splits backwards into I and W

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step on the busiest rank."""
        return 1.0 - self.busy / self.makespan


def schedule_error(kind: str, p: int, m: int, v: int, memory: str = "fast") -> str | None:
    """One-line reason the schedule library refuses (kind, p, m, v, memory), else None."""
    from jaxpar.pipeline.generators import check_arguments

    try:
        check_arguments(kind, p, m, v, memory)
    except ConfigError as e:
        return str(e)
    return None


@lru_cache(maxsize=1024)
def _table(kind: str, p: int, m: int, v: int, memory: str) -> tuple:
    """The schedule and what depends only on its order: ticks, sends, peaks, slots."""
    import numpy as np

    from jaxpar.pipeline.schedules import make_schedule
    from jaxpar.pipeline.step_tables import StepTables
    from jaxpar.pipeline.tables import SEND_LOCAL, SEND_NONE
    from jaxpar.pipeline.timing import stats

    tables = StepTables(make_schedule(kind, p, m, v, memory), p * v)
    sched, table = tables.schedule, tables.table
    remote = sum(
        ((sends != SEND_NONE) & (sends != SEND_LOCAL)).sum(axis=0)
        for sends in (table.f_send, table.b_send)
    )
    slots = (table.slots.act, table.slots.grad, table.slots.cot, table.slots.taps,
             table.slots.dys)  # fmt: skip
    st = stats(sched)
    # Lock-step peaks: what the executor holds (the memory mode's table: lean caps them).
    return tables, st.lockstep_ticks, int(np.max(remote)), tuple(st.peak_stashes), slots


@lru_cache(maxsize=8192)
def _measure(kind: str, p: int, m: int, v: int, costs: ActionCosts, lockstep: bool,
             memory: str) -> tuple:  # fmt: skip
    from jaxpar.pipeline.coupled import coupled_makespan
    from jaxpar.pipeline.timing import stats

    tables, ticks, sends, peaks, slots = _table(kind, p, m, v, memory)
    st = stats(tables.schedule, f=costs.f, b=costs.b, i=costs.i, w=costs.w, head=costs.head)
    if lockstep:  # jaxpar's executor: the ranks coupled at each tick's sends
        makespan = coupled_makespan(tables, costs.f, costs.b, costs.i, costs.w, costs.head)
    else:
        makespan = st.makespan
    return makespan, st.busy_per_rank, ticks, sends, peaks, slots


@lru_cache(maxsize=65536)
def figures(
    kind: str,
    p: int,
    m: int,
    v: int,
    costs: ActionCosts = ActionCosts(),
    lockstep: bool = True,
    exact: bool = False,
    memory: str = "fast",
) -> PipeFigures:
    """Figures of schedule ``kind`` with ``p`` ranks, ``m`` micro-batches, ``v`` chunks per rank.

    ``lockstep``: time the tick table as jaxpar's executor runs it; ``False`` gives the
    asynchronous (event-driven) makespan other frameworks approach. ``memory``: the table's
    memory mode (``"lean"``: 1F1B's stashes capped at ``p - r``). ``p == 1``: no pipeline
    (one stash, no bubble, one tick per micro-batch). Raises :class:`ConfigError` for
    combinations the library refuses.
    """
    if p == 1:
        busy = m * (costs.f + costs.b + sum(costs.head))
        return PipeFigures(busy, busy, m, 0, (1,), (0, 0, 1), False)
    err = schedule_error(kind, p, m, v, memory)
    if err:
        raise ConfigError(err)
    m0 = m if exact or m <= 2 * p else 2 * p + m % p
    # Timing is piecewise linear in the cost ratios: steps of 0.05 keep the cache small (a
    # search costs thousands of layouts whose ratios differ in the third decimal).
    step = lambda x: round(x * 20) / 20  # noqa: E731
    costs = ActionCosts(step(costs.b), step(costs.i), step(costs.w),
                        (step(costs.head[0]), step(costs.head[1])), step(costs.f))  # fmt: skip
    makespan, busy, ticks, sends, peaks, slots = _measure(kind, p, m0, v, costs, lockstep, memory)
    extra = m - m0
    if extra:
        mk2, busy2, t2, s2, _, _ = _measure(kind, p, m0 + p, v, costs, lockstep, memory)
        periods = extra / p
        makespan += (mk2 - makespan) * periods
        busy += (busy2 - busy) * periods
        ticks += round((t2 - ticks) * periods)
        sends += round((s2 - sends) * periods)
    slots, w_slots = slots[:3], slots[3:]
    if kind == "gpipe":  # every forward before any backward: m stashes and loss cotangents
        peaks = tuple(m * v for _ in peaks)
        slots = (*slots[:2], m)
    split = _table(kind, p, m0, v, memory)[0].split_backward
    return PipeFigures(makespan, busy, ticks, sends, peaks, slots, extra > 0, w_slots, split)
