"""The schedule data model: action kinds, the one action type, and a schedule's tables.

A leaf module (it imports nothing of jaxpar): generators build these values,
:mod:`jaxpar.pipeline.schedules` simulates and validates them, :mod:`jaxpar.pipeline.timing`
costs them, :mod:`jaxpar.pipeline.tables` turns them into the executor's integer table and
:mod:`jaxpar.pipeline.render` draws them.

Vocabulary: ``p`` ranks (pipeline devices), ``m`` micro-batches, ``v`` virtual stages (chunks)
per rank; the model is cut into ``S = p * v`` global virtual stages ``s = 0 .. S-1``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple


class ScheduleError(ValueError):
    """A schedule table breaks a rule (a bug in a generator, or a hand-made table)."""


class Kind(str, enum.Enum):
    """What an action computes for one (stage, micro-batch). A ``str`` enum, so ``"F"`` and
    ``Kind.F`` compare and hash alike (tables written by hand stay readable)."""

    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # input-gradient half of a split backward (zero-bubble)  # noqa: E741
    W = "W"  # weight-gradient half, after the I of the same (stage, micro-batch)

    def __str__(self) -> str:
        return self.value


class Action(NamedTuple):
    """One unit of pipeline work: ``kind`` of global virtual ``stage`` on micro-batch ``mb``.

    Text form ``F3.5``: the forward of stage 3 on micro-batch 5. Also the key of every
    per-action map (ticks, timings): a named tuple, so it hashes, compares and orders as
    ``(kind, stage, mb)`` at tuple speed (schedules of thousands of actions are built in the
    planner's inner loop). ``kind`` is a :class:`Kind`; a plain ``"F"`` compares the same.
    """

    kind: Kind
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"

    @staticmethod
    def parse(text: str) -> Action:
        """Inverse of ``str``: ``"I3.5"`` -> ``Action(Kind.I, 3, 5)``."""
        stage, mb = text[1:].split(".")
        return Action(Kind(text[0]), int(stage), int(mb))

    def of(self, kind: Kind, stage: int | None = None) -> Action:
        """The action of ``kind`` on the same micro-batch (and stage, unless given)."""
        # tuple.__new__ directly: a named tuple's own constructor is a Python function, and
        # dependency walks build hundreds of thousands of these.
        return _tuple_new(Action, (kind, self.stage if stage is None else stage, self.mb))


_tuple_new = tuple.__new__


# One rank's work in one tick: (), (a,), or a forward and a backward in the order they run.
Cell = tuple[Action, ...]
Step = Cell  # one step of a rank's order: one action, or a fused forward and backward


@dataclass
class Schedule:
    """A pipeline schedule: placement, per-rank steps (fused ticks) and the lock-step table.

    * ``placement[s]`` is the rank holding stage ``s``: standard ``s`` (v = 1), interleaved
      (Megatron) ``s mod p``, V-shaped (ZB-V, DualPipeV; v = 2) rank ``r`` holds ``r`` and
      ``2p-1-r``.
    * ``steps[r]`` is what rank ``r`` executes, strictly in that order: one action per step,
      or a fused pair (a forward and a backward sharing a tick, in the order they run).
    * ``ticks[r][t]`` is the lock-step table derived from the steps
      (:func:`jaxpar.pipeline.schedules.lockstep`); an idle tick is an empty cell.
    * ``memory``: ``"fast"`` (fused ticks) or ``"lean"`` (stashes capped at ``p - r``).
    """

    kind: str
    p: int
    m: int
    v: int
    placement: tuple[int, ...]  # global stage -> rank
    steps: tuple[tuple[Cell, ...], ...]  # per rank, in execution order
    ticks: tuple[tuple[Cell, ...], ...] = field(default=())  # [rank][tick]
    memory: str = "fast"

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

    def tick_of(self) -> dict[Action, int]:
        """Tick at which each action runs in the lock-step table."""
        return {a: t for row in self.ticks for t, cell in enumerate(row) for a in cell}

    def kinds(self) -> set[Kind]:
        """The action kinds the schedule runs."""
        return {a.kind for row in self.orders for a in row}
