"""Same-run A/B of the training loop: this tree against another (main), step time and host wait.

Each measurement is one worker subprocess that trains with ``jaxpar.train.loop.run`` from the
tree on its ``PYTHONPATH``; the trees alternate (ABBA) within each repeat, so both see the same
machine load. The worker wraps ``Trainer.step`` (the same code in both trees) to time, per step:

- ``period_s``: from one step's dispatch to the next one's (the loop's pace);
- ``gap_s``: from the moment a step's loss is ready on the device (a watcher thread waits for it)
  to the next step's dispatch. Positive: the device had nothing queued for that long, waiting on
  the host; negative: the next step was already queued before this one finished;
- ``idle_fraction``: the positive gaps' share of the run's time;
- ``dispatch_s``: how long the dispatch call itself takes (the same code in both trees).

Shapes: ``default`` is ``jaxpar train``'s default job (tiny model, pp 2 × dp 2 × tp 2 on 8
simulated CPU devices, 4 micro-batches, full remat); ``one`` is the one-device bench shape of
BENCHMARKS.md (4 layers, d 256, 8/4 heads, FFN 768, seq 256, batch 16, no remat). No
evaluation, checkpoint or bar: the loop itself. Prints one JSON object (ratios: this tree over
the other, of the medians).

    python scripts/bench_loop.py                      # both shapes, 3 repeats, 12 steps
    python scripts/bench_loop.py --shapes one --repeats 2 --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

SHAPES = {
    "default": dict(devices=8, model={}, layout={}, train={}),
    "one": dict(
        devices=1,
        model=dict(n_layers=4, d_model=256, n_heads=8, n_kv_heads=4, d_ff=768, vocab_size=256),
        layout=dict(dp=1, tp=1, pp=1, sp=1, microbatches=1, remat="none"),
        train=dict(seq_len=256, global_batch=16),
    ),
}


def _instrument():
    """Wrap Trainer.step: dispatch times, and a watcher thread that notes when each loss is
    ready (in order, so it never waits on a later step first)."""
    import queue
    import threading

    from jaxpar.train import step as step_mod

    calls, returns, ready = [], [], []
    pending: queue.Queue = queue.Queue()
    sys.setswitchinterval(1e-4)  # the watcher takes the GIL within 0.1 ms of a step's end

    def watch():
        while (loss := pending.get()) is not None:
            loss.block_until_ready()
            ready.append(time.perf_counter())

    threading.Thread(target=watch, daemon=True).start()
    original = step_mod.Trainer.step

    def step(self, state, batch):
        calls.append(time.perf_counter())
        out = original(self, state, batch)
        returns.append(time.perf_counter())
        pending.put(out[1]["loss"])
        return out

    step_mod.Trainer.step = step

    def finish():
        pending.put(None)
        while len(ready) < len(calls):
            time.sleep(0.01)
        return calls, returns, ready

    return finish


def worker(shape_name: str, steps: int) -> dict:
    """One run in this process (the tree on PYTHONPATH); its timings as a dict."""
    import jax

    shape = SHAPES[shape_name]
    jax.config.update("jax_num_cpu_devices", shape["devices"])
    from jaxpar import config as C
    from jaxpar.train.loop import run

    cfg = C.load("tiny", "cpu-8")
    for k, v in shape["model"].items():
        setattr(cfg.model, k, v)
    for k, v in shape["layout"].items():
        setattr(cfg.layout, k, v)
    for k, v in {**shape["train"], "steps": steps, "eval_every": 0, "progress": False}.items():
        setattr(cfg.train, k, v)
    cfg.mesh.devices = cfg.layout.n_devices
    finish = _instrument()
    t0 = time.perf_counter()
    out = run(cfg, devices=jax.devices()[: cfg.layout.n_devices], quiet=True)
    wall = time.perf_counter() - t0
    calls, returns, ready = finish()
    skip = 2  # the first steps warm up
    period = [calls[i + 1] - calls[i] for i in range(skip, len(calls) - 1)]
    gap = [calls[i + 1] - ready[i] for i in range(skip, len(calls) - 1)]
    return {
        "tree": str(Path(sys.modules["jaxpar"].__file__).parent.parent),
        "period_s": statistics.median(period),
        "gap_s": statistics.median(gap),
        "idle_fraction": sum(max(0.0, g) for g in gap) / sum(period),
        "dispatch_s": statistics.median(b - a for a, b in zip(calls, returns, strict=True)),
        "summary_step_time_s": out["step_time_s"],
        "final_loss": out["final_loss"],
        "run_s": wall,
    }


def _spawn(tree: Path, shape: str, steps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", shape, "--steps", str(steps)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if p.returncode != 0:
        raise SystemExit(f"worker {shape} in {tree} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="default,one")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--other", default="/work/main", help="the tree to compare against")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps)))
        return
    trees = {"this": HERE, "other": Path(args.other).resolve()}
    result: dict = {"steps": args.steps, "repeats": args.repeats, "trees": {k: str(v) for k, v in
                    trees.items()}, "shapes": {}}  # fmt: skip
    for shape in args.shapes.split(","):
        runs: dict[str, list[dict]] = {"this": [], "other": []}
        for r in range(args.repeats):
            order = ("this", "other") if r % 2 == 0 else ("other", "this")  # ABBA
            for name in order:
                runs[name].append(_spawn(trees[name], shape, args.steps))
        med = {
            name: {
                k: statistics.median(x[k] for x in rs)
                for k in ("period_s", "gap_s", "idle_fraction", "summary_step_time_s")
            }  # fmt: skip
            for name, rs in runs.items()
        }
        result["shapes"][shape] = {
            "median": med,
            "period_ratio": med["this"]["period_s"] / med["other"]["period_s"],
            "same_losses": len({x["final_loss"] for x in runs["this"] + runs["other"]}) == 1,
            "runs": runs,
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
