"""The pipeline executor's cost, from the compiled program, against what its schedule implies.

Simulated CPU devices, fp32; one JSON object printed last (``--quick``: a covering subset,
fewer repeats). Parts (``--parts``, comma-separated; all by default):

* ``dp``: data-parallel wire bytes per device per step of dp 2 × pp 2 (1F1B, the tiny model),
  read from the compiled train step's HLO (:func:`jaxpar.analysis.memory.measure`, what
  ``jaxpar memory --measure`` reports) at m = 4 and m = 8 for ZeRO 0-3, their m 8 / m 4 ratio
  and the ratio to the once-per-step theory (:func:`jaxpar.analysis.memory.dp_comm_theory`:
  ZeRO 0 all-reduces the stage's gradients once, 2Ψ(N−1)/N; 1 reduce-scatters once and
  gathers the params once; 2 reduce-scatters per micro-batch, kΨ; 3 gathers per micro-batch
  in forward and backward, 3kΨ — so only ZeRO 0 and 1 are flat in m by design).
* ``pp``: interleaved v = 2 (p = 2 and 4, m = 8, the tiny model with 8 layers): pp-axis
  bytes of the compiled gradient program by collective kind, against the messages the table
  implies — each cross-rank send of ``f_send``/``b_send`` (:mod:`jaxpar.pipeline.tables`)
  moves one ``[b, s, d]`` activation or cotangent
  (:func:`jaxpar.planner.traffic.pp_message_bytes`), so the per-device wire bytes are
  sends × message bytes / p. An all-gather over pp (weights moving) would show apart, and so
  would an all-reduce of the embedding's or head's gradients (they are stage-owned at rest,
  :mod:`jaxpar.pipeline.rest`, so none is expected); ``other_pp_collectives`` lists every
  pp collective that is not a send (the scalar loss's sum).
* ``flops``: XLA cost-analysis flops of the F, B, I and W branches of ZB-H1 and ZB-V
  (``bench_schedules.branch_flops``: a one-layer chunk scaled by the chunk's layers); target
  W, I ≤ 1.2 F (I keeps what each weight matmul's gradient needs; W computes only those).
* ``tick``: pp 2 × 1F1B × m 8 against one device accumulating the same 8 micro-batches (the
  tiny model, batch 16 × 256, ``remat none`` and ``full``), compiled gradient programs timed in
  one subprocess with interleaved repeats (:mod:`pipeline_bench_common`), on this tree and on
  the revision before the fused-tick executor (``--before-rev``): bytes copied per step and
  per tick (:func:`jaxpar.analysis.hlo.copy_bytes` of each HLO; ``carry_bytes_per_trip`` are
  the copies shaped like the scan's state, jax-ml/jax#38145) and the wall-time ratio pipeline
  / one device (target ≤ 1.3). The before revision's switches carry no branch weights, so its
  copies inside a branch count as if every branch ran every tick (an upper bound).
* ``torch``: the same comparison in PyTorch, same model and shape
  (``bench_torch._torch_model``): ``torch.distributed.pipelining`` Schedule1F1B over 8
  micro-batches on 2 gloo processes (one intra-op thread each on 2 cores) against one process
  accumulating the 8 micro-batches with every core's thread and with one thread (a process
  with several threads suffers most from other jobs on a shared machine); forward and
  backward only (as the jaxpar programs), interleaved bursts, median and best step.

The machine this runs on may be shared: ratios come from one run, and ``loadavg`` is recorded.

    python scripts/bench_pipeline.py [--quick] [--parts dp,pp,flops,tick,torch] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

TICK_BATCH, TICK_SEQ, TICK_M = 16, 256, 8


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _cfg(batch: int, seq: int, n_layers: int = 4, **layout):
    """The tiny model (``n_layers`` of them) under ``layout`` (dp, tp, pp 1 and ZeRO 0 unless
    given), validated."""
    from jaxpar import config as C
    from jaxpar.validation import validate

    cfg = C.load("tiny", "cpu-8")
    cfg.model.n_layers = n_layers
    cfg.train.global_batch, cfg.train.seq_len = batch, seq
    lay = cfg.layout
    lay.dp, lay.tp, lay.pp, lay.sp, lay.zero, lay.remat = 1, 1, 1, 1, 0, "none"
    for k, v in layout.items():
        setattr(lay, k, v)
    cfg.mesh.devices = lay.n_devices
    validate(cfg, lay.n_devices)
    return cfg


def dp_part(quick: bool) -> dict:
    """dp-axis bytes of dp 2 × pp 2 per ZeRO stage at m = 4 and 8 (module docstring)."""
    from jaxpar.analysis.memory import dp_comm_theory, measure

    out = {}
    for zero in (0, 2) if quick else (0, 1, 2, 3):
        row = {}
        for m in (4, 8):
            cfg = _cfg(16, 64, dp=2, pp=2, zero=zero, schedule="1f1b", microbatches=m)
            comm = measure(cfg)["comm"]
            th = dp_comm_theory(cfg)["total_bytes"]
            row[f"m{m}"] = {"dp_wire_bytes": comm["dp_wire_bytes"], "theory_bytes": th,
                            "over_theory": round(comm["dp_wire_bytes"] / th, 4),
                            "conditional_ops": comm["conditional_ops"]}  # fmt: skip
        row["m8_over_m4"] = round(row["m8"]["dp_wire_bytes"] / row["m4"]["dp_wire_bytes"], 4)
        row["theory_m8_over_m4"] = round(row["m8"]["theory_bytes"] / row["m4"]["theory_bytes"], 4)
        out[f"zero{zero}"] = row
    return out


def pp_part(quick: bool) -> dict:
    """pp-axis bytes of interleaved v = 2 against the table's messages (module docstring)."""
    import jax
    import jax.numpy as jnp

    from jaxpar.analysis.hlo import collective_bytes
    from jaxpar.devices import make_mesh
    from jaxpar.pipeline.schedules import make_schedule
    from jaxpar.pipeline.tables import SEND_NEXT, SEND_PREV, build_table
    from jaxpar.planner.traffic import pp_message_bytes
    from jaxpar.planner.workload import Shape
    from jaxpar.train.step import Trainer

    out = {}
    for p in (4,) if quick else (2, 4):
        m, batch, seq = 8, 16, 64
        cfg = _cfg(batch, seq, 8, pp=p, schedule="interleaved", virtual=2, microbatches=m)
        tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[:p]))
        shape = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=tr.batch_sharding)
        with tr._ctx():
            compiled = jax.jit(tr.grads_fn).lower(tr.abstract_params, shape).compile()
        rep = collective_bytes(compiled, tr.mesh)
        table = build_table(make_schedule("interleaved", p, m, 2))
        sends = int(sum(((codes == SEND_NEXT) | (codes == SEND_PREV)).sum()
                        for codes in (table.f_send, table.b_send)))  # fmt: skip
        msg = pp_message_bytes(cfg.model, cfg.layout, Shape(batch, seq))
        implied = sends * msg / p
        pp = rep.select(axes=("pp",))
        out[f"p{p}"] = {
            "microbatches": m, "sends": sends, "message_bytes": msg,
            "implied_wire_bytes": implied, "pp_wire_bytes": pp.wire_bytes,
            "over_implied": round(pp.wire_bytes / implied, 4),
            "by_kind": {k: {"count": rep.select(k, ("pp",)).count,
                            "wire_bytes": rep.select(k, ("pp",)).wire_bytes}
                        for k in ("collective-permute", "all-gather", "all-reduce",
                                  "reduce-scatter", "all-to-all")
                        if rep.select(k, ("pp",)).ops},
            "weight_all_gather_bytes": rep.select("all-gather", ("pp",)).bytes,
            "other_pp_collectives": [
                {"kind": c.kind, "bytes": c.bytes, "trips": c.trips, "op_name": c.op_name[-120:]}
                for c in rep.collectives if c.axes == ("pp",) and c.kind != "collective-permute"
            ],
            "permute_over_implied": round(
                rep.select("collective-permute", ("pp",)).wire_bytes / implied, 4
            ),
        }  # fmt: skip
    return out


def flops_part() -> dict:
    """F, B, I, W branch flops of the zero-bubble schedules (``bench_schedules``)."""
    from bench_schedules import branch_flops

    out = {}
    for kind, v in (("zb-h1", 1), ("zbv", 2)):
        f = branch_flops(kind, v)
        out[kind] = {"flops": {k: f[k] for k in ("F", "B", "I", "W")},
                     "W_over_F": round(f["W"] / f["F"], 3), "I_over_F": round(f["I"] / f["F"], 3),
                     "B_over_F": round(f["B"] / f["F"], 3)}  # fmt: skip
    return out


def tick_part(steps: int, rev: str | None) -> dict:
    """Copies per tick and wall time, pp 2 × 1F1B × m 8 vs one device (module docstring)."""
    from pipeline_bench_common import before_tree, measure_jobs

    from jaxpar.analysis.hlo import copy_bytes

    tmp = Path(tempfile.mkdtemp(prefix="jaxpar-tick-"))
    pipe = dict(pp=2, dp=1, tp=1, zero=0, schedule="1f1b", microbatches=TICK_M)
    one = dict(pp=1, dp=1, tp=1, zero=0, microbatches=TICK_M)
    trees = {"after": None} | ({"before": before_tree(rev)} if rev else {})
    out: dict = {"batch": [TICK_BATCH, TICK_SEQ], "microbatches": TICK_M}
    for tag, tree in trees.items():
        jobs = [dict(name=f"{n}_{r}", batch=TICK_BATCH, seq=TICK_SEQ,
                     layout=dict(lay, remat=r), hlo=str(tmp / f"{tag}_{n}_{r}.hlo"))
                for r in ("none", "full") for n, lay in (("pp2", pipe), ("one", one))]  # fmt: skip
        load0 = loadavg()
        runs = {j["name"]: j for j in (measure_jobs(jobs, 2, steps, tree) if tree
                                       else measure_jobs(jobs, 2, steps))}  # fmt: skip
        res: dict = {"loadavg": [load0, loadavg()]}
        for job in jobs:
            r = runs[job["name"]]
            cb = copy_bytes(Path(job["hlo"]).read_text())
            tick = max(cb["loops"], key=lambda lp: lp["trips"]) if cb["loops"] else None
            res[job["name"]] = {
                "step_s": r["step_s"], "temp_bytes": r["memory"]["temp"],
                "copy_bytes_per_step": cb["total"],
                "tick": None if tick is None or job["name"].startswith("one") else {
                    k: tick[k] for k in ("trips", "bytes_per_trip", "carry_bytes_per_trip",
                                         "updated_state_bytes")},
            }  # fmt: skip
        for r in ("none", "full"):
            res[f"wall_pp2_over_one_{r}"] = round(
                res[f"pp2_{r}"]["step_s"] / res[f"one_{r}"]["step_s"], 3
            )
        out[tag] = res
    if "before" in out:
        a, b = out["after"], out["before"]
        out["copy_bytes_after_over_before"] = {
            r: round(a[f"pp2_{r}"]["copy_bytes_per_step"] / b[f"pp2_{r}"]["copy_bytes_per_step"], 4)
            for r in ("none", "full")
        }  # fmt: skip
    return out


# ---- PyTorch ---------------------------------------------------------------------------------


def _torch_rank(rank: int, world: int, m: int, threads: int, port: int, cmd_q, res_q) -> None:
    """One PyTorch process: 1F1B stage ``rank`` of ``world`` (or, alone, accumulation), with
    ``threads`` intra-op threads."""
    import torch
    import torch.distributed as dist
    from bench_torch import SHAPES, _loss, _tokens, _torch_model

    shape = SHAPES["issue"]  # jaxpar's tiny model, batch 16 × 256
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = _torch_model(shape)
    tok = torch.from_numpy(_tokens(shape)).long()
    x, y = tok[:, :-1], tok[:, 1:]
    schedule = None
    if world > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)  # fmt: skip
        mods = list(model)
        per = (len(mods) - 2) // world  # blocks per stage; embedding first, head last
        lo = 0 if rank == 0 else 1 + rank * per
        hi = 1 + (rank + 1) * per if rank < world - 1 else len(mods)
        model = torch.nn.Sequential(*mods[lo:hi])
        stage = PipelineStage(model, rank, world, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=_loss)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        if schedule is None:
            for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
                (_loss(model(xs), ys) / m).backward()
        elif rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])

    step()
    res_q.put({"rank": rank})
    while (req := cmd_q.get()).get("steps"):
        times = []
        for _ in range(req["steps"]):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        res_q.put({"rank": rank, "times": times})
    if world > 1:
        dist.destroy_process_group()


class _TorchGroup:
    """``world`` PyTorch processes serving timed bursts (per step: the slowest rank)."""

    def __init__(self, world: int, m: int, threads: int):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.cmd = [ctx.Queue() for _ in range(world)]
        self.res = ctx.Queue()
        args = (world, m, threads, port)
        self.procs = [
            ctx.Process(target=_torch_rank, args=(r, *args, self.cmd[r], self.res))
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self._gather()

    def _gather(self) -> list[dict]:
        return [self.res.get(timeout=900) for _ in self.procs]

    def run(self, steps: int) -> list[float]:
        for q in self.cmd:
            q.put({"steps": steps})
        per_rank = [g["times"] for g in self._gather()]
        return [max(ts) for ts in zip(*per_rank, strict=True)]

    def close(self) -> None:
        for q in self.cmd:
            q.put({})
        for p in self.procs:
            p.join()


def torch_part(steps: int, rounds: int) -> dict:
    """PyTorch pipelining (2 processes, 1F1B) vs one process accumulating (module docstring)."""
    load0 = loadavg()
    cores = os.cpu_count() or 1
    groups = {
        "pp2": _TorchGroup(2, TICK_M, max(1, cores // 2)),  # the cores split between the ranks
        "one": _TorchGroup(1, TICK_M, cores),
        "one_1thread": _TorchGroup(1, TICK_M, 1),  # as each pp rank on 2 cores (load-robust)
    }
    times: dict[str, list[float]] = {k: [] for k in groups}
    try:
        for r in range(rounds):
            order = list(groups) if r % 2 == 0 else list(groups)[::-1]  # ABC CBA ...
            for k in order:
                times[k] += groups[k].run(steps)
    finally:
        for g in groups.values():
            g.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    return {"microbatches": TICK_M, "batch": [TICK_BATCH, TICK_SEQ], "steps": len(times["pp2"]),
            "median_s": med, "best_s": best,
            **{f"pp2_over_{k}_{s}": round(d["pp2"] / d[k], 3)
               for k in ("one", "one_1thread") for s, d in (("median", med), ("best", best))},
            "loadavg": [load0, loadavg()]}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a covering subset, fewer repeats")
    ap.add_argument("--parts", default="dp,pp,flops,tick,torch")
    ap.add_argument("--steps", type=int, default=None, help="timed repeats per program")
    ap.add_argument("--before-rev", default=None, help="revision for the tick part's 'before' "
                    "(default: pipeline_bench_common.BEFORE_REV; 'none' to skip)")  # fmt: skip
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxpar.devices import simulate_cpu_devices

    simulate_cpu_devices(4)
    from pipeline_bench_common import BEFORE_REV

    parts = args.parts.split(",")
    steps = args.steps or (3 if args.quick else 5)
    rev = args.before_rev or BEFORE_REV
    result: dict = {"loadavg_start": loadavg(), "cpus": os.cpu_count(), "quick": args.quick}
    for part in parts:
        t0 = time.perf_counter()
        if part == "dp":
            result["dp"] = dp_part(args.quick)
        elif part == "pp":
            result["pp"] = pp_part(args.quick)
        elif part == "flops":
            result["flops"] = flops_part()
        elif part == "tick":
            result["tick"] = tick_part(steps, None if rev == "none" or args.quick else rev)
        elif part == "torch":
            result["torch"] = torch_part(steps, 2 if args.quick else 4)
        else:
            ap.error(f"--parts: unknown part {part!r}")
        print(f"{part}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    result["loadavg_end"] = loadavg()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
