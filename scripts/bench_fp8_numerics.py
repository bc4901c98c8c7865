"""FP8 numerics held to bf16: the same training run with bf16 GEMMs and with each FP8 recipe.

For two model sizes, ``jaxpar train`` runs once per recipe from the same seed (same init, same
data order; the held-out batches are the same for every seed), one device, no remat,
``--compute-dtype bfloat16``:
``--fp8 none`` (the bf16 reference), ``--fp8 tensorwise``, ``--fp8 rowwise`` and
``--fp8 delayed`` (:mod:`jaxpar.model.fp8`; ``--recipes`` picks some, bf16 always runs). On
CPU the FP8 products are emulated exactly by XLA:CPU, so the figures are an FP8 GPU's numerics
(not its speed). Models:

* ``tiny``: ``models/tiny.yaml`` (4 layers, d 256, 8/4 heads, FFN 768, 3.3 M parameters),
  300 steps of 8 × 128 tokens;
* ``small``: tiny's file with ``-o`` overrides to 6 layers, d 384, 6/3 heads, FFN 1152
  (10.8 M parameters), 200 steps of 8 × 64 tokens (sized so the script's six runs take about
  20 minutes on 2 shared cores).

Per model and recipe: the last step's training loss, the held-out loss after the last step
(``train.eval_batches`` consecutive held-out windows, the same for every recipe), its
relative difference to bf16's, and whether the run diverged. **Divergence rule**: a run
diverged if it failed or stopped early (jaxpar's own guard, exit 3), if any training or
held-out loss is non-finite, or if at any step its training loss (same batch as bf16's at that
step) or a held-out loss exceeds ``DIVERGE_RATIO`` (1.25) × bf16's at the same step.
**Tolerance**: ``within_tolerance`` holds when the held-out loss is within ``TOLERANCE`` (2%,
either side) of bf16's and the run did not diverge. Nothing here is tuned to pass it.

**Seeds** (``--seeds N``, default 1): every (model, recipe) runs with seeds ``S .. S+N-1``
(``S`` is ``--seed``, default 0), the seed being ``jaxpar train --seed``, which sets both the
initialization (``jax.random.key(seed)``) and the training data order (each batch row drawn
from ``(seed, step, row)``); the held-out windows do not depend on it. Each run's divergence
and relative difference are taken against bf16's run with the same seed (per-run rows, as
with one seed). Per model and recipe, ``summaries`` gives the held-out loss's mean and sample
standard deviation over the seeds, and the gap to bf16 as the difference of the means,
relative to bf16's mean, ± its standard error from both groups,
``sqrt(sd_fp8**2 / n + sd_bf16**2 / n) / mean_bf16`` (the seed-paired gap, the mean of the
per-seed relative differences ± their standard error, beside it). **Verdict with seeds**:
``within_tolerance`` holds when the gap of the means is within ``TOLERANCE`` (2%, either
side) and no run of the recipe diverged; the uncertainty is reported, not used by the rule
(``gap_beyond_2se`` says whether the gap is more than two standard errors from zero). With
one seed this is the per-row verdict.

Prints one JSON object (commands, jax version, per-run and total wall time, the rows).
Runs each ``jaxpar train`` as a subprocess of the tree given by ``--tree`` (default: this
script's checkout), with ``JAX_PLATFORMS=cpu``.

    python scripts/bench_fp8_numerics.py                    # both models, ~20 min on 2 cores
    python scripts/bench_fp8_numerics.py --models tiny --steps 50     # a quick look
    python scripts/bench_fp8_numerics.py --models small --seeds 3     # 9 runs, seeds 0, 1, 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

RECIPES = ("none", "tensorwise", "rowwise", "delayed")  # "none": bf16 GEMMs, the reference
TOLERANCE = 0.02  # |held-out loss - bf16's| / bf16's
DIVERGE_RATIO = 1.25  # a loss above this × bf16's at the same step counts as diverged

SMALL = dict(n_layers=6, d_model=384, n_heads=6, n_kv_heads=3, d_ff=1152)
MODELS = {
    "tiny": dict(model="tiny", overrides={}, steps=300, global_batch=8, seq_len=128),
    "small": dict(model="tiny", overrides=SMALL, steps=200, global_batch=8, seq_len=64),
}
ONE_DEVICE = ["--devices", "1", "--dp", "1", "--tp", "1", "--pp", "1", "--microbatches", "1"]


def command(name: str, recipe: str, seed: int, args: argparse.Namespace) -> list[str]:
    """The ``jaxpar train`` argv (after the interpreter) of one model, recipe and seed."""
    m = MODELS[name]
    steps = args.steps or m["steps"]
    argv = ["-m", "jaxpar.cli", "train", "--model", m["model"], "--seed", str(seed),
            "--steps", str(steps), "--global-batch", str(m["global_batch"]),
            "--seq-len", str(m["seq_len"]), *ONE_DEVICE, "--remat", "none",
            "--compute-dtype", "bfloat16", "--fp8", recipe,
            "--eval-every", str(args.eval_every), "-o", f"train.eval_batches={args.eval_batches}",
            "--no-progress", "--json"]  # fmt: skip
    for k, v in m["overrides"].items():
        argv += ["-o", f"model.{k}={v}"]
    return argv


def train(argv: list[str], tree: Path, timeout: float) -> dict:
    """Run one training; its JSON summary (or what went wrong), exit code and wall time."""
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu")
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, *argv], cwd=tree, env=env, capture_output=True,
                           text=True, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"returncode": None, "error": f"timed out after {timeout} s",
                "wall_s": time.perf_counter() - t0}  # fmt: skip
    out = {"returncode": p.returncode, "wall_s": time.perf_counter() - t0}
    lines = p.stdout.strip().splitlines()
    try:
        out["summary"] = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        out["error"] = (p.stderr or p.stdout)[-3000:]
    return out


def _finite(x) -> bool:
    return x is not None and math.isfinite(x)


def _divergence(run: dict, ref: dict | None, steps: int) -> tuple[bool, list[str], dict]:
    """Apply the divergence rule (module docstring) to one run against bf16's (``ref``)."""
    s = run.get("summary")
    if s is None:
        return True, [f"run failed (exit {run['returncode']})"], {}
    why = []
    if run["returncode"] != 0 or s.get("stopped"):
        why.append(f"exit {run['returncode']}, stopped: {s.get('stopped')}")
    if s["end_step"] < steps:
        why.append(f"ended at step {s['end_step']} of {steps}")
    if s.get("diverged_steps"):
        why.append(f"jaxpar's guard counted {s['diverged_steps']} diverged steps")
    losses = s["losses"]
    evals = {e["step"]: e["eval_loss"] for e in s["evals"]}
    bad = [i + 1 for i, x in enumerate(losses) if not _finite(x)]
    bad_eval = [k for k, v in evals.items() if not _finite(v)]
    if bad:
        why.append(f"non-finite training loss at steps {bad[:5]}")
    if bad_eval:
        why.append(f"non-finite held-out loss at steps {bad_eval}")
    stats: dict = {}
    if ref is not None and ref.get("summary") is not None:
        rl = ref["summary"]["losses"]
        ratios = [(a / b, i + 1) for i, (a, b) in enumerate(zip(losses, rl, strict=False))
                  if _finite(a) and _finite(b)]  # fmt: skip
        if ratios:
            worst, at = max(ratios)
            stats = {"max_step_loss_ratio": worst, "max_step_loss_ratio_at": at}
            above = [i for r, i in ratios if r > DIVERGE_RATIO]
            if above:
                why.append(f"training loss > {DIVERGE_RATIO} × bf16's at steps {above[:5]}")
        tail = [r for r, _ in ratios[-50:]]
        if tail:
            stats["mean_train_loss_ratio_last50"] = sum(tail) / len(tail)
        rev = {e["step"]: e["eval_loss"] for e in ref["summary"]["evals"]}
        above = [k for k, v in evals.items()
                 if _finite(v) and _finite(rev.get(k)) and v > DIVERGE_RATIO * rev[k]]  # fmt: skip
        if above:
            why.append(f"held-out loss > {DIVERGE_RATIO} × bf16's at steps {above}")
    return bool(why), why, stats


def _mean_sd(xs: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (``None`` for fewer than 1 and 2 values)."""
    if not xs:
        return None, None
    mean = sum(xs) / len(xs)
    if len(xs) < 2:
        return mean, None
    return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def summarize(rows: list[dict], model: str) -> list[dict]:
    """Per recipe of ``model``: held-out loss over the seeds and the gap to bf16 (docstring)."""
    by = {r: [x for x in rows if x["model"] == model and x["recipe"] == r]
          for r in ("bf16", *RECIPES[1:])
          if r == "bf16" or any(x["recipe"] == r for x in rows)}  # fmt: skip
    ref_mean, ref_sd = _mean_sd([x["eval_loss"] for x in by["bf16"] if _finite(x["eval_loss"])])
    n_ref = sum(_finite(x["eval_loss"]) for x in by["bf16"])
    out = []
    for recipe, runs in by.items():
        evs = [x["eval_loss"] for x in runs if _finite(x["eval_loss"])]
        mean, sd = _mean_sd(evs)
        diverged = any(x["diverged"] for x in runs) or len(evs) < len(runs)
        s = {"model": model, "recipe": recipe, "seeds": [x["seed"] for x in runs],
             "n": len(evs), "eval_loss_mean": mean, "eval_loss_sd": sd, "eval_losses": evs,
             "any_diverged": diverged}  # fmt: skip
        if recipe != "bf16" and mean is not None and ref_mean is not None:
            gap = (mean - ref_mean) / ref_mean
            se = (math.sqrt(sd**2 / len(evs) + ref_sd**2 / n_ref) / ref_mean
                  if sd is not None and ref_sd is not None else None)  # fmt: skip
            paired = [x["eval_rel_diff_to_bf16"] for x in runs
                      if x["eval_rel_diff_to_bf16"] is not None]  # fmt: skip
            p_mean, p_sd = _mean_sd(paired)
            s.update({
                "gap_rel": gap, "gap_rel_se": se,
                "gap_beyond_2se": None if se is None else abs(gap) > 2 * se,
                "paired_gap_rel": p_mean,
                "paired_gap_rel_se": None if p_sd is None else p_sd / math.sqrt(len(paired)),
                "within_tolerance": abs(gap) <= TOLERANCE and not diverged,
            })  # fmt: skip
        out.append(s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,small", help=f"comma-separated, of {list(MODELS)}")
    ap.add_argument("--steps", type=int, default=0, help="steps of every run (0: per model)")
    ap.add_argument("--seed", type=int, default=0, help="the first seed")
    ap.add_argument("--seeds", type=int, default=1, help="seeds per run: --seed .. --seed+N-1")
    ap.add_argument("--recipes", default=",".join(RECIPES[1:]),
                    help=f"FP8 recipes beside bf16, of {list(RECIPES[1:])}")  # fmt: skip
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--tree", default=str(HERE), help="the jaxpar checkout to run")
    args = ap.parse_args()
    tree = Path(args.tree).resolve()
    if args.seeds < 1:
        ap.error("--seeds: at least 1")
    args.recipes = [r for r in args.recipes.split(",") if r]
    if bad := [r for r in args.recipes if r not in RECIPES[1:]]:
        ap.error(f"--recipes: {bad[0]!r} is not one of {list(RECIPES[1:])}")
    seeds = list(range(args.seed, args.seed + args.seeds))
    t_start = time.perf_counter()

    def git(*a: str) -> str | None:
        p = subprocess.run(["git", "-C", str(tree), *a], capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else None

    result: dict = {
        "what": "FP8 recipes against bf16 GEMMs: same seeds, data and held-out batches",
        "seeds": seeds,
        "jax_version": metadata.version("jax"),
        "jaxlib_version": metadata.version("jaxlib"),
        "tree": str(tree),
        "commit": git("rev-parse", "HEAD"),
        "tree_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "tolerance": {
            "eval_loss_rel_diff_max": TOLERANCE,
            "diverge_ratio": DIVERGE_RATIO,
            "rule": "within_tolerance: |eval - bf16 eval| / bf16 eval <= eval_loss_rel_diff_max "
            "and not diverged; diverged: failed or stopped early, a non-finite loss, or a "
            "training loss (same step) or held-out loss above diverge_ratio x bf16's (same "
            "seed); summaries: within_tolerance: |mean eval - mean bf16 eval| / mean bf16 eval "
            "<= eval_loss_rel_diff_max over the seeds and no run diverged",
        },
        "models": {},
        "rows": [],
        "summaries": [],
    }
    for name in args.models.split(","):
        m = MODELS[name]
        steps = args.steps or m["steps"]
        result["models"][name] = {
            "steps": steps, "global_batch": m["global_batch"], "seq_len": m["seq_len"],
            "model_file": m["model"], "overrides": m["overrides"],
        }  # fmt: skip
        for seed in seeds:
            ref = None
            for recipe in ("none", *args.recipes):
                argv = command(name, recipe, seed, args)
                run = train(argv, tree, args.timeout)
                if recipe == "none":
                    ref = run
                s = run.get("summary") or {}
                diverged, why, stats = _divergence(run, None if recipe == "none" else ref, steps)
                ev, ref_ev = s.get("eval_loss"), (ref.get("summary") or {}).get("eval_loss")
                rel = (ev - ref_ev) / ref_ev if _finite(ev) and _finite(ref_ev) else None
                row = {
                    "model": name,
                    "recipe": "bf16" if recipe == "none" else recipe,
                    "seed": seed,
                    "params": s.get("params"),
                    "final_loss": s.get("final_loss"),
                    "eval_loss": ev,
                    "eval_rel_diff_to_bf16": rel,
                    "diverged": diverged,
                    "divergence_reasons": why,
                    **stats,
                    "within_tolerance": rel is not None and abs(rel) <= TOLERANCE and not diverged,
                    "evals": s.get("evals"),
                    "eval_batches": s.get("eval_batches"),
                    "end_step": s.get("end_step"),
                    "step_time_s": s.get("step_time_s"),
                    "compile_time_s": s.get("compile_time_s"),
                    "wall_s": run["wall_s"],
                    "returncode": run["returncode"],
                    "command": shlex.join(["python3", *argv]),
                }
                if "error" in run:
                    row["error"] = run["error"]
                result["rows"].append(row)
                note = f"final {row['final_loss']}, held-out {ev}, rel {rel}, diverged {diverged}"
                note += f", {run['wall_s']:.0f} s"
                print(f"{name} {row['recipe']} seed {seed}: {note}", file=sys.stderr)
        for summ in summarize(result["rows"], name):
            result["summaries"].append(summ)
            if "gap_rel" in summ:
                print(f"{name} {summ['recipe']} over seeds {summ['seeds']}: held-out "
                      f"{summ['eval_loss_mean']} ± {summ['eval_loss_sd']}, gap {summ['gap_rel']} "
                      f"± {summ['gap_rel_se']}, within {summ['within_tolerance']}",
                      file=sys.stderr)  # fmt: skip
    result["wall_s"] = time.perf_counter() - t_start
    print(json.dumps(result))


if __name__ == "__main__":
    main()
