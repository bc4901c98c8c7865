"""Training: the step (:mod:`~jaxpar.train.step`), the run (:mod:`~jaxpar.train.loop`), the
loop's core and its hooks (:mod:`~jaxpar.train.core`, :mod:`~jaxpar.train.hooks`,
:mod:`~jaxpar.train.checkpointing`) and what lets a run survive (:mod:`~jaxpar.train.preempt`,
:mod:`~jaxpar.train.nonfinite`).

This package's own namespace imports no JAX: :func:`load_data` also serves ``--dry-run``.
"""

from __future__ import annotations

from typing import Any


def load_data(cfg: Any):
    """The run's corpus (:func:`jaxpar.data.load_corpus`: token files checked against the
    model's vocabulary in one line)."""
    from jaxpar.data import load_corpus

    t = cfg.train
    return load_corpus(t.data, cfg.model.vocab_size, t.data_dtype, t.eval_data)
