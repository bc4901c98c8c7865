"""XLA's latency-hiding-scheduler statistics beside jaxpar's simulated time, per scheduled
computation (issue 46, item 4a; :mod:`jaxpar.gpu.lhs`), as JSON.

Each row is one ``jaxpar compile --json --hlo`` in its own process with the analytical
speed-of-light estimator configured from the mesh file (:func:`jaxpar.gpu.lhs.sol_flags`) and the
scheduler's statistics logged (``TF_CPP_VMODULE=latency_hiding_scheduler=1``). For each
computation the scheduler reports after scheduling: its total and wasted µs (per collective
kind), and jaxpar's walk of the same computation (:func:`jaxpar.gpu.lhs.computation_times`):
step, compute and exposed µs without the ``while`` loops it runs (XLA costs a ``while`` at
0.01 µs), the time in those loops, and the cuDNN attention time (XLA: a 10 µs fallback a call).
Per instruction class (``instructions``, :func:`jaxpar.gpu.lhs.instruction_costs`): what XLA's
estimator gave the matmuls (its interpolator over measured GEMMs), the fusions (its performance
model) and the collectives, beside jaxpar's cost of the same instructions.
Reduced depths (``-o model.n_layers=N``) keep each compile under a minute or two on two cores.

    python scripts/bench_lhs.py [--rows 8b-zero3-2l] > lhs.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_gpu_grid import run_rows  # noqa: E402

from jaxpar import config as C  # noqa: E402
from jaxpar.gpu import lhs  # noqa: E402

B8 = ("--global-batch", "8", "--seq-len", "4096")
ROWS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "8b-zero3-2l": ("llama3-8b", "h100-8", (*B8, "--dp", "8", "--tp", "1", "--zero", "3",
                                             "-o", "model.n_layers=2")),
    "8b-tp8-sp-2l": ("llama3-8b", "h100-8", (*B8, "--dp", "1", "--tp", "8",
                                              "--sequence-parallel", "-o", "model.n_layers=2")),
    # two nodes: the dp groups cross the network, which XLA's SoL estimator models
    "8b-zero3-2nodes-2l": ("llama3-8b", "h100-8", ("--devices", "16", "--global-batch", "16",
                                                    "--seq-len", "4096", "--dp", "16", "--tp",
                                                    "1", "--zero", "3", "-o",
                                                    "model.n_layers=2")),
    # the 70B pick at two layers, dp 32 x tp 2 + SP, ZeRO-3, across 8 nodes (an A100
    # target: XLA does not use the SoL estimator there; its cycles are not µs)
    "70b-planner-2l": ("llama2-70b", "a100-64", ("--dp", "32", "--tp", "2",
                                                 "--sequence-parallel", "--pp", "1", "--zero",
                                                 "3", "--remat", "selective", "--microbatches",
                                                 "2", "-o", "model.n_layers=2")),
}  # fmt: skip


def row(name: str, timeout: int) -> dict:
    model, mesh, flags = ROWS[name]
    hw = C.load_mesh(mesh).hardware
    with tempfile.TemporaryDirectory() as tmp:
        hlo = Path(tmp) / "step.hlo"
        cmd = ["compile", "--model", model, "--mesh", mesh, *flags, "--json", "--hlo", str(hlo)]
        env = dict(os.environ, PYTHONPATH=str(ROOT), **lhs.COST_ENV,
                   XLA_FLAGS=" ".join(lhs.sol_flags(hw)))  # fmt: skip
        base = {"row": name, "command": "jaxpar " + " ".join(cmd[:-2]),
                "sol_options": lhs.sol_options(hw)}  # fmt: skip
        try:
            proc = subprocess.run([sys.executable, "-m", "jaxpar.cli", *cmd], env=env,
                                  capture_output=True, text=True, timeout=timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            return {**base, "error": f"timeout after {timeout} s"}
        if proc.returncode != 0:
            err = proc.stderr.strip().splitlines()
            return {**base, "error": err[-1] if err else "failed"}
        rep = json.loads(proc.stdout.strip().splitlines()[-1])
        text = hlo.read_text()
    stats = [s for s in lhs.parse_stats(proc.stderr) if s.phase == "after"]
    mine = lhs.computation_times(text, lhs.mesh_of(rep["layout"]), hw,
                                 [s.computation for s in stats])  # fmt: skip
    comps = []
    for s in stats:
        j = mine.get(s.computation)
        comps.append({
            "computation": s.computation,
            "xla_total_us": s.total,
            "xla_wasted_us": s.wasted,
            "xla_wasted_share": s.wasted / s.total if s.total else None,
            "xla_wasted_by_kind_us": s.wasted_by_kind,
            **({} if j is None else {
                "jaxpar_step_us": j["flat_step_s"] * 1e6,
                "jaxpar_compute_us": j["flat_compute_s"] * 1e6,
                "jaxpar_exposed_us": j["flat_exposed_s"] * 1e6,
                "jaxpar_exposed_share": j["flat_exposed_s"] / j["flat_step_s"]
                if j["flat_step_s"] else None,
                "jaxpar_attention_us": j["attention_s"] * 1e6,
                "jaxpar_loops_us": j["loops_s"] * 1e6,
                "step_ratio_xla_over_jaxpar": s.total / (j["flat_step_s"] * 1e6)
                if j["flat_step_s"] else None,
            }),
        })  # fmt: skip
    est = rep["estimate"]
    costs = lhs.instruction_costs(text, lhs.mesh_of(rep["layout"]), hw,
                                  lhs.parse_costs(proc.stderr))  # fmt: skip
    return {
        **base,
        "computations": comps,
        "instructions": costs,
        "jaxpar_estimate": {k: est[k] for k in ("step_s", "compute_s", "exposed_s")},
    }


def main() -> None:
    run_rows(__doc__, ROWS, row, 600)


if __name__ == "__main__":
    main()
