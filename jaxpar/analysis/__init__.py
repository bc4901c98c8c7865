"""Analysis: closed-form costs (:mod:`.theory`) and measurement of compiled programs (:mod:`.hlo`).

``theory`` is pure Python (memory, communication, FLOPs, bubble formulas with their sources);
``hlo`` reads XLA's optimized HLO text and memory analysis of a compiled JAX program.
"""
