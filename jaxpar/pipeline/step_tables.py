"""Everything the executor reads from a layout's schedule, derived once per layout.

:class:`StepTables` holds the schedule and what follows from it alone: the tick table
(:mod:`jaxpar.pipeline.tables`), the send routes (per message kind and ring direction, the
distinct per-tick sets of (source, destination) pairs and each tick's choice among them), the
branch weights the HLO analysis reads (:mod:`jaxpar.pipeline.branches`), the facts that decide
which branches the program has, and the order of the layer stack at rest. Pure NumPy; the
training code caches one per layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from jaxpar.pipeline.branches import BranchWeights
from jaxpar.pipeline.schedules import forward_schedule, make_schedule
from jaxpar.pipeline.tables import (
    F_FB,
    F_RUN,
    SEND_NEXT,
    SEND_PREV,
    TickTable,
    build_table,
    destination,
)
from jaxpar.pipeline.types import Kind, Schedule

Pairs = tuple[tuple[int, int], ...]  # (source rank, destination rank) of one collective-permute


@dataclass(frozen=True, eq=False)
class SendRoute:
    """One message kind in one ring direction: the table sends ``pair_sets[index[t] - 1]`` at
    tick ``t`` (``index[t] == 0``: nothing). The executor sends so, in a switch over the pair
    sets, at the tick's end."""

    message: str  # "act" (the forward's activation) or "grad" (the input cotangent)
    direction: int  # SEND_NEXT or SEND_PREV
    pair_sets: tuple[Pairs, ...]
    index: np.ndarray  # int32 [T]

    def pairs_at(self, tick: int) -> Pairs:
        """The pairs the route sends at ``tick`` (none: ``()``)."""
        k = int(self.index[tick])
        return self.pair_sets[k - 1] if k > 0 else ()


def stage_collectives(tp: int, sp: int, ep: int, zero: int) -> bool:
    """Whether a stage's forward runs collectives of its own (tp, sp, ep, ZeRO-3's gathers):
    the executor then issues every collective of the backward phase before it."""
    return not (tp == sp == ep == 1 and zero < 3)


@dataclass(frozen=True)
class StepTables:
    """A schedule and what the executor derives from it (module docstring)."""

    schedule: Schedule
    n_layers: int

    @staticmethod
    def make(kind: str, p: int, m: int, v: int, n_layers: int, forward_only: bool = False,
             memory: str = "fast") -> StepTables:  # fmt: skip
        """Build the schedule (``ConfigError`` one-liners for bad arguments); ``forward_only``:
        its forwards alone (evaluation)."""
        sched = make_schedule(kind, p, m, v, memory)
        return StepTables(forward_schedule(sched) if forward_only else sched, n_layers)

    @cached_property
    def table(self) -> TickTable:
        """The tick table (``[T, P]`` fields)."""
        return build_table(self.schedule)

    @cached_property
    def rank_rows(self) -> TickTable:
        """The tick table with ranks leading (``[P, T]``): each rank scans its own row."""
        return TickTable(**{k: np.swapaxes(a, 0, 1).copy() for k, a in self.table.arrays().items()},
                         slots=self.table.slots)  # fmt: skip

    @property
    def training(self) -> bool:
        """Whether the table has backward work (else: forward only, the loss)."""
        return self.table.training

    @property
    def last_stage(self) -> int:
        return self.schedule.num_stages - 1

    @cached_property
    def has_fb(self) -> bool:
        """Whether the last stage ever runs its forward and backward in one tick (``FB``)."""
        return bool(np.any(self.table.f_kind == F_FB))

    @cached_property
    def head_in_forward(self) -> bool:
        """Whether the forward phase runs the head: a plain ``F`` on the last stage (GPipe, lean
        1F1B, zero-bubble) or evaluation. A fused table's last stage always runs ``FB``, and a
        head-sized zero out of every forward branch would be copied into the switch's output
        each tick (a ``[V, D]`` buffer at scale)."""
        t = self.table
        return (
            bool(np.any((t.f_kind == F_RUN) & (t.f_stage == self.last_stage))) or not self.training
        )

    @cached_property
    def split_backward(self) -> bool:
        """Whether the schedule splits backwards into ``I`` and ``W`` (zero-bubble)."""
        return Kind.I in self.schedule.kinds()

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

    @cached_property
    def sends(self) -> tuple[SendRoute, ...]:
        """The routes that ever send, activations first, then cotangents; next, then prev."""
        p, out = self.schedule.p, []
        for msg, codes in (("act", self.table.f_send), ("grad", self.table.b_send)):
            for d in (SEND_NEXT, SEND_PREV):
                per_tick = [
                    tuple((r, destination(r, d, p)) for r in range(p) if codes[t, r] == d)
                    for t in range(codes.shape[0])
                ]
                sets = sorted({s for s in per_tick if s})
                if sets:
                    idx = np.array([sets.index(s) + 1 if s else 0 for s in per_tick], np.int32)
                    out.append(SendRoute(msg, d, tuple(sets), idx))
        return tuple(out)

    @cached_property
    def weights(self) -> BranchWeights:
        """How often each branch of the tick's conditionals runs (for the HLO analysis)."""
        return BranchWeights.of(self.table, self.last_stage, [r.index for r in self.sends])
