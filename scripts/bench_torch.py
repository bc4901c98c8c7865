"""jaxpar against PyTorch on the same Llama: step-time ratios measured in one run.

The PyTorch model has jaxpar's block (RMSNorm, rotary half-split, grouped-query attention
through ``scaled_dot_product_attention(is_causal=True, enable_gqa=True)``, SwiGLU, untied head),
the same shapes, init scale, AdamW (β 0.9/0.95, weight decay 0.1) and global-norm clipping at 1.
Pairs, same global batch:

==========  =============================  ==========================================
config      jaxpar                         PyTorch (CPU, gloo)
==========  =============================  ==========================================
single      1 device                       eager, one process
single_mb4  1 device, 4 micro-batches      eager, one process (no accumulation)
ddp4        dp 4, ZeRO-0                   DistributedDataParallel, 4 processes
zero3x4     dp 4, ZeRO-3                   FSDP2 (``fully_shard`` per block), 4 processes
pp2         pp 2, 1F1B, 4 micro-batches    ``torch.distributed.pipelining`` Schedule1F1B
==========  =============================  ==========================================

Every side runs in a long-lived worker subprocess (jaxpar with exactly the simulated CPU
devices its layout needs: simulating 8 while using 1 costs a few percent) that compiles or
warms up once and then runs timed bursts of steps on request. The coordinator interleaves the
bursts (ABBA order over ``--repeats`` rounds) and reports median step times and the
jaxpar/PyTorch ratio per config: on a shared machine a ratio from interleaved bursts is worth
more than either absolute time; each round's own ratio (its two bursts seconds apart) is
reported too, with their median and spread. Both sides use every CPU the process may run on
(PyTorch's ranks split them); ``--cpus N`` narrows that to N, which shows how each side scales
with cores. Last line of stdout: one JSON object.

    python scripts/bench_torch.py                        # both shapes, all configs
    python scripts/bench_torch.py --shapes issue --configs single,ddp4 --repeats 3
    python scripts/bench_torch.py --shapes issue --configs single --cpus 1
    python scripts/bench_torch.py --shapes issue --configs single --attribute

``--attribute`` says what each side's attention core costs inside its step: two more workers per
config run the same step with the core (jaxpar's kernel, PyTorch's SDPA) replaced by one
elementwise stand-in, the same on both sides (``o = q ∘ repeat(v + k)`` over each kv head's
query heads: same shapes, differentiable in q, k and v, no softmax). A side's core cost is its
step minus its stand-in step; the stand-in steps compare everything but the core.

Each shape's row also carries both sides' rate on one plain fp32 matmul of the step (the MLP's
up projection, ``[batch·seq, d_model] × [d_model, d_ff]``), timed in a fresh process of each
side with the same CPUs, and the JSON names the CPU: a ratio is a property of a machine as much
as of the code (PyTorch's CPU matmuls call MKL, jaxpar's XLA's own; their rates differ by vendor).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {
    # The shape of issue 13 (jaxpar's default tiny model at its full context).
    "issue": dict(n_layers=4, d_model=256, n_heads=8, n_kv_heads=4, d_ff=768, vocab_size=256,
                  seq=256, batch=16),
    # Wider and longer: d 512 (head dim 64), 1024 positions.
    "wide": dict(n_layers=4, d_model=512, n_heads=8, n_kv_heads=4, d_ff=1536, vocab_size=256,
                 seq=1024, batch=4),
}  # fmt: skip
# jaxpar's settings per shape (what pays on CPU, README "Attention, the layer loop and the
# loss"): straight-line layers; attention tiles of a quarter of the sequence (10 of 16 tiles
# computed). Same-process A/B of the one-device step at 13c0864: issue shape, tiles of 32 and 128
# against 64: 1.13, 1.17; wide shape, 128 and 512 against 256: 1.13, 1.01.
JAXPAR = {"issue": {"layer_unroll": 0}, "wide": {"layer_unroll": 0, "attention_block": 256}}
CONFIGS = {
    "single": dict(devices=1, layout=dict(dp=1), torch="eager"),
    # Gradient accumulation over 4 micro-batches (same global batch and update) against eager
    # without: on CPU the smaller working set stays in cache (PyTorch gains nothing from it).
    "single_mb4": dict(devices=1, layout=dict(dp=1, microbatches=4), torch="eager"),
    "ddp4": dict(devices=4, layout=dict(dp=4, zero=0), torch="ddp"),
    "zero3x4": dict(devices=4, layout=dict(dp=4, zero=3), torch="fsdp2"),
    "pp2": dict(devices=2, layout=dict(pp=2, schedule="1f1b", microbatches=4), torch="pp"),
}
TAG = "@@bench "  # protocol lines on a worker's stdout start with this


def _cpus() -> int:
    """CPUs this process may run on (its affinity, which ``--cpus`` narrows)."""
    return len(os.sched_getaffinity(0))


def _say(obj) -> None:
    print(TAG + json.dumps(obj), flush=True)


def _commands():
    """Requests from the coordinator, one JSON object per stdin line."""
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            return
        yield req


def _tokens(shape: dict, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, shape["vocab_size"], (shape["batch"], shape["seq"] + 1), np.int32)


# --------------------------------------------------------------------------------------------
# jaxpar worker


def standin_jax(q_BxSxHxDh, k_BxSxKxDh, v_BxSxKxDh):
    """``--attribute``'s attention stand-in, jaxpar's layout: query head h reads kv head
    h // G."""
    import jax.numpy as jnp

    g = q_BxSxHxDh.shape[2] // k_BxSxKxDh.shape[2]
    return q_BxSxHxDh * jnp.repeat(v_BxSxKxDh + k_BxSxKxDh, g, axis=2)


def standin_torch(q_BxHxSxDh, k_BxKxSxDh, v_BxKxSxDh, is_causal=True, enable_gqa=True):
    """The same stand-in in PyTorch's layout, called as ``scaled_dot_product_attention``."""
    import torch

    g = q_BxHxSxDh.shape[1] // k_BxKxSxDh.shape[1]
    return q_BxHxSxDh * torch.repeat_interleave(v_BxKxSxDh + k_BxKxSxDh, g, dim=1)


def jax_worker(shape_name: str, config: str, model_overrides: dict, core: str = "real") -> None:
    """Compile the jaxpar train step of ``config`` and serve timed bursts (``core="standin"``:
    with :func:`standin_jax` as the attention core)."""
    spec, shape = CONFIGS[config], SHAPES[shape_name]
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    from jaxpar.devices import make_mesh, simulate_cpu_devices

    # As every jaxpar CPU run: the simulated devices, and the host allocator keeping each
    # step's buffers mapped (jaxpar.hostmem; JAXPAR_HOST_ALLOCATOR=system turns it off).
    simulate_cpu_devices(spec["devices"])
    from jaxpar import config as C
    from jaxpar import validation as V
    from jaxpar.train.step import Trainer

    if core == "standin":
        from jaxpar.model import layers

        # The local (dp/ZeRO) path's core, whatever implementation it resolved to.
        layers.attention_core = lambda implementation, block: standin_jax
    cfg = C.load("tiny", "cpu-8")
    for k in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size"):
        setattr(cfg.model, k, shape[k])
    cfg.model.max_seq_len = shape["seq"]
    for k, v in model_overrides.items():
        C.override(cfg, f"model.{k}", v)
    lay = cfg.layout
    lay.dp, lay.tp, lay.pp, lay.sp, lay.zero, lay.microbatches = 1, 1, 1, 1, 1, 1
    lay.remat = "none"
    for k, v in spec["layout"].items():
        setattr(lay, k, v)
    cfg.mesh.devices = spec["devices"]
    cfg.train.global_batch, cfg.train.seq_len = shape["batch"], shape["seq"]
    V.validate(cfg, spec["devices"])
    tr = Trainer(cfg, make_mesh(lay, jax.devices()))
    state = tr.init_state(0)
    batch = jax.device_put(_tokens(shape), tr.batch_sharding)
    t0 = time.perf_counter()
    tr.compile_step()
    compile_s = time.perf_counter() - t0
    losses = []
    for _ in range(2):
        state, m = tr.step(state, batch)
        losses.append(float(m["loss"]))
    from jaxpar.model.attention import nvidia, resolve

    dev = jax.devices()[0]
    impl = resolve(
        cfg.model.attention, nvidia(dev), tr.compute_dtype, cfg.model.hd, tr.rules.attention,
        dev.platform,
    )  # fmt: skip
    if core == "standin":
        impl = "standin"
    from jaxpar import hostmem

    _say({
        "ready": True, "compile_s": compile_s, "first_loss": losses[0], "attention": impl,
        "host_allocator": hostmem.state(),
    })  # fmt: skip
    for req in _commands():
        times = []
        for _ in range(req["steps"]):
            t = time.perf_counter()
            state, m = tr.step(state, batch)
            float(m["loss"])  # waits for the step
            times.append(time.perf_counter() - t)
        _say({"times": times})


# --------------------------------------------------------------------------------------------
# PyTorch: the model


def _torch_model(shape: dict, core: str = "real"):
    import torch
    import torch.nn.functional as F
    from torch import nn

    attend = F.scaled_dot_product_attention if core == "real" else standin_torch
    d, h, kvh, f, v = (shape[k] for k in ("d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size"))
    hd, L, std = d // h, shape["n_layers"], 0.02

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight

    def linear(n_in, n_out, s=std):
        lin = nn.Linear(n_in, n_out, bias=False)
        nn.init.normal_(lin.weight, std=s)
        return lin

    half = hd // 2
    freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    angle = torch.arange(shape["seq"], dtype=torch.float32)[:, None] * freq[None, :]

    def rope(x):  # [B, H, S, Dh], half-split as jaxpar
        cos, sin = angle.cos()[: x.shape[2]], angle.sin()[: x.shape[2]]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            out_std = std / (2 * L) ** 0.5
            self.n1, self.n2 = RMSNorm(), RMSNorm()
            self.wq, self.wk, self.wv = linear(d, h * hd), linear(d, kvh * hd), linear(d, kvh * hd)
            self.wo = linear(h * hd, d, out_std)
            self.gate, self.up, self.down = linear(d, f), linear(d, f), linear(f, d, out_std)

        def forward(self, x):
            b, s, _ = x.shape
            y = self.n1(x)
            q = rope(self.wq(y).view(b, s, h, hd).transpose(1, 2))
            k = rope(self.wk(y).view(b, s, kvh, hd).transpose(1, 2))
            val = self.wv(y).view(b, s, kvh, hd).transpose(1, 2)
            o = attend(q, k, val, is_causal=True, enable_gqa=True)
            x = x + self.wo(o.transpose(1, 2).reshape(b, s, h * hd))
            y = self.n2(x)
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(v, d)
            nn.init.normal_(self.table.weight, std=std)

        def forward(self, tokens):
            return self.table(tokens)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.out = RMSNorm(), linear(d, v)

        def forward(self, x):
            return self.out(self.norm(x))

    return nn.Sequential(Embed(), *[Block() for _ in range(L)], Head())


def _loss(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


# --------------------------------------------------------------------------------------------
# PyTorch: one rank


def _rank_main(
    rank: int, world: int, kind: str, shape: dict, port: int, cmd_q, res_q, core: str = "real"
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, _cpus() // world))
    torch.manual_seed(0)
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    model = _torch_model(shape, core)
    tok = torch.from_numpy(_tokens(shape)).long()
    x_all, y_all = tok[:, :-1], tok[:, 1:]
    if kind in ("ddp", "fsdp2"):
        per = shape["batch"] // world
        x, y = x_all[rank * per : (rank + 1) * per], y_all[rank * per : (rank + 1) * per]
    else:
        x, y = x_all, y_all
    schedule = None
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in list(model)[1:-1]:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "pp":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        mods = list(model)
        per = (len(mods) - 2) // world  # blocks per stage; embed first, head last
        lo = 0 if rank == 0 else 1 + rank * per
        hi = 1 + (rank + 1) * per if rank < world - 1 else len(mods)
        model = torch.nn.Sequential(*mods[lo:hi])
        stage = PipelineStage(model, rank, world, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        if schedule is not None:
            losses: list = []
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
            loss = float(sum(losses) / len(losses)) if losses else float("nan")
        else:
            loss_t = _loss(model(x), y)
            loss_t.backward()
            loss = float(loss_t.detach())
        # Stage-local norm under pp (a global one needs another collective); timing only.
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    first = [step() for _ in range(2)][0]
    res_q.put({"rank": rank, "ready": True, "first_loss": first})
    while True:
        req = cmd_q.get()
        if req.get("quit"):
            break
        times = []
        for _ in range(req["steps"]):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        res_q.put({"rank": rank, "times": times})
    if world > 1:
        dist.destroy_process_group()


def torch_worker(shape_name: str, config: str, core: str = "real") -> None:
    """Start the ranks of ``config`` and serve timed bursts (per step: the slowest rank;
    ``core="standin"``: with :func:`standin_torch` as the attention core)."""
    import torch.multiprocessing as mp

    spec, shape = CONFIGS[config], SHAPES[shape_name]
    world, kind = spec["devices"], spec["torch"]
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd_qs, res_q = [ctx.Queue() for _ in range(world)], ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, kind, shape, port, cmd_qs[r], res_q, core))
        for r in range(world)
    ]
    for p in procs:
        p.start()

    def gather():
        got = [res_q.get() for _ in range(world)]
        return sorted(got, key=lambda g: g["rank"])

    t0 = time.perf_counter()
    ready = gather()
    loss = [g["first_loss"] for g in ready if not math.isnan(g["first_loss"])]
    _say({"ready": True, "compile_s": time.perf_counter() - t0, "first_loss": loss[-1]})
    for req in _commands():
        for q in cmd_qs:
            q.put(req)
        per_rank = [g["times"] for g in gather()]
        _say({"times": [max(ts) for ts in zip(*per_rank, strict=True)]})
    for q in cmd_qs:
        q.put({"quit": True})
    for p in procs:
        p.join()


def matmul_worker(side: str, m: int, k: int, n: int) -> None:
    """Time one fp32 ``[m, k] × [k, n]`` matmul on ``side`` ("jax" or "torch"); say GFLOP/s
    (best of 5 bursts of 10)."""
    if side == "jax":
        os.environ["JAX_PLATFORMS"] = "cpu"
        from jaxpar.devices import simulate_cpu_devices

        simulate_cpu_devices(1)  # and jaxpar's host allocator, as in the step
        import jax
        import jax.numpy as jnp

        a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
        f = jax.jit(jnp.matmul)

        def once():
            return f(a, b).block_until_ready()
    else:
        import torch

        a, b = torch.ones(m, k), torch.ones(k, n)

        def once():
            return torch.matmul(a, b)

    got = float(once()[0, 0])
    if got != k:  # ones times ones: every element is k
        raise RuntimeError(f"{side} matmul of ones gave {got}, not {k}")
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            once()
        best = min(best, (time.perf_counter() - t) / 10)
    _say({"gflops": 2 * m * k * n / best / 1e9})


def matmul_rates(shape_name: str) -> dict:
    """Both sides' GFLOP/s on ``shape_name``'s MLP up projection (:func:`matmul_worker`)."""
    sh = SHAPES[shape_name]
    dims = [str(sh["batch"] * sh["seq"]), str(sh["d_model"]), str(sh["d_ff"])]
    out = {}
    for side in ("jax", "torch"):
        w = Worker(["--worker", "matmul", side, *dims])
        out["jaxpar" if side == "jax" else "torch"] = w.info["gflops"]
        w.proc.wait()
    return out


def cpu_name() -> str:
    """The CPU's model name with its family and model numbers (a VM may name only the
    vendor line, e.g. "AMD EPYC")."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            info.setdefault(key.strip(), val.strip())
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')}, model " \
           f"{info.get('model', '?')})"  # fmt: skip


# --------------------------------------------------------------------------------------------
# Coordinator


class Worker:
    """A worker subprocess speaking the line protocol."""

    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG) :])
        raise RuntimeError(f"worker {self.proc.args[2:]} exited with {self.proc.wait()}")

    def run(self, steps: int) -> list[float]:
        self.proc.stdin.write(json.dumps({"steps": steps}) + "\n")
        self.proc.stdin.flush()
        return self._read()["times"]

    def close(self) -> None:
        self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
        self.proc.stdin.close()
        self.proc.wait()


def compare(
    shape: str, config: str, steps: int, repeats: int, model_overrides: dict,
    attribute: bool = False,
) -> dict:  # fmt: skip
    """Interleaved bursts of jaxpar and PyTorch steps for one (shape, config); ``attribute``:
    also both steps with the attention stand-in, and each side's core cost."""
    load0 = os.getloadavg()[0]
    model = json.dumps(JAXPAR[shape] | model_overrides)
    cores = ("real", "standin") if attribute else ("real",)
    workers = {}  # side -> worker, in burst order
    try:
        for c in cores:
            tag = "" if c == "real" else "_standin"
            workers["jaxpar" + tag] = Worker(["--worker", "jax", shape, config, model, c])
            workers["torch" + tag] = Worker(["--worker", "torch", shape, config, c])
        times = {name: [] for name in workers}
        rounds = []  # per round: jaxpar's burst median over PyTorch's, the bursts seconds apart
        for r in range(repeats):
            order = list(workers.items())
            burst = {}
            for name, w in order if r % 2 == 0 else order[::-1]:  # ABBA (ABCDDCBA)
                burst[name] = w.run(steps)
                times[name] += burst[name]
            rounds.append(statistics.median(burst["jaxpar"]) / statistics.median(burst["torch"]))
    finally:
        for w in workers.values():
            w.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    jx, pt = workers["jaxpar"], workers["torch"]
    row = {
        "shape": shape,
        "config": config,
        "jaxpar_step_s": med["jaxpar"],
        "torch_step_s": med["torch"],
        "ratio": med["jaxpar"] / med["torch"],
        # Load on a shared machine drifts between rounds; the median of per-round ratios
        # compares bursts that ran seconds apart, and the spread says how much to trust it.
        "ratio_rounds": rounds,
        "ratio_round_median": statistics.median(rounds),
        "jaxpar_first_loss": jx.info["first_loss"],
        "torch_first_loss": pt.info["first_loss"],
        "jaxpar_compile_s": jx.info["compile_s"],
        "attention": jx.info.get("attention"),
        "host_allocator": jx.info.get("host_allocator"),
        "jaxpar_model": JAXPAR[shape] | model_overrides,
        "steps": len(times["jaxpar"]),
        "load_avg_1m": [load0, os.getloadavg()[0]],  # before and after: the machine is shared
    }
    line = (
        f"{shape:6s} {config:8s} jaxpar {med['jaxpar']:.3f} s  torch {med['torch']:.3f} s  "
        f"ratio {row['ratio']:.2f}  rounds {min(rounds):.2f}-{max(rounds):.2f}"
    )
    if attribute:
        row |= {
            "jaxpar_standin_step_s": med["jaxpar_standin"],
            "torch_standin_step_s": med["torch_standin"],
            # The rest of the step (everything but the core), jaxpar over PyTorch.
            "rest_ratio": med["jaxpar_standin"] / med["torch_standin"],
            "jaxpar_core_s": med["jaxpar"] - med["jaxpar_standin"],
            "torch_core_s": med["torch"] - med["torch_standin"],
        }
        line += (
            f"  core {row['jaxpar_core_s'] * 1e3:.0f} / {row['torch_core_s'] * 1e3:.0f} ms"
            f"  rest ratio {row['rest_ratio']:.2f}"
        )
    print(
        f"{line}  (load {row['load_avg_1m'][0]:.1f}-{row['load_avg_1m'][1]:.1f})",
        file=sys.stderr,
        flush=True,
    )
    return row


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        kind, shape, config = sys.argv[2:5]
        if kind == "matmul":  # --worker matmul SIDE M K N
            matmul_worker(sys.argv[3], *map(int, sys.argv[4:7]))
        elif kind == "jax":
            jax_worker(shape, config, json.loads(sys.argv[5]), sys.argv[6])
        else:
            torch_worker(shape, config, sys.argv[5])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="issue,wide")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=3, help="steps per burst")
    ap.add_argument("--repeats", type=int, default=4, help="bursts per side (interleaved)")
    ap.add_argument("-o", dest="model", action="append", default=[], metavar="FIELD=VALUE",
                    help="jaxpar model override, e.g. -o layer_unroll=1")  # fmt: skip
    ap.add_argument("--cpus", type=int, default=None,
                    help="run every worker on the first N CPUs of this process's affinity "
                         "(both sides' thread pools follow); default: all")  # fmt: skip
    ap.add_argument("--attribute", action="store_true",
                    help="also run both steps with one elementwise stand-in for the attention "
                         "core and report each side's core cost (module docstring)")  # fmt: skip
    args = ap.parse_args()
    if args.cpus is not None:
        have = sorted(os.sched_getaffinity(0))
        if not 1 <= args.cpus <= len(have):
            ap.error(f"--cpus={args.cpus}: must be between 1 and the {len(have)} CPUs available")
        os.sched_setaffinity(0, have[: args.cpus])  # inherited by every worker
    overrides = dict(kv.split("=", 1) for kv in args.model)
    rows, rates = [], {}
    for s in args.shapes.split(","):
        rates[s] = matmul_rates(s)
        print(
            f"{s:6s} matmul   jaxpar {rates[s]['jaxpar']:.0f} GFLOP/s  "
            f"torch {rates[s]['torch']:.0f} GFLOP/s",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        for c in args.configs.split(","):
            rows.append(compare(s, c, args.steps, args.repeats, overrides, args.attribute))
            rows[-1]["matmul_gflops"] = rates[s]
    print(json.dumps({
        "cpus": _cpus(), "cpu": cpu_name(), "load_avg_1m": os.getloadavg()[0], "rows": rows,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
