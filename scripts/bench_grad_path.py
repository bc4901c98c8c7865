"""The one gradient path across layouts: dp bytes, model states, equivalence and step time.

For each layout × ZeRO stage × micro-batch count of the grid (issue: dp 8, dp 4 × tp 2,
dp 2 × tp 4, dp 2 × sp 2 × tp 2 Ulysses, dp 2 × tp 2 × pp 2, plus hybrid ``dp_shard``), on
simulated CPU devices and the test model, prints one JSON object (and ``--markdown`` a table):

* ``dp_wire_bytes``: data-parallel collective bytes per device per step read from the compiled
  HLO (:func:`jaxpar.analysis.memory.measure`), against ``theory_bytes``
  (:func:`jaxpar.analysis.memory.dp_comm_theory`: 0 → 2Ψ, 1 → Ψ + Ψ, 2 → kΨ + Ψ, 3 → 3kΨ,
  times (N−1)/N) and the stage's ``dp_reduction``;
* ``dp_collectives``: per kind, the dp collectives the compiled step executes per step (ZeRO-3:
  one all-gather per layer pass, one reduce-scatter per layer, however many tensors a layer has);
* ``state_bytes``: model states held at rest (compiled arguments − batch) against what
  ``jaxpar memory`` stores (``stored.at_rest_bytes``);
* ``loss_rel``/``grad_rel``: loss and largest per-leaf gradient error against one device (fp32);
* ``step_s`` and, with ``--baseline REF``, ``baseline_step_s`` of the same layout on git ref
  REF (run from a temporary worktree in a subprocess, interleaved with this tree's runs) and
  their ratio.

    python scripts/bench_grad_path.py [--quick] [--baseline e2a6bc1] [--markdown]

Collectives inside the pipeline's per-tick ``switch`` are counted as if every branch ran every
tick (``in_conditional`` in the report), so pipeline rows with a per-micro-batch collective in
a branch (ZeRO 2/3) over-count; their ``theory_bytes`` says what one step does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYOUTS = {
    "dp8": dict(dp=8),
    "dp4_tp2": dict(dp=4, tp=2),
    "dp2_tp4": dict(dp=2, tp=4),
    "dp2_sp2_tp2_ulysses": dict(dp=2, sp=2, tp=2, sp_mode="ulysses"),
    "dp2_tp2_pp2": dict(dp=2, tp=2, pp=2),
    "dp8_hybrid4": dict(dp=8, dp_shard=4),
}


def config(layout: dict, zero: int, k: int):
    """The test model (4 layers, d 64) with a global batch of 32 × 32 tokens."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import small_config

    cfg = small_config(zero=zero, microbatches=k, **layout)
    cfg.train.global_batch = 32
    cfg.mesh.devices = cfg.layout.n_devices
    return cfg


def grid(quick: bool):
    for name, lay in LAYOUTS.items():
        ks = (2, 4) if lay.get("pp", 1) > 1 else (1, 4)
        for zero in range(4):
            for k in ks:
                if quick and (k != ks[0] or (zero in (1, 2) and name != "dp4_tp2")):
                    continue
                yield name, lay, zero, k


REPEAT = 7  # timed steps per round (the minimum is reported)


def _time_steps(tr, state, batch, n: int = REPEAT) -> float:
    import jax

    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        state, m = tr.step(state, batch)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t0)
    return min(times), state


def measure_one(name: str, layout: dict, zero: int, k: int, reference) -> dict:
    import jax
    import numpy as np

    from jaxpar.analysis.memory import dp_comm_theory, measure, theory
    from jaxpar.data import Batches, load_corpus
    from jaxpar.devices import make_mesh
    from jaxpar.train.step import Trainer

    cfg = config(layout, zero, k)
    mesh = make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices])
    tr = Trainer(cfg, mesh)
    t = cfg.train
    batch = Batches(load_corpus("stdlib", 256), t.global_batch, t.seq_len, seed=3).global_array(
        0, tr.batch_sharding
    )
    state = tr.init_state(0)
    loss, g = tr.grads(state["params"], batch)
    ref_loss, ref_g = reference
    g = jax.tree.map(np.asarray, g)
    rel = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30)), g,
                       ref_g)  # fmt: skip
    m = measure(cfg)
    th = dp_comm_theory(cfg)
    dp_ops: dict[str, float] = {}
    for e in m["comm"]["entries"]:
        if e["axes"] and all(a.startswith("dp") for a in e["axes"]):
            dp_ops[e["kind"]] = dp_ops.get(e["kind"], 0) + e["count"]
    stored = theory(cfg.layout, cfg.model)["stored"]["at_rest_bytes"]
    tr.compile_step()
    _time_steps(tr, state, batch, 1)  # warm
    step_s, _ = _time_steps(tr, tr.init_state(0), batch)
    return {
        "layout": name,
        "zero": zero,
        "microbatches": k,
        "dp_reduction": tr.grad_ctx.reduction.name,
        "loss_rel": abs(float(loss) / ref_loss - 1),
        "grad_rel": max(jax.tree.leaves(rel)),
        "dp_wire_bytes": m["comm"]["dp_wire_bytes"],
        "theory_bytes": th["total_bytes"],
        "bytes_ratio": m["comm"]["dp_wire_bytes"] / th["total_bytes"]
        if th["total_bytes"]
        else None,
        "dp_collectives": dp_ops,
        "state_bytes": m["state_bytes"],
        "stored_bytes": stored,
        "state_ratio": m["state_bytes"] / stored,
        "temp_bytes": m["temp"],
        "step_s": step_s,
    }


def reference_grads(k: int = 1):
    import jax
    import numpy as np

    from jaxpar.data import Batches, load_corpus
    from jaxpar.devices import make_mesh
    from jaxpar.train.step import Trainer

    cfg = config({"dp": 1}, 0, 1)
    tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[:1]))
    t = cfg.train
    batch = Batches(load_corpus("stdlib", 256), t.global_batch, t.seq_len, seed=3).global_array(
        0, tr.batch_sharding
    )
    loss, g = tr.grads(tr.init_state(0)["params"], batch)
    return float(loss), jax.tree.map(np.asarray, g)


BASELINE_SNIPPET = r"""
import json, os, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from conftest import small_config
from jaxpar.data import Batches, load_corpus
from jaxpar.devices import make_mesh
from jaxpar.train.step import Trainer
lay, zero, k = json.loads(sys.argv[1])
cfg = small_config(zero=zero, microbatches=k, **lay)
cfg.train.global_batch = 32
tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices]))
t = cfg.train
batch = Batches(load_corpus("stdlib", 256), t.global_batch, t.seq_len, seed=3).global_array(
    0, tr.batch_sharding)
state = tr.init_state(0)
state, m = tr.step(state, batch); jax.block_until_ready(m["loss"])
best = 1e9
for _ in range(int(sys.argv[2])):
    t0 = time.perf_counter(); state, m = tr.step(state, batch); jax.block_until_ready(m["loss"])
    best = min(best, time.perf_counter() - t0)
print(json.dumps({"step_s": best}))
"""


def baseline_step(tree: str, layout: dict, zero: int, k: int) -> float | None:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run(
        [sys.executable, "-c", BASELINE_SNIPPET, json.dumps([layout, zero, k]), str(REPEAT)],
        cwd=tree, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if out.returncode != 0:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])["step_s"]


def markdown(rows: list[dict]) -> str:
    head = ("| layout | ZeRO | k | dp_reduction | dp bytes (HLO) | theory | ratio | dp ops/step "
            "| states / stored | loss rel | grad rel | step s | vs baseline |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    lines = [head]
    for r in rows:
        ratio = r["bytes_ratio"]
        base = r.get("baseline_ratio")
        ops = ", ".join(f"{v:g} {k}" for k, v in sorted(r["dp_collectives"].items()))
        lines.append(
            f"| {r['layout']} | {r['zero']} | {r['microbatches']} | {r['dp_reduction']} | "
            f"{r['dp_wire_bytes']:,.0f} | {r['theory_bytes']:,.0f} | "
            f"{'-' if ratio is None else f'{ratio:.3f}'} | {ops} | {r['state_ratio']:.3f} | "
            f"{r['loss_rel']:.1e} | {r['grad_rel']:.1e} | {r['step_s']:.3f} | "
            f"{'-' if base is None else f'{base:.2f}'} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a covering subset of the grid")
    ap.add_argument("--baseline", help="git ref to time the same layouts on (e.g. e2a6bc1)")
    ap.add_argument("--only", nargs="*", help="layout names to run")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    tmp = None
    if args.baseline:
        tmp = tempfile.mkdtemp(prefix="jaxpar-baseline-")
        subprocess.run(["git", "worktree", "add", "--detach", tmp, args.baseline], cwd=ROOT,
                       check=True, capture_output=True)  # fmt: skip
    reference = reference_grads()
    rows = []
    try:
        for name, lay, zero, k in grid(args.quick):
            if args.only and name not in args.only:
                continue
            row = measure_one(name, lay, zero, k, reference)
            if tmp:
                # A, B, A: this tree in-process, the baseline, this tree again by the baseline's
                # own procedure (a fresh process); the faster of the two A rounds counts
                base = baseline_step(tmp, lay, zero, k)
                again = baseline_step(str(ROOT), lay, zero, k)
                if again is not None:
                    row["step_s"] = min(row["step_s"], again)
                row["baseline_step_s"] = base
                row["baseline_ratio"] = row["step_s"] / base if base else None
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        if tmp:
            subprocess.run(["git", "worktree", "remove", "--force", tmp], cwd=ROOT,
                           capture_output=True)  # fmt: skip
    if args.markdown:
        print(markdown(rows))
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
