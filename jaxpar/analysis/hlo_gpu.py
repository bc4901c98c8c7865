"""What XLA:GPU's scheduled program does with its collectives: asynchrony, overlap, exposure.

XLA:GPU emits every collective as a ``X-start``/``X-done`` pair, so a pair alone says nothing
about overlap. Two things do, both read from the optimized HLO (``compiled.as_text()``, in
schedule order, ``is_scheduled=true``):

* ``"is_sync":true`` in the start's ``collective_backend_config``: the latency-hiding
  scheduler found nothing to overlap it with and the collective runs on the compute stream;
* the instructions the scheduler placed between the start and its done in the same
  computation (:attr:`AsyncCollective.compute_between`: fusions, library calls, loops, ... and
  the dot FLOPs among them: fused dots and cuBLAS gemms).

A collective is **exposed** when it is synchronous or no matmul (dot, gemm) or attention kernel
lies between its start and done; its wire bytes (:func:`jaxpar.analysis.hlo.collective_bytes`:
per device per step, loops weighted by their trips) are then communication the step waits for.
A start whose done is not in its computation (a collective the pipeliner split across loop
iterations) is counted as overlapped with the rest of the iteration (``spans_iterations``).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from jaxpar.analysis.hlo import collective_bytes
from jaxpar.analysis.hlo_text import Instr, Module, callees, parse

# Opcodes that do work on the device (elementwise ops outside fusions are bookkeeping here).
COMPUTE = {
    "fusion", "custom-call", "dot", "convolution", "while", "conditional", "call", "sort",
    "scatter", "gather", "reduce", "reduce-window", "select-and-scatter",
}  # fmt: skip
_DIMS = re.compile(r"(\w+)\[([\d,]*)\]")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


@dataclass
class AsyncCollective:
    """One collective of the program and where the scheduler put it."""

    kind: str
    name: str
    computation: str
    axes: tuple[str, ...]
    wire_bytes: float  # per device per step (all trips)
    count: float  # executions per step
    asynchronous: bool  # issued as a start/done pair
    sync: bool  # start marked "is_sync": the scheduler could not overlap it
    pipelined: bool = False  # XLA's collective pipeliner moved it across loop iterations
    spans_iterations: bool = False
    ops_between: int = 0
    compute_between: int = 0
    flops_between: float = 0.0  # dot FLOPs scheduled between start and done, per execution
    attention_between: int = 0  # cuDNN attention kernels among them

    @property
    def exposed(self) -> bool:
        """Synchronous, or no matmul or attention kernel runs while it is in flight (elementwise
        fusions alone are not counted as hiding it)."""
        if self.spans_iterations:
            return self.sync
        hidden = self.flops_between > 0 or self.attention_between > 0
        return self.sync or not self.asynchronous or not hidden


@dataclass
class AxisOverlap:
    """The collectives of one mesh-axis set: bytes, and the share the step waits for."""

    axes: tuple[str, ...]
    count: float = 0.0
    wire_bytes: float = 0.0
    sync_bytes: float = 0.0
    exposed_bytes: float = 0.0
    by_kind: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON view with the shares."""
        d = asdict(self)
        d["axes"] = list(self.axes)
        d["sync_share"] = self.sync_bytes / self.wire_bytes if self.wire_bytes else 0.0
        d["exposed_share"] = self.exposed_bytes / self.wire_bytes if self.wire_bytes else 0.0
        return d


def _dims(shape: str) -> list[int]:
    m = _DIMS.search(shape)
    return [int(x) for x in m.group(2).split(",") if x] if m else []


def _dot_flops(ins: Instr, table: dict[str, str]) -> float:
    """2·(output elements)·(contracted elements) of a ``dot`` or a cuBLAS gemm custom call."""
    if ins.opcode == "dot":
        cm = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        contracting = [int(x) for x in cm.group(1).split(",") if x] if cm else []
    elif "__cublas" in ins.attrs:
        cm = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
        contracting = [int(x.strip('"')) for x in cm.group(1).split(",") if x] if cm else []
    else:
        return 0.0
    lhs = _dims(table.get(ins.operands[0], "")) if ins.operands else []
    k = float(np.prod([lhs[i] for i in contracting if i < len(lhs)])) if lhs else 0.0
    out = ins.shape.split(")")[0] if ins.shape.startswith("(") else ins.shape
    return 2.0 * float(np.prod(_dims(out) or [0])) * k


def _flops(comps: dict[str, list[Instr]], ins: Instr, table: dict[str, str], seen=()) -> float:
    """Dot FLOPs of ``ins`` and what it calls (a loop's body times its known trips)."""
    own = _dot_flops(ins, table)
    trips = 1.0
    if ins.opcode == "while":
        tm = _TRIP.search(ins.attrs)
        trips = float(tm.group(1)) if tm else 1.0
    for c in callees(ins):
        if c in comps and c not in seen:
            sub = {i.name: i.shape for i in comps[c]}
            own += trips * sum(_flops(comps, j, sub, (*seen, c)) for j in comps[c])
    return own


def _between(comps, cname: str, start: Instr) -> tuple[list[Instr] | None, bool]:
    """Instructions scheduled between ``start`` and its done (None: the done is elsewhere)."""
    body = comps[cname]
    i = next(k for k, x in enumerate(body) if x.name == start.name)
    for j in range(i + 1, len(body)):
        x = body[j]
        if (x.opcode.endswith("-done") or x.opcode == "async-done") and start.name in x.operands:
            return body[i + 1 : j], False
    return None, True


def _config(ins: Instr) -> dict[str, Any]:
    m = re.search(r'"collective_backend_config":(\{[^{}]*\})', ins.attrs)
    try:
        return json.loads(m.group(1)) if m else {}
    except json.JSONDecodeError:
        return {}


def async_collectives(compiled_or_text: Any, mesh: Any) -> list[AsyncCollective]:
    """Every collective of the program with its asynchrony and what overlaps it
    (``compiled_or_text``: a compiled program, its optimized HLO text or that text parsed,
    :class:`~jaxpar.analysis.hlo_text.Module`)."""
    src = compiled_or_text
    module = parse(src if isinstance(src, (str, Module)) else src.as_text())
    report = collective_bytes(module, mesh)
    comps = module.comps
    index = {(c, i.name): i for c, body in comps.items() for i in body}
    out = []
    for c in report.collectives:
        ins = index[(c.computation, c.name)]
        started = ins.opcode.endswith("-start") or ins.opcode == "async-start"
        cfg = _config(ins)
        item = AsyncCollective(
            kind=c.kind, name=c.name, computation=c.computation, axes=c.axes,
            wire_bytes=c.wire_bytes * c.trips, count=c.trips, asynchronous=started,
            sync=bool(cfg.get("is_sync", not started)), pipelined=bool(cfg.get("is_pipelined")),
        )  # fmt: skip
        if started:
            between, elsewhere = _between(comps, c.computation, ins)
            item.spans_iterations = elsewhere
            table = {i.name: i.shape for i in comps[c.computation]}
            for x in between or []:
                item.ops_between += 1
                if x.opcode in COMPUTE:
                    item.compute_between += 1
                    item.flops_between += _flops(comps, x, table)
                    item.attention_between += "__cudnn$fmha" in x.attrs
        out.append(item)
    return out


def overlap_by_axes(items: list[AsyncCollective]) -> dict[str, AxisOverlap]:
    """:class:`AxisOverlap` per mesh-axis set, keyed ``"dp"``, ``"pp"``, ``"dp,tp"``, ..."""
    out: dict[str, AxisOverlap] = {}
    for it in items:
        key = ",".join(it.axes) or "-"
        ax = out.setdefault(key, AxisOverlap(it.axes))
        ax.count += it.count
        ax.wire_bytes += it.wire_bytes
        ax.sync_bytes += it.wire_bytes if it.sync else 0.0
        ax.exposed_bytes += it.wire_bytes if it.exposed else 0.0
        k = ax.by_kind.setdefault(it.kind, {"count": 0.0, "wire_bytes": 0.0, "sync_count": 0.0,
                                            "exposed_bytes": 0.0})  # fmt: skip
        k["count"] += it.count
        k["wire_bytes"] += it.wire_bytes
        k["sync_count"] += it.count if it.sync else 0.0
        k["exposed_bytes"] += it.wire_bytes if it.exposed else 0.0
    return out


def custom_calls(compiled_or_text: Any) -> dict[str, int]:
    """Static count of each custom-call target (``__cudnn$fmha...`` is cuDNN attention)."""
    text = compiled_or_text
    if isinstance(text, Module):
        text = text.text
    elif not isinstance(text, str):
        text = text.as_text()
    counts: dict[str, int] = {}
    for t in re.findall(r'custom_call_target="([^"]+)"', text):
        counts[t] = counts.get(t, 0) + 1
    return counts


__all__ = ["AsyncCollective", "AxisOverlap", "async_collectives", "custom_calls",
           "overlap_by_axes"]  # fmt: skip
