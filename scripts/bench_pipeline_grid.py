"""The pipeline equivalence grid: loss and every gradient leaf against one device, per case.

Cases (8 layers of d 32, batch 16 × 16 tokens, fp32, real text; ``tests/test_pipeline.py``'s
model, reference and tolerance, imported from there — the test runs one case of each kind):

* every schedule at p ∈ {2, 4}, m ∈ {4, 8}, v ∈ {1, 2} where the schedule accepts them
  (interleaved at v = 1 and 2, ZB-V and DualPipeV at v = 2, the others at v = 1);
* dp 2 × tp 2 × pp 2 with ZeRO 0, 1, 2, 3 (1F1B and ZB-H1, m 4);
* dp 2 × sp 2 × pp 2, Ulysses and ring (1F1B, m 4);
* pp 2 with hybrid sharding (dp 4, ``dp_shard`` 2, ZeRO 3; 1F1B, m 4).

Per case: ``loss_rel`` (|loss / reference − 1|), ``grad_rel`` (largest over leaves of
max |g − g_ref| / max |g_ref|), the leaf it occurs in, and ``passes``: the test's criterion
(loss within 1e-4 relative, every element within rtol 1e-4 plus 1e-4 of the leaf's largest).
One JSON object printed last; ``--quick`` runs p = 2 only.

    python scripts/bench_pipeline_grid.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from conftest import small_config  # noqa: E402  (8 simulated CPU devices)
from test_pipeline import assert_matches, loss_and_grads, reference, tiny  # noqa: E402

from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.pipeline.generators import KINDS, check_arguments  # noqa: E402


def cases(quick: bool):
    """(name, layout) of every case (module docstring)."""
    for kind in KINDS:
        for p in (2,) if quick else (2, 4):
            for m in (4, 8):
                for v in (1, 2):
                    try:
                        check_arguments(kind, p, m, v)
                    except ConfigError:  # a combination the schedule refuses
                        continue
                    if kind in ("gpipe", "1f1b", "zb-h1") and v != 1:
                        continue  # v is ignored there: the same case again
                    yield (f"{kind}-p{p}-m{m}-v{v}",
                           dict(pp=p, schedule=kind, microbatches=m, virtual=v))  # fmt: skip
    for kind in ("1f1b", "zb-h1"):
        for zero in range(4):
            yield (f"dp2-tp2-pp2-z{zero}-{kind}",
                   dict(pp=2, dp=2, tp=2, zero=zero, schedule=kind, microbatches=4))  # fmt: skip
    for mode in ("ulysses", "ring"):
        yield (f"dp2-sp2-pp2-{mode}-1f1b",
               dict(pp=2, dp=2, sp=2, sp_mode=mode, schedule="1f1b", microbatches=4))  # fmt: skip
    yield "pp2-dp4-shard2-z3-1f1b", dict(pp=2, dp=4, dp_shard=2, zero=3, schedule="1f1b",
                                         microbatches=4)  # fmt: skip


def errors(got, ref) -> dict:
    """Loss and largest per-leaf relative gradient error (module docstring)."""
    import jax
    import numpy as np

    (loss, g), (ref_loss, ref_g) = got, ref
    worst, leaf = 0.0, ""
    for path, a in jax.tree_util.tree_leaves_with_path(g):
        b = ref_g
        for k in path:
            b = b[k.key]
        rel = float(np.abs(a - b).max() / np.abs(b).max())
        if rel >= worst:
            worst, leaf = rel, jax.tree_util.keystr(path)
    try:
        assert_matches(got, ref)
        passes = True
    except AssertionError:
        passes = False
    return {"loss_rel": abs(loss / ref_loss - 1), "grad_rel": worst, "worst_leaf": leaf,
            "passes": passes}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="p = 2 only")
    args = ap.parse_args()
    load0 = os.getloadavg()
    ref = reference(small_config)
    rows = []
    for name, layout in cases(args.quick):
        t0 = time.perf_counter()
        row = {"case": name, **errors(loss_and_grads(tiny(small_config, **layout)), ref),
               "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({
        "cases": len(rows), "all_pass": all(r["passes"] for r in rows),
        "max_loss_rel": max(r["loss_rel"] for r in rows),
        "max_grad_rel": max(r["grad_rel"] for r in rows),
        "loadavg": [list(load0), list(os.getloadavg())], "rows": rows,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
