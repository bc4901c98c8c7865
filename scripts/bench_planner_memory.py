"""Planner memory against the compiled per-device total, on simulated CPU devices; prints JSON.

    python scripts/bench_planner_memory.py                 # the layouts of BENCHMARKS.md, ~5 min
    python scripts/bench_planner_memory.py --only 0 5 17   # a subset (indices into LAYOUTS)
    python scripts/bench_planner_memory.py --calibrate     # refit the XLA_* constants (~2 min)

Measured: ``compiled_memory(Trainer(cfg, mesh).compile_step())['total']`` (arguments + outputs
− aliased + temporaries, XLA's buffer assignment). Predicted: ``jaxpar.planner.footprint.memory``
(the function ``jaxpar plan`` and ``jaxpar memory`` call). The test model of ``tests/conftest.py``
(4 layers, d 64, 4/2 heads, batch 16 × 32 tokens, fp32). ``--calibrate`` compiles one device
with the layers, vocabulary, batch and sequence varied under each remat policy and least-squares
the four XLA constants of :mod:`jaxpar.planner.footprint`; none of the layouts below is used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpar.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402

from jaxpar import config as C  # noqa: E402
from jaxpar import validation as V  # noqa: E402
from jaxpar.analysis.hlo import compiled_memory  # noqa: E402
from jaxpar.devices import make_mesh  # noqa: E402
from jaxpar.planner import footprint as M  # noqa: E402
from jaxpar.train.step import Trainer  # noqa: E402

LAYOUTS = [
    dict(dp=1),
    dict(dp=8, zero=0),
    dict(dp=8, zero=1),
    dict(dp=8, zero=2, microbatches=2),
    dict(dp=8, zero=3),
    dict(dp=8, zero=3, dp_shard=4),
    dict(dp=2, tp=4, zero=1),
    dict(dp=4, tp=2, zero=3),
    dict(dp=4, tp=2, sequence_parallel=True),
    dict(dp=2, tp=2, sp=2, sp_mode="ulysses"),
    dict(dp=2, sp=4, sp_mode="ulysses"),
    dict(dp=4, sp=2, sp_mode="ring"),
    dict(dp=2, tp=2, sp=2, sp_mode="ring", sequence_parallel=True),
    dict(dp=8, zero=1, remat="full"),
    dict(dp=8, zero=1, remat="selective"),
    dict(dp=2, tp=4, zero=3, remat="selective"),
    dict(pp=2, dp=4, microbatches=4, schedule="1f1b"),
    dict(pp=4, dp=2, microbatches=4, schedule="1f1b"),
    dict(pp=2, dp=2, tp=2, microbatches=4, schedule="1f1b", remat="full"),
    dict(pp=2, dp=4, microbatches=4, schedule="interleaved", virtual=2),
    dict(pp=2, dp=4, microbatches=4, schedule="zbv", virtual=2),
    dict(pp=2, dp=4, microbatches=4, schedule="gpipe"),
]
CALIBRATED_ON = {  # index -> what this row calibrated
    0: "XLA_* constants: the one-device base compile of --calibrate",
    16: "Executor.tick_stashes",
}
CONSTANTS = ("XLA_UPDATE", "XLA_HEAD", "XLA_RECOMPUTE", "XLA_BACKWARD")


def small_config(model_kw=None, train_kw=None, **layout) -> C.RunConfig:
    """The test suite's small run (tests/conftest.py), layout applied."""
    cfg = C.load("tiny", "cpu-8")
    cfg.model = C.ModelConfig(name="test", n_layers=4, d_model=64, n_heads=4, n_kv_heads=2,
                              d_ff=128, vocab_size=256, max_seq_len=64)  # fmt: skip
    cfg.model = dataclasses.replace(cfg.model, **(model_kw or {}))
    cfg.train.global_batch, cfg.train.seq_len = 16, 32
    for k, v in (train_kw or {}).items():
        setattr(cfg.train, k, v)
    cfg.layout.dp, cfg.layout.tp, cfg.layout.pp, cfg.layout.microbatches = 1, 1, 1, 1
    cfg.layout.remat = "none"
    for k, v in layout.items():
        setattr(cfg.layout, k, v)
    cfg.mesh.devices = cfg.layout.n_devices
    return cfg


def compiled_total(cfg: C.RunConfig) -> int:
    """XLA's per-device total for ``cfg``'s compiled step."""
    V.validate(cfg, n_devices=cfg.layout.n_devices)
    mesh = make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices])
    return compiled_memory(Trainer(cfg, mesh).compile_step())["total"]


def predicted(cfg: C.RunConfig) -> dict[str, float]:
    """The planner's breakdown for ``cfg``."""
    return M.memory(cfg.model, cfg.layout, M.Shape(cfg.train.global_batch, cfg.train.seq_len))


def name_of(layout: dict) -> str:
    """``dp=8 zero=3``-style label."""
    return " ".join(f"{k}={v}" for k, v in layout.items())


def row(i: int) -> dict:
    """Measure and predict layout ``i``."""
    layout = LAYOUTS[i]
    cfg = small_config(**layout)
    t0 = time.perf_counter()
    measured = compiled_total(cfg)
    pred = predicted(cfg)
    return {"index": i, "layout": name_of(layout), "measured_bytes": measured,
            "predicted_bytes": pred["total"], "rel_error": pred["total"] / measured - 1,
            "predicted": pred, "calibrated": CALIBRATED_ON.get(i),
            "compile_s": time.perf_counter() - t0}  # fmt: skip


def repredict(old: dict) -> dict:
    """A saved row with the prediction made again (the measurement kept)."""
    cfg = small_config(**LAYOUTS[old["index"]])
    pred = predicted(cfg)
    return dict(old, predicted_bytes=pred["total"], predicted=pred,
                rel_error=pred["total"] / old["measured_bytes"] - 1,
                calibrated=CALIBRATED_ON.get(old["index"]))  # fmt: skip


def calibrate() -> dict:
    """Least squares of the XLA constants on one-device compiles (module docstring)."""
    import numpy as np

    variants = []
    for remat in ("none", "selective", "full"):
        for model_kw, train_kw in ((None, None), ({"n_layers": 8}, None),
                                   ({"vocab_size": 1024}, None), (None, {"global_batch": 32}),
                                   ({"max_seq_len": 64}, {"seq_len": 64})):  # fmt: skip
            variants.append(small_config(model_kw, train_kw, remat=remat))
    saved = {k: getattr(M, k) for k in CONSTANTS}
    rows, y = [], []
    try:
        for cfg in variants:
            basis = []
            for k in (None, *CONSTANTS):
                for c in CONSTANTS:
                    setattr(M, c, 1.0 if c == k else 0.0)
                basis.append(predicted(cfg)["total"])
            rows.append([b - basis[0] for b in basis[1:]])
            y.append(compiled_total(cfg) - basis[0])
    finally:
        for k, v in saved.items():
            setattr(M, k, v)
    # Non-negative least squares by active set: a constant that would come out negative
    # (collinear with another on this set) is held at zero and the rest refitted.
    a, b = np.array(rows), np.array(y, float)
    free = list(range(len(CONSTANTS)))
    coef = np.zeros(len(CONSTANTS))
    while free:
        sol, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if (sol >= 0).all():
            coef[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    fitted = a @ coef
    return {"constants": dict(zip(CONSTANTS, map(float, coef), strict=True)),
            "current": saved, "compiles": len(variants),
            "temp_errors": [float(f / t - 1) for f, t in zip(fitted, b, strict=True)],
            "basis": rows, "measured_minus_fixed": y}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", type=int, nargs="+", default=None, help="indices into LAYOUTS")
    ap.add_argument("--calibrate", action="store_true", help="refit the XLA_* constants")
    ap.add_argument("--from", dest="saved", default=None,
                    help="reuse the measured bytes of an earlier run; predict again")  # fmt: skip
    args = ap.parse_args()
    if args.calibrate:
        print(json.dumps(calibrate()))
        return
    rows = []
    saved = (
        {r["index"]: r for r in json.loads(Path(args.saved).read_text())["rows"]}
        if args.saved
        else {}
    )
    for i in args.only if args.only is not None else range(len(LAYOUTS)):
        rows.append(repredict(saved[i]) if i in saved else row(i))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "predicted"}),
              file=sys.stderr, flush=True)  # fmt: skip
    checked = [r for r in rows if not r["calibrated"]]
    worst = max((abs(r["rel_error"]) for r in checked), default=0.0)
    print(json.dumps({"rows": rows, "validated": len(checked),
                      "within_10pct": sum(abs(r["rel_error"]) <= 0.10 for r in checked),
                      "max_abs_error": worst}))  # fmt: skip


if __name__ == "__main__":
    main()
