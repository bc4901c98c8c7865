"""Parse XLA's optimized HLO text: computations, instructions, shapes, loop trip counts and
replica groups. Used by :mod:`jaxpar.analysis.hlo`; kept apart so that module reads as the
accounting rules.

Formats handled (as printed by the XLA in jax 0.10.x; checked against its CPU output):

* computations ``[ENTRY] %name (params) -> shape {`` … ``}``; instructions
  ``[ROOT] %name = <shape> <opcode>(<operands>), attr=…`` where operands are ``%x`` or
  ``<shape> %x``; the ``FileNames``/``StackFrames`` tables between them are skipped;
* ``while`` trip counts from ``backend_config={…"known_trip_count":{"n":"5"}…}``;
* replica groups: explicit ``{{0,1},{2,3}}`` (``{}`` = one group of all partitions), iota
  ``[G,S]<=[dims]T(perm)``, and the mesh-axes form
  ``mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0':(2)2}``
  (Shardy ``MeshAxesReplicaGroupList``; sub-axis ``a:(pre)size``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from jaxpar.pipeline.branches import parse_branch_scope

# Bytes per element of HLO primitive types (sub-byte types are fractional).
DTYPE_BYTES: dict[str, float] = {
    **dict.fromkeys(("s4", "u4"), 0.5),
    **dict.fromkeys(("pred", "s8", "u8", "f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz"), 1),
    **dict.fromkeys(("s16", "u16", "f16", "bf16"), 2),
    **dict.fromkeys(("s32", "u32", "f32"), 4),
    **dict.fromkeys(("s64", "u64", "f64", "c64"), 8),
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([^\]]*)\]")
_INSTR = re.compile(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_CALLEE_ATTRS = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|"
    r"branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')


def branch_weights(ins: Instr) -> list[float] | None:
    """The weights the pipeline executor put on a ``conditional`` (its ``op_name`` scope,
    :func:`jaxpar.pipeline.branches.branch_scope`), or None (unannotated)."""
    om = re.search(r'op_name="([^"]*)"', ins.attrs)
    return parse_branch_scope(om.group(1)) if om else None


@dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str


def _balanced(s: str, i: int) -> int:
    """Index just past the bracket group opening at ``s[i]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = [pairs[s[i]]]
    j = i + 1
    while stack and j < len(s):
        c = s[j]
        if c in pairs:
            stack.append(pairs[c])
        elif c == stack[-1]:
            stack.pop()
        elif c == '"':  # skip string literals (metadata, backend_config keys)
            j = s.index('"', j + 1)
        j += 1
    return j


def _parse_instr(line: str) -> Instr | None:
    # Long tuples carry "/*index=5*/" markers in shapes and operand lists.
    line = re.sub(r"/\*.*?\*/", "", line)
    m = _INSTR.match(line)
    if not m:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):  # tuple shape
        end = _balanced(rest, 0)
    else:
        end = rest.find(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    om = re.match(r"([\w\-]+)\(", rest)
    if not om:
        return None
    close = _balanced(rest, om.end() - 1)
    ops_text = rest[om.end() : close - 1]
    # An operand is "%name" or "<shape> %name"; the name is the last token.
    operands = [p.split()[-1].lstrip("%") for p in split_top(ops_text) if p.strip()]
    return Instr(m.group(1), shape, om.group(1), operands, rest[close:])


def split_top(s: str) -> list[str]:
    """Split on commas not nested in brackets."""
    parts, depth, cur = [], 0, []
    for c in s:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return parts


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape (arrays of a tuple summed; dynamic dims ``<=k`` at their bound)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in dims.split(","):
            d = d.strip().lstrip("<=")
            if d:
                n *= int(d)
        total += n * DTYPE_BYTES.get(dtype, 0)
    return total


def parse_module(text: str) -> tuple[dict[str, list[Instr]], str]:
    comps: dict[str, list[Instr]] = {}
    entry, cur = "", None
    for line in text.splitlines():
        if cur is None:
            h = _HEADER.match(line)
            if h and "=" not in line.split("(")[0]:
                cur = h.group(2)
                comps[cur] = []
                if h.group(1):
                    entry = cur
        elif line.strip() == "}":
            cur = None
        else:
            ins = _parse_instr(line)
            if ins:
                comps[cur].append(ins)
    if not entry:
        raise ValueError("no ENTRY computation found: pass compiled.as_text() (optimized HLO)")
    return comps, entry


def execution_counts(
    comps: dict[str, list[Instr]], entry: str
) -> tuple[dict[str, tuple[float, bool, bool]], list[str]]:
    """Executions per step of each computation reachable from ENTRY.

    Returns ``{comp: (trips, all_known, in_conditional)}`` and the loops whose count is unknown.
    A branch of a ``conditional`` annotated by :func:`~jaxpar.pipeline.branches.branch_scope`
    runs ``weights[i]`` of the conditional's executions (``in_conditional`` stays False for it:
    its count is what the annotation says); a branch of an unannotated one is counted as if it
    ran every time and flagged ``in_conditional``.
    """
    mult: dict[str, tuple[int, bool, bool]] = {entry: (1, True, False)}
    unknown: list[str] = []
    order, seen = [], set()

    def visit(c: str) -> None:  # post-order DFS, then reverse: callers before callees
        seen.add(c)
        for ins in comps.get(c, []):
            for callee in callees(ins):
                if callee in comps and callee not in seen:
                    visit(callee)
        order.append(c)

    visit(entry)
    for c in reversed(order):
        trips, known, cond = mult.get(c, (0, True, False))
        for ins in comps[c]:
            factor, k = 1, True
            if ins.opcode == "while":
                tm = _TRIP.search(ins.attrs)
                inferred = None if tm else infer_trips(comps, comps[c], ins)
                if tm:
                    factor = int(tm.group(1))
                elif inferred is not None:
                    factor = inferred
                else:
                    k = False
                    unknown.append(ins.name)
            called = callees(ins)
            weights = branch_weights(ins) if ins.opcode == "conditional" else None
            pred = re.search(r"true_computation=%?([\w.\-]+).*false_computation=%?([\w.\-]+)",
                             ins.attrs)  # fmt: skip
            if pred:  # the predicate form: branch 0 is false, 1 is true
                called = [pred.group(2), pred.group(1)]
            if weights is not None and len(weights) != len(called):
                weights = None  # XLA rewrote the branches: fall back to the upper bound
            for i, callee in enumerate(called):
                if callee not in comps:
                    continue
                t0, k0, c0 = mult.get(callee, (0, True, False))
                w = weights[i] if weights is not None else 1.0
                flagged = ins.opcode == "conditional" and weights is None
                mult[callee] = (t0 + trips * factor * w, k0 and known and k, c0 or cond or flagged)
    return mult, unknown


def _scalar(comps: dict[str, list[Instr]], table: dict[str, Instr], name: str) -> int | None:
    """The integer a scalar operand holds when it is a constant (through copies)."""
    ins = table.get(name)
    while ins is not None and ins.opcode in ("copy", "bitcast") and ins.operands:
        ins = table.get(ins.operands[0])
    if ins is None or ins.opcode != "constant" or not ins.shape.startswith("s32[]"):
        return None
    # The parser reads a constant's literal as its one operand: "constant(3)" -> ["3"].
    ok = ins.operands and re.fullmatch(r"-?\d+", ins.operands[0])
    return int(ins.operands[0]) if ok else None


def _fused_pair(comps: dict[str, list[Instr]], ins: Instr, opcode: str) -> tuple[Instr, int] | None:
    """``(op, constant)`` of the ``opcode`` instruction with one s32 constant operand that
    ``ins`` is, or that its fused computation holds."""
    bodies = [[ins]] + [comps.get(c, []) for c in callees(ins)]
    for body in bodies:
        table = {i.name: i for i in body}
        for op in body:
            if op.opcode != opcode:
                continue
            values = [_scalar(comps, table, o) for o in op.operands]
            known = [v for v in values if v is not None]
            if len(known) == 1:
                return op, known[0]
    return None


def infer_trips(comps: dict[str, list[Instr]], caller: list[Instr], loop: Instr) -> int | None:
    """Trips of a ``while`` that lost its ``known_trip_count`` (XLA's loop double-buffering
    and collective pipelining peel iterations and rewrite the loop): ``i < N`` in the
    condition, ``i = i + 1`` in the body and a constant start; None unless all three are
    found."""
    cm = re.search(r"condition=%?([\w.\-]+)", loop.attrs)
    bm = re.search(r"body=%?([\w.\-]+)", loop.attrs)
    if not cm or not bm or cm.group(1) not in comps or bm.group(1) not in comps:
        return None
    cond, body = comps[cm.group(1)], comps[bm.group(1)]
    found = _fused_pair(comps, cond[-1], "compare")
    if found is None or "direction=LT" not in found[0].attrs:
        return None
    limit = found[1]
    root = body[-1]
    step_ins = {i.name: i for i in body}.get(root.operands[0]) if root.operands else None
    step = _fused_pair(comps, step_ins, "add") if step_ins is not None else None
    table = {i.name: i for i in caller}
    init_tuple = table.get(loop.operands[0]) if loop.operands else None
    if step is None or step[1] != 1 or init_tuple is None or not init_tuple.operands:
        return None
    start = _scalar(comps, table, init_tuple.operands[0])
    return None if start is None else max(0, limit - start)


def callees(ins: Instr) -> list[str]:
    """Computations ``ins`` calls (branches, loop body and condition, fused code, ...)."""
    # async-update/-done repeat the wrapped computation of their async-start: count it once.
    if ins.opcode in ("async-update", "async-done") or ins.opcode.endswith("-done"):
        return []
    names: list[str] = []
    for _, val in _CALLEE_ATTRS.findall(ins.attrs):
        names += [v.strip().lstrip("%") for v in val.strip("{}").split(",") if v.strip()]
    return names


# --------------------------------------------------------------------------------------------
# Replica groups → mesh axes


def _ints(s: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", s)]


def _iota(reshape: list[int], perm: list[int] | None) -> np.ndarray:
    a = np.arange(int(np.prod(reshape))).reshape(reshape)
    return a.transpose(perm) if perm else a


def replica_groups(attrs: str, n_parts: int) -> list[list[int]]:
    """Groups of partition ids, from any of the three spellings (empty: one group of all)."""
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        g, s = _ints(m.group(1))
        perm = _ints(m.group(3)) if m.group(3) else None
        return _iota(_ints(m.group(2)), perm).reshape(g, s).tolist()
    m = re.search(
        r"replica_groups=mesh\[([^\]]*)\]"
        r"(?:,\s*device_ids=\(((?:[^()]|\([^()]*\))*)\))?\s*\{([^}]*)\}",
        attrs,
    )
    if m:
        return _mesh_axes_groups(m.group(1), m.group(2), m.group(3))
    m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
    if m:
        groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
        if groups and any(groups):
            return groups
    return [list(range(n_parts))]


def _mesh_axes_groups(axes_txt: str, ids_txt: str | None, group_txt: str) -> list[list[int]]:
    """Expand XLA's mesh-axes replica group list (Shardy ``MeshAxesReplicaGroupList``)."""
    names, sizes = [], []
    for item in axes_txt.split(","):
        k, v = item.split("=")
        names.append(k.strip().strip("'\""))
        sizes.append(int(v))
    total = int(np.prod(sizes))
    if not ids_txt:
        ids = np.arange(total)
    else:
        im = re.fullmatch(r"\s*\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?\s*", ids_txt)
        nums = _ints(ids_txt)
        if im and int(np.prod(_ints(im.group(1)))) == total and len(_ints(im.group(1))) != total:
            ids = _iota(_ints(im.group(1)), _ints(im.group(2)) if im.group(2) else None)
        elif len(nums) == total:  # explicit device list
            ids = np.array(nums)
        else:
            raise ValueError(f"cannot parse mesh device_ids=({ids_txt})")
    ids = ids.reshape(sizes)
    # Which digits of each mesh coordinate vary inside a group. A sub-axis "a:(pre)size" is the
    # middle factor of a's size split as [pre, size, rest] (row-major), i.e. digit
    # (c // rest) % size.
    grouped: dict[int, list[tuple[int, int]]] = {}
    for ref in split_top(group_txt):
        ref = ref.strip()
        if not ref:
            continue
        sm = re.fullmatch(r"'?([^':]+)'?(?::\((\d+)\)(\d+))?", ref)
        if not sm:
            raise ValueError(f"cannot parse replica group axis {ref!r}")
        d = names.index(sm.group(1))
        pre, size = (int(sm.group(2)), int(sm.group(3))) if sm.group(2) else (1, sizes[d])
        grouped.setdefault(d, []).append((sizes[d] // (pre * size), size))
    buckets: dict[tuple[int, ...], list[int]] = {}
    for coord in np.ndindex(*sizes):
        key = []
        for d, c in enumerate(coord):
            for stride, size in grouped.get(d, []):
                c -= ((c // stride) % size) * stride
            key.append(c)
        buckets.setdefault(tuple(key), []).append(int(ids[coord]))
    return list(buckets.values())
