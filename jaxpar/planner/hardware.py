"""Hardware figures the cost model reads from a mesh file: matmul efficiency, links, NICs.

* **Matmul efficiency** — ``hardware.matmul_efficiency``: ``[[size, share], ...]``, the
  sustained share of ``peak_flops_bf16`` of a matmul whose smallest dimension is ``size``,
  interpolated in log2(size) and held flat beyond the ends. ``jaxpar bench --calibrate``
  measures it on the machine it runs on and writes it into a mesh file (:func:`write_curve`).
  The GPU mesh files carry the roofline-shaped curve of :func:`roofline_curve`, whose two
  constants were fitted on published runs (:mod:`jaxpar.planner.published`): a matmul of
  smallest dimension g does about g/3 FLOPs per byte it moves, so it leaves the memory-bound
  regime around the ridge point ``peak / hbm_bw`` — an H100 (989 TFLOP/s, 3.35 TB/s) needs
  larger matmuls than an A100 (312 TFLOP/s, 2.04 TB/s) to reach the same share, and an H200
  (same peak, 4.8 TB/s) smaller ones.
* **Links** — a group of ``size`` devices ``stride`` apart in mesh order (pp, dp, sp, tp) is
  intra-node when ``stride · size <= devices_per_node`` (NVLink, ``intra_node_bw`` per device);
  otherwise its traffic leaves the node through the ``nics_per_node`` adapters of ``nic_bw``
  each, shared by every group of the node that crosses at the same time: a ring whose members
  sit ``m`` per node gets ``nics · nic_bw · m / devices_per_node`` (all 8 adapters for pure
  data parallelism over whole nodes; one adapter's worth when tp fills the node).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from jaxpar.config import HardwareConfig
from jaxpar.errors import ConfigError

CURVE_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# The GPU mesh files' curves: share_max · g / (g + kappa · peak / hbm_bw), share_max per GPU
# generation (GENERATIONS, fitted), kappa = 1 set (jaxpar.planner.published.fit).
# tests/test_planner.py checks that every GPU mesh file carries the curve these give.
ROOFLINE_KAPPA = 1.0
GPU_MESHES = ("a100-8", "a100-64", "a100-40gb-8", "h100-8", "h100-1024", "h200-8")


@dataclass(frozen=True)
class Generation:
    """What a GPU generation sustains, as fitted on published runs
    (:mod:`jaxpar.planner.published`, the rows in ``FITTED`` only).

    * ``matmul_share_max``: the roofline curve's ceiling, the share of ``peak_flops_bf16`` a
      large bf16 matmul sustains in a training step (clocks under load, kernel efficiency);
    * ``elementwise_share``: the share of ``hbm_bw`` the memory-bound remainder sustains
      (norms, rotary, softmax, casts, the optimizer): Hopper's matmuls run ~3× an A100's but
      its memory-bound kernels only ~1.6× (the HBM ratio), so the remainder weighs more there.
    """

    name: str
    peak_flops_bf16: float  # how a mesh file's hardware is recognised (dense bf16 peak)
    matmul_share_max: float
    elementwise_share: float


GENERATIONS = (
    Generation("a100", 312e12, 0.76, 0.75),
    Generation("h100", 989e12, 0.62, 0.85),  # H100 and H200 (same SM, same peak)
)
ROOFLINE_SHARE_MAX = GENERATIONS[0].matmul_share_max  # the A100 figure (older callers)


def generation(hw: HardwareConfig) -> Generation | None:
    """The GPU generation of ``hw`` (by a ``gpu`` name when the mesh has one, else by its
    peak), or None (CPU, or a GPU the fit has not seen: the curve is then the mesh's own)."""
    name = str(getattr(hw, "gpu", "") or "").lower()
    for g in GENERATIONS:
        if name.startswith(g.name) or (name.startswith("h200") and g.name == "h100"):
            return g
    if hw.platform != "gpu":
        return None
    return next((g for g in GENERATIONS if abs(hw.peak_flops_bf16 / g.peak_flops_bf16 - 1) < 0.05),
                None)  # fmt: skip


def elementwise_share(hw: HardwareConfig) -> float:
    """Share of ``hbm_bw`` memory-bound kernels sustain on ``hw`` (1 off the fitted GPUs)."""
    g = generation(hw)
    return g.elementwise_share if g else 1.0


def matmul_efficiency(hw: HardwareConfig, size: float) -> float:
    """Sustained share of peak of a matmul whose smallest dimension is ``size``."""
    pts = hw.matmul_efficiency
    if not pts:
        raise ConfigError(
            "hardware.matmul_efficiency missing: [[size, share], ...] (jaxpar bench "
            "--calibrate measures it)"
        )
    x = math.log2(max(size, 1.0))
    xs = [math.log2(p[0]) for p in pts]
    if x <= xs[0]:
        return float(pts[0][1])
    for i in range(1, len(pts)):
        if x <= xs[i]:
            y0, y1 = pts[i - 1][1], pts[i][1]
            return float(y0 + (y1 - y0) * (x - xs[i - 1]) / (xs[i] - xs[i - 1]))
    return float(pts[-1][1])


def roofline_curve(
    peak: float, hbm_bw: float, share_max: float, kappa: float, sizes=CURVE_SIZES
) -> list[list[float]]:
    """``share_max · g / (g + kappa · peak / hbm_bw)`` sampled at ``sizes`` (rounded)."""
    ridge = peak / hbm_bw
    return [[g, round(share_max * g / (g + kappa * ridge), 4)] for g in sizes]


def gpu_curve(hw: HardwareConfig, share_max: float | None = None) -> list[list[float]]:
    """The fitted roofline curve for a GPU's peak and memory bandwidth (its generation's
    ``matmul_share_max`` unless ``share_max`` is given)."""
    if share_max is None:
        g = generation(hw)
        share_max = g.matmul_share_max if g else GENERATIONS[0].matmul_share_max
    return roofline_curve(hw.peak_flops_bf16, hw.hbm_bw, share_max, ROOFLINE_KAPPA)


def link_bw(hw: HardwareConfig, stride: int, size: int) -> float:
    """Bytes/s per device of a collective over ``size`` devices ``stride`` apart (module doc)."""
    if size <= 1 or stride * size <= hw.devices_per_node:
        return hw.intra_node_bw
    per_node = max(1, min(size, hw.devices_per_node // max(stride, 1)))
    crossing = hw.nics_per_node * hw.nic_bw * per_node / hw.devices_per_node
    return min(hw.intra_node_bw, crossing)


def crosses_nodes(hw: HardwareConfig, stride: int, size: int) -> bool:
    """Whether a group of ``size`` devices ``stride`` apart spans more than one node."""
    return size > 1 and stride * size > hw.devices_per_node


def write_curve(path: str | Path, curve: list[list[float]]) -> None:
    """Set ``hardware.matmul_efficiency`` in the mesh file at ``path``, keeping everything else
    (comments included) as written."""
    path = Path(path)
    text = path.read_text()
    line = "  matmul_efficiency: [" + ", ".join(f"[{int(g)}, {s}]" for g, s in curve) + "]"
    pattern = re.compile(r"^  matmul_efficiency:.*$", re.M)
    if pattern.search(text):
        text = pattern.sub(line, text, count=1)
    elif re.search(r"^hardware:\s*$", text, re.M):
        text = re.sub(r"^hardware:\s*$", "hardware:\n" + line, text, count=1, flags=re.M)
    else:
        raise ConfigError(f"{path}: no block-style 'hardware:' mapping to write the curve into")
    path.write_text(text)
