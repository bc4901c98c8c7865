"""The planner: enumerate layouts on a cluster, cost them, recommend one and explain.

Modules: :mod:`~jaxpar.planner.pipe` (schedule-library figures), :mod:`~jaxpar.planner.memory`
(per-device bytes), :mod:`~jaxpar.planner.cost` (step-time terms), :mod:`~jaxpar.planner.search`
(enumeration, pruning, baseline), :mod:`~jaxpar.planner.explain` (JSON and text), and
:mod:`~jaxpar.planner.plan` (the entry points ``plan`` and ``cost_layout``).
"""

from jaxpar.planner.plan import check_hardware, cost_layout, plan

__all__ = ["check_hardware", "cost_layout", "plan"]
