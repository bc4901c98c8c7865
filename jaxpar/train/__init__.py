"""Training: the step (:mod:`~jaxpar.train.step`), the loop (:mod:`~jaxpar.train.loop`) and
what lets a run survive (:mod:`~jaxpar.train.guard`).

This package's own namespace imports no JAX: :func:`load_data` also serves ``--dry-run``.
"""

from __future__ import annotations

from typing import Any


def load_data(cfg: Any):
    """The run's corpus (:func:`jaxpar.data.load_corpus`), refused in one line when its
    vocabulary does not fit the model's."""
    from jaxpar.data import load_corpus
    from jaxpar.errors import ConfigError

    t = cfg.train
    corpus = load_corpus(t.data, cfg.model.vocab_size, t.data_dtype)
    if corpus.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size}: smaller than the data's vocabulary "
            f"({corpus.vocab_size})"
        )
    return corpus
