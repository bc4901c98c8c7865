"""The planner: one cost model of jaxpar's train step, a search over runnable layouts, and the
published runs it is checked against.

The cost model — what ``jaxpar plan``, ``jaxpar memory``, ``jaxpar bench`` and the tests all
call: :mod:`~jaxpar.planner.shapes` (per-tensor parameter shards from the model's descriptor and
the trainer's rules), :mod:`~jaxpar.planner.activations` (residuals per remat policy and
attention kernel), :mod:`~jaxpar.planner.footprint` (per-device bytes),
:mod:`~jaxpar.planner.traffic` (bytes per collective), :mod:`~jaxpar.planner.pipe` (the one
adapter to the schedule library), :mod:`~jaxpar.planner.hardware` (matmul efficiency, links,
NICs), :mod:`~jaxpar.planner.cost` (step time), :mod:`~jaxpar.planner.frameworks` (what the
program does). Around it: :mod:`~jaxpar.planner.search` (candidates through
``validation.check_layout``), :mod:`~jaxpar.planner.explain` (JSON and text),
:mod:`~jaxpar.planner.recommend` (``plan`` and ``cost_layout``), :mod:`~jaxpar.planner.published`
(large runs, fit and held out), :mod:`~jaxpar.planner.calibrate` (``bench --calibrate``).
"""

from jaxpar.planner.recommend import check_hardware, cost_layout, plan

__all__ = ["check_hardware", "cost_layout", "plan"]
