"""The workload a layout is costed for: a leaf module every planner module may import.

:class:`Shape` (global batch × sequence) is shared by the memory, traffic and time models; it
lives here, apart from all of them, so that none of them imports another for a type.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpar.config import LayoutConfig

# What a plan assumes when neither the mesh file's ``train:`` section nor the command line
# states the workload (``jaxpar.config.TrainConfig``'s defaults: a laptop-sized run).
DEFAULT_WORKLOAD_NOTE = "jaxpar's training default"


@dataclass(frozen=True)
class Shape:
    """The workload a layout is costed for."""

    global_batch: int
    seq: int

    def microbatch_size(self, lay: LayoutConfig) -> int:
        """Sequences per micro-batch per dp rank (0 when it does not divide)."""
        per_dp, r = divmod(self.global_batch, lay.dp)
        if r or per_dp % lay.microbatches:
            return 0
        return per_dp // lay.microbatches
