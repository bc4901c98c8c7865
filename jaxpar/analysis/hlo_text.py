"""Parse XLA's optimized HLO text: computations, instructions, shapes, loop trip counts and
replica groups. Used by :mod:`jaxpar.analysis.hlo`; kept apart so that module reads as the
accounting rules.

Formats handled (as printed by the XLA in jax 0.10.x; checked against its CPU output):

* computations ``[ENTRY] %name (params) -> shape {`` … ``}``; instructions
  ``[ROOT] %name = <shape> <opcode>(<operands>), attr=…`` where operands are ``%x`` or
  ``<shape> %x``; the ``FileNames``/``StackFrames`` tables between them are skipped;
* ``while`` trip counts from ``backend_config={…"known_trip_count":{"n":"5"}…}``, from the
  loop's ``i < N`` (:func:`infer_trips`), or by running the condition on the values the loop
  starts with (:class:`Values`: small integer arrays where constants decide them);
* replica groups: explicit ``{{0,1},{2,3}}`` (``{}`` = one group of all partitions), iota
  ``[G,S]<=[dims]T(perm)``, and the mesh-axes form
  ``mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0':(2)2}``
  (Shardy ``MeshAxesReplicaGroupList``; sub-axis ``a:(pre)size``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

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
    literal: str = ""  # a constant's literal, as printed ("3", "{0, 1}", "true")


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
    literal = ops_text.strip() if om.group(1) == "constant" else ""
    return Instr(m.group(1), shape, om.group(1), operands, rest[close:], literal)


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


@dataclass(eq=False)
class Module:
    """An optimized HLO module parsed once (:func:`parse`): its ``text``, its computations
    ``comps`` (each a list of instructions, in schedule order) and the ``entry``'s name. The
    readers of a compiled program (:func:`jaxpar.analysis.hlo.collective_bytes`,
    :func:`jaxpar.analysis.hlo_gpu.async_collectives`, :func:`jaxpar.gpu.timing.simulate`)
    take one in place of the text, so a report that runs them all parses the program once."""

    text: str
    comps: dict[str, list[Instr]]
    entry: str
    _counts: Any = field(default=None, init=False, repr=False)

    def execution_counts(self) -> tuple[dict[str, tuple[float, bool, bool]], list[str]]:
        """:func:`execution_counts` of the module, computed once."""
        if self._counts is None:
            self._counts = execution_counts(self.comps, self.entry)
        return self._counts


def parse(text: str | Module) -> Module:
    """``text`` parsed (:func:`parse_module`) as a :class:`Module`; a module as it is."""
    return text if isinstance(text, Module) else Module(text, *parse_module(text))


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


def program_text(compiled: Any) -> str:
    """The optimized, scheduled HLO of ``compiled`` (a ``jax.stages.Compiled``) as
    ``compiled.as_text()`` prints it, but with every constant's literal: ``as_text`` elides
    large ones (``constant({...})``), among them the pipeline's schedule tables, which
    :class:`Values` reads to know each rank's branch of a tick. Falls back to ``as_text()``
    where the executable does not expose its module."""
    try:
        from jaxlib import _hlo

        opts = _hlo.HloPrintOptions()
        opts.print_large_constants = True
        modules = compiled.runtime_executable().hlo_modules()
        if len(modules) == 1:
            return "\n".join(map(_elide_float_constant, modules[0].to_string(opts).split("\n")))
    except (ImportError, AttributeError, RuntimeError, TypeError):
        pass
    return compiled.as_text()


# An instruction XLA's rematerialization pass cloned: ``<name>.remat``, ``.remat2``, ... (a clone
# of a clone stacks the suffixes). JAX's own recompute (``jax.checkpoint``) leaves no such name.
_REMAT = re.compile(r"\s*(?:ROOT\s+)?%?[\w.\-]*\.remat\d*(?:\.[\w.\-]*)?\s*=\s*")


def remat_clones(text: str) -> int:
    """Instructions of the program ``text`` that XLA's rematerialization pass added: work the
    compiled step repeats to lower XLA's own estimate of the peak memory."""
    return sum(1 for line in text.splitlines() if _REMAT.match(line))


_CONSTANT = re.compile(r"%[\w.\-]+ = ([a-z]+\d*)\[[^\]]*\]\S* constant\(")


def _elide_float_constant(line: str) -> str:
    """``line`` with a large floating-point constant's literal elided (RoPE tables: megabytes
    that say nothing about the schedule), as ``as_text`` prints it."""
    if len(line) < 1000:
        return line
    m = _CONSTANT.search(line)
    if not m or m.group(1) in _INT:
        return line
    end = line.find(")", m.end())
    return line[: m.end()] + "{...}" + line[end:] if end > 0 else line


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
# What the small integer arrays hold


_INT = {"s8": np.int64, "s16": np.int64, "s32": np.int64, "s64": np.int64, "u8": np.int64,
        "u16": np.int64, "u32": np.int64, "u64": np.int64, "pred": np.bool_}  # fmt: skip
_BINARY = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum,
    "minimum": np.minimum, "remainder": np.fmod, "and": np.bitwise_and, "or": np.bitwise_or,
    "xor": np.bitwise_xor, "shift-left": np.left_shift,
    "shift-right-logical": np.right_shift,  # partition ids and counters: not negative
    "shift-right-arithmetic": np.right_shift,
}  # fmt: skip
_LOGICAL = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}
_COMPARE = {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal,
            "GT": np.greater, "GE": np.greater_equal}  # fmt: skip
_REDUCERS = {"add": np.sum, "multiply": np.prod, "maximum": np.max, "minimum": np.min,
             "and": np.all, "or": np.any}  # fmt: skip


def _leaves(shape: str) -> Any:
    """A shape as a tree: a tuple shape's elements as a list, an array as its text."""
    shape = shape.strip()
    if shape.startswith("("):
        return [_leaves(p) for p in split_top(shape[1 : _balanced(shape, 0) - 1]) if p.strip()]
    return shape


def _array(shape: str) -> tuple[Any, tuple[int, ...]] | None:
    """(numpy dtype, dims) of an integer or predicate array shape, else None."""
    m = _ARRAY.search(shape)
    if not m or m.group(1) not in _INT or "<" in m.group(2):
        return None
    return _INT[m.group(1)], tuple(int(d) for d in m.group(2).split(",") if d.strip())


def _ints_attr(attrs: str, key: str) -> list[int] | None:
    m = re.search(key + r"=\{([^}]*)\}", attrs)
    return [int(x) for x in re.findall(r"-?\d+", m.group(1))] if m else None


class Values:
    """What a module's small integer and predicate arrays hold where constants decide it: loop
    counters and bounds, slice indices, the tables of bounds XLA or JAX keep in a loop's state.

    :meth:`of` computes one instruction from its operands' values; :meth:`run` a computation's
    root from its parameters', through fusions, calls, conditionals whose branch is known and
    ``while`` loops (iterated); :meth:`trips` how many times a loop runs from the values its
    state starts with. A value is a numpy array (``int64`` or ``bool``), a list for a tuple, or
    None where it is not known (floats, ``partition-id``, anything it does not read).
    """

    LIMIT = 1 << 16  # elements of an array worth following
    MAX_TRIPS = 1 << 20  # iterations a loop is followed for

    def __init__(self, comps: dict[str, list[Instr]], partition: int | None = None) -> None:
        self.comps = comps
        self.partition = partition  # what ``partition-id`` reads: None, not known
        self._tables: dict[str, dict[str, Instr]] = {}
        self._plans: dict[str, list[Instr]] = {}
        self._wanted: dict[str, bool] = {}

    def table(self, comp: str) -> dict[str, Instr]:
        if comp not in self._tables:
            self._tables[comp] = {i.name: i for i in self.comps.get(comp, [])}
        return self._tables[comp]

    def wanted(self, shape: str) -> bool:
        """Whether a value of ``shape`` holds a small integer or predicate array."""
        if shape not in self._wanted:

            def small(t: Any) -> bool:
                if isinstance(t, list):
                    return any(small(x) for x in t)
                a = _array(t)
                return a is not None and int(np.prod(a[1], dtype=np.int64)) <= self.LIMIT

            self._wanted[shape] = small(_leaves(shape))
        return self._wanted[shape]

    def _plan(self, comp: str) -> list[Instr]:
        """The instructions the root's small arrays depend on, in program order."""
        if comp not in self._plans:
            body, table = self.comps.get(comp, []), self.table(comp)
            need: set[str] = set()
            todo = [body[-1].name] if body and self.wanted(body[-1].shape) else []
            while todo:
                name = todo.pop()
                if name in need:
                    continue
                need.add(name)
                ins = table[name]
                todo += [o for o in ins.operands if o in table and self.wanted(table[o].shape)]
            self._plans[comp] = [i for i in body if i.name in need]
        return self._plans[comp]

    def run(self, comp: str, args: list[Any]) -> Any:
        """The value of ``comp``'s root given its parameters' values."""
        env: dict[str, Any] = {}
        plan = self._plan(comp)
        for ins in plan:
            env[ins.name] = self.of(comp, ins, [env.get(o) for o in ins.operands], args)
        return env.get(plan[-1].name) if plan else None

    def trips(self, loop: Instr, state: Any) -> int | None:
        """How many times ``loop`` runs its body from ``state`` (its operand's value), or None
        where the condition's value is not known."""
        cm = re.search(r"condition=%?([\w.\-]+)", loop.attrs)
        bm = re.search(r"body=%?([\w.\-]+)", loop.attrs)
        if not cm or not bm or cm.group(1) not in self.comps or bm.group(1) not in self.comps:
            return None
        for n in range(self.MAX_TRIPS):
            go = self.run(cm.group(1), [state])
            if not isinstance(go, np.ndarray) or go.shape != ():
                return None
            if not go:
                return n
            state = self.run(bm.group(1), [state])
        return None

    def advance(self, loop: Instr, state: Any, n: int) -> Any:
        """``state`` after ``n`` more runs of ``loop``'s body (what is known of it)."""
        bm = re.search(r"body=%?([\w.\-]+)", loop.attrs)
        if not bm or bm.group(1) not in self.comps:
            return None
        for _ in range(n):
            state = self.run(bm.group(1), [state])
        return state

    def of(self, comp: str, ins: Instr, ops: list[Any], args: list[Any] | None = None) -> Any:
        """The value of ``ins`` (an instruction of ``comp``) given its operands' values;
        ``args`` the computation's parameters' (for ``parameter``)."""
        op = ins.opcode
        if op == "parameter":
            k = int(ins.operands[0]) if ins.operands and ins.operands[0].isdigit() else 0
            return args[k] if args is not None and k < len(args) else None
        if op == "tuple":
            return list(ops)
        if op == "get-tuple-element":
            m = re.search(r"index=(\d+)", ins.attrs)
            v = ops[0] if ops else None
            k = int(m.group(1)) if m else 0
            return v[k] if isinstance(v, list) and k < len(v) else None
        if op in ("fusion", "call"):
            called = callees(ins)
            return self.run(called[0], ops) if called else None
        if op == "while":
            if not self.wanted(ins.shape) or not ops:
                return None
            tm = _TRIP.search(ins.attrs)
            n = int(tm.group(1)) if tm else self.trips(ins, ops[0])
            return None if n is None else self.advance(ins, ops[0], n)
        if op == "conditional":
            return self._conditional(ins, ops)
        if not self.wanted(ins.shape):
            return None
        try:
            got = self._array_op(comp, ins, ops)
        except (ValueError, IndexError, TypeError, KeyError, ZeroDivisionError):
            return None
        return None if got is None else np.asarray(got)

    def _conditional(self, ins: Instr, ops: list[Any]) -> Any:
        called = callees(ins)
        pred = re.search(r"true_computation=%?([\w.\-]+).*false_computation=%?([\w.\-]+)",
                         ins.attrs)  # fmt: skip
        if pred:
            called = [pred.group(2), pred.group(1)]
        k = ops[0] if ops else None
        if not isinstance(k, np.ndarray) or k.shape != ():
            return None
        i = int(k) if not pred else int(bool(k))
        i = i if 0 <= i < len(called) else len(called) - 1  # an index out of range: the last
        return self.run(called[i], [ops[1 + i] if 1 + i < len(ops) else None])

    def _array_op(self, comp: str, ins: Instr, ops: list[Any]) -> np.ndarray | None:
        op, attrs = ins.opcode, ins.attrs
        dtype, dims = _array(ins.shape)  # type: ignore[misc]
        if op == "constant":
            words = re.findall(r"-?\d+|true|false", ins.literal)
            vals = [w == "true" if w in ("true", "false") else int(w) for w in words]
            if len(vals) != int(np.prod(dims, dtype=np.int64)):
                return None
            return np.array(vals, dtype=dtype).reshape(dims)
        if op == "partition-id":
            return None if self.partition is None else np.array(self.partition, dtype=dtype)
        if op == "replica-id":
            return np.array(0, dtype=dtype)
        if op == "iota":
            m = re.search(r"iota_dimension=(\d+)", attrs)
            d = int(m.group(1)) if m else 0
            shape = [1] * len(dims)
            shape[d] = dims[d]
            return np.broadcast_to(np.arange(dims[d]).reshape(shape), dims).astype(dtype)
        if any(not isinstance(v, np.ndarray) for v in ops):
            return None
        if op == "copy":
            return ops[0]
        if op in ("bitcast", "reshape"):
            src = self.table(comp).get(ins.operands[0])
            if op == "bitcast" and not (_default_layout(ins.shape) and src is not None and
                                        _default_layout(src.shape)):  # fmt: skip
                return None
            return ops[0].reshape(dims).astype(dtype)
        if op == "convert":
            return ops[0].astype(dtype) if dtype is not np.bool_ else ops[0] != 0
        if op == "broadcast":
            bdims = _ints_attr(attrs, "dimensions") or []
            x = ops[0].transpose(np.argsort(bdims)) if bdims else ops[0]
            shape = [1] * len(dims)
            for j, d in enumerate(sorted(bdims)):
                shape[d] = x.shape[j]
            return np.broadcast_to(x.reshape(shape), dims).astype(dtype)
        if op == "transpose":
            return ops[0].transpose(_ints_attr(attrs, "dimensions"))
        if op in _BINARY:
            a, b = ops
            if a.dtype == np.bool_ and op in _LOGICAL:
                return _LOGICAL[op](a, b)
            return _BINARY[op](a, b).astype(dtype)
        if op == "divide":
            a, b = ops
            return (np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))).astype(dtype)
        if op == "compare":
            m = re.search(r"direction=(\w+)", attrs)
            return _COMPARE[m.group(1)](*ops) if m else None
        if op == "select":
            return np.where(ops[0], ops[1], ops[2]).astype(dtype)
        if op == "clamp":
            return np.minimum(np.maximum(ops[1], ops[0]), ops[2]).astype(dtype)
        if op == "not":
            return ~ops[0] if dtype is not np.bool_ else np.logical_not(ops[0])
        if op == "negate":
            return -ops[0]
        if op == "abs":
            return np.abs(ops[0])
        if op == "dynamic-slice":
            sizes = _ints_attr(attrs, "dynamic_slice_sizes") or []
            x = ops[0]
            starts = [min(max(int(s), 0), x.shape[d] - sizes[d]) for d, s in enumerate(ops[1:])]
            return x[tuple(slice(s, s + n) for s, n in zip(starts, sizes, strict=True))].copy()
        if op == "dynamic-update-slice":
            x, upd = ops[0].copy(), ops[1]
            starts = [min(max(int(s), 0), x.shape[d] - upd.shape[d])
                      for d, s in enumerate(ops[2:])]  # fmt: skip
            x[tuple(slice(s, s + n) for s, n in zip(starts, upd.shape, strict=True))] = upd
            return x
        if op == "slice":
            m = re.search(r"slice=\{([^}]*)\}", attrs)
            parts = re.findall(r"\[(-?\d+):(-?\d+)(?::(\d+))?\]", m.group(1)) if m else []
            return ops[0][tuple(slice(int(a), int(b), int(c or 1)) for a, b, c in parts)].copy()
        if op == "concatenate":
            return np.concatenate(ops, axis=(_ints_attr(attrs, "dimensions") or [0])[0])
        if op == "reduce" and len(ops) == 2:
            to = re.search(r"to_apply=%?([\w.\-]+)", attrs)
            root = self.comps.get(to.group(1), [None])[-1] if to else None
            fn = _REDUCERS.get(root.opcode) if root is not None else None
            if fn is None:
                return None
            axes = tuple(_ints_attr(attrs, "dimensions") or [])
            combine = _LOGICAL.get(root.opcode) if dtype is np.bool_ else None
            combine = combine or _BINARY[root.opcode]
            return np.asarray(combine(fn(ops[0], axis=axes), ops[1])).astype(dtype)
        return None


def _default_layout(shape: str) -> bool:
    """Whether an array shape's layout is the row-major default (or not printed)."""
    m = re.search(r"\]\{([\d,]*)", shape)
    if not m:
        return True
    got = [int(x) for x in m.group(1).split(",") if x]
    return got == sorted(got, reverse=True)


# --------------------------------------------------------------------------------------------
# Replica groups → mesh axes


def _ints(s: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", s)]


def _iota(reshape: list[int], perm: list[int] | None) -> np.ndarray:
    a = np.arange(int(np.prod(reshape))).reshape(reshape)
    return a.transpose(perm) if perm else a


def source_target_pairs(attrs: str) -> list[tuple[int, int]]:
    """A ``collective-permute``'s (source, target) partition pairs, as printed in ``attrs``
    (``[]`` where there are none)."""
    pm = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    return [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pm.group(1) if pm else "")]


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
