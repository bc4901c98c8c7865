"""The lock-step makespan of jaxpar's executor, its ranks coupled where the tick sends.

:func:`jaxpar.pipeline.timing.stats` times a tick table as if every tick lasted as long as its
slowest rank's work. The executor's tick is two phases and its sends
(:mod:`jaxpar.pipeline.executor`): the backward phase (``B``, ``I``, ``W``, or the last stage's
``FB``), the forward phase (``F``), then the input cotangent's send and the activation's. A send
is a collective-permute, and a send/receive pair moves data once both ends have reached it, so
each send holds a rank until the ranks it sends to and receives from have reached it: with
the sends at the tick's end, a tick lasts as long as the slowest rank of each exchange (the
lock-step makespan of :func:`jaxpar.pipeline.timing.stats`, where every rank exchanges with
its neighbours).

A cotangent route the executor sends every tick (``SendRoute.every_tick``) starts after the
backward phase instead. Where ``overlap``, it is in flight during the forward: the rank waits
for its peers at the send's end, after its forward. Where XLA:GPU's scheduler places that
send's end before the forward (``overlap=False``: it did on the GPU grid's pp 4 rows, programs
near the device's memory, BENCHMARKS.md), a rank's forward starts only when its neighbours'
backward phases have ended: with the last stage's ``FB`` (forward, backward, head and loss in
one tick) the longest backward phase, its neighbour's forward follows it instead of running
beside it, and a tick lasts longer than its slowest rank. The time model of the compiled
program walks the ranks the same way (:mod:`jaxpar.gpu.ranks`) and sees this; this module gives
the planner the same makespan from the table alone.

Costs are :func:`jaxpar.pipeline.timing.stats`' (per full stage, a chunk ``1/v`` of it; ``head``
on the last stage's forward and backward); transfer times are not part of it (the planner
prices the sends apart).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpar.pipeline.step_tables import StepTables
from jaxpar.pipeline.tables import B_FULL, B_INPUT, B_WEIGHT, F_FB, F_RUN


def phase_costs(tables: StepTables, f: float, b: float, i: float, w: float,
                head: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``[T, P]`` seconds of each tick's backward phase and forward phase on each rank."""
    t, v, last = tables.table, tables.schedule.v, tables.last_stage
    f, b, i, w = f / v, b / v, i / v, w / v
    back = np.select(
        [t.b_kind == B_FULL, t.b_kind == B_INPUT, t.b_kind == B_WEIGHT], [b, i, w], 0.0
    )
    back = back + np.where((t.b_stage == last) & np.isin(t.b_kind, (B_FULL, B_INPUT)), head[1], 0.0)
    back = back + np.where(t.f_kind == F_FB, f + b + head[0] + head[1], 0.0)
    fwd = np.where(t.f_kind == F_RUN, f + np.where(t.f_stage == last, head[0], 0.0), 0.0)
    return back, fwd


def _pairs(route, tick: int, every: bool) -> tuple[tuple[int, int], ...]:
    if every:
        return route.pairs
    k = int(route.index[tick])
    return route.pair_sets[k - 1] if k > 0 else ()


def _couple(clock: np.ndarray, pairs, ready: np.ndarray | None = None) -> np.ndarray:
    """Each rank of ``pairs`` held until its peers reached the send (``ready``: when they
    did, default ``clock``)."""
    ready = clock if ready is None else ready
    out = clock.copy()
    for s, d in pairs:
        out[s] = max(out[s], ready[d])
        out[d] = max(out[d], ready[s])
    return out


def coupled_makespan(tables: StepTables, f: float = 1.0, b: float = 2.0, i: float = 1.0,
                     w: float = 1.0, head: tuple[float, float] = (0.0, 0.0),
                     overlap: bool = True, every_tick: bool = True) -> float:  # fmt: skip
    """The step of the tick table with the ranks coupled at every send (module docstring);
    ``every_tick``: whether the executor sends its every-tick route so (it does not where the
    stage's forward runs collectives of its own: every route is then sent by the table)."""
    back, fwd = phase_costs(tables, f, b, i, w, head)
    routes = tables.sends
    if not every_tick:
        routes = tuple(dataclasses.replace(r, every_tick=False) for r in routes)
    clock = np.zeros(back.shape[1])
    for t in range(back.shape[0]):
        clock = clock + back[t]
        pending = None  # the every-tick route, in flight during the forward
        for r in routes:
            if r.message == "grad" and r.every_tick:
                if overlap:
                    pending = (r.pairs, clock.copy())
                else:
                    clock = _couple(clock, r.pairs)
        clock = clock + fwd[t]
        if pending is not None:  # its end: the peers have started it
            clock = _couple(clock, pending[0], pending[1])
        for message in ("grad", "act"):  # the tick's end: the table's sends
            for r in routes:
                if r.message == message and not r.every_tick:
                    clock = _couple(clock, _pairs(r, t, False))
    return float(clock.max())
