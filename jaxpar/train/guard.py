"""Where the survival helpers used to live; each now has a module of its own.

:mod:`jaxpar.train.preempt` (:class:`StopRequest`, :func:`resume_command`),
:mod:`jaxpar.train.nonfinite` (:class:`Divergence`, :func:`nonfinite_leaves`,
:func:`write_nonfinite_report`, :func:`inject_nonfinite`) and :mod:`jaxpar.train.tensorboard`
(:class:`TensorBoard`). These names stay importable from here for existing code.
"""

from __future__ import annotations

from jaxpar.train.nonfinite import (
    Divergence,
    inject_nonfinite,
    nonfinite_leaves,
    write_nonfinite_report,
)
from jaxpar.train.preempt import StopRequest, resume_command
from jaxpar.train.tensorboard import TensorBoard

__all__ = [
    "Divergence",
    "StopRequest",
    "TensorBoard",
    "inject_nonfinite",
    "nonfinite_leaves",
    "resume_command",
    "write_nonfinite_report",
]
