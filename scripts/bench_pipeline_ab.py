"""Same-run A/B of the pipeline executor against another jaxpar tree (default: /work/main).

For each pipeline layout it compiles the gradient program on both trees (each in its own
process, ``PYTHONPATH`` set to the tree, the same simulated devices) and reports, in one JSON
object printed last:

* ``bitwise``: whether the loss and every gradient leaf are bit for bit the same (the same
  initial parameters and batch on both: the init does not depend on the layout);
* ``same_program``: whether the two optimized HLO programs are the same instruction for
  instruction (metadata and constant numbering aside);
* ``permutes``: count and wire bytes per device of the pp collective-permutes, and the bytes of
  every other collective, read from both optimized HLO texts by this tree's
  :func:`jaxpar.analysis.hlo.collective_bytes` (one measuring procedure for both);
* for the timed layouts, ``step_s`` of each tree (median of its bursts) and
  ``ratio`` = this tree / the other: both programs stay loaded and run in alternating bursts
  (A B B A ...), so machine load hits them alike.

    python scripts/bench_pipeline_ab.py [--other /work/main] [--bursts 6] [--steps 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent

# name -> (layout overrides, timed); the tiny model of tests/test_pipeline.py (8 layers of d 32,
# seq 16, batch 16) for the checks, the benchmark shape (4 layers of d 256, batch 16 x 256) timed.
SMALL = dict(n_layers=8, d_model=32, d_ff=64, n_heads=2, n_kv_heads=1)
LAYOUTS = {
    "pp4-1f1b-m8": (dict(pp=4, schedule="1f1b", microbatches=8), SMALL, (16, 16), False),
    "pp4-interleaved-v2-m8": (
        dict(pp=4, schedule="interleaved", virtual=2, microbatches=8),
        SMALL,
        (16, 16),
        False,
    ),  # fmt: skip
    "pp4-zbv-m8": (dict(pp=4, schedule="zbv", virtual=2, microbatches=8), SMALL, (16, 16), False),
    "pp2-dp2-z2-zbh1-m4": (
        dict(pp=2, dp=2, zero=2, schedule="zb-h1", microbatches=4),
        SMALL,
        (16, 16),
        False,
    ),  # fmt: skip
    "pp2-dualpipev-m4": (
        dict(pp=2, schedule="dualpipev", virtual=2, microbatches=4),
        SMALL,
        (16, 16),
        False,
    ),  # fmt: skip
    "pp2-1f1b-m8-timed": (dict(pp=2, schedule="1f1b", microbatches=8), {}, (16, 256), True),
    "pp2-interleaved-m8-timed": (
        dict(pp=2, schedule="interleaved", virtual=2, microbatches=8),
        {},
        (16, 256),
        True,
    ),  # fmt: skip
}
QUICK = ("pp4-interleaved-v2-m8", "pp2-1f1b-m8-timed")

WORKER = r"""
import hashlib, json, os, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
jax.config.update("jax_num_cpu_devices", 4)
import numpy as np
from jaxpar import config as C
from jaxpar.data import Batches, load_corpus
from jaxpar.devices import make_mesh
from jaxpar.train.step import Trainer
from jaxpar.validation import validate

progs = {}
for line in sys.stdin:
    req = json.loads(line)
    if req["op"] == "compile":
        cfg = C.load("tiny", "cpu-8")
        for k, v in req["model"].items():
            setattr(cfg.model, k, v)
        cfg.train.global_batch, cfg.train.seq_len = req["batch"]
        lay = cfg.layout
        lay.dp, lay.tp, lay.pp, lay.sp, lay.zero, lay.remat = 1, 1, 1, 1, 0, "none"
        for k, v in req["layout"].items():
            setattr(lay, k, v)
        cfg.mesh.devices = lay.n_devices
        validate(cfg, lay.n_devices)
        tr = Trainer(cfg, make_mesh(lay, jax.devices()[: lay.n_devices]))
        params = tr.init_state(0)["params"]
        b, s = req["batch"]
        batch = Batches(load_corpus("stdlib", 256), b, s, seed=3).global_array(0, tr.batch_sharding)
        with tr._ctx():
            shardings = (tr.device_shardings["params"], tr.batch_sharding)
            fn = jax.jit(tr.grads_fn, in_shardings=shardings)
            compiled = fn.lower(params, batch).compile()
        loss, g = compiled(params, batch)
        digest = hashlib.sha256(np.asarray(loss).tobytes())
        for leaf in jax.tree.leaves(g):
            digest.update(np.asarray(leaf).tobytes())
        with open(req["hlo"], "w") as f:
            f.write(compiled.as_text())
        progs[req["name"]] = (compiled, params, batch)
        out = {"loss": float(loss), "digest": digest.hexdigest(),
               "mesh": [list(tr.mesh.devices.shape), list(tr.mesh.axis_names)]}
    else:
        compiled, params, batch = progs[req["name"]]
        times = []
        for _ in range(req["steps"]):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(params, batch))
            times.append(time.perf_counter() - t0)
        out = {"times": times}
    print(json.dumps(out), flush=True)
"""


class Worker:
    """A process serving compile and time requests on the jaxpar tree at ``tree``."""

    def __init__(self, tree: Path):
        env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu")
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=str(tree))  # fmt: skip

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker died on {req}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def program_text(path: Path) -> list[str]:
    """The optimized HLO's instructions without metadata (source lines, op names) and with
    constants unnumbered: two programs equal here differ only in what the profiler shows."""
    out = []
    for line in path.read_text().splitlines():
        if line.lstrip().startswith('"') or not (" = " in line or line.rstrip().endswith("{")):
            continue  # the metadata tables (file and function names, stack frames)
        line = re.sub(r", metadata=\{[^}]*\}", "", line)
        out.append(re.sub(r"%constant\.\d+", "%constant", line))
    return out


def comm(hlo: str, mesh: list) -> dict:
    """pp collective-permutes and all other collectives of one program (this tree's counter)."""
    import numpy as np

    from jaxpar.analysis.hlo import collective_bytes

    shape, names = mesh
    rep = collective_bytes(hlo, SimpleNamespace(devices=np.empty(shape), axis_names=tuple(names)))
    perm = rep.select("collective-permute", ("pp",))
    return {"permute_ops": perm.ops, "permute_count": perm.count,
            "permute_wire_bytes": perm.wire_bytes,
            "other_bytes": rep.total.bytes - perm.bytes}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", default="/work/main", help="the tree to compare against")
    ap.add_argument("--bursts", type=int, default=6, help="timed bursts per tree and layout")
    ap.add_argument("--steps", type=int, default=3, help="steps per burst")
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="jaxpar-ab-"))
    trees = {"this": ROOT, "other": Path(args.other)}
    workers = {k: Worker(t) for k, t in trees.items()}
    names = QUICK if args.quick else tuple(LAYOUTS)
    result: dict = {"other": str(args.other), "loadavg_start": list(os.getloadavg()), "layouts": {}}
    try:
        for name in names:
            layout, model, batch, timed = LAYOUTS[name]
            row: dict = {}
            for k, w in workers.items():
                hlo = str(tmp / f"{k}_{name}.hlo")
                got = w.ask(op="compile", name=name, layout=layout, model=model, batch=batch,
                            hlo=hlo)  # fmt: skip
                row[k] = {"loss": got["loss"], "digest": got["digest"],
                          **comm(Path(hlo).read_text(), got["mesh"])}  # fmt: skip
            row["bitwise"] = row["this"]["digest"] == row["other"]["digest"]
            keys = ("permute_ops", "permute_count", "permute_wire_bytes")
            row["same_permutes"] = all(row["this"][k] == row["other"][k] for k in keys)
            row["same_program"] = program_text(tmp / f"this_{name}.hlo") == program_text(
                tmp / f"other_{name}.hlo"
            )
            if timed:
                times: dict = {k: [] for k in workers}
                for b in range(args.bursts):
                    for k in list(workers) if b % 2 == 0 else list(workers)[::-1]:
                        times[k] += workers[k].ask(op="time", name=name, steps=args.steps)["times"]
                med = {k: statistics.median(v) for k, v in times.items()}
                for k in workers:
                    row[k]["step_s"] = round(med[k], 5)
                    row[k]["best_s"] = round(min(times[k]), 5)
                row["ratio"] = round(med["this"] / med["other"], 4)
                row["best_ratio"] = round(min(times["this"]) / min(times["other"]), 4)
            result["layouts"][name] = row
            print(f"{name}: {json.dumps(row)}", file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.close()
    result["loadavg_end"] = list(os.getloadavg())
    result["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
