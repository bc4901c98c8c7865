"""Every pipeline schedule: its tables' makespans and stashes, and its compiled program at pp = 4.

Parts (``--parts``, comma-separated; all by default), one JSON object printed last:

* ``table``: for every schedule at p ∈ {2, 4, 8}, m ∈ {8, 16, 32} (where valid; interleaved at
  v = 1 and 2; 1F1B also with ``pipeline_memory`` lean): asynchronous and lock-step makespan
  (F = 1, B = 2, I = W = 1 per stage, a chunk 1/v), their ratio, peak stashes per rank (lock
  step), ticks.
* ``compiled``: each schedule (and lean 1F1B, ``1f1b-lean``) at p = 4, m = 16 (16 layers of
  d 128, batch 32 × 64 tokens, fp32,
  ``remat none``): the compiled flops of each branch (XLA cost analysis of the stage's F, B, I,
  W and FB functions, and of the head the last stage adds), the **simulated step time** — the
  sum over ticks of the slowest rank's branch flops, what a GPU pod would see in lock step
  (simulated CPU devices share two cores, so their wall time hides lock-step waste) —, the CPU
  wall time and its ratio to GPipe's in the same run (interleaved repeats), compiled
  temporaries, ticks, lock-step makespan and peak stashes; the 1F1B/GPipe and lean
  1F1B/GPipe temporaries ratios.
* ``before``: the same for GPipe, 1F1B and interleaved on the revision before the fused-tick
  executor (``--before-rev``, a temporary git worktree, measured in a subprocess by the same
  code), with its tables (``jaxpar schedule --json`` of that revision) costed by this
  revision's branch flops (the stage math is the same), and the after/before ratios.

    python scripts/bench_schedules.py [--parts table,compiled,before] [--steps 5] [--png F.png]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from jaxpar.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from pipeline_bench_common import (  # noqa: E402
    BEFORE_REV,
    before_tree,
    measure_jobs,
    old_schedule,
)

from jaxpar import config as C  # noqa: E402
from jaxpar import sharding as shd  # noqa: E402
from jaxpar import validation as V  # noqa: E402
from jaxpar.devices import make_mesh  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.pipeline.generators import KINDS, check_arguments  # noqa: E402
from jaxpar.pipeline.render import plot_schedules  # noqa: E402
from jaxpar.pipeline.schedules import Action, lockstep, make_schedule  # noqa: E402
from jaxpar.pipeline.stage import Chunk, Stage  # noqa: E402
from jaxpar.pipeline.tables import fused_fb  # noqa: E402
from jaxpar.pipeline.timing import stats  # noqa: E402
from jaxpar.train.pipeline_run import PipelineRun  # noqa: E402
from jaxpar.train.step import Trainer  # noqa: E402

P, M = 4, 16
# 16 layers of d 128 (4 per stage, 2 per chunk at v = 2): the head is ~10% of a stage's work,
# as in a language model (a smaller stage would let the last stage's head dominate each tick).
MODEL = dict(name="bench", n_layers=16, d_model=128, n_heads=4, n_kv_heads=2, d_ff=512,
             vocab_size=256, max_seq_len=64)  # fmt: skip
BATCH, SEQ = 32, 64
COMPILED = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1, "zbv": 2, "dualpipev": 2}
# Rows of the compiled part: name -> (schedule, virtual, pipeline_memory).
ROWS = {k: (k, v, "fast") for k, v in COMPILED.items()} | {"1f1b-lean": ("1f1b", 1, "lean")}
# (virtual, pipeline_memory) variants of the table part; (1, "fast") for the other schedules.
TABLE_VARIANTS = {
    "1f1b": ((1, "fast"), (1, "lean")),
    "interleaved": ((1, "fast"), (2, "fast")),
    "zbv": ((2, "fast"),),
    "dualpipev": ((2, "fast"),),
}


def table() -> list[dict]:
    """Async and lock-step makespans and peak stashes of every schedule (pure Python)."""
    rows = []
    for kind in KINDS:
        for v, mem in TABLE_VARIANTS.get(kind, ((1, "fast"),)):
            for p in (2, 4, 8):
                for m in (8, 16, 32):
                    try:
                        check_arguments(kind, p, m, v, mem)
                    except ConfigError:  # a combination the schedule refuses
                        continue
                    st = stats(make_schedule(kind, p, m, v, mem))
                    rows.append({
                        "kind": kind, "p": p, "m": m, "v": v, "pipeline_memory": mem,
                        "makespan": st.makespan,
                        "lockstep_makespan": st.lockstep_makespan,
                        "lockstep_over_async": round(st.lockstep_makespan / st.makespan, 4),
                        "peak_stashes": st.peak_stashes, "ticks": st.lockstep_ticks,
                    })  # fmt: skip
    return rows


def config(kind: str, v: int, m: int = M) -> C.RunConfig:
    cfg = C.load("tiny", "cpu-8")
    cfg.model = C.ModelConfig(**MODEL)
    cfg.train.global_batch, cfg.train.seq_len = BATCH, SEQ
    lay = cfg.layout
    lay.pp, lay.dp, lay.tp, lay.schedule, lay.microbatches, lay.virtual = P, 1, 1, kind, m, v
    lay.remat = "none"
    cfg.mesh.devices = lay.n_devices
    V.validate(cfg, lay.n_devices)
    return cfg


def _flops(fn, *args) -> float:
    return float(jax.jit(fn).lower(*args).compile().cost_analysis()["flops"])


def branch_flops(kind: str, v: int) -> dict[str, float]:
    """XLA's flop count of each action's function for one chunk (and the head's extra).

    XLA's cost analysis counts a while loop's body once, whatever its trip count, so each
    function is compiled for a chunk of one layer (a one-trip layer scan) and scaled by the
    chunk's layers (they are identical); the head, outside the scan, is counted once.
    """
    cfg = config(kind, v)
    tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[:P]))
    run = PipelineRun(tr.grad_ctx)
    lc = cfg.model.n_layers // (P * v)
    local = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, 1, *a.shape[1:]), a.dtype),
                         tr.abstract_params["layers"])  # fmt: skip
    head = tr.model.head_params(tr.model.abstract())  # canonical: no stage slot
    b = BATCH // M
    x = jax.ShapeDtypeStruct((b, SEQ, cfg.model.d_model), jnp.float32)
    tg = jax.ShapeDtypeStruct((b, SEQ), jnp.int32)
    out = {}
    with tr._ctx(), shd.use_rules(tr.grad_ctx.inner_rules()):
        pm = run.pieces_for(jnp.arange(SEQ))
        held = {}

        def stage(c, h):
            st = Stage(pm.pieces, c, jnp.zeros(h.shape, h.dtype))
            held.setdefault("s", st)
            return st

        def grads(c):  # each layer's gradient kept (summed), so no weight matmul is dropped
            zero = [jnp.zeros(a.shape[2:], a.dtype) for a in jax.tree.leaves(c)]

            def sink(acc, i, d, computed):
                return [a + x for a, x in zip(acc, jax.tree.leaves(d), strict=True)], []

            return zero, sink

        jax.eval_shape(lambda c, h: stage(c, h).apply(Chunk(c, 0), h), local, x)
        s0 = held["s"]
        stash, taps, wpend = s0.stash_shapes, s0.taps_shapes, s0.wpend_shapes
        out["F"] = _flops(lambda c, h: stage(c, h).forward(Chunk(c, 0), h), local, x)
        out["B"] = _flops(lambda c, st, tp, g: stage(c, g).backward(
            Chunk(c, 0), list(st), list(tp), g, *grads(c)), local, stash, taps, x)  # fmt: skip
        if s0.split:
            out["I"] = _flops(lambda c, st, g: stage(c, g).input_grads(
                Chunk(c, 0), list(st), g, *grads(c)), local, stash, x)  # fmt: skip
            out["W"] = _flops(lambda c, tp, wp: stage(c, x_zero(x)).weight_grads(
                Chunk(c, 0), list(tp), list(wp), *grads(c)), local, taps, wpend)  # fmt: skip

        def head_grads(hp, y, t):
            return jax.value_and_grad(lambda q, z: pm.head_loss(q, z, t), argnums=(0, 1))(hp, y)

        out["head"] = _flops(head_grads, head, x, tg)

        def fb(c, hp, h, t):
            f = lambda c, q, z: pm.head_loss(q, stage(c, z).apply(Chunk(c, 0), z)[0], t)  # noqa: E731
            return jax.value_and_grad(f, argnums=(0, 1, 2))(c, hp, h)

        out["FB"] = _flops(fb, local, head, x, tg)
    scaled = {k: c * lc for k, c in out.items() if k not in ("head", "FB")}
    return dict(scaled, head=out["head"], FB=(out["FB"] - out["head"]) * lc + out["head"])


def x_zero(x: jax.ShapeDtypeStruct) -> jax.Array:
    """A zero input of the message shape (probing a stage inside a traced function)."""
    return jnp.zeros(x.shape, x.dtype)


def simulated_step(sched, flops: dict[str, float], fb: bool = True) -> float:
    """Sum over ticks of the slowest rank's work, in flops (module docstring)."""
    last = sched.num_stages - 1
    pairs = fused_fb(sched) if fb else set()
    total = 0.0
    for col in zip(*sched.ticks, strict=True):
        work = []
        for cell in col:
            w = 0.0
            for a in cell:
                if a.kind == "B" and (a.stage, a.mb) in pairs:
                    continue  # counted with its F as one FB
                if a.kind == "F" and (a.stage, a.mb) in pairs:
                    w += flops["FB"]
                else:
                    w += flops[a.kind] + (flops["head"] if a.kind == "F" and a.stage == last else 0)
            work.append(w)
        total += max(work)
    return total


def compiled_part(steps: int) -> dict:
    flops = {k: branch_flops(k, v) for k, v in COMPILED.items()}  # per schedule: same math
    jobs = [dict(name=name, model=MODEL, batch=BATCH, seq=SEQ,
                 layout=dict(pp=P, dp=1, tp=1, schedule=k, microbatches=M, virtual=v,
                             pipeline_memory=mem, remat="none"))
            for name, (k, v, mem) in ROWS.items()]  # fmt: skip
    runs = {r["name"]: r for r in measure_jobs(jobs, P, steps)}
    out = {}
    for name, (k, v, mem) in ROWS.items():
        sched = make_schedule(k, P, M, v, mem)
        st = stats(sched)
        f = flops[k]
        sim = simulated_step(sched, f)
        out[name] = {
            "virtual": v, "pipeline_memory": mem, "ticks": sched.num_ticks,
            "lockstep_makespan": st.lockstep_makespan, "makespan": st.makespan,
            "peak_stashes": st.peak_stashes, "branch_flops": f,
            "branch_over_F": {a: round(c / f["F"], 3) for a, c in f.items()},
            "simulated_step_flops": sim, "simulated_step_in_F": round(sim / f["F"], 2),
            "wall_s": runs[name]["step_s"], "temp_bytes": runs[name]["memory"]["temp"],
            "compile_s": runs[name]["compile_s"],
        }  # fmt: skip
    for k in out:
        out[k]["wall_over_gpipe"] = round(out[k]["wall_s"] / out["gpipe"]["wall_s"], 3)
    return out


def before_part(steps: int, rev: str, after: dict) -> dict:
    """GPipe, 1F1B and interleaved on ``rev`` (module docstring)."""
    tree = before_tree(rev)
    kinds = {"gpipe": 1, "1f1b": 1, "interleaved": 2}
    jobs = [dict(name=k, model=MODEL, batch=BATCH, seq=SEQ,
                 layout=dict(pp=P, dp=1, tp=1, schedule=k, microbatches=M, virtual=v,
                             remat="none")) for k, v in kinds.items()]  # fmt: skip
    runs = {r["name"]: r for r in measure_jobs(jobs, P, steps, tree)}
    out = {}
    for k, v in kinds.items():
        old = old_schedule(k, P, M, v, tree)
        steps_ = [tuple((Action.parse(a),) for a in row) for row in old["ranks"]]
        sched = make_schedule(k, P, M, v)  # for the placement and sizes
        sched = type(sched)(k, P, M, v, sched.placement, tuple(steps_))
        sched.ticks = tuple(map(tuple, lockstep(sched.steps, sched.num_stages)))
        sim = simulated_step(sched, after[k]["branch_flops"], fb=False)
        out[k] = {
            "ticks": sched.num_ticks, "lockstep_makespan": old["lockstep_makespan"],
            "simulated_step_flops": sim, "wall_s": runs[k]["step_s"],
            "temp_bytes": runs[k]["memory"]["temp"],
        }  # fmt: skip
    for k in out:
        out[k]["wall_over_gpipe"] = round(out[k]["wall_s"] / out["gpipe"]["wall_s"], 3)
        a = after[k]
        out[k]["simulated_before_over_after"] = round(
            out[k]["simulated_step_flops"] / a["simulated_step_flops"], 3
        )
        out[k]["wall_over_gpipe_after_over_before"] = round(
            a["wall_over_gpipe"] / out[k]["wall_over_gpipe"], 3
        )
        out[k]["wall_after_over_before"] = round(a["wall_s"] / out[k]["wall_s"], 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="table,compiled,before")
    ap.add_argument("--steps", type=int, default=5, help="timed repeats per program")
    ap.add_argument("--before-rev", default=BEFORE_REV)
    ap.add_argument("--png", default=None, help="write the p = 4, m = 8 timelines here")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    result: dict = {"pp": P, "microbatches": M, "model": MODEL, "batch": [BATCH, SEQ]}
    if "table" in parts:
        result["table"] = table()
    if "compiled" in parts or "before" in parts:
        after = compiled_part(args.steps)
        result["compiled"] = after
        g, o = after["gpipe"]["temp_bytes"], after["1f1b"]["temp_bytes"]
        result["temp_1f1b_over_gpipe"] = round(o / g, 4)
        result["temp_1f1b_lean_over_gpipe"] = round(after["1f1b-lean"]["temp_bytes"] / g, 4)
        result["simulated_1f1b_lean_over_1f1b"] = round(
            after["1f1b-lean"]["simulated_step_flops"] / after["1f1b"]["simulated_step_flops"], 4
        )
        if "before" in parts:
            result["before"] = before_part(args.steps, args.before_rev, after)
            b = result["before"]
            result["before"]["temp_1f1b_over_gpipe"] = round(
                b["1f1b"]["temp_bytes"] / b["gpipe"]["temp_bytes"], 4
            )
    if args.png:
        plot_schedules([make_schedule(k, P, 8, v) for k, v in COMPILED.items()], args.png)
        result["png"] = args.png
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
