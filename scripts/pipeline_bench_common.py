"""Shared by the pipeline benchmark scripts: timing compiled gradient programs in a subprocess, on
this tree or on another revision of jaxpar ("before"), with the same code either way.

:func:`measure_jobs` runs :data:`MEASURE` in a fresh process (its own simulated device count)
with ``PYTHONPATH`` set to the tree to measure: it compiles each job's gradient program, then
times the jobs round robin (interleaved repeats, so machine load hits them alike) and reports
per job the best step time, XLA's compiled memory and, optionally, the HLO text. It uses only
interfaces every jaxpar revision of this series has (``Trainer.grads_fn``, ``compiled_memory``),
so the before/after figures come from one procedure. :func:`before_tree` makes a temporary git
worktree of the "before" revision.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEFORE_REV = "6881a8a"  # main before the fused-tick executor (07fafb8 plus its config fix)

MEASURE = r"""
import json, os, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
spec = json.loads(sys.argv[1])
import jax
jax.config.update("jax_num_cpu_devices", spec["devices"])
import jax.numpy as jnp
from jaxpar import config as C
try:  # the rules moved out of jaxpar.config; a "before" revision may predate that
    from jaxpar.validation import validate
except ImportError:
    validate = C.validate
from jaxpar.analysis.hlo import compiled_memory
from jaxpar.data import Batches, load_corpus
from jaxpar.devices import make_mesh
from jaxpar.train.step import Trainer

runs = []
for job in spec["jobs"]:
    cfg = C.load(job.get("model_name", "tiny"), "cpu-8")
    if job.get("model"):
        cfg.model = C.ModelConfig(**job["model"])
    cfg.train.global_batch, cfg.train.seq_len = job["batch"], job["seq"]
    for k, v in job["layout"].items():
        setattr(cfg.layout, k, v)
    cfg.mesh.devices = cfg.layout.n_devices
    validate(cfg, cfg.layout.n_devices)
    tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices]))
    shape = jax.ShapeDtypeStruct((job["batch"], job["seq"] + 1), jnp.int32,
                                 sharding=tr.batch_sharding)
    with tr._ctx():
        fn = jax.jit(tr.grads_fn, in_shardings=(tr.param_shardings, tr.batch_sharding))
        t0 = time.perf_counter()
        compiled = fn.lower(tr.abstract_params, shape).compile()
        compile_s = time.perf_counter() - t0
    params = tr.init_state(0)["params"]
    data = Batches(load_corpus("stdlib", 256), job["batch"], job["seq"], seed=0)
    batch = data.global_array(0, tr.batch_sharding)
    jax.block_until_ready(compiled(params, batch))
    out = {"name": job["name"], "compile_s": round(compile_s, 2),
           "memory": compiled_memory(compiled), "times": []}
    if job.get("hlo"):
        with open(job["hlo"], "w") as f:
            f.write(compiled.as_text())
    runs.append((out, compiled, params, batch))
for _ in range(spec["steps"]):
    for out, compiled, params, batch in runs:
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, batch))
        out["times"].append(time.perf_counter() - t0)
print(json.dumps([dict(o, step_s=min(o["times"]) if o["times"] else None) for o, *_ in runs]))
"""


def before_tree(rev: str = BEFORE_REV) -> Path:
    """A git worktree of ``rev`` (created once, detached, under the system temp directory)."""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"jaxpar-before-{rev}"
    if not (path / "jaxpar").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev],
                       check=True, capture_output=True)  # fmt: skip
    return path


def measure_jobs(jobs: list[dict], devices: int, steps: int, tree: Path = ROOT) -> list[dict]:
    """Compile and time ``jobs`` on jaxpar at ``tree`` in a fresh process (module docstring)."""
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu")
    spec = json.dumps({"jobs": jobs, "devices": devices, "steps": steps})
    proc = subprocess.run([sys.executable, "-c", MEASURE, spec], env=env, capture_output=True,
                          text=True, cwd=str(tree))  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"measuring on {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def old_schedule(kind: str, p: int, m: int, v: int, tree: Path) -> dict:
    """``jaxpar schedule --json`` of the tree at ``tree`` (its orders and figures)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    argv = ["-m", "jaxpar.cli", "schedule", "--kind", kind, "--stages", str(p),
            "--microbatches", str(m), "--virtual", str(v), "--json"]  # fmt: skip
    proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True,
                          cwd=str(tree), check=True)  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])
