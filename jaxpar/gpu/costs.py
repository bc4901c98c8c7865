"""What one instruction of a compiled XLA:GPU program costs on the target, in seconds.

Used by :mod:`jaxpar.gpu.timing`, which places these costs on the compute and communication
streams. Every figure comes from the mesh file's hardware (``peak_flops_bf16``,
``matmul_efficiency``, ``hbm_bw``, the links and NICs) and the planner's collective model:

* **matmuls** (``dot``, ``convolution``, XLA's gemm fusions, cuBLAS custom calls): their FLOPs
  at ``peak × matmul_share(size)`` (:func:`matmul_share`), ``size`` the side of the square
  matmul with the same FLOPs per byte (:func:`jaxpar.planner.cost.matmul_size`, here from the
  element counts of lhs, rhs and output: ``1.5·FLOPs / (L + R + E)``), or the fusion's bytes
  at HBM bandwidth if that is longer (a roofline); a dot of two FP8 operands (an FP8 GEMM,
  :mod:`jaxpar.model.fp8`) at ``peak_flops_fp8 × fp8_matmul_share(size)``;
* **cuDNN attention** (``__cudnn$fmha*``): ``4·B·H·Sq·Skv·D`` FLOPs forward, half of it under a
  causal mask (flash kernels skip the masked blocks), 2.5× that backward (FlashAttention-2,
  Dao 2023, §3.1: five matmuls against two), at :func:`attention_share` of peak;
* **everything else** (loop/input fusions, copies, slices, reductions): the bytes it reads and
  writes at ``hbm_bw`` (the peak: no fitted share). A fusion reading a buffer only through
  ``dynamic-slice``/``slice``/``gather`` reads the slice; one updating a buffer in place moves
  the update, not the buffer: XLA:GPU's rule (:func:`_in_place`), a ``dynamic-update-slice`` of
  a parameter read elsewhere in the fusion only at the slice it writes (``buf.at[i].add(x)``);
  otherwise the fusion writes its whole output;
* **collectives**: :func:`jaxpar.planner.collectives.call_time` (NCCL's ring/tree and protocol
  latencies, the mesh's NVLink and NIC bandwidths) for the wire bytes one device sends
  (:func:`jaxpar.analysis.hlo.collective_bytes`), over the group's size and the nodes it spans
  (from the replica groups and each partition's node); a ``collective-permute`` is a
  point-to-point send of its operand, across nodes when any of its pairs is.

No kernel launch overhead is added (the mesh files run XLA with command buffers).

**Kernel efficiency: published measurements, not fits** (:data:`MEASURED`). The planner's
matmul curve in the mesh files has a ceiling fitted on published training runs
(:data:`jaxpar.planner.hardware.GENERATIONS`); the time model, judged on such runs, does not use
it. A matmul of size ``g`` runs at ``min(ceiling, (g/3)·hbm_bw / peak)`` of peak — the
roofline: a g×g×g bf16 matmul does g/3 FLOPs per byte it moves — with ``ceiling`` the largest
bf16 matmul throughput measured on the GPU, from S. Bekman's *Machine Learning Engineering*,
"Maximum Achievable Matmul FLOPS comparison table" (BF16, v2; ``torch.matmul`` over a sweep of
shapes, mean of 100 iterations after 50 warm-up; stas00/ml-engineering@b9e29720
compute/accelerator/README.md): A100 SXM 271.2 of 312 TFLOP/s (86.9%), H100 SXM 794.5 of 989
(80.3%); the H200 (the H100's SM at the same 700 W) takes the H100 SXM figure. FP8 GEMMs on
Hopper run at DeepGEMM's published "up to 1550 TFLOPS on H800" (deepseek-ai/DeepGEMM README;
the H800 has the H100 SXM's compute): 78.3% of the 1979 TFLOP/s dense FP8 peak. Attention kernels
run at the published ceiling of flash attention: FlashAttention-2 (Dao 2023, abstract: "50-73%
of the theoretical maximum FLOPs/s on A100") 0.73 on A100, FlashAttention-3 (Shah et al. 2024,
abstract: "FP16 reaching up to 740 TFLOPs/s (75% utilization)") 0.75 on Hopper, each under the
same roofline in ``Skv``. A GPU without a measurement here (and the CPU meshes) keeps the mesh
file's curve (``jaxpar bench --calibrate`` measures it on the machine).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from jaxpar.analysis.hlo_text import (
    Instr,
    callees,
    replica_groups,
    shape_bytes,
    source_target_pairs,
)
from jaxpar.config import HardwareConfig
from jaxpar.planner.collectives import call_time
from jaxpar.planner.hardware import matmul_efficiency

FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id",
    "replica-id", "after-all", "opt-barrier", "add-dependency", "domain", "iota",
    "async-update", "async-done",
}  # fmt: skip
_DIMS = re.compile(r"\b[a-z]+[0-9a-z]*\[([\d,]*)\]")
ATTENTION = "__cudnn$fmha"
# The planner's kinds for XLA's (collective-permute is one point-to-point send per device).
PLANNER_KIND = {"ragged-all-to-all": "all-to-all", "collective-permute": "send"}


@dataclass(frozen=True)
class Measured:
    """A GPU's published kernel ceilings (module docstring)."""

    gpu: str  # how a mesh file's ``hardware.gpu`` starts
    peak_flops_bf16: float  # the dense bf16 peak the measurement is a share of
    matmul_flops: float  # the largest bf16 matmul throughput measured
    attention_share: float  # flash attention's published share of peak
    source: str
    fp8_matmul_flops: float = 0.0  # the largest FP8 GEMM throughput published (0: no FP8)


MAMF = (
    "Bekman, Machine Learning Engineering, 'Maximum Achievable Matmul FLOPS comparison table' "
    "(BF16 v2), stas00/ml-engineering@b9e29720 compute/accelerator/README.md"
)
# FP8 GEMMs on Hopper: DeepGEMM's README (deepseek-ai/DeepGEMM), "up to 1550 TFLOPS on H800"
# for its dense FP8 GEMMs; the H800 has the H100 SXM's SMs and clocks (1979 TFLOP/s dense FP8).
DEEPGEMM = "DeepGEMM README (H800 = H100 SXM compute: up to 1550 TFLOP/s FP8)"
MEASURED = (
    Measured("a100", 312e12, 271.2e12, 0.73, MAMF + " (A100 SXM); FlashAttention-2 abstract"),
    Measured("h100", 989e12, 794.5e12, 0.75,
             MAMF + " (H100 SXM); FlashAttention-3 abstract; " + DEEPGEMM, 1550e12),
    Measured("h200", 989e12, 794.5e12, 0.75,
             MAMF + " (H100 SXM: same SM and power); " + DEEPGEMM, 1550e12),
)  # fmt: skip


def measured(hw: HardwareConfig) -> Measured | None:
    """The published ceilings of ``hw``'s GPU (by ``hardware.gpu``, else by a peak within 5%
    of one measured), or None."""
    name = str(getattr(hw, "gpu", "") or "").lower()
    for m in MEASURED:
        if name.startswith(m.gpu):
            return m
    if hw.platform != "gpu" or name:
        return None
    return next((m for m in MEASURED if abs(hw.peak_flops_bf16 / m.peak_flops_bf16 - 1) < 0.05),
                None)  # fmt: skip


def _roofline(hw: HardwareConfig, size: float) -> float:
    """Share of peak a size-``size`` bf16 matmul's bytes allow: (size/3)·hbm_bw / peak."""
    return max(size, 1.0) / 3.0 * hw.hbm_bw / hw.peak_flops_bf16


def matmul_share(hw: HardwareConfig, size: float) -> float:
    """Share of ``peak_flops_bf16`` a matmul of ``size`` (:func:`jaxpar.planner.cost.
    matmul_size`) sustains: the measured ceiling under the roofline (module docstring); the
    mesh file's curve for a GPU without a measurement."""
    m = measured(hw)
    if m is None:
        return matmul_efficiency(hw, size)
    return min(m.matmul_flops / hw.peak_flops_bf16, _roofline(hw, size))


def fp8_matmul_share(hw: HardwareConfig, size: float) -> float:
    """Share of ``peak_flops_fp8`` an FP8 GEMM of ``size`` sustains: the published FP8
    ceiling under the roofline (an FP8 operand is half a bf16 one's bytes for twice the peak,
    so the bf16 roofline's share carries over); a GPU without a measurement takes the mesh
    file's bf16 curve as a share of its FP8 peak."""
    m = measured(hw)
    if m is None or not m.fp8_matmul_flops:
        return matmul_efficiency(hw, size)
    return min(m.fp8_matmul_flops / hw.peak_flops_fp8, _roofline(hw, size))


def attention_share(hw: HardwareConfig, skv: float) -> float:
    """Share of peak a flash-attention kernel over ``skv`` keys sustains (module docstring)."""
    m = measured(hw)
    if m is None:
        return matmul_efficiency(hw, skv)
    return min(m.attention_share * m.peak_flops_bf16 / hw.peak_flops_bf16, _roofline(hw, skv))


@dataclass(frozen=True)
class Kernel:
    """One compute-stream instruction: seconds, FLOPs (hardware, recompute included), bytes."""

    seconds: float
    flops: float
    bytes: float
    kind: str  # "matmul", "attention" or "memory"


@dataclass(frozen=True)
class Transfer:
    """One collective call: seconds (the latency part apart), and over what."""

    seconds: float
    latency_s: float
    kind: str
    axes: tuple[str, ...]
    wire_bytes: float  # what one device sends, ring count
    group_size: int
    nodes: int  # nodes the largest group spans
    algorithm: str


def _elems(shape: str) -> float:
    m = _DIMS.search(shape)
    return float(math.prod(int(x) for x in m.group(1).split(",") if x)) if m else 0.0


def _dims(shape: str) -> list[int]:
    m = _DIMS.search(shape)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def _first(shape: str) -> str:
    """The first array of a (tuple) shape."""
    return shape[1:].split(")")[0] if shape.startswith("(") else shape


# Elementwise opcodes (HloInstruction::IsElementwise, the ones fusions hold).
_ELEMENTWISE = frozenset((
    "abs", "add", "and", "atan2", "cbrt", "ceil", "clamp", "compare", "convert", "cosine",
    "divide", "exponential", "exponential-minus-one", "floor", "imag", "is-finite", "log",
    "log-plus-one", "logistic", "maximum", "minimum", "multiply", "negate", "not", "or",
    "popcnt", "power", "real", "remainder", "round-nearest-afz", "round-nearest-even", "rsqrt",
    "select", "shift-left", "shift-right-arithmetic", "shift-right-logical", "sign", "sine",
    "sqrt", "subtract", "tan", "tanh", "xor",
))  # fmt: skip


def _readers(name: str, users: dict[str, list[Instr]]) -> list[Instr]:
    """The instructions that read ``name``, through bitcasts of it."""
    out = []
    for u in users.get(name, []):
        out += _readers(u.name, users) if u.opcode == "bitcast" else [u]
    return out


def _through_bitcasts(ins: Instr, table: dict[str, Instr]) -> Instr | None:
    """The ``dynamic-update-slice`` a fusion root is, possibly under bitcasts, or None."""
    while ins.opcode == "bitcast" and ins.operands and ins.operands[0] in table:
        ins = table[ins.operands[0]]
    return ins if ins.opcode == "dynamic-update-slice" else None


def _in_place(roots: list[Instr], table: dict[str, Instr],
              users: dict[str, list[Instr]]) -> set[str]:  # fmt: skip
    """The parameters a fusion updates in place; empty when XLA:GPU writes its whole output.

    XLA's rule (``CanEmitFusedDynamicUpdateSliceInPlaceForGpu``, xla/service/gpu/
    ir_emission_utils.cc): every root is a ``dynamic-update-slice`` (under bitcasts) of the
    same update shape, whose buffer is a fusion parameter (under a bitcast); what reads that
    parameter, followed through its users, is only ``dynamic-slice`` s of the update's shape at
    the update's start indices (the slice is read before it is written), elementwise ops,
    bitcasts and tuples, up to the update itself."""
    out: set[str] = set()
    shapes = set()
    for r in roots:
        dus = _through_bitcasts(r, table)
        if dus is None or len(dus.operands) < 2 or dus.operands[1] not in table:
            return set()
        shapes.add(tuple(_dims(table[dus.operands[1]].shape)))
        buf = table.get(dus.operands[0])
        if buf is not None and buf.opcode == "bitcast" and buf.operands:
            buf = table.get(buf.operands[0])
        if buf is None or buf.opcode != "parameter":
            return set()
        update, starts = _dims(table[dus.operands[1]].shape), dus.operands[2:]
        seen, todo = {buf.name, dus.name}, [buf.name]
        while todo:
            for u in users.get(todo.pop(), []):
                if u.opcode == "dynamic-slice":
                    same = (u.operands[0] == dus.operands[0] and u.operands[1:] == starts
                            and _dims(u.shape) == update)  # fmt: skip
                    if not same:
                        return set()
                elif u.opcode == "dynamic-update-slice" and u is not dus:
                    return set()
                elif u is not dus and u.opcode not in (*_ELEMENTWISE, "bitcast", "tuple"):
                    return set()
                if u.name not in seen:
                    seen.add(u.name)
                    todo.append(u.name)
        out.add(buf.name)
    return out if len(shapes) == 1 else set()


class Coster:
    """Costs of the instructions of one parsed module (``comps`` from
    :func:`jaxpar.analysis.hlo_text.parse_module`) on ``hw``; ``nodes[p]`` is the node of
    partition ``p`` (default: ``p // hw.devices_per_node``)."""

    def __init__(self, comps: dict[str, list[Instr]], hw: HardwareConfig,
                 nodes: Sequence[int] | None = None) -> None:  # fmt: skip
        self.comps, self.hw = comps, hw
        self.nodes = list(nodes) if nodes is not None else None
        self._tables: dict[str, dict[str, Instr]] = {}

    def table(self, comp: str) -> dict[str, Instr]:
        """Name → instruction of ``comp``."""
        if comp not in self._tables:
            self._tables[comp] = {i.name: i for i in self.comps.get(comp, [])}
        return self._tables[comp]

    def node(self, p: int) -> int:
        """The node of partition ``p``."""
        if self.nodes is not None and p < len(self.nodes):
            return self.nodes[p]
        return p // max(self.hw.devices_per_node, 1)

    # ----------------------------------------------------------------------------- compute

    def _matmul_seconds(self, flops: float, elems: float, fp8: bool = False) -> float:
        size = 1.5 * flops / elems if elems else 1.0
        if fp8 and self.hw.peak_flops_fp8:  # FP8 operands: the FP8 tensor cores
            return flops / (self.hw.peak_flops_fp8 * fp8_matmul_share(self.hw, size))
        return flops / (self.hw.peak_flops_bf16 * matmul_share(self.hw, size))

    def _fp8(self, ins: Instr, table: dict[str, Instr]) -> bool:
        """Whether a dot's two operands are FP8 (an FP8 GEMM: ``jaxpar.model.fp8``)."""
        shapes = [table[o].shape if o in table else "" for o in ins.operands[:2]]
        return len(shapes) == 2 and all(_first(x).startswith("f8") for x in shapes)

    def _dots(self, comp: str, seen: tuple[str, ...] = ()) -> tuple[float, float]:
        """(FLOPs, seconds) of the dots and convolutions of ``comp`` and what it calls."""
        flops = secs = 0.0
        table = self.table(comp)
        for ins in self.comps.get(comp, []):
            f, e = self._dot(ins, table)
            if f:
                flops, secs = flops + f, secs + self._matmul_seconds(f, e, self._fp8(ins, table))
            for c in callees(ins):
                if c in self.comps and c not in seen:
                    f2, s2 = self._dots(c, (*seen, c))
                    flops, secs = flops + f2, secs + s2
        return flops, secs

    def _dot(self, ins: Instr, table: dict[str, Instr]) -> tuple[float, float]:
        """(FLOPs, lhs + rhs + output elements) of a dot, convolution or cuBLAS gemm."""
        shapes = [table[o].shape if o in table else "" for o in ins.operands]
        if len(shapes) < 2:
            return 0.0, 0.0
        lhs, rhs, out = _dims(_first(shapes[0])), _dims(_first(shapes[1])), _first(ins.shape)
        if ins.opcode == "dot":
            cm = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
            contracting = [int(x) for x in cm.group(1).split(",") if x] if cm else []
        elif ins.opcode == "custom-call" and "__cublas" in ins.attrs:
            cm = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
            contracting = [int(x.strip('" ')) for x in cm.group(1).split(",") if x] if cm else []
        elif ins.opcode == "convolution":
            # output elements × (kernel elements per output feature)
            lm = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
            o = lm.group(1).find("o") if lm else -1
            per_out = math.prod(rhs) / (rhs[o] if 0 <= o < len(rhs) else 1) if rhs else 0
            flops = 2.0 * _elems(out) * per_out
            return flops, math.prod(lhs or [0]) + math.prod(rhs or [0]) + _elems(out)
        else:
            return 0.0, 0.0
        k = math.prod(lhs[i] for i in contracting if i < len(lhs)) if contracting else 1
        flops = 2.0 * _elems(out) * k
        return flops, float(math.prod(lhs or [0]) + math.prod(rhs or [0])) + _elems(out)

    def gemms(self) -> dict[str, int]:
        """Static count of the program's GEMM call sites by operand type (``fp8``: both
        operands FP8, ``jaxpar.model.fp8``; else the lhs's type, e.g. ``bf16``): a ``dot`` or
        cuBLAS call outside fused code, or a fusion whose fused code holds a dot (XLA:GPU's
        gemm fusions). Counted like the cuDNN attention calls: once per place in the program,
        not per execution."""
        fused = {c for comp in self.comps.values() for i in comp if i.opcode == "fusion"
                 for c in callees(i)}  # fmt: skip
        counts: dict[str, int] = {}

        def kind(comp: str, ins: Instr) -> str:
            table = self.table(comp)
            if self._fp8(ins, table):
                return "fp8"
            lhs = table[ins.operands[0]].shape if ins.operands[0] in table else ""
            m = re.match(r"\(?([a-z]+[0-9a-z]*)\[", _first(lhs))
            return m[1] if m else "unknown"

        def dot_in(comp: str) -> str | None:
            for ins in self.comps.get(comp, []):
                if self._dot(ins, self.table(comp))[0]:
                    return kind(comp, ins)
            return None

        for name, comp in self.comps.items():
            if name in fused:
                continue
            for ins in comp:
                k = None
                if ins.opcode == "fusion":
                    k = next((d for c in callees(ins) if (d := dot_in(c))), None)
                elif self._dot(ins, self.table(name))[0]:
                    k = kind(name, ins)
                if k:
                    counts[k] = counts.get(k, 0) + 1
        return counts

    def _attention(self, ins: Instr, table: dict[str, Instr]) -> tuple[float, float]:
        """(FLOPs, seconds) of a cuDNN attention custom call."""
        m = re.search(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]',
                      ins.attrs)  # fmt: skip
        bhqk = [int(x.strip('" ')) for x in m.group(1).split(",")] if m else []
        first = table.get(ins.operands[0]) if ins.operands else None
        q = _elems(_first(first.shape)) if first is not None else 0.0
        if len(bhqk) != 4 or not q:
            return 0.0, 0.0
        b, h, sq, skv = bhqk
        d = q / (b * h * sq)
        flops = 4.0 * b * h * sq * skv * d
        if '"mask_type": "CAUSAL"' in ins.attrs or '"mask_type":"CAUSAL"' in ins.attrs:
            flops /= 2
        target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
        if target and "Backward" in target.group(1):
            flops *= 2.5
        return flops, flops / (self.hw.peak_flops_bf16 * attention_share(self.hw, skv))

    def _bytes(self, ins: Instr, table: dict[str, Instr]) -> float:
        """Bytes ``ins`` reads and writes in device memory."""
        out = shape_bytes(ins.shape)
        ops = [shape_bytes(table[o].shape) if o in table else 0.0 for o in ins.operands]
        if ins.opcode in ("dynamic-slice", "slice", "gather"):
            return 2 * out
        if ins.opcode == "dynamic-update-slice":
            return 2 * (ops[1] if len(ops) > 1 else out)
        if ins.opcode == "copy":
            return 2 * out
        if ins.opcode != "fusion":
            return out + sum(ops)
        fused = re.search(r"calls=%?([\w.\-]+)", ins.attrs)
        body = self.comps.get(fused.group(1), []) if fused else []
        if not body:
            return out + sum(ops)
        ftable = self.table(fused.group(1))
        users: dict[str, list[Instr]] = {}
        for i in body:
            for o in i.operands:
                users.setdefault(o, []).append(i)
        params = {}
        for i in body:
            if i.opcode == "parameter" and i.operands and i.operands[0].isdigit():
                params[int(i.operands[0])] = i.name
        roots = [body[-1]]
        if body[-1].opcode == "tuple":
            roots = [ftable[o] for o in body[-1].operands if o in ftable]
        in_place = _in_place(roots, ftable, users)
        total = 0.0
        for r in roots:  # what the fusion writes
            dus = _through_bitcasts(r, ftable)
            if in_place and dus is not None:
                total += shape_bytes(ftable[dus.operands[1]].shape)
            else:
                total += shape_bytes(r.shape)
        for k, size in enumerate(ops):  # what it reads
            p = params.get(k)
            use = _readers(p, users) if p else []
            if p in in_place:  # the update's slice, read where a dynamic-slice reads it
                total += sum(shape_bytes(u.shape) for u in use if u.opcode == "dynamic-slice")
            elif use and all(u.opcode in ("dynamic-slice", "slice", "gather") for u in use):
                total += sum(shape_bytes(u.shape) for u in use)
            else:
                total += size
        return total

    def kernel(self, comp: str, ins: Instr) -> Kernel:
        """The cost of a compute instruction of ``comp`` (zero for bookkeeping)."""
        if ins.opcode in FREE:
            return Kernel(0.0, 0.0, 0.0, "memory")
        table = self.table(comp)
        mem = self._bytes(ins, table)
        mem_s = mem / self.hw.hbm_bw
        if ins.opcode == "custom-call" and ATTENTION in ins.attrs:
            flops, secs = self._attention(ins, table)
            return Kernel(max(secs, mem_s), flops, mem, "attention")
        flops, secs = 0.0, 0.0
        f, e = self._dot(ins, table)
        if f:
            flops, secs = f, self._matmul_seconds(f, e, self._fp8(ins, table))
        elif ins.opcode == "fusion":
            fused = re.search(r"calls=%?([\w.\-]+)", ins.attrs)
            if fused:
                flops, secs = self._dots(fused.group(1), (fused.group(1),))
        if flops:
            return Kernel(max(secs, mem_s), flops, mem, "matmul")
        return Kernel(mem_s, 0.0, mem, "memory")

    # ----------------------------------------------------------------------------- collectives

    def transfer(self, ins: Instr, kind: str, wire_bytes: float, axes: tuple[str, ...],
                 n_parts: int) -> Transfer:  # fmt: skip
        """The time of one ``kind`` call of ``ins`` (``wire_bytes`` per device, ring count)."""
        dpn = max(self.hw.devices_per_node, 1)
        if kind == "collective-permute":
            pairs = source_target_pairs(ins.attrs)
            moving = [(a, b) for a, b in pairs if a != b]
            if not moving:
                return Transfer(0.0, 0.0, kind, axes, 0.0, 1, 1, "none")
            cross = any(self.node(a) != self.node(b) for a, b in moving)
            # the busiest device sends its whole operand (the wire figure is an average)
            table_bytes = wire_bytes * n_parts / len(moving)
            t = call_time(self.hw, "send", table_bytes, 2, dpn if cross else 1)
            return Transfer(t.seconds, t.latency_s, kind, axes, table_bytes, 2, 1 + cross,
                            t.algorithm)  # fmt: skip
        groups = replica_groups(ins.attrs, n_parts)
        n = max(len(g) for g in groups)
        per_node, spans = n, 1
        for g in groups:
            counts: dict[int, int] = {}
            for p in g:
                counts[self.node(p)] = counts.get(self.node(p), 0) + 1
            if len(counts) > spans:
                spans, per_node = len(counts), max(counts.values())
        # the stride that puts `per_node` members of an n-group on each node (planner's terms)
        stride = 1 if spans == 1 else max(1, dpn // max(per_node, 1))
        t = call_time(self.hw, PLANNER_KIND.get(kind, kind), wire_bytes, n, stride)
        return Transfer(t.seconds, t.latency_s, kind, axes, wire_bytes, n, spans, t.algorithm)


def backend_config(ins: Instr) -> dict:
    """The ``collective_backend_config`` of a start (empty when absent or unreadable)."""
    m = re.search(r'"collective_backend_config":(\{[^{}]*\})', ins.attrs)
    try:
        return json.loads(m.group(1)) if m else {}
    except json.JSONDecodeError:
        return {}
