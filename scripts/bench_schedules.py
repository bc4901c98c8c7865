"""Compare every pipeline schedule on one small model and layout (pp = 4, simulated CPU devices).

For each schedule: compile time, steady step time of the gradient computation, lock-step ticks
and bubbles from the table, the executor's stash slots, and XLA's compiled memory (temporaries).
Also: the 1F1B / GPipe temporaries ratio at m = 16 and the compile time of one schedule at
m = 8 versus m = 32 (the tick scan keeps it flat). Writes a PNG of the timelines side by side.
Prints one JSON object.

    python scripts/bench_schedules.py [--png F.png] [--steps 3] [--parts schedules,memory,compile]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxpar.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxpar import config as C  # noqa: E402
from jaxpar.analysis.hlo import compiled_memory  # noqa: E402
from jaxpar.data import Batches, load_corpus  # noqa: E402
from jaxpar.devices import make_mesh  # noqa: E402
from jaxpar.pipeline.render import plot_schedules  # noqa: E402
from jaxpar.pipeline.schedules import make_schedule  # noqa: E402
from jaxpar.train.step import Trainer  # noqa: E402

P = 4
# schedule -> (micro-batches, virtual) on the common comparison
SCHEDULES = {
    "gpipe": (8, 1),
    "1f1b": (8, 1),
    "interleaved": (8, 2),
    "zb-h1": (8, 1),
    "zbv": (8, 2),
    "dualpipev": (8, 2),
}


def config(kind: str, m: int, v: int, batch: int, seq: int) -> C.RunConfig:
    """8 layers of d 64 (1-2 per chunk), 4 heads, seq ``seq``, batch ``batch``."""
    cfg = C.load("tiny", "cpu-8")
    cfg.model = C.ModelConfig(
        name="bench", n_layers=8, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128,
        vocab_size=256, max_seq_len=seq,
    )  # fmt: skip
    cfg.train.global_batch, cfg.train.seq_len = batch, seq
    lay = cfg.layout
    lay.pp, lay.dp, lay.tp, lay.schedule, lay.microbatches, lay.virtual = P, 1, 1, kind, m, v
    cfg.mesh.devices = lay.n_devices
    C.validate(cfg, lay.n_devices)
    return cfg


def measure(kind: str, m: int, v: int, batch: int, seq: int, steps: int) -> dict:
    """Compile the gradient program; time ``steps`` runs; memory from the compiled program."""
    cfg = config(kind, m, v, batch, seq)
    tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[:P]))
    spec = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=tr.batch_sharding)
    with tr._ctx():
        fn = jax.jit(tr.grads_fn, in_shardings=(tr.param_shardings, tr.batch_sharding))
        t0 = time.perf_counter()
        compiled = fn.lower(tr.abstract_params, spec).compile()
        compile_s = time.perf_counter() - t0
    out = {"compile_s": round(compile_s, 2), "memory": compiled_memory(compiled)}
    if steps:
        params = tr.init_state(0)["params"]
        data = Batches(load_corpus("stdlib", 256), batch, seq, seed=0)
        batch_arr = data.global_array(0, tr.batch_sharding)
        jax.block_until_ready(compiled(params, batch_arr))
        times = []
        for _ in range(steps):
            t1 = time.perf_counter()
            jax.block_until_ready(compiled(params, batch_arr))
            times.append(time.perf_counter() - t1)
        out["step_s"] = round(min(times), 4)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--png", default="schedules.png")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--parts", default="schedules,memory,compile", help="comma-separated subset")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    result: dict = {"pp": P, "schedules": {}}
    scheds = []
    for kind, (m, v) in SCHEDULES.items() if "schedules" in parts else ():
        s = make_schedule(kind, P, m, v)
        scheds.append(s)
        st = s.stats()
        row = {
            "microbatches": m,
            "virtual": v,
            "lockstep_ticks": st.lockstep_ticks,
            "bubble_fraction": round(st.bubble_fraction, 4),
            "lockstep_bubble_fraction": round(st.lockstep_bubble_fraction, 4),
            "stash_slots": int(s.as_arrays()["n_stash_slots"]),
        }
        row.update(measure(kind, m, v, 32, args.seq, args.steps))
        result["schedules"][kind] = row
        print(kind, row, file=sys.stderr, flush=True)
    if scheds:
        plot_schedules(scheds, args.png)
        result["png"] = args.png

    if "memory" in parts:  # 1F1B versus GPipe at m = 16 (in-flight p versus m)
        mem = {k: measure(k, 16, 1, 32, args.seq, 0)["memory"]["temp"] for k in ("gpipe", "1f1b")}
        result["temp_bytes_m16"] = mem
        result["temp_ratio_1f1b_over_gpipe_m16"] = round(mem["1f1b"] / mem["gpipe"], 4)

    if "compile" in parts:  # m = 8 versus m = 32 (same schedule, same model; batch 32)
        ct = {m: measure("1f1b", m, 1, 32, args.seq, 0)["compile_s"] for m in (8, 32)}
        result["compile_s_1f1b"] = {"m8": ct[8], "m32": ct[32], "ratio": round(ct[32] / ct[8], 3)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
