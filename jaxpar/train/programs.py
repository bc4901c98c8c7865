"""The process's compiled programs, kept for reuse: a trainer that lowers the same program as one
before it in the process (a run resumed in the same process, the same layout run again, a
notebook cell run twice) runs that executable instead of compiling it again.

The key is what decides the executable: the lowered StableHLO text (shapes, shardings, memory
kinds, donation and every constant of the program), the argument and result trees, the devices
in mesh order (platform, kind, process and id) with the mesh's shape and axis names,
``XLA_FLAGS`` and the caller's own figures (the memory limits
:func:`jaxpar.xla_limit.compile_within` compiles under). The program is still traced and
lowered each time; only XLA's compile is saved. A program that passes closed-over constants as
arguments (JAX's ``const_args``: their values are not in the text) is never kept. At most
:data:`KEEP` programs are kept, the least recently used dropped first.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

KEEP = 16  # programs kept per process (host memory: the executables, no device buffers)

_KEPT: OrderedDict[tuple, Any] = OrderedDict()


def key(lowered: Any, mesh: Any, *extra: Hashable) -> tuple | None:
    """What decides the executable of ``lowered`` (a ``jax.stages.Lowered``) on ``mesh``, or
    None where the text does not (``const_args``)."""
    if getattr(getattr(lowered, "_lowering", None), "const_args", None):
        return None
    text = hashlib.sha256(lowered.as_text().encode()).hexdigest()
    devices = tuple((d.platform, d.device_kind, d.process_index, d.id) for d in mesh.devices.flat)
    return (text, str(lowered.in_tree), str(lowered.out_tree), devices, mesh.devices.shape,
            tuple(mesh.axis_names), os.environ.get("XLA_FLAGS", ""), *extra)  # fmt: skip


def compiled(k: tuple | None, compile: Callable[[], Any]) -> Any:
    """The value kept under ``k`` (:func:`key`), else ``compile()``'s, kept (None: not kept)."""
    if k is None:
        return compile()
    if k in _KEPT:
        _KEPT.move_to_end(k)
        return _KEPT[k]
    value = compile()
    _KEPT[k] = value
    while len(_KEPT) > KEEP:
        _KEPT.popitem(last=False)
    return value


def clear() -> None:
    """Drop every kept program."""
    _KEPT.clear()
