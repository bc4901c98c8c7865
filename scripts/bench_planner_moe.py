"""The planner on MoE models; prints one JSON object per row.

    python scripts/bench_planner_moe.py memory   # predicted vs compiled, simulated CPUs, ~1 min
    python scripts/bench_planner_moe.py search   # fastest fitting layout per ep, ~15 s

``memory``: the MoE test model of ``tests/test_moe.py`` (3 layers, d 32, 8 experts top-2, one
shared, batch 8 × 16 tokens, fp32) on expert-parallel layouts: the planner's per-device total
(:func:`jaxpar.planner.footprint.memory`) against XLA:CPU's compiled total, and the planner's
all-to-all bytes against the optimized HLO's. ``search``: for Mixtral 8x7B, Qwen3-30B-A3B
and DeepSeek-V3 (dropless as in their model files, and with capacity factor 1.25), the
fastest fitting layout of each ep and its step-time terms.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

MEMORY_LAYOUTS = (
    (0.0, dict(dp=2, ep=2)),
    (0.0, dict(dp=4, ep=4)),
    (0.0, dict(dp=8, ep=8)),
    (0.0, dict(dp=4, ep=4, remat="full")),
    (0.0, dict(dp=4, ep=2, remat="selective")),
    (1.0, dict(dp=4, ep=2, zero=1)),
    (0.0, dict(dp=4, ep=4, zero=2, microbatches=2)),
    (0.0, dict(dp=4, ep=2, zero=3, microbatches=2)),
)
SEARCHES = (
    ("mixtral-8x7b", "h100-8", 16, 8192),
    ("qwen3-30b-a3b", "h100-8", 16, 4096),
    ("deepseek-v3", "h100-1024", 1024, 4096),
)


def memory_rows() -> None:
    """Predicted against compiled memory and all-to-all bytes, one row per layout."""
    from jaxpar.devices import simulate_cpu_devices

    simulate_cpu_devices(8)
    from test_moe import _trainer, moe_config

    from jaxpar.analysis.hlo import collective_bytes, compiled_memory
    from jaxpar.planner import footprint as M
    from jaxpar.planner import moe as MOE

    for cf, layout in MEMORY_LAYOUTS:
        cfg = moe_config(capacity_factor=cf, **layout)
        lay, shape = cfg.layout, M.Shape(cfg.train.global_batch, cfg.train.seq_len)
        tr = _trainer(cfg)
        compiled = tr.compile_step()
        total = compiled_memory(compiled)["total"]
        predicted = M.memory(cfg.model, lay, shape)["total"]
        a2a = collective_bytes(compiled, tr.mesh).select(kind="all-to-all")
        fig = MOE.figures(cfg.model, lay, shape.microbatch_size(lay), shape.seq, 4)
        a2a_pred = fig.a2a_bytes * cfg.model.moe_layers() * lay.microbatches
        row = {"layout": layout, "capacity_factor": cf, "compiled_bytes": total,
               "predicted_bytes": predicted, "ratio": round(predicted / total, 3),
               "a2a_hlo_bytes": a2a.bytes, "a2a_predicted_bytes": a2a_pred}  # fmt: skip
        print(json.dumps(row), flush=True)


def search_rows() -> None:
    """The fastest fitting layout of each ep, per model and capacity factor."""
    from jaxpar import config as C
    from jaxpar.planner import footprint as M
    from jaxpar.planner import search as S
    from jaxpar.planner.explain import layout_text

    for model, mesh, batch, seq in SEARCHES:
        for cf in (0.0, 1.25):
            cfg = C.load(model, mesh)
            cfg.model.moe.capacity_factor = cf
            shape = M.Shape(batch, seq)
            best: dict[int, S.Candidate] = {}
            for c in S.candidates(cfg.model, cfg.mesh.hardware, cfg.mesh.devices, shape):
                if c.layout.ep not in best or c.step_time < best[c.layout.ep].step_time:
                    best[c.layout.ep] = c
            for ep, c in sorted(best.items()):
                terms = {k: round(v, 3) for k, v in c.cost.terms.items() if v}
                print(json.dumps({"model": model, "mesh": mesh, "capacity_factor": cf, "ep": ep,
                                  "step_time_s": round(c.step_time, 3),
                                  "memory_gib": round(c.memory["total"] / 2**30, 1),
                                  "layout": layout_text(S.layout_dict(c.layout, shape)),
                                  "terms_s": terms}), flush=True)  # fmt: skip


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "search"
    if what not in ("memory", "search"):
        raise SystemExit(f"bench_planner_moe.py: error: {what!r}: must be memory or search")
    memory_rows() if what == "memory" else search_rows()
