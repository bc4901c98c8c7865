"""The training loop: data, steps, progress, metrics, held-out loss and checkpoints."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np

from jaxpar import config as C
from jaxpar.checkpoint import Checkpointer, check_model_matches
from jaxpar.data import Batches, load_corpus
from jaxpar.devices import make_mesh
from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.metrics import MetricsLog, Progress, device_memory
from jaxpar.profiling import StepProfiler
from jaxpar.train.step import Trainer


def _devices_for(cfg: C.RunConfig, devices):
    n = cfg.layout.n_devices
    if devices is None:
        devices = jax.devices()
        if len(devices) != n:
            raise ConfigError(
                f"layout pp*dp*sp*tp={n}: must equal the number of devices JAX sees "
                f"({len(devices)}); on CPU simulate them with --devices {n} or pass devices="
            )
    if len(devices) != n:
        raise ConfigError(f"layout pp*dp*sp*tp={n}: got {len(devices)} devices")
    return list(devices)


def evaluate(trainer: Trainer, params, batches: Batches, n: int) -> float:
    """Mean held-out loss over ``n`` fixed held-out batches."""
    losses = [
        trainer.eval_loss(params, batches.global_array(i, trainer.batch_sharding, "heldout"))
        for i in range(n)
    ]
    return float(np.mean([float(x) for x in losses]))


def run(cfg: C.RunConfig, devices=None, quiet: bool = False) -> dict[str, Any]:
    """Train as configured and return the run's summary (the ``--json`` object).

    ``devices`` defaults to all of JAX's devices; tests pass a subset (e.g. one device for the
    reference run). Everything is validated before anything is compiled.
    """
    C.validate(cfg, n_devices=len(devices) if devices is not None else cfg.mesh.devices)
    t = cfg.train
    corpus = load_corpus(t.data, cfg.model.vocab_size, t.data_dtype)
    if corpus.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size}: smaller than the data's vocabulary "
            f"({corpus.vocab_size})"
        )
    batches = Batches(corpus, t.global_batch, t.seq_len, t.seed)
    profiler = StepProfiler.from_config(t)
    if t.init_from_hf:
        from jaxpar.model import hf

        if t.resume:
            raise ConfigError(
                f"train.init_from_hf={t.init_from_hf!r}: conflicts with train.resume=True (the "
                "checkpoint already holds the weights); drop one of them"
            )
        hf.check(t.init_from_hf, cfg.model)  # names a mismatching tensor before compiling
    ckpt = _open_checkpoints(cfg)
    devices = _devices_for(cfg, devices)
    mesh = make_mesh(cfg.layout, devices)
    trainer = Trainer(cfg, mesh)

    start = 0
    if ckpt is not None and t.resume:
        start = ckpt.latest_step()
        check_model_matches(ckpt.read_meta(start), cfg.model)
        state, _ = ckpt.restore(start, trainer.abstract_state())
    else:
        state = trainer.init_state(t.seed)
        if t.init_from_hf:
            state["params"] = hf.load(t.init_from_hf, cfg.model, trainer.param_shardings)

    metrics_path = t.metrics_file or (
        f"{t.checkpoint_dir}/metrics.jsonl" if t.checkpoint_dir else None
    )
    log = MetricsLog(metrics_path)
    t0 = time.perf_counter()
    trainer.compile_step()
    compile_s = time.perf_counter() - t0
    memory = device_memory(trainer)
    log.write(
        {
            "event": "start",
            "step": start,
            "layout": dataclasses.asdict(cfg.layout),
            "params": cfg.model.param_count(),
            "compile_s": compile_s,
            "memory": memory,
        }
    )

    tokens_per_step = t.global_batch * t.seq_len
    progress = Progress(t.steps, start, enabled=t.progress and not quiet)
    losses, times, evals, skipped = [], [], [], 0
    eval_loss = None
    stopped = None
    for step in range(start, t.steps):
        batch = batches.global_array(step, trainer.batch_sharding)
        profiler.begin(step + 1)
        t1 = time.perf_counter()
        state, m = trainer.step(state, batch)
        loss = float(m["loss"])
        dt = time.perf_counter() - t1
        profiler.end(step + 1)
        finite = bool(m["finite"])
        times.append(dt)
        losses.append(loss)
        rec = {
            "step": step + 1,
            "loss": loss,
            "grad_norm": float(m["grad_norm"]),
            "lr": float(m["lr"]),
            "step_time_s": dt,
            "tokens_per_s": tokens_per_step / dt,
        }
        if not finite:
            skipped += 1
            rec["nonfinite"] = True
            log.write(rec)
            if t.on_nonfinite == "stop":
                stopped = (
                    f"non-finite loss or gradient at step {step + 1}; update skipped, stopping"
                )
                print(f"jaxpar: {stopped}", file=sys.stderr)
                break
            continue
        log.write(rec)
        progress.update(step + 1, loss, tokens_per_step / dt, dt)
        done = step + 1
        if t.eval_every and (done % t.eval_every == 0 or done == t.steps):
            eval_loss = evaluate(trainer, state["params"], batches, t.eval_batches)
            evals.append({"step": done, "eval_loss": eval_loss})
            log.write({"step": done, "eval_loss": eval_loss})
            progress.note(f"step {done}: held-out loss {eval_loss:.4f}")
        if ckpt is not None:
            ckpt.save(done, state, _meta(cfg, done), force=done == t.steps)
    progress.close()
    profiler.close()
    if t.export_hf:
        from jaxpar.model import hf

        hf.export(state["params"], cfg.model, t.export_hf)
    if ckpt is not None:
        ckpt.close()
    log.close()

    steady = times[1:] or times
    step_time = statistics.median(steady) if steady else float("nan")
    return {
        "losses": losses,
        "final_loss": losses[-1] if losses else None,
        "eval_loss": eval_loss,
        "evals": evals,
        "start_step": start,
        "steps": t.steps,
        "skipped_steps": skipped,
        "stopped": stopped,
        "tokens_per_s": tokens_per_step / step_time if steady else None,
        "step_time_s": step_time,
        "compile_time_s": compile_s,
        "params": cfg.model.param_count(),
        "memory": memory,
        "layout": dataclasses.asdict(cfg.layout),
        "model": cfg.model.name,
        "mesh": cfg.mesh.name,
        "devices": len(devices),
        "platform": devices[0].platform,
        "processes": jax.process_count(),
        "profiled_steps": profiler.traced,
    }


def _meta(cfg: C.RunConfig, step: int) -> dict[str, Any]:
    return {
        "step": step,
        "data_position": step,
        "model": dataclasses.asdict(cfg.model),
        "layout": dataclasses.asdict(cfg.layout),
        "seed": cfg.train.seed,
    }


def _open_checkpoints(cfg: C.RunConfig) -> Checkpointer | None:
    t = cfg.train
    if not t.checkpoint_dir:
        if t.resume:
            raise ConfigError("train.resume=True: needs train.checkpoint_dir (--checkpoint-dir)")
        return None
    ckpt = Checkpointer(t.checkpoint_dir, keep=t.keep_checkpoints, every=t.checkpoint_every)
    latest = ckpt.latest_step()
    if t.resume and latest is None:
        raise CheckpointError(
            f"train.resume=True: no complete checkpoint in {t.checkpoint_dir!r}; drop --resume "
            "to start fresh"
        )
    if not t.resume and latest is not None:
        raise CheckpointError(
            f"train.checkpoint_dir={t.checkpoint_dir!r}: already holds checkpoints up to step "
            f"{latest}; pass --resume to continue, or choose another directory (nothing was "
            "overwritten)"
        )
    if t.resume and latest >= t.steps:
        raise ConfigError(f"train.steps={t.steps}: the checkpoint is already at step {latest}")
    return ckpt
