"""The simulated step (:class:`jaxpar.gpu.timing.StepTime`) as a Chrome / Perfetto trace:
``X`` events in microseconds, one thread per stream (compute, collective, p2p), each named by its
HLO instruction with its op name, phase (forward / backward, from JAX's ``jvp``/``transpose``
scopes) and loop iterations as arguments; waits of the compute stream are events too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxpar.gpu.timing import StepTime

STREAMS = ("compute", "collective", "p2p")  # jaxpar.gpu.timing.STREAMS, thread ids in order


def phase(op_name: str) -> str:
    """``backward`` or ``forward`` from JAX's ``transpose``/``jvp`` scopes in an op name; ""."""
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    return ""


def chrome_trace(st: StepTime, name: str = "step") -> dict[str, Any]:
    """The simulated step as Chrome trace JSON (``X`` events, microseconds; one thread per
    stream: compute, collective, p2p)."""
    tid = {s: i for i, s in enumerate(STREAMS)}
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 0, "name": "process_name", "args": {"name": name}},
        *({"ph": "M", "pid": 0, "tid": i, "name": "thread_name", "args": {"name": s}}
          for s, i in tid.items()),
    ]  # fmt: skip
    for e in st.events:
        args: dict[str, Any] = {"kind": e.kind}
        if e.axes:
            args["axes"] = ",".join(e.axes)
        if e.op_name:
            args["op_name"] = e.op_name
            if phase(e.op_name):
                args["phase"] = phase(e.op_name)
        if e.loop:
            args["loop"] = e.loop
        events.append({"ph": "X", "pid": 0, "tid": tid[e.stream], "name": e.name, "cat": e.kind,
                       "ts": e.start * 1e6, "dur": e.dur * 1e6, "args": args})  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"step_s": st.step_s, "events_dropped": st.events_dropped}}  # fmt: skip


def write_trace(path: str | Path, st: StepTime, name: str = "step") -> int:
    """Write :func:`chrome_trace` to ``path``; returns the number of ``X`` events."""
    tr = chrome_trace(st, name)
    Path(path).write_text(json.dumps(tr))
    return sum(e["ph"] == "X" for e in tr["traceEvents"])


def check_output_path(flag: str, path: str, suffix: str, what: str, force: bool) -> None:
    """Refuse an output ``path`` of ``flag`` before compiling: not ``suffix``, a missing or
    unwritable directory, an existing file without ``force`` (one line, :class:`ConfigError`)."""
    import argparse

    from jaxpar.commands._checks import writable_file
    from jaxpar.errors import ConfigError

    if Path(path).suffix.lower() != suffix:
        raise ConfigError(f"{flag} {path!r}: must end in {suffix} ({what})")
    try:
        writable_file(path)
    except argparse.ArgumentTypeError as e:
        raise ConfigError(f"{flag} {e}") from None
    if Path(path).exists() and not force:
        raise ConfigError(f"{flag} {path!r}: file exists; pass --force to replace it")


def check_trace_path(path: str, force: bool) -> None:
    """:func:`check_output_path` for ``--trace`` (Chrome trace JSON)."""
    check_output_path("--trace", path, ".json", "Chrome trace JSON", force)
