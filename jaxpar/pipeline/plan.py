"""What the executor derives from a schedule: its tick tables, send pair sets, branch weights.

A :class:`Plan` is built once per layout (cached by :func:`jaxpar.pipeline.grads.plan_for`):
the integer tables of :mod:`jaxpar.pipeline.tables`, the per-tick sets of (source, destination)
pairs each ring direction sends, and how often each branch of the tick's switches runs (for
the HLO analysis). :func:`forward_schedule` is the forward-only table evaluation runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from jaxpar.pipeline.schedules import Schedule, lockstep, make_schedule
from jaxpar.pipeline.tables import PER_TICK, SEND_NEXT, SEND_PREV, as_arrays, destination

_ROW_KEYS = (*PER_TICK, "recv_act", "recv_grad")


def forward_schedule(schedule: Schedule) -> Schedule:
    """The forwards of ``schedule`` alone, same placement and order (evaluation)."""
    steps = tuple(tuple((a,) for a in row if a.kind == "F") for row in schedule.orders)
    out = Schedule(f"{schedule.kind}-forward", schedule.p, schedule.m, schedule.v,
                   schedule.placement, steps, memory=schedule.memory)  # fmt: skip
    out.ticks = tuple(map(tuple, lockstep(out.steps, out.num_stages)))
    return out


@dataclass(frozen=True)
class Plan:
    """A schedule and what the executor derives from it."""

    schedule: Schedule
    n_layers: int

    @staticmethod
    def make(kind: str, p: int, m: int, v: int, n_layers: int, forward_only=False,
             memory: str = "fast") -> Plan:  # fmt: skip
        """Build the schedule (``ConfigError`` one-liners for bad arguments)."""
        sched = make_schedule(kind, p, m, v, memory)
        return Plan(forward_schedule(sched) if forward_only else sched, n_layers)

    @cached_property
    def arrays(self) -> dict[str, np.ndarray]:
        """Tick tables (``tables.as_arrays``)."""
        return as_arrays(self.schedule)

    @property
    def training(self) -> bool:
        """Whether the table has backward actions (else: forward only, the loss)."""
        return bool(np.any(self.arrays["b_kind"]))

    @property
    def per_chunk(self) -> int:
        """Layers per virtual stage."""
        return self.n_layers // self.schedule.num_stages

    @cached_property
    def order(self) -> np.ndarray:
        """Canonical layer index at each position of the stack at rest (placement order:
        rank-major, then the rank's chunks, then the chunk's layers)."""
        s, lc = self.schedule, self.per_chunk
        stages = [st for r in range(s.p) for st in s.stages_of(r)]
        return np.array([st * lc + i for st in stages for i in range(lc)], np.int32)

    @property
    def identity(self) -> bool:
        """Whether placement order is canonical order (one stage per rank)."""
        return bool(np.all(self.order == np.arange(self.n_layers)))

    def rank_tables(self) -> dict[str, np.ndarray]:
        """Per-rank rows ``[p, T, ...]`` of the tick table (scanned over ``T`` on each rank)."""
        return {k: np.swapaxes(self.arrays[k], 0, 1).copy() for k in _ROW_KEYS}

    @cached_property
    def sends(self) -> dict[tuple[str, int], tuple[list[tuple], np.ndarray]]:
        """Per (buffer, direction code): the distinct per-tick pair sets and each tick's index
        into them (0: no send this tick)."""
        p, out = self.schedule.p, {}
        for buf, field in (("act", "f_send"), ("grad", "b_send")):
            codes = self.arrays[field]
            for d in (SEND_NEXT, SEND_PREV):
                per_tick = [
                    tuple((r, destination(r, d, p)) for r in range(p) if codes[t, r] == d)
                    for t in range(codes.shape[0])
                ]
                sets = sorted({s for s in per_tick if s})
                if sets:
                    idx = np.array([sets.index(s) + 1 if s else 0 for s in per_tick], np.int32)
                    out[(buf, d)] = (sets, idx)
        return out

    def fraction(self, field: str, n: int, among: np.ndarray | None = None) -> list[float]:
        """How often each value ``0..n-1`` of ``field`` occurs (per device, over ``among``)."""
        a = self.arrays[field] if among is None else self.arrays[field][among]
        total = max(a.size, 1)
        return [float(np.sum(a == k)) / total for k in range(n)]
