"""Published large training runs costed by the planner's own model, and the fit of its
per-generation constants.

Each row of :data:`~jaxpar.planner.published_runs.RUNS` is one published run: model shape, GPU
kind and count, full layout, the framework (an :class:`~jaxpar.planner.frameworks.Executor`:
attention kernel, asynchronous pipeline, overlapped collectives) and the measured step time,
with its source. The planner predicts each row's step time with exactly the cost model
``jaxpar plan`` uses, on the hardware section of the repository's mesh file for that GPU kind.

The constants fitted here are per GPU generation (:data:`jaxpar.planner.hardware.GENERATIONS`):
the matmul roofline's ``matmul_share_max`` and the memory-bound remainder's
``elementwise_share``. They are fitted on the rows named in
:data:`~jaxpar.planner.published_runs.FITTED` only — chosen before the fit, one tensor/pipeline
run and one ZeRO-3 run per generation; ``kappa`` = 1 and two elementwise passes are set, not
fitted. Every other row is held out.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import statistics
from dataclasses import dataclass

from jaxpar import config as C
from jaxpar.config import HardwareConfig, LayoutConfig
from jaxpar.planner import hardware as HWM
from jaxpar.planner.cost import step_cost
from jaxpar.planner.published_runs import FITTED, RUNS, Run
from jaxpar.planner.workload import Shape

__all__ = ["FITTED", "RUNS", "Fit", "Run", "comparison", "fit", "predict", "summary"]

SHARE_GRID = [round(0.40 + 0.01 * i, 2) for i in range(41)]  # matmul_share_max, 0.40-0.80
ELEMENTWISE_GRID = [round(0.30 + 0.05 * i, 2) for i in range(15)]  # elementwise_share


@dataclass(frozen=True)
class Fit:
    """The per-generation constants: ``{generation: (matmul_share_max, elementwise_share)}``."""

    constants: tuple[tuple[str, float, float], ...] = tuple(
        (g.name, g.matmul_share_max, g.elementwise_share) for g in HWM.GENERATIONS
    )

    def of(self, name: str) -> tuple[float, float]:
        """(matmul_share_max, elementwise_share) of generation ``name``."""
        return next((s, e) for n, s, e in self.constants if n == name)

    def with_(self, name: str, share: float, elementwise: float) -> Fit:
        """A copy with generation ``name``'s constants replaced."""
        rows = tuple((n, share, elementwise) if n == name else (n, s, e)
                     for n, s, e in self.constants)  # fmt: skip
        return Fit(rows)


@functools.lru_cache(maxsize=16)
def _mesh_hardware(name: str) -> HardwareConfig:
    return C.load_mesh(name).hardware


def run_generation(run: Run) -> str:
    """The GPU generation of ``run``'s mesh file."""
    g = HWM.generation(_mesh_hardware(run.mesh))
    assert g is not None, run.mesh
    return g.name


def run_hardware(run: Run, fit: Fit | None = None) -> tuple[HardwareConfig, HWM.Generation]:
    """The mesh file's hardware for ``run`` with the run's departures, its curve regenerated
    from ``fit`` (default: the constants in :data:`~jaxpar.planner.hardware.GENERATIONS`)."""
    hw = dataclasses.replace(_mesh_hardware(run.mesh), **run.hardware)
    gen = HWM.generation(hw)
    assert gen is not None, run.mesh
    share, elementwise = (fit or Fit()).of(gen.name)
    curve = HWM.roofline_curve(hw.peak_flops_bf16, hw.hbm_bw, share, HWM.ROOFLINE_KAPPA)
    return dataclasses.replace(hw, matmul_efficiency=curve), dataclasses.replace(
        gen, matmul_share_max=share, elementwise_share=elementwise
    )


def predict(run: Run, fit: Fit | None = None) -> dict:
    """Predicted vs published throughput of one row (``error`` = predicted/published − 1)."""
    hw, gen = run_hardware(run, fit)
    cost = step_cost(run.model, hw, run.layout, Shape(run.global_batch, run.seq), run.executor,
                     elementwise=gen.elementwise_share)  # fmt: skip
    t = cost.step_time
    return {
        "name": run.name,
        "source": run.source,
        "gpu": run.mesh.split("-")[0].upper(),
        "gpus": run.gpus,
        "framework": run.executor.name,
        "layout": _layout_text(run.layout),
        "zero3": run.layout.zero == 3,
        "published_tokens_per_s_per_gpu": run.tokens_per_s_per_gpu(run.step_time_s),
        "predicted_tokens_per_s_per_gpu": run.tokens_per_s_per_gpu(t),
        "published_step_s": run.step_time_s,
        "predicted_step_s": t,
        "error": run.step_time_s / t - 1,
        "fitted": run.name in FITTED,
        "terms": dict(cost.terms),
        "note": run.note,
    }


def _layout_text(lay: LayoutConfig) -> str:
    parts = [f"tp{lay.tp}", f"pp{lay.pp}"] + ([f"v{lay.virtual}"] if lay.pp > 1 else [])
    parts += [f"cp{lay.sp}"] if lay.sp > 1 else []
    shard = f" (shard {lay.dp_shard})" if lay.dp_shard else ""
    parts += [f"dp{lay.dp}{shard}", f"ZeRO-{lay.zero}", f"m{lay.microbatches}",
              f"remat {lay.remat}"]  # fmt: skip
    return " ".join(parts)


def comparison(fit: Fit | None = None) -> list[dict]:
    """Every row, predicted."""
    return [predict(r, fit) for r in RUNS]


def _stats(errs: list[float]) -> dict:
    return {
        "rows": len(errs),
        "median_abs_error": statistics.median(errs) if errs else math.nan,
        "within_20pct": sum(e <= 0.20 for e in errs) / len(errs) if errs else math.nan,
        "max_abs_error": max(errs) if errs else math.nan,
    }


def summary(rows: list[dict]) -> dict:
    """Median absolute error, share within 20% and largest error: fitted and held-out rows
    apart, and among the held-out rows the ZeRO-3 rows at >= 512 GPUs and the H100 rows."""
    held = [r for r in rows if not r["fitted"]]
    groups = {
        "fitted": [r for r in rows if r["fitted"]],
        "held_out": held,
        "held_out_zero3_512plus": [r for r in held if r["zero3"] and r["gpus"] >= 512],
        "held_out_h100": [r for r in held if r["gpu"] == "H100"],
        "held_out_a100": [r for r in held if r["gpu"] == "A100"],
    }
    return {k: _stats([abs(r["error"]) for r in v]) for k, v in groups.items()}


def fit() -> tuple[Fit, list[dict]]:
    """Fit each generation's (``matmul_share_max``, ``elementwise_share``) on its
    :data:`FITTED` rows only (least squares of log throughput over :data:`SHARE_GRID` ×
    :data:`ELEMENTWISE_GRID`; ties to the first). Returns the fit and its comparison over every
    row."""
    best = Fit()
    for gen in HWM.GENERATIONS:
        rows = [r for r in RUNS if r.name in FITTED and run_generation(r) == gen.name]
        scored = []
        for share, elem in itertools.product(SHARE_GRID, ELEMENTWISE_GRID):
            f = best.with_(gen.name, share, elem)
            scored.append((sum(math.log1p(predict(r, f)["error"]) ** 2 for r in rows), f))
        best = min(scored, key=lambda x: x[0])[1]
    return best, comparison(best)
