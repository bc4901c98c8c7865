"""XLA:GPU's memory limit for one compiled step: the mesh file's, or XLA's default where the
program compiled under the mesh's does not fit the device.

XLA:GPU's latency-hiding scheduler and its rematerialization pass plan for
``(device memory - arguments) x slop / 100`` bytes (``--xla_gpu_memory_limit_slop_factor``,
XLA's default 95). The GPU mesh files raise the factor to 300 (docs/pods.md): at 95 the pass,
whose live-memory estimate runs 1.5-1.8x the buffer assignment's on jaxpar's programs, cloned
work into programs that fit without lowering their peak. A higher limit also lets the scheduler
keep more collectives in flight, and those hold buffers: llama2-70b dp 16 x tp 4 + SP ZeRO-3 on
a100-64 compiles to 79.1 GiB at 300 and 72.9 GiB at 95 (usable: 73.6). So a step whose program
does not fit the usable memory under a raised factor is compiled once more at XLA's default
(a per-compile option: ``XLA_FLAGS`` is read once per process). The second program is kept
where it fits the usable memory, or where the first exceeds the device's whole memory and the
second does not; otherwise the first, faster one is (the report says it does not fit): llama3-8b
GPipe at pp 4 compiled to 78.4 GiB either way, 0.91 s simulated at 300 and 1.42 s at 95.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SLOP = "xla_gpu_memory_limit_slop_factor"
XLA_DEFAULT = 95  # XLA's own default for the factor
_FLAG = re.compile(r"--" + SLOP + r"=(\d+)")


@dataclass(frozen=True)
class MemoryLimit:
    """Which memory limit the kept program was compiled under.

    ``slop_factor``: the factor in force (None: not set, XLA's default); ``recompiled``: whether
    the program was compiled again at XLA's default and that one kept; ``first_bytes`` and
    ``second_bytes``: the two programs' total bytes per device when a second was compiled
    (whichever was kept)."""

    slop_factor: int | None
    recompiled: bool = False
    first_bytes: int | None = None
    second_bytes: int | None = None


def slop_factor(flags: str) -> int | None:
    """The factor the XLA flags ``flags`` set (the last one wins, as XLA reads them), else
    None."""
    found = _FLAG.findall(flags)
    return int(found[-1]) if found else None


def _total(compiled: Any) -> int | None:
    from jaxpar.analysis.hlo import compiled_memory

    return compiled_memory(compiled)["total"]


def compile_within(lowered: Any, usable_bytes: float, device_bytes: float,
                   env: Mapping[str, str] | None = None) -> tuple[Any, MemoryLimit]:  # fmt: skip
    """``lowered`` compiled under ``XLA_FLAGS``; where the factor there is above XLA's default
    and the program's bytes per device exceed ``usable_bytes``, compiled again at XLA's
    default, which is kept where it fits ``usable_bytes`` or where only it fits in
    ``device_bytes`` (module docstring)."""
    slop = slop_factor((os.environ if env is None else env).get("XLA_FLAGS", ""))
    compiled = lowered.compile()
    if slop is None or slop <= XLA_DEFAULT:
        return compiled, MemoryLimit(slop)
    first = _total(compiled)
    if first is None or first <= usable_bytes:
        return compiled, MemoryLimit(slop)
    again = lowered.compile(compiler_options={SLOP: XLA_DEFAULT})
    second = _total(again)
    if second is not None and (second <= usable_bytes or second <= device_bytes < first):
        return again, MemoryLimit(XLA_DEFAULT, True, first, second)
    return compiled, MemoryLimit(slop, False, first, second)
