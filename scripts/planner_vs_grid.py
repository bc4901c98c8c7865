"""The planner's step for every row of the GPU grid beside the simulated step recorded for it.

The planner is analytic and cheap; the grid (``scripts/bench_gpu_grid.py``) compiles every row
for a GPU and simulates the scheduled program (``jaxpar.gpu.timing``), which takes 15 minutes
or more on two cores. This prints, without compiling, ``jaxpar plan``'s step for each grid row's
layout (exactly as ``jaxpar compile`` computes ``estimate.planner_step_s``) beside the
simulated step recorded in BENCHMARKS.md (``RECORDED``: "The pipeline's per-tick weight work
(2026-12-07, issues 46 and 47)", grid at cb6b2e3; the DDP, ZeRO-1 and ZeRO-2 rows of
llama3-8b at 6581ea4, "Each layer's gradient reduced in the backward"), the ratio planner /
simulated and how many rows are within 10%. ``70b-pick`` is ``--layout auto`` in the grid,
whose layout moves with the planner; here it is the layout that grid compiled (dp 2 x tp 4 +
SP x pp 8, ZeRO-3, interleaved v 2, 32 micro-batches, selective). Rerun rows of the grid to
check a recorded figure still holds (``scripts/bench_gpu_grid.py --rows ...``).

    python scripts/planner_vs_grid.py [--json] [--rows PREFIX ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench_gpu_grid import ROWS  # noqa: E402

# Simulated step (s) per row: BENCHMARKS.md, grid at cb6b2e3 (2026-12-07); the rows with
# Megatron-SP's rings or ZeRO-3 across nodes again with four collectives in flight ("Four
# collectives in flight", 2026-12-07); the llama2-70b pipeline rows with Megatron-SP again
# without rings inside the ticks ("No rings inside a pipeline's ticks", 2026-12-07).
RECORDED = {
    "70b-production": 9.574,
    "70b-pick": 9.835,
    "70b-planner": 9.699,
    "70b-planner-1mb": 11.015,
    "70b-dp64-zero3": 8.140,
    "70b-rule-of-thumb": 10.243,
    # 6581ea4 (each layer's gradient reduced in the backward): these three rows again
    "8b-ddp": 0.817,
    "8b-zero1": 0.543,
    "8b-zero2": 0.543,
    "8b-zero3": 0.383,
    "8b-tp8-sp": 0.491,
    "8b-pp2-tp4": 0.623,
    "8b-ulysses-sp8": 0.705,
    "moe-mixtral-ep1": 9.692,
    "moe-mixtral-ep2-padded": 9.643,
    "moe-mixtral-ep2-ragged": 9.766,
    "moe-mixtral-pp2-ep2-dualpipev": 15.797,
    "pp4-gpipe": 0.813,
    "pp4-1f1b": 0.748,
    "pp4-interleaved": 0.695,
    "pp4-zb-h1": 0.783,
    "pp4-zbv": 0.755,
    "pp4-dualpipev": 0.715,
}
PICK = ("--dp", "2", "--tp", "4", "--sequence-parallel", "--pp", "8", "--zero", "3",
        "--schedule", "interleaved", "--virtual", "2", "--microbatches", "32",
        "--remat", "selective")  # fmt: skip


def config(name: str):
    """The RunConfig ``jaxpar compile`` builds for grid row ``name``."""
    from jaxpar.commands import compile as CC

    model, mesh, flags = ROWS[name]
    if name == "70b-pick":
        flags = PICK
    p = argparse.ArgumentParser()
    CC.add_arguments(p)
    args = p.parse_args(["--model", model, "--mesh", mesh, *flags])
    return CC.build_config(args)


def row(name: str) -> dict:
    """Planner step, its terms and the ratio to the recorded simulated step."""
    from jaxpar.planner.search import evaluate
    from jaxpar.planner.workload import Shape

    cfg = config(name)
    shape = Shape(cfg.train.global_batch, cfg.train.seq_len)
    cand = evaluate(cfg.model, cfg.mesh.hardware, cfg.layout, shape)
    sim = RECORDED[name]
    terms = {k: round(v, 4) for k, v in cand.cost.terms.items() if v}
    return {"row": name, "simulated_s": sim, "planner_s": cand.step_time,
            "ratio": cand.step_time / sim, "terms": terms}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="*", default=None, help="row names or prefixes (default all)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--terms", action="store_true", help="print each row's planner terms")
    args = p.parse_args()
    names = [n for n in ROWS if not args.rows or any(n.startswith(r) for r in args.rows)]
    rows = [row(n) for n in names]
    within = sum(abs(r["ratio"] - 1) <= 0.10 for r in rows)
    if args.json:
        print(json.dumps({"rows": rows, "within_10pct": within, "of": len(rows)}))
        return
    for r in rows:
        mark = "" if abs(r["ratio"] - 1) <= 0.10 else "  *"
        print(f"{r['row']:32s} sim {r['simulated_s']:7.3f}  plan {r['planner_s']:7.3f}  "
              f"ratio {r['ratio']:.2f}{mark}")  # fmt: skip
        if args.terms:
            print("    " + ", ".join(f"{k} {v:.4g}" for k, v in r["terms"].items()))
    print(f"within 10%: {within} of {len(rows)}")


if __name__ == "__main__":
    main()
