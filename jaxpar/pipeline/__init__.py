"""Pipeline parallelism: schedules as typed tables, and the SPMD executor that runs them.

Imports run one way, from the data model up:

* :mod:`~jaxpar.pipeline.types` — the data model (a leaf): :class:`~.types.Kind`,
  :class:`~.types.Action`, :class:`~.types.Schedule`;
* :mod:`~jaxpar.pipeline.generators` — each schedule's per-rank steps and argument rules;
  :mod:`~jaxpar.pipeline.schedules` — ``make_schedule``, the lock-step table, validation;
  :mod:`~jaxpar.pipeline.timing` — costs and bubbles; :mod:`~jaxpar.pipeline.render` — ASCII
  and PNG;
* :mod:`~jaxpar.pipeline.tables` — the executor's input, a frozen
  :class:`~.tables.TickTable` of int32 ``[ticks, ranks]`` fields;
  :mod:`~jaxpar.pipeline.branches` — how often each branch runs (for the HLO analysis);
  :mod:`~jaxpar.pipeline.step_tables` — all of it for one layout;
* :mod:`~jaxpar.pipeline.executor` — the runtime (``shard_map`` + ``lax.scan`` over ticks),
  its typed state in :mod:`~jaxpar.pipeline.carry`, a stage's actions in
  :mod:`~jaxpar.pipeline.stage` (the layer interface) and :mod:`~jaxpar.pipeline.split`;
  :mod:`~jaxpar.pipeline.rest` — how a pipeline layout stores the model at rest.

The package imports neither :mod:`jaxpar.train` nor :mod:`jaxpar.analysis`: the training code
adapts it (:mod:`jaxpar.train.pipeline_run`), the analysis reads its branch scopes.
"""
