"""XLA's own estimate of a scheduled computation beside :mod:`jaxpar.gpu.timing`'s (issue 46,
item 4a).

XLA:GPU's latency-hiding scheduler (LHS) prints, per computation it schedules, the cycles its
latency estimator gives the schedule and the cycles it spends waiting on each kind of async
collective ("wasted"), when asked: ``TF_CPP_MIN_LOG_LEVEL=0
TF_CPP_VMODULE=latency_hiding_scheduler=1``. With the analytical speed-of-light estimator
(``--xla_gpu_enable_analytical_sol_latency_estimator=true``) the cycles are microseconds
(``xla/service/gpu/model/sol_latency_estimator.cc``: ``NodeCost`` and ``GetLatencyBetween``
return ``absl::ToDoubleMicroseconds``). What that estimator costs and how, read from the same
file (jaxlib 0.10.x):

* loop and input fusions: XLA's GPU performance model (bytes and FLOPs at the device's
  figures); matmuls: its matmul interpolator (bf16 GEMMs measured per GPU) where it has a
  profile for the device; every other instruction a fallback: 0.01 µs for a ``while`` (its
  body not counted), 10 µs for a cuDNN attention custom call (read from the VLOG 10 lines);
* async collective pairs: ``ComputeCollectiveTime`` from the options below (launch time, NIC
  speed in GB/s, chunk preparation, round trip, GPUs per node, chunk size) across nodes; inside
  one NVLink domain a measured perf table, else a fallback (the approximate estimator or the
  NCCL launch overhead, by version).

:func:`sol_options` sets those options from the mesh file where it has the figure
(``nic_speed_gbps`` = ``nic_bw`` in GB/s, ``gpus_per_node`` = ``devices_per_node``) and keeps
XLA's own defaults for the three it has no figure for (``xla/debug_options_flags.cc``: 0.45 ×
(100, 13.34, 68.89) µs for launch, chunk preparation and round trip, 4 MiB chunks).
:func:`parse_stats` reads the log; :func:`computation_times` walks the same computations with
jaxpar's simulation, once each, nested loops apart, so the two can be set side by side.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from jaxpar.analysis.hlo import collective_bytes
from jaxpar.analysis.hlo_text import parse_module
from jaxpar.config import HardwareConfig
from jaxpar.gpu.costs import ATTENTION
from jaxpar.gpu.timing import _Sim, check_hardware

# XLA's defaults for the options the mesh file has no figure for (xla/debug_options_flags.cc,
# kDefaultNcclCostModelCoeff = 0.45; int() as XLA writes them).
XLA_DEFAULTS = {"nccl_op_launch_us": 45, "chunk_prep_us": 6, "rtt_us": 31,
                "chunk_size_bytes": 4194304}  # fmt: skip
LOG_ENV = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "latency_hiding_scheduler=1"}

_HEAD = re.compile(r"Statistics (before|after) scheduling")
_COMP = re.compile(r"For computation: (\S+), module (.*)$")
_TOTAL = re.compile(r"Total cycles: ([\d.eE+-]+)")
_WASTED = re.compile(r"Total wasted cycles: ([\d.eE+-]+)")
_KIND = re.compile(r"Wasted cycles for ([\w -]+): ([\d.eE+-]+)")
_PEAK = re.compile(r"Memory pressure peak \(bytes\): (\d+)")


def sol_options(hw: HardwareConfig) -> dict[str, float]:
    """The analytical estimator's options for ``hw`` (module docstring)."""
    return {**XLA_DEFAULTS, "nic_speed_gbps": round(hw.nic_bw / 1e9, 3),
            "gpus_per_node": int(hw.devices_per_node)}  # fmt: skip


def sol_flags(hw: HardwareConfig) -> list[str]:
    """``XLA_FLAGS`` entries that turn the analytical estimator on, configured for ``hw``."""
    opts = ",".join(f"{k}={v:g}" for k, v in sorted(sol_options(hw).items()))
    return ["--xla_gpu_enable_analytical_sol_latency_estimator=true",
            f"--xla_gpu_analytical_latency_estimator_options={opts}"]  # fmt: skip


@dataclass
class LhsStats:
    """One computation's statistics as the scheduler printed them (estimator units: µs with
    the analytical estimator)."""

    computation: str
    module: str
    phase: str  # "before" or "after" scheduling
    total: float = 0.0
    wasted: float = 0.0
    wasted_by_kind: dict[str, float] = field(default_factory=dict)
    memory_peak: int = 0


def parse_stats(log: str) -> list[LhsStats]:
    """Every statistics block of ``log`` (the compiling process's stderr), in order."""
    out: list[LhsStats] = []
    phase = ""
    for line in log.splitlines():
        if m := _HEAD.search(line):
            phase = m.group(1)
        elif m := _COMP.search(line):
            out.append(LhsStats(m.group(1), m.group(2).strip(), phase))
        elif not out:
            continue
        elif m := _WASTED.search(line):
            out[-1].wasted = float(m.group(1))
        elif m := _KIND.search(line):
            if float(m.group(2)):
                out[-1].wasted_by_kind[m.group(1).strip()] = float(m.group(2))
        elif m := _TOTAL.search(line):
            out[-1].total = float(m.group(1))
        elif m := _PEAK.search(line):
            out[-1].memory_peak = int(m.group(1))
    return out


def computation_times(text: str, mesh: Any, hw: HardwareConfig, comps_wanted: list[str],
                      nodes: list[int] | None = None) -> dict[str, dict[str, float]]:  # fmt: skip
    """jaxpar's simulation of each computation in ``comps_wanted`` walked once (a loop body as
    one iteration, its parameter unknown: a collective started in the previous iteration is not
    waited for). Per computation: ``step_s``, ``compute_s``, ``exposed_s`` (all of it) and the
    same three without the ``while`` loops it runs (``flat_*``: XLA's estimator costs a
    ``while`` at 0.01 µs), ``loops_s``, the time spent in those loops, and ``attention_s``, the
    cuDNN attention time outside them (XLA: 10 µs a call)."""
    check_hardware(hw)
    comps, entry = parse_module(text)
    colls = {(c.computation, c.name): c for c in collective_bytes(text, mesh).collectives}
    out: dict[str, dict[str, float]] = {}
    for comp in comps_wanted:
        if comp not in comps:
            continue
        sim = _Nested(comps, entry, hw, mesh, nodes, colls)
        sim.run(comp, [None] * 64)
        exposed = sum(sim.exposed.values())
        out[comp] = {
            "step_s": sim.t,
            "compute_s": sim.compute_s,
            "exposed_s": exposed,
            "loops_s": sim.in_loops[0],
            "flat_step_s": sim.t - sim.in_loops[0],
            "flat_compute_s": sim.compute_s - sim.in_loops[1],
            "flat_exposed_s": exposed - sim.in_loops[2],
            "attention_s": sim.attention_s,
        }
    return out


class _Nested(_Sim):
    """The simulation, booking what its outermost ``while`` loops take apart."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.in_loops = [0.0, 0.0, 0.0]  # step, compute, exposed inside top-level loops
        self.attention_s = 0.0

    def loop(self, comp, ins, state):
        if self.loops:
            return super().loop(comp, ins, state)
        t, c, e = self.t, self.compute_s, sum(self.exposed.values())
        got = super().loop(comp, ins, state)
        self.in_loops[0] += self.t - t
        self.in_loops[1] += self.compute_s - c
        self.in_loops[2] += sum(self.exposed.values()) - e
        return got

    def kernel(self, comp, ins):
        before = self.compute_s
        super().kernel(comp, ins)
        if not self.loops and ins.opcode == "custom-call" and ATTENTION in ins.attrs:
            self.attention_s += self.compute_s - before


_COSTS = {
    "matmul": re.compile(r"Matmul cost from matmul_interpolator for (\S+): ([\d.eE+-]+) us"),
    "fusion": re.compile(r"Fusion cost from gpu_performance_model for (\S+): ([\d.eE+-]+) us"),
    "collective": re.compile(r"Computed collective time for (\S+): ([\d.eE+-]+) us"),
}
COST_ENV = {**LOG_ENV, "TF_CPP_VMODULE": "latency_hiding_scheduler=1,sol_latency_estimator=10"}


def parse_costs(log: str) -> dict[str, dict[str, float]]:
    """What XLA's analytical estimator gave each instruction, in µs, by class: ``matmul``
    (its matmul interpolator, a table of bf16 GEMMs measured per GPU), ``fusion`` (its GPU
    performance model) and ``collective`` (``ComputeCollectiveTime`` of a start). Needs
    ``TF_CPP_VMODULE=sol_latency_estimator=10`` (:data:`COST_ENV`); the first figure of each
    instruction is kept."""
    out: dict[str, dict[str, float]] = {k: {} for k in _COSTS}
    for kind, pat in _COSTS.items():
        for name, us in pat.findall(log):
            out[kind].setdefault(name, float(us))
    return out


def instruction_costs(text: str, mesh: Any, hw: HardwareConfig, xla: dict[str, dict[str, float]],
                      nodes: list[int] | None = None) -> dict[str, dict[str, Any]]:  # fmt: skip
    """jaxpar's cost of every instruction XLA costed (:func:`parse_costs`), by class: the
    count, both totals in µs, their ratio (XLA / jaxpar) and the median per-instruction ratio.
    The classes are XLA's, the matmuls with an f32 output apart (``matmul_f32_out``: XLA's
    interpolator costs a bf16 × bf16 → f32 GEMM from its f32 table, ~10× slower)."""
    comps, entry = parse_module(text)
    where = {i.name: (c, i) for c, body in comps.items() for i in body}
    colls = {(c.computation, c.name): c for c in collective_bytes(text, mesh).collectives}
    sim = _Sim(comps, entry, hw, mesh, nodes, colls)
    classes: dict[str, list[tuple[float, float]]] = {}
    for kind, costs in xla.items():
        classes.setdefault(kind, [])
        for name, us in costs.items():
            if name not in where:
                continue
            comp, ins = where[name]
            if kind == "collective":
                got = sim._transfer(comp, ins)
                mine = got[1].seconds if got else None
            else:
                mine = sim.coster.kernel(comp, ins).seconds
            # XLA's interpolator looks a bf16 x bf16 -> f32 GEMM up in its f32 table
            key = f"{kind}_f32_out" if kind == "matmul" and ins.shape.startswith("f32") else kind
            if mine is not None:
                classes.setdefault(key, []).append((us, mine * 1e6))
    out: dict[str, dict[str, Any]] = {}
    for key, pairs in classes.items():
        ratios = sorted(x / j for x, j in pairs if j > 0)
        xs, js = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
        out[key] = {"count": len(pairs), "xla_us": xs, "jaxpar_us": js,
                    "ratio_xla_over_jaxpar": xs / js if js else None,
                    "median_ratio": ratios[len(ratios) // 2] if ratios else None}  # fmt: skip
    return out


def mesh_of(layout: dict) -> Any:
    """A stand-in for jaxpar's device mesh of ``layout`` (the JSON ``layout`` of ``jaxpar
    compile``): its shape and axis names in partition order (:func:`jaxpar.devices.make_mesh`)."""
    from types import SimpleNamespace

    import numpy as np

    pp, dp, sp, tp = (int(layout.get(a, 1)) for a in ("pp", "dp", "sp", "tp"))
    shape, axes = (pp, dp, sp, tp), ("pp", "dp", "sp", "tp")
    shard, ep = int(layout.get("dp_shard", 0) or 0), int(layout.get("ep", 1) or 1)
    if 0 < shard < dp:
        shape, axes = (pp, dp // shard, shard, sp, tp), ("pp", "dpr", "dps", "sp", "tp")
    if ep > 1:
        shape, axes = (pp, dp // ep, ep, sp, tp), ("pp", "edp", "ep", "sp", "tp")
    return SimpleNamespace(devices=np.zeros(shape), axis_names=axes)
