"""Time of one collective call: latency per step plus bytes over bandwidth, with the algorithm
and protocol NCCL would choose for that size and group.

NCCL's own tuning model (``src/graph/tuning.cc`` of NVIDIA/nccl: ``baseLat`` and ``hwLat``,
in µs) prices a call of ``S`` bytes over ``n`` ranks on ``k`` nodes as
``base + steps_intra · lat_intra + steps_inter · lat_inter + S / algorithm_bandwidth`` and
runs the cheapest (algorithm, protocol) pair:

* **ring** (every collective): all-reduce ``2(n−1)`` steps, ``2(k−1)`` of them across nodes;
  all-gather / reduce-scatter ``n−1`` steps, ``k−1`` across. Bandwidth term: the wire bytes
  each device sends (:mod:`jaxpar.planner.traffic`) over its link
  (:func:`jaxpar.planner.hardware.link_bw`).
* **tree** (all-reduce only, and only across nodes here): ``2·((n/k − 1)·lat_intra +
  log2(k)·lat_inter)``; it moves the whole buffer up and down at 0.9 of the link's
  bandwidth, capped as NCCL caps it (``maxTreeBw``), so it wins for small buffers over many
  nodes and loses for large ones.
* **protocols**: ``Simple`` (full bandwidth, the per-hop latencies below) and ``LL128``
  (0.92 of the bandwidth, lower per-hop latency). LL (a quarter of the bandwidth) only wins
  for buffers of a few kB, which no train step issues, and is left out.

The per-hop latencies of the ring/Simple pair are the mesh file's
``hardware.intra_node_latency_s`` (NVLink) and ``hardware.inter_node_latency_s`` (the
network); a mesh without them gets NCCL's figures (:data:`DEFAULT_INTRA_LATENCY_S`,
:data:`DEFAULT_INTER_LATENCY_S`), and the plan says so. The other entries of NCCL's table
scale with them.

Call counts (how many calls a step issues) are the caller's: per layer and pass for ZeRO-3
and tensor parallelism (a ``lax.scan`` body is one layer; XLA's combiner cannot merge across
trips), per gradient bucket otherwise (:func:`combined_calls`, XLA's combiner thresholds from
the mesh's ``xla_flags``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from jaxpar.config import HardwareConfig
from jaxpar.planner.hardware import link_bw

# NCCL hwLat, ring/Simple (µs per step): NVLink 3.4, network 9.6 (src/graph/tuning.cc).
DEFAULT_INTRA_LATENCY_S = 3.4e-6
DEFAULT_INTER_LATENCY_S = 9.6e-6
# (base µs, NVLink hop µs, network hop µs, bandwidth share) per (algorithm, protocol), as
# NCCL's table has them; hops are scaled by the mesh's figures over the ring/Simple defaults.
NCCL_TABLE = {
    ("ring", "simple"): (8.4, 3.4, 9.6, 1.0),
    ("ring", "ll128"): (10.0, 1.9, 4.0, 0.92),
    ("tree", "simple"): (0.0, 28.0, 50.0, 0.9),
    ("tree", "ll128"): (4.4, 1.2, 8.5, 0.9 * 0.915),
}
# NCCL caps a tree's bus bandwidth (maxTreeBw, GB/s): 80 beyond two nodes, 110 within two.
TREE_MAX_BW = (110e9, 80e9)
# XLA:GPU's combiner thresholds when the mesh's xla_flags do not set them (30 MiB each).
XLA_DEFAULT_COMBINE_BYTES = 30 * 2**20
COMBINE_FLAGS = {
    "all-reduce": "--xla_gpu_all_reduce_combine_threshold_bytes",
    "all-gather": "--xla_gpu_all_gather_combine_threshold_bytes",
    "reduce-scatter": "--xla_gpu_reduce_scatter_combine_threshold_bytes",
}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "send")


@dataclass(frozen=True)
class CallTime:
    """One call: total seconds, the latency part of them, and what NCCL would run."""

    seconds: float
    latency_s: float
    algorithm: str
    protocol: str


def latencies(hw: HardwareConfig) -> tuple[float, float, list[str]]:
    """(NVLink hop, network hop) seconds and the defaults taken (mesh fields left unset)."""
    intra = getattr(hw, "intra_node_latency_s", None)
    inter = getattr(hw, "inter_node_latency_s", None)
    assumed = []
    if intra is None:
        intra = DEFAULT_INTRA_LATENCY_S
        assumed.append(f"hardware.intra_node_latency_s={intra:g} (NCCL's ring/Simple NVLink hop)")
    if inter is None:
        inter = DEFAULT_INTER_LATENCY_S
        assumed.append(f"hardware.inter_node_latency_s={inter:g} (NCCL's ring/Simple network hop)")
    return float(intra), float(inter), assumed


def nodes_spanned(hw: HardwareConfig, stride: int, size: int) -> int:
    """Nodes a group of ``size`` devices ``stride`` apart in mesh order occupies."""
    if size <= 1 or stride * size <= hw.devices_per_node:
        return 1
    per_node = max(1, min(size, hw.devices_per_node // max(stride, 1)))
    return max(2, math.ceil(size / per_node))


def _steps(kind: str, n: int, k: int) -> tuple[int, int]:
    """(all steps, steps across nodes) of a ring call of ``kind`` over n ranks on k nodes."""
    if kind == "all-reduce":
        return 2 * (n - 1), 2 * (k - 1)
    if kind == "send":
        return 1, 1 if k > 1 else 0
    return n - 1, k - 1  # all-gather, reduce-scatter, all-to-all (pairwise exchanges)


def call_time(
    hw: HardwareConfig, kind: str, wire_bytes: float, size: int, stride: int = 1
) -> CallTime:
    """Seconds of one ``kind`` call in which each device sends ``wire_bytes`` (ring count),
    over a group of ``size`` devices ``stride`` apart (module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"collective kind {kind!r}: must be one of {', '.join(KINDS)}")
    if size <= 1 and kind != "send":
        return CallTime(0.0, 0.0, "none", "none")
    intra, inter, _ = latencies(hw)
    k = nodes_spanned(hw, stride, max(size, 2) if kind == "send" else size)
    bw = link_bw(hw, stride, max(size, 2))
    n_steps, n_inter = _steps(kind, size, k)
    best: CallTime | None = None
    for (algo, proto), (base, hop_nv, hop_net, share) in NCCL_TABLE.items():
        if algo == "tree" and (kind != "all-reduce" or k == 1):
            continue
        lat_i = hop_nv * 1e-6 * intra / DEFAULT_INTRA_LATENCY_S
        lat_x = hop_net * 1e-6 * inter / DEFAULT_INTER_LATENCY_S
        if algo == "ring":
            lat = base * 1e-6 + (n_steps - n_inter) * lat_i + n_inter * lat_x
            secs = wire_bytes / (bw * share)
        else:  # the whole buffer up the tree and back down
            ppn = size / k
            lat = base * 1e-6 + 2 * ((ppn - 1) * lat_i + math.log2(k) * lat_x)
            buffer = wire_bytes * size / (2 * (size - 1))
            secs = 2 * buffer / min(bw * share, TREE_MAX_BW[k > 2])
        if best is None or lat + secs < best.seconds:
            best = CallTime(lat + secs, lat, algo, proto)
    assert best is not None
    return best


def combine_threshold(hw: HardwareConfig, kind: str) -> float:
    """XLA's combiner threshold for ``kind`` from the mesh's ``xla_flags`` (else XLA's)."""
    flag = COMBINE_FLAGS.get(kind)
    for f in hw.xla_flags if flag else ():
        m = re.fullmatch(re.escape(flag) + r"=(\d+)", f.strip())
        if m:
            return float(m.group(1))
    return float(XLA_DEFAULT_COMBINE_BYTES)


def combined_calls(hw: HardwareConfig, kind: str, buffer_bytes: float, bucket: float = 0) -> int:
    """Calls one reduction of ``buffer_bytes`` becomes: XLA combines independent collectives up
    to its threshold (``bucket`` > 0: a framework's own bucket size instead)."""
    size = bucket or combine_threshold(hw, kind)
    return max(1, math.ceil(buffer_bytes / size))
