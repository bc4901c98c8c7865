"""Collective accounting and memory figures from a compiled JAX program.

:func:`collective_bytes` parses the *optimized* HLO text
(``jax.jit(f).lower(...).compile().as_text()``) and returns, per (collective kind, mesh axes),
how many times the collectives run per step and how many bytes they move per device.

Definitions (``size`` is per device, per execution, from the HLO shapes; ``n`` the group size):

* all-reduce: ``bytes`` = operand size; ``wire_bytes`` = 2·(n−1)/n · size;
* all-gather: ``bytes`` = output size (n · operand); ``wire_bytes`` = (n−1)/n · size;
* reduce-scatter: ``bytes`` = operand (input) size; ``wire_bytes`` = (n−1)/n · size;
* all-to-all: ``bytes`` = operand size (all pieces); ``wire_bytes`` = (n−1)/n · size;
* ragged-all-to-all: ``bytes`` = the send buffer's size (operand 0; the offsets, sizes and
  the output buffer it updates are not traffic), the most it can move — what it does move is
  decided at run time; ``wire_bytes`` = (n−1)/n · size, as a balanced exchange;
* collective-permute: ``bytes`` = operand size (every operand of a combined permute);
  ``wire_bytes`` = size · (pairs with source ≠ target) / partitions.

The permute's wire figure is the average over partitions of what a device sends to another
device (self-pairs, which GSPMD emits for resharding, move nothing).

Async forms (``all-reduce-start``/``-done`` and friends) are counted once, at ``-start``; a
collective wrapped in a generic ``async-start`` is counted inside its wrapped computation.
Collectives in a ``while`` body run once per trip: XLA records ``known_trip_count`` in the
while's ``backend_config`` for ``lax.scan``/``fori_loop``; nested loops multiply. A loop
without a known trip count is counted as one trip and listed in ``unknown_trip_loops`` (a
lower bound, not a guess). A ``conditional`` whose code stated how often it takes each branch
(:func:`jaxpar.pipeline.branches.branch_scope`: the pipeline's tick branches) counts each
branch that often; the branches of any other conditional are counted as if every branch ran
and flagged (``in_conditional``), an upper bound. :func:`copy_bytes` counts the buffer copies
the same way.

Replica groups. Under SPMD partitioning (one replica, ``use_global_device_ids=true``) the ids
in ``replica_groups``/``source_target_pairs`` are *partition ids* = positions in the flattened
``mesh.devices`` array, not ``device.id`` (checked on jax 0.10.2: a mesh over a permuted device
list yields the same groups as the identity mesh). Three spellings are parsed: explicit
``{{0,1},{2,3}}``, iota ``[G,S]<=[dims]T(perm)``, and the mesh-axes form
``mesh['axis_0'=2,...], device_ids=([2,2,2]T(0,2,1)) {'axis_1'}`` whose axis names are XLA's
own, not jax's (so they are mapped back through the partition ids).

Bytes are those of the compiled program: CPU XLA (jax 0.10.2) converts bf16 operands of every
collective kind to f32 before communicating, so bf16 traffic measured on CPU is twice GPU's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxpar.analysis.hlo_text import (
    Module,
    callees,
    execution_counts,
    parse,
    parse_module,
    replica_groups,
    shape_bytes,
    source_target_pairs,
    split_top,
)

KINDS = (
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
    "collective-permute",
)  # fmt: skip


@dataclass
class Collective:
    """One collective instruction of the HLO, with its per-step multiplicity."""

    kind: str
    name: str
    computation: str
    axes: tuple[str, ...]
    group_size: int
    bytes: float  # per device per execution, as defined in the module docstring
    wire_bytes: float
    trips: float  # executions per step (enclosing trip counts × branch weights)
    trips_known: bool = True
    in_conditional: bool = False
    op_name: str = ""


@dataclass
class CollectiveStat:
    """Aggregate of the collectives of one (kind, axes): per step, per device."""

    ops: int = 0  # static instructions
    count: float = 0  # executions per step (fractional where a branch runs on some ticks)
    bytes: float = 0.0
    wire_bytes: float = 0.0


@dataclass
class CollectiveReport:
    """Result of :func:`collective_bytes`; ``stats`` is keyed by ``(kind, axes)``."""

    collectives: list[Collective]
    stats: dict[tuple[str, tuple[str, ...]], CollectiveStat]
    unknown_trip_loops: list[str] = field(default_factory=list)
    num_partitions: int = 0

    def select(
        self, kind: str | None = None, axes: tuple[str, ...] | set[str] | None = None
    ) -> CollectiveStat:
        """Sum of the stats matching ``kind`` (None: any) and exactly the axis set ``axes``."""
        out = CollectiveStat()
        for (k, ax), s in self.stats.items():
            if (kind is None or k == kind) and (axes is None or set(ax) == set(axes)):
                out.ops += s.ops
                out.count += s.count
                out.bytes += s.bytes
                out.wire_bytes += s.wire_bytes
        return out

    @property
    def total(self) -> CollectiveStat:
        """All collectives together."""
        return self.select()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view: ``total``, ``by_kind``, ``entries`` (one per kind × axes), flags."""

        def stat(s: CollectiveStat) -> dict[str, Any]:
            return {"ops": s.ops, "count": s.count, "bytes": s.bytes, "wire_bytes": s.wire_bytes}

        return {
            "num_partitions": self.num_partitions,
            "total": stat(self.total),
            "by_kind": {k: stat(self.select(kind=k)) for k in sorted({k for k, _ in self.stats})},
            "entries": [
                {"kind": k, "axes": list(ax), **stat(s)}
                for (k, ax), s in sorted(self.stats.items())
            ],
            "unknown_trip_loops": list(self.unknown_trip_loops),
            "conditional_ops": sum(c.in_conditional for c in self.collectives),
        }


def _varying_axes(
    groups: list[list[int]], shape: tuple[int, ...], names: tuple[str, ...]
) -> tuple[str, ...]:
    """Mesh axes along which the members of a group differ (union over groups, mesh order)."""
    varying = set()
    for g in groups:
        coords = np.array(np.unravel_index(np.asarray(g), shape))  # [ndim, members]
        varying |= {i for i in range(len(shape)) if len(set(coords[i].tolist())) > 1}
    return tuple(names[i] for i in sorted(varying))


# --------------------------------------------------------------------------------------------
# Public API


def collective_bytes(compiled_or_hlo_text: Any, mesh: Any) -> CollectiveReport:
    """Count the collectives of a compiled program and their bytes per device per step.

    ``compiled_or_hlo_text`` is a ``jax.stages.Compiled`` (anything with ``as_text()``), its
    optimized HLO text or that text parsed (:class:`~jaxpar.analysis.hlo_text.Module`);
    ``mesh`` a ``jax.sharding.Mesh`` (``devices.shape`` and ``axis_names`` are used) whose
    device order is the program's partition order. Definitions of ``bytes`` and
    ``wire_bytes``, loop and replica-group handling: see the module docstring.
    """
    src = compiled_or_hlo_text
    if not isinstance(src, (str, Module)):
        src = src.as_text()
    text = src.text if isinstance(src, Module) else src
    shape = tuple(int(s) for s in np.shape(mesh.devices))
    names = tuple(mesh.axis_names)
    n_parts = int(np.prod(shape))
    pm = re.search(r"num_partitions=(\d+)", text)
    if pm and int(pm.group(1)) not in (1, n_parts):
        raise ValueError(f"program has {pm.group(1)} partitions but the mesh has {n_parts}")
    module = parse(src)
    comps = module.comps
    mult, unknown = module.execution_counts()
    out: list[Collective] = []
    stats: dict[tuple[str, tuple[str, ...]], CollectiveStat] = {}
    for cname, instrs in comps.items():
        trips, known, cond = mult.get(cname, (0, True, False))
        if trips == 0:
            continue  # unreachable from ENTRY (e.g. reduction regions: no collectives)
        table = {i.name: i.shape for i in instrs}
        for ins in instrs:
            # "X-start" is the async form of X (also XLA's printed sugar for a generic
            # async-start wrapping X); its "X-done" is skipped so each op counts once.
            kind = ins.opcode.removesuffix("-start")
            if kind not in KINDS:
                continue
            opnd = [shape_bytes(table.get(o, "")) for o in ins.operands]
            if kind == "collective-permute":
                moving = [(a, b) for a, b in source_target_pairs(ins.attrs) if a != b]
                groups = [list(p) for p in moving]
                n = 2 if moving else 1
                # XLA:GPU combines sends with the same pairs into one permute of several
                # operands (all sent); the in-place form's further operands are buffers and
                # offsets (``slice_sizes``), not data
                size = (opnd[0] if "slice_sizes" in ins.attrs else sum(opnd)) if opnd else 0.0
                wire = size * len(moving) / n_parts
            else:
                groups = replica_groups(ins.attrs, n_parts)
                n = max(len(g) for g in groups)
                size = opnd[0] if kind == "ragged-all-to-all" and opnd else sum(opnd)
                if kind == "all-gather":
                    size *= n
                ring = (n - 1) / n
                wire = size * ring * (2 if kind == "all-reduce" else 1)
            axes = _varying_axes(groups, shape, names) if groups else ()
            om = re.search(r'op_name="([^"]*)"', ins.attrs)
            op_name = om.group(1) if om else ""
            out.append(
                Collective(kind, ins.name, cname, axes, n, size, wire, trips, known, cond, op_name)
            )
            s = stats.setdefault((kind, axes), CollectiveStat())
            s.ops += 1
            s.count += trips
            s.bytes += size * trips
            s.wire_bytes += wire * trips
    return CollectiveReport(out, stats, list(unknown), n_parts)


def copy_bytes(compiled_or_hlo_text: Any) -> dict[str, Any]:
    """Bytes moved by the program's ``copy`` instructions per step (per device), loops and
    annotated branches weighted as :func:`collective_bytes` does; copies inside a fusion are
    part of that fusion's output and not counted.

    Returns ``total`` and ``loops``: per ``while`` body (with what it calls), its trips, the
    bytes copied per trip, and ``carry_bytes_per_trip``: those of copies shaped like one of the
    buffers the loop updates (what XLA adds when such a buffer passes through a conditional,
    jax-ml/jax#38145; loop-invariant buffers, e.g. zeros XLA hoisted out of the body, are not
    among them; ``updated_state_bytes`` is their size) — for the pipeline's tick scan, the bytes
    copied per tick.
    """
    text = compiled_or_hlo_text
    if not isinstance(text, str):
        text = text.as_text()
    comps, entry = parse_module(text)
    mult, _ = execution_counts(comps, entry)
    fused = {
        c for ins in comps.values() for i in ins if i.opcode == "fusion"
        for c in re.findall(r"calls=%?([\w.\-]+)", i.attrs)
    }  # fmt: skip
    own = {
        name: sum(shape_bytes(i.shape) for i in ins if i.opcode in ("copy", "copy-start"))
        for name, ins in comps.items()
        if name not in fused
    }
    total = sum(own[c] * mult.get(c, (0,))[0] for c in own)
    loops = []
    for name, ins in comps.items():
        for i in ins:
            body = re.search(r"body=%?([\w.\-]+)", i.attrs) if i.opcode == "while" else None
            trips = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', i.attrs)
            if not body or body.group(1) not in comps or mult.get(name, (0,))[0] == 0:
                continue
            b, n = body.group(1), int(trips.group(1)) if trips else 1
            # Everything the body runs (branches weighted), per execution of the body.
            per_run = mult[b][0] or 1
            inside = _reachable(comps, b) - fused
            carried, state_bytes = _updated_shapes(comps[b])
            moved = carry = 0.0
            for c in inside:
                for j in comps[c]:
                    if j.opcode not in ("copy", "copy-start"):
                        continue
                    nbytes = shape_bytes(j.shape) * mult.get(c, (0,))[0] / per_run
                    moved += nbytes
                    if set(_ARRAYS.findall(j.shape)) & carried:
                        carry += nbytes
            loops.append({"body": b, "trips": n, "bytes_per_trip": moved,
                          "carry_bytes_per_trip": carry,
                          "updated_state_bytes": state_bytes})  # fmt: skip
    return {"total": total, "loops": loops}


_ARRAYS = re.compile(r"\b([a-z]+[0-9a-z]*)\[([^\]]*)\]")


def _updated_shapes(body: list) -> tuple[set[tuple[str, str]], float]:
    """Array shapes of the loop state elements a ``while`` body changes (not passed through),
    and their bytes."""
    params = {i.name for i in body if i.opcode == "parameter"}
    gte = {
        i.name: int(m.group(1))
        for i in body
        if i.opcode == "get-tuple-element" and i.operands and i.operands[0] in params
        and (m := re.search(r"index=(\d+)", i.attrs))
    }  # fmt: skip
    root = body[-1]
    for i in body:  # the ROOT is the tuple of the next state
        if i.opcode == "tuple" and i is body[-1]:
            root = i
    elems = split_top(root.shape[1:-1]) if root.shape.startswith("(") else []
    out, nbytes = set(), 0.0
    for k, (op, shape) in enumerate(zip(root.operands, elems, strict=False)):
        if gte.get(op) != k:
            out |= {a for a in _ARRAYS.findall(shape) if a[1]}
            nbytes += shape_bytes(shape)
    return out, nbytes


def _reachable(comps: dict, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for ins in comps[c]:
            todo.extend(callees(ins))
    return seen


_MEMORY_KEYS = ("argument", "output", "alias", "temp", "generated_code")
_MEMORY_FIELDS = (
    *(f"{k}_size_in_bytes" for k in _MEMORY_KEYS),
    *(f"host_{k}_size_in_bytes" for k in _MEMORY_KEYS[:4]),
    "peak_memory_in_bytes",
)


def compiled_memory(compiled: Any) -> dict[str, int | None]:
    """XLA's per-device memory analysis of a compiled program, as a dict of bytes.

    Keys are the ``CompiledMemoryStats`` field names without ``_size_in_bytes``/``_in_bytes``
    (``argument``, ``output``, ``alias``, ``temp``, ``generated_code``, ``host_*``, ``peak``);
    a field the backend does not report is ``None``. ``total`` = argument + output − alias +
    temp: the device buffers XLA assigned (arguments donated into outputs counted once); code
    size is reported apart. Everything is ``None`` when the backend has no analysis.
    """
    try:
        stats = compiled.memory_analysis()
    except (AttributeError, NotImplementedError, RuntimeError):  # backend without analysis
        stats = None
    out: dict[str, int | None] = {}
    for f in _MEMORY_FIELDS:
        key = f.removesuffix("_size_in_bytes").removesuffix("_in_bytes")
        v = getattr(stats, f, None) if stats is not None else None
        out[key] = int(v) if isinstance(v, (int, np.integer)) else None
    parts = [out["argument"], out["output"], out["temp"]]
    known = [p for p in parts if p is not None]
    out["total"] = sum(known) - (out["alias"] or 0) if len(known) == 3 else None
    return out
