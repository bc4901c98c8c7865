"""Pipeline parallelism: schedule tables (pure Python) and, later, the SPMD executor that runs them.

``jaxpar.pipeline.schedules`` builds and validates schedules, ``timing`` costs them,
``tables`` turns them into integer arrays for the executor, ``render`` draws them.
"""
