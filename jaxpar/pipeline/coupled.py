"""The lock-step makespan of jaxpar's executor, its ranks coupled where the tick sends.

The executor's tick is two phases and its sends (:mod:`jaxpar.pipeline.executor`): the
backward phase (``B``, ``I``, ``W``, or the last stage's ``FB``: forward, backward, head and
loss of one micro-batch), the forward phase (``F``), then the input cotangent's send and the
activation's. A send is a collective-permute, and a send/receive pair moves data once both ends
have reached it, so each send holds a rank until the ranks it sends to and receives from (that
tick's pairs) have reached it. A tick thus lasts as long as the slowest rank of each exchange;
a rank that exchanges with no one in a tick is not held by it, so the makespan is at most
:func:`jaxpar.pipeline.timing.stats`' lock-step one (every tick as long as its slowest rank).

A send waited for between the phases instead (the executor's earlier cotangent) held each
rank's forward until its neighbours' backward phases had ended, the last stage's ``FB`` the
longest of them, so a tick lasted longer than its slowest rank (BENCHMARKS.md, "Pipeline ranks
walked side by side").

The time model of the compiled program walks the ranks the same way (:mod:`jaxpar.gpu.ranks`);
this module gives the planner the makespan from the table alone. Costs are
:func:`jaxpar.pipeline.timing.stats`' (per full stage, a chunk ``1/v`` of it; ``head`` on the
last stage's forward and backward), but where the last stage runs plain ``F`` actions (GPipe,
lean 1F1B, the zero-bubble schedules: :attr:`StepTables.head_in_forward`) the executor runs
the head's forward and backward inside that ``F`` (``value_and_grad`` of the loss), so the
whole head lands on it; transfer times are not part of it (the planner prices the sends
apart).
"""

from __future__ import annotations

import numpy as np

from jaxpar.pipeline.step_tables import StepTables
from jaxpar.pipeline.tables import B_FULL, B_INPUT, B_WEIGHT, F_FB, F_RUN


def phase_costs(tables: StepTables, f: float, b: float, i: float, w: float,
                head: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``[T, P]`` seconds of each tick's backward phase and forward phase on each rank."""
    t, v, last = tables.table, tables.schedule.v, tables.last_stage
    f, b, i, w = f / v, b / v, i / v, w / v
    if tables.head_in_forward:  # a plain F on the last stage runs the head's forward and backward
        head = (head[0] + head[1], 0.0)
    kinds = [t.b_kind == B_FULL, t.b_kind == B_INPUT, t.b_kind == B_WEIGHT]
    back = np.select(kinds, [b, i, w], 0.0)
    back = back + np.where((t.b_stage == last) & np.isin(t.b_kind, (B_FULL, B_INPUT)), head[1], 0.0)
    back = back + np.where(t.f_kind == F_FB, f + b + head[0] + head[1], 0.0)
    fwd = np.where(t.f_kind == F_RUN, f + np.where(t.f_stage == last, head[0], 0.0), 0.0)
    return back, fwd


def _couple(clock: np.ndarray, pairs) -> np.ndarray:
    """Each rank of ``pairs`` held until its peers reached the send."""
    out = clock.copy()
    for s, d in pairs:
        out[s] = max(out[s], clock[d])
        out[d] = max(out[d], clock[s])
    return out


def coupled_makespan(tables: StepTables, f: float = 1.0, b: float = 2.0, i: float = 1.0,
                     w: float = 1.0, head: tuple[float, float] = (0.0, 0.0)) -> float:  # fmt: skip
    """The step of the tick table with the ranks coupled at every send (module docstring)."""
    back, fwd = phase_costs(tables, f, b, i, w, head)
    clock = np.zeros(back.shape[1])

    def sends(message: str, tick: int) -> None:
        nonlocal clock
        for r in tables.sends:
            if r.message == message:
                clock = _couple(clock, r.pairs_at(tick))

    for t in range(back.shape[0]):
        clock = clock + back[t] + fwd[t]
        sends("grad", t)
        sends("act", t)
    return float(clock.max())
