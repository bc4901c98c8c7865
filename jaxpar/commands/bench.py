"""``jaxpar bench``: compile and time the train step of a layout; report throughput and MFU.

Reuses :class:`jaxpar.train.step.Trainer` (no training loop of its own): compile once (timed),
run ``--warmup`` steps, then ``--steps`` timed steps (each synchronised with
``block_until_ready``), and report the median. Model FLOPs per token are
``theory.train_flops_per_token`` (6Ψ + 12·l·h·s, no recompute: MFU, not HFU), against the
mesh file's ``peak_flops_bf16``. On GPU the step runs as configured (``--compute-dtype
bfloat16`` is the mesh files' default there). The attention is ``model.attention``'s
(:mod:`jaxpar.model.attention`: cuDNN flash attention on NVIDIA GPUs in bf16, the native
kernel on CPU in fp32, the blockwise kernel elsewhere; none keeps the s×s scores).
"""

from __future__ import annotations

import argparse

HELP = "compile and time the train step: step time, tokens/s, TFLOP/s, MFU, memory, collectives"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``jaxpar bench``: those of ``jaxpar train`` plus ``--warmup``/``--profile``."""
    from jaxpar.commands.train import add_arguments as train_arguments

    train_arguments(p)
    p.set_defaults(steps=None)
    from jaxpar.commands import _checks as K

    p.add_argument("--warmup", type=K.nonneg_int, default=2, help="untimed steps after compiling")
    p.add_argument("--profile", type=K.writable_dir, default=None, metavar="DIR",
                   help="write a jax.profiler trace")  # fmt: skip
    p.add_argument(
        "--calibrate",
        default=None,
        metavar="MESH_YAML",
        help="measure the matmul efficiency curve of this machine's device and write "
        "it into MESH_YAML (a copy of --mesh when it does not exist); no step is run",
    )
    p.add_argument(
        "--calibrate-max-size",
        type=K.positive_int,
        default=None,
        help="largest matmul dimension to time (default 2048 on CPU, 16384 on GPU)",
    )


def run(args: argparse.Namespace) -> int:
    """Validate, compile, time, report."""
    from jaxpar import validation as V
    from jaxpar.commands.train import build_config
    from jaxpar.devices import simulate_cpu_devices
    from jaxpar.distributed import apply_xla_flags, run_xla_flags
    from jaxpar.errors import ConfigError
    from jaxpar.report import emit_json

    cfg = build_config(args)
    if args.calibrate:
        return _calibrate(args, cfg, emit_json)
    from jaxpar.commands.train import auto_layout

    auto = auto_layout(cfg, args)
    if auto is not None and auto.get("fits") is False:
        return 1
    if args.steps is None:
        cfg.train.steps = 10
    if args.warmup < 0:
        raise ConfigError(f"--warmup {args.warmup}: must be >= 0")
    if args.dry_run:  # validate and estimate memory; nothing compiled (jaxpar train --dry-run)
        from jaxpar.commands.train import dry_run

        return dry_run(cfg, args, "bench", auto)
    V.validate(cfg, n_devices=cfg.mesh.devices)
    # the XLA flags `jaxpar train` starts this layout with (before JAX's backend starts)
    apply_xla_flags(cfg.mesh.hardware.platform, run_xla_flags(cfg.mesh.hardware, cfg.layout))
    if cfg.mesh.hardware.platform == "cpu":
        simulate_cpu_devices(cfg.mesh.devices)
    result = bench(cfg, warmup=args.warmup, profile=args.profile)
    if auto is not None:
        result["auto_layout"] = auto
    if args.json:
        emit_json(result)
    else:
        print(
            f"{cfg.model.name} on {result['devices']} {result['platform']} devices "
            f"{result['layout']}: compile {result['compile_s']:.1f} s, step "
            f"{result['step_time_s'] * 1e3:.1f} ms (median of {result['steps']}), "
            f"{result['tokens_per_s']:,.0f} tokens/s, {result['tflops_per_device']:.3g} "
            f"TFLOP/s/device, MFU {result['mfu']:.1%} of {result['peak_tflops']:.3g}, "
            f"{result['memory_per_device_bytes'] / 2**20:.1f} MiB/device, collectives "
            f"{result['collective_bytes'] / 2**20:.1f} MiB/device/step"
        )
    return 0


def _calibrate(args: argparse.Namespace, cfg, emit_json) -> int:
    """``--calibrate``: time matmuls, write the curve into the mesh file, report it."""
    import shutil
    from pathlib import Path

    from jaxpar import config as C
    from jaxpar.errors import ConfigError
    from jaxpar.planner.calibrate import measure_curve
    from jaxpar.planner.hardware import write_curve

    out = Path(args.calibrate)
    if not out.exists():
        shutil.copyfile(C._resolve(args.mesh, C.MESHES_DIR, "mesh"), out)
    gpu = cfg.mesh.hardware.platform == "gpu"
    max_size = args.calibrate_max_size or (16384 if gpu else 2048)
    if max_size < 32:
        raise ConfigError(f"--calibrate-max-size {max_size}: must be >= 32")
    dtype = cfg.layout.compute_dtype if gpu else "float32"
    res = measure_curve(cfg.mesh.hardware, dtype, max_size, 8192 if gpu else 1024)
    write_curve(out, res["curve"])
    res["mesh_file"] = str(out)
    if args.json:
        emit_json(res)
    else:
        print(f"matmul efficiency of {res['device']} ({dtype}) written to {out}:")
        for (g, share), pt in zip(res["curve"], res["points"], strict=True):
            print(f"  size {g:>6}: {pt['flops_per_s'] / 1e9:10.1f} GFLOP/s = {share:.1%} of peak")
        if res["clipped"]:
            print(f"  ! sizes {res['clipped']} beat hardware.peak_flops_bf16: kept at 100%")
    return 0


def predicted(cfg) -> dict:
    """The planner's memory and step time for ``cfg`` (jaxpar's own executor)."""
    from jaxpar.planner.search import evaluate
    from jaxpar.planner.workload import Shape

    shape = Shape(cfg.train.global_batch, cfg.train.seq_len)
    try:
        c = evaluate(cfg.model, cfg.mesh.hardware, cfg.layout, shape)
    except Exception as e:  # noqa: BLE001  (a mesh without a curve: the bench still runs)
        return {"error": f"{type(e).__name__}: {e}"}
    return {"memory_per_device_bytes": c.memory["total"], "step_time_s": c.step_time,
            "step_time_terms_s": dict(c.cost.terms)}  # fmt: skip


def _time_steps(trainer, batches, steps: int, warmup: int, profile: str | None):
    """Wall time of ``steps`` steps after ``warmup`` (each waited for), alternating two batches;
    a profiler trace of the timed steps into ``profile``. Returns the times and last metrics."""
    import time

    import jax

    t = trainer.cfg.train
    state = trainer.init_state(t.seed)
    data = [batches.global_array(i, trainer.batch_sharding) for i in range(2)]
    for i in range(warmup):
        state, metrics = trainer.step(state, data[i % 2])
    jax.block_until_ready(state)
    if profile:
        jax.profiler.start_trace(profile)
    times = []
    for i in range(steps):
        t1 = time.perf_counter()
        state, metrics = trainer.step(state, data[i % 2])
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t1)
    if profile:
        jax.profiler.stop_trace()
    return times, metrics


def bench(cfg, devices=None, warmup: int = 2, profile: str | None = None) -> dict:
    """Time ``cfg``'s step on ``devices`` (default: all JAX devices). Returns the JSON summary:
    ``compile_s``, ``step_time_s`` (median), ``step_times_s``, ``tokens_per_s``,
    ``tflops_per_device``, ``mfu``, ``memory_per_device_bytes`` (XLA's compiled total, or the
    allocator's peak where the platform reports one: ``memory_source``), ``compiled_memory``,
    ``collective_bytes`` (per device per step), ``collectives`` (by kind and axes) and
    ``predicted`` (the planner's memory and step time for the same layout)."""
    import statistics
    import time

    from jaxpar import hostmem
    from jaxpar.analysis import theory as T
    from jaxpar.analysis.hlo import collective_bytes, compiled_memory
    from jaxpar.data import Batches, load_corpus
    from jaxpar.devices import make_mesh
    from jaxpar.train.loop import _devices_for
    from jaxpar.train.step import Trainer

    t = cfg.train
    devices = _devices_for(cfg, devices)
    mesh = make_mesh(cfg.layout, devices)
    trainer = Trainer(cfg, mesh)
    t0 = time.perf_counter()
    compiled = trainer.compile_step()
    compile_s = time.perf_counter() - t0
    batches = Batches(load_corpus(t.data, cfg.model.vocab_size, t.data_dtype), t.global_batch,
                      t.seq_len, t.seed)  # fmt: skip
    times, metrics = _time_steps(trainer, batches, t.steps, warmup, profile)
    step = statistics.median(times)
    n = len(devices)
    tokens = t.global_batch * t.seq_len
    flops = T.train_flops_per_token(cfg.model, t.seq_len) * tokens / step / n
    peak = cfg.mesh.hardware.peak_flops_bf16
    mem = compiled_memory(compiled)
    measured, source = mem["total"], "compiled"
    try:
        stats = devices[0].memory_stats() or {}
    except Exception:  # noqa: BLE001  (backends without allocator statistics)
        stats = {}
    if stats.get("peak_bytes_in_use"):
        measured, source = stats["peak_bytes_in_use"], "allocator_peak"
    coll = collective_bytes(compiled, mesh)
    lay = cfg.layout
    return {
        "model": cfg.model.name,
        "platform": devices[0].platform,
        "devices": n,
        "layout": {a: getattr(lay, a) for a in ("dp", "tp", "pp", "sp", "zero", "microbatches",
                                                  "schedule", "virtual", "remat", "offload")},
        "compile_s": compile_s,
        "steps": len(times),
        "step_time_s": step,
        "step_times_s": times,
        "tokens_per_s": tokens / step,
        "tflops_per_device": flops / 1e12,
        "peak_tflops": peak / 1e12,
        "mfu": flops / peak,
        "memory_per_device_bytes": measured,
        "memory_source": source,
        "compiled_memory": mem,
        "collective_bytes": coll.total.bytes,
        "collectives": coll.to_dict(),
        "final_loss": float(metrics["loss"]),
        "predicted": predicted(cfg),
        "profile_dir": profile,
        "host_allocator": hostmem.state(),  # jaxpar.hostmem on CPU, None elsewhere
    }  # fmt: skip
