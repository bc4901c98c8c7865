"""The time model of the compiled program (:mod:`jaxpar.gpu.timing`) against published per-GPU
throughput (issue 46, item 4b), as JSON.

For each row below — a run of :data:`jaxpar.planner.published_runs.RUNS` whose layout jaxpar
compiles on a small machine — the published layout (data, tensor and context parallelism,
ZeRO stage, micro-batches, recomputation, sequence parallelism) is compiled for the row's GPU
(``jaxpar compile`` on the row's mesh file with ``--devices`` the row's GPU count) at 2 and 4
layers, the per-layer shape kept, and each program simulated on the mesh file's hardware with
the row's departures (e.g. torchtitan's 2.4 TB/s H100s). The step at the published depth ``L``
is extrapolated linearly per layer: ``t(2) + (L − 2)·(t(4) − t(2))/2`` (at 2 layers XLA unrolls
the layer loop, so the layer loop's trip count does not carry the scaling; the difference of
two depths does). TFLOP/s per GPU from the model FLOPs of the full-depth model
(:func:`jaxpar.analysis.theory.train_flops_per_token`, PaLM's convention, recomputation not
counted) for both the published step and the estimate; ``tflops_error`` = estimated / published
throughput − 1 (positive: the model is too fast). jaxpar compiles its own attention (cuDNN
flash attention on the GPU targets) and its own program, not the framework's: the error is the
model's and the compiler's together.

``--fitted-ceiling`` costs the matmuls on the mesh file's curve (the planner's ceiling, fitted
on published runs) instead of the published measurement (:data:`jaxpar.gpu.costs.MEASURED`), to
compare the two. Rows that are not compiled are listed in ``skipped`` with the reason.
``--hlo-dir DIR`` keeps the compiled programs (``ROW_L.hlo`` and ``ROW_L.json``) and
re-simulates from them when they are there, so a change to the cost model is re-judged without
compiling.

    python scripts/bench_published_time.py [--rows torchtitan] [--hlo-dir /tmp/pub] > pub.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxpar import config as C  # noqa: E402
from jaxpar.analysis.theory import train_flops_per_token  # noqa: E402
from jaxpar.gpu.lhs import mesh_of  # noqa: E402
from jaxpar.gpu.timing import simulate  # noqa: E402
from jaxpar.planner.published_runs import RUNS, Run  # noqa: E402

DEPTHS = (2, 4)
COMPILED = (
    "torchtitan Llama 3.1 8B FSDP (8 H100)",
    "NeMo Llama 3.1 8B (8 GPUs)",
    "GPT 22B (SP + selective)",
    "torchtitan Llama 3 8B",
    "torchtitan Llama 2 13B",
    "torchtitan Llama 2 70B",
    "GPT 1.7B",
    "GPT 3.6B",
    "torchtitan Llama 3 70B",
    "MaxText Llama 2 70B (64 GPUs)",
)
# Why the other rows are not compiled here (24 GiB, two cores, about 2 min a compile).
SKIP_PIPELINE = ("a pipeline (pp {pp}, {v} virtual): a step is not linear in the layers per "
                 "stage (the bubble), and the smallest depth the schedule takes is pp·v = {d} "
                 "layers of d_model {dm}; not tried")  # fmt: skip
SKIP_DEVICES = ("{n} GPUs: not tried (XLA compiled the 64-GPU rows in 8-63 s each here; the "
                "partitioner's work grows with the device count)")  # fmt: skip


def skip_reason(run: Run) -> str | None:
    if run.name in COMPILED:
        return None
    lay = run.layout
    if lay.pp > 1:
        return SKIP_PIPELINE.format(pp=lay.pp, v=lay.virtual, d=lay.pp * lay.virtual,
                                    dm=run.model.d_model)  # fmt: skip
    if run.gpus > 64:
        return SKIP_DEVICES.format(n=run.gpus)
    return "the same layout as a compiled row at another GPU count; not run, for time"


def flags(run: Run, layers: int, model_path: Path) -> list[str]:
    lay = run.layout
    out = ["--model", str(model_path), "--mesh", run.mesh, "--devices", str(run.gpus),
           "--global-batch", str(run.global_batch), "--seq-len", str(run.seq),
           "--dp", str(lay.dp), "--tp", str(lay.tp), "--pp", str(lay.pp), "--sp", str(lay.sp),
           "--zero", str(lay.zero), "--microbatches", str(lay.microbatches),
           "--remat", lay.remat]  # fmt: skip
    if lay.sp > 1:
        out += ["--sp-mode", lay.sp_mode]
    if lay.sequence_parallel and lay.tp > 1:
        out.append("--sequence-parallel")
    return out


def compile_depth(run: Run, layers: int, where: Path, timeout: int) -> tuple[str, dict] | str:
    """(HLO text, compile JSON) of ``run`` at ``layers`` layers, or an error line."""
    key = run.name.replace(" ", "_").replace("(", "").replace(")", "").replace(".", "p")
    hlo, rep = where / f"{key}_{layers}.hlo", where / f"{key}_{layers}.json"
    if hlo.exists() and rep.exists():
        return hlo.read_text(), json.loads(rep.read_text())
    model = dataclasses.replace(run.model, n_layers=layers)
    mpath = where / f"{key}_{layers}.yaml"
    fields = {k: v for k, v in dataclasses.asdict(model).items() if k not in ("name", "moe")}
    mpath.write_text(yaml.safe_dump({**fields}))
    cmd = ["compile", *flags(run, layers, mpath), "--json", "--hlo", str(hlo)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    if hlo.exists():
        hlo.unlink()
    try:
        proc = subprocess.run([sys.executable, "-m", "jaxpar.cli", *cmd], env=env,
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"timeout after {timeout} s at {layers} layers"
    if proc.returncode != 0:
        err = proc.stderr.strip().splitlines()
        return f"{layers} layers: " + (err[-1] if err else "failed")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rep.write_text(json.dumps(out))
    return hlo.read_text(), out


def row(run: Run, where: Path, timeout: int, fitted: bool = False) -> dict:
    hw = dataclasses.replace(C.load_mesh(run.mesh).hardware, **run.hardware)
    if fitted:  # a GPU name without a measurement: the costs take the mesh file's curve
        hw = dataclasses.replace(hw, gpu="mesh-curve")
    layout = " ".join(flags(run, run.model.n_layers, Path(run.model.name))[4:])
    base = {"row": run.name, "source": run.source, "gpus": run.gpus, "layout": layout}
    steps, compile_s = {}, {}
    for d in DEPTHS:
        got = compile_depth(run, d, where, timeout)
        if isinstance(got, str):
            return {**base, "error": got}
        text, rep = got
        st = simulate(text, mesh_of(rep["layout"]), hw)
        steps[d], compile_s[d] = st, rep.get("compile_seconds")
    lo, hi = DEPTHS
    per_layer = (steps[hi].step_s - steps[lo].step_s) / (hi - lo)
    step = steps[lo].step_s + (run.model.n_layers - lo) * per_layer

    def ext(f) -> float:
        return f(steps[lo]) + (run.model.n_layers - lo) * (f(steps[hi]) - f(steps[lo])) / (hi - lo)

    flops = train_flops_per_token(run.model, run.seq) * run.global_batch * run.seq / run.gpus
    pub, est = flops / run.step_time_s / 1e12, flops / step / 1e12
    exposed = ext(lambda s: s.exposed_s["total"])
    return {
        **base,
        "published_step_s": run.step_time_s,
        "estimated_step_s": step,
        "published_tflops_per_gpu": pub,
        "estimated_tflops_per_gpu": est,
        "tflops_error": est / pub - 1,
        "estimated_compute_s": ext(lambda s: s.compute_s),
        "estimated_exposed_s": exposed,
        "per_layer_s": per_layer,
        "steps_at_depths_s": {str(d): steps[d].step_s for d in DEPTHS},
        "compile_seconds": compile_s,
        "note": run.note,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="*", default=None, help="row names or prefixes (default all)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per compile")
    p.add_argument("--hlo-dir", default=None, help="keep (and reuse) the compiled programs here")
    p.add_argument("--fitted-ceiling", action="store_true",
                   help="cost matmuls on the mesh file's curve (the planner's fitted ceiling), "
                   "as the time model did before it took the published measurement")  # fmt: skip
    args = p.parse_args()
    tmp = None
    if args.hlo_dir:
        where = Path(args.hlo_dir)
        where.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory()
        where = Path(tmp.name)
    rows, skipped = [], []
    for run in RUNS:
        if args.rows and not any(run.name.startswith(r) for r in args.rows):
            continue
        why = skip_reason(run)
        if why is not None:
            skipped.append({"row": run.name, "gpus": run.gpus, "reason": why})
            continue
        rows.append(row(run, where, args.timeout, args.fitted_ceiling))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    errs = sorted((abs(r["tflops_error"]), r["row"]) for r in rows if "tflops_error" in r)
    summary = {
        "rows": len(errs),
        "median_abs_error": errs[len(errs) // 2][0] if errs else None,
        "worst": {"row": errs[-1][1], "abs_error": errs[-1][0]} if errs else None,
    }
    print(json.dumps({"rows": rows, "skipped": skipped, "summary": summary}))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
