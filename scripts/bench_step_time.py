"""The simulated step time of the GPU grid's layouts beside the planner's (JSON).

For each row of ``scripts/bench_gpu_grid.py`` (same models, meshes and flags), one
``jaxpar compile --json`` in its own process; from its ``estimate`` (:mod:`jaxpar.gpu.timing`:
the scheduled XLA:GPU program simulated on the mesh file's hardware): the estimated step, compute
and exposed communication per mesh axis, TFLOP/s per device and MFU (model FLOPs, PaLM), the
planner's step for the same layout and ``step_ratio`` = planner / estimate. Needs the jax CUDA
plugin; about a minute a row on two cores (the 70B rows need up to ~20 GB of memory).

    python scripts/bench_step_time.py [--rows 8b-zero3 70b] > step_time.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_gpu_grid import ROWS  # noqa: E402


def row(name: str, timeout: int) -> dict:
    """One compile's estimate (or its error)."""
    model, mesh, flags = ROWS[name]
    cmd = ["jaxpar", "compile", "--model", model, "--mesh", mesh, *flags, "--json"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    try:
        proc = subprocess.run([sys.executable, "-m", "jaxpar.cli", *cmd[1:]], env=env,
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"row": name, "command": " ".join(cmd), "error": f"timeout after {timeout} s"}
    if proc.returncode != 0:
        err = proc.stderr.strip().splitlines()
        return {"row": name, "command": " ".join(cmd), "error": err[-1] if err else "failed"}
    est = json.loads(proc.stdout.strip().splitlines()[-1])["estimate"]
    keep = ("step_s", "planner_step_s", "step_ratio", "compute_s", "exposed_s", "comm_s",
            "tflops_per_device", "mfu", "assumptions")  # fmt: skip
    return {"row": name, "command": " ".join(cmd), **{k: est[k] for k in keep}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="*", default=None, help="row names or prefixes (default all)")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per compile")
    args = p.parse_args()
    names = [n for n in ROWS if not args.rows or any(n.startswith(r) for r in args.rows)]
    rows = []
    for n in names:
        rows.append(row(n, args.timeout))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress, one row a line
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
