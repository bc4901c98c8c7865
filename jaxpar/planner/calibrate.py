"""Measure the sustained matmul efficiency curve of the device JAX runs on.

For each size g of :data:`jaxpar.planner.hardware.CURVE_SIZES` (up to ``max_size``), times a
jitted ``[g, C] @ [C, C]`` matmul (C = max(g, ``width``), so g is the smallest dimension, the
quantity the cost model looks the curve up by) in the mesh's compute dtype, takes the best of
``repeats`` runs and divides the achieved FLOP/s by the mesh file's ``peak_flops_bf16``. A share
above 1 means the mesh file's peak is below what the device does: it is kept at 1 and reported.
"""

from __future__ import annotations

import time
from typing import Any

from jaxpar.config import HardwareConfig
from jaxpar.planner.hardware import CURVE_SIZES


def measure_curve(
    hw: HardwareConfig,
    dtype: str = "float32",
    max_size: int = 2048,
    width: int = 1024,
    repeats: int = 3,
    device: Any = None,
) -> dict[str, Any]:
    """``{"curve": [[g, share], ...], "points": [...measured FLOP/s...], "clipped": [...]}``."""
    import jax
    import jax.numpy as jnp

    device = device or jax.devices()[0]
    points, curve, clipped = [], [], []
    for g in (s for s in CURVE_SIZES if s <= max_size):
        c = max(g, width)
        a = jax.device_put(jnp.ones((g, c), dtype), device)
        b = jax.device_put(jnp.ones((c, c), dtype), device)
        f = jax.jit(jnp.matmul)
        f(a, b).block_until_ready()  # compile
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            f(a, b).block_until_ready()
            best = min(best, time.perf_counter() - t0)
        flops = 2 * g * c * c / best
        share = flops / hw.peak_flops_bf16
        if share > 1:
            clipped.append(g)
        points.append({"size": g, "other": c, "seconds": best, "flops_per_s": flops})
        curve.append([g, round(min(share, 1.0), 4)])
    return {"curve": curve, "points": points, "clipped": clipped, "dtype": dtype,
            "device": str(device)}  # fmt: skip
