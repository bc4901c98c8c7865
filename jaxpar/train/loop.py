"""The training loop: data, steps, progress, metrics, held-out loss and checkpoints."""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxpar import config as C
from jaxpar import validation as V
from jaxpar.checkpoint import Checkpointer, CheckpointWarning, check_model_matches
from jaxpar.data import Batches
from jaxpar.devices import make_mesh
from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.lock import LOCK_NAME, RunLock
from jaxpar.metrics import MetricsLog, Progress, device_memory
from jaxpar.model.attention import implementation_for
from jaxpar.profiling import StepProfiler
from jaxpar.train import load_data
from jaxpar.train.guard import (
    Divergence,
    StopRequest,
    TensorBoard,
    nonfinite_leaves,
    write_nonfinite_report,
)
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
    reference run). Everything is validated before anything is compiled, and the checkpoint
    directory is locked for this run (:mod:`jaxpar.lock`). A SIGTERM/SIGINT ends the run after
    an agreed step with a checkpoint (``"preempted"`` in the summary); a non-finite or
    blown-up step is skipped or stops the run per ``train.on_nonfinite`` and the divergence
    budget ``train.max_skipped_steps``.
    """
    V.validate(cfg, n_devices=len(devices) if devices is not None else cfg.mesh.devices)
    t = cfg.train
    batches = Batches(load_data(cfg), t.global_batch, t.seq_len, t.seed)
    profiler = StepProfiler.from_config(t)
    if t.init_from_hf and t.resume:
        raise ConfigError(
            f"train.init_from_hf={t.init_from_hf!r}: conflicts with train.resume=True (the "
            "checkpoint already holds the weights); drop one of them (--resume-or-start "
            "starts from the weights only when there is no checkpoint)"
        )
    locks = _lock_outputs(cfg)
    try:
        ckpt, resume_step = _open_checkpoints(cfg)
        if t.init_from_hf and resume_step is None:
            from jaxpar.model import hf

            hf.check(t.init_from_hf, cfg.model)  # names a mismatching tensor before compiling
        tb = TensorBoard(t.tensorboard_dir) if t.tensorboard_dir else None
        devices = _devices_for(cfg, devices)
        attention = implementation_for(cfg, devices[0])  # refuses e.g. cudnn on CPU, pre-compile
        mesh = make_mesh(cfg.layout, devices)
        trainer = Trainer(cfg, mesh)
        with StopRequest(multi_process=jax.process_count() > 1) as stop:
            start, meta = 0, {}
            if resume_step is not None:
                abstract = trainer.canonical_abstract_state()  # what checkpoints hold
                ckpt.check_shapes(resume_step, abstract)  # names the parameter and both shapes
                meta = ckpt.read_meta(resume_step)
                check_model_matches(meta, cfg.model)
                _warn_data_changes(meta, cfg)
                # Read straight into this run's shardings, whatever layout wrote the checkpoint.
                state, meta = ckpt.restore(resume_step, abstract)
                state = trainer.convert(state, "rest")
                start = int(meta.get("data_position", resume_step))
            else:
                state = trainer.init_state(t.seed)
                if t.init_from_hf:
                    params = hf.load(t.init_from_hf, cfg.model, trainer.canonical_param_shardings)
                    state["params"] = trainer.convert(params, "rest")
            div = Divergence(t.max_skipped_steps, t.divergence_factor, meta.get("first_loss"),
                             int(meta.get("diverged_steps", 0)))  # fmt: skip
            out = _train(
                cfg, trainer, state, start, batches, ckpt, tb, profiler, stop, quiet, devices, div
            )
            from jaxpar import hostmem

            # jaxpar.hostmem's answer on CPU, None elsewhere (as `jaxpar bench` reports it).
            return {**out, "attention": attention, "host_allocator": hostmem.state()}
    finally:
        for lock in locks:
            lock.release()


def _metrics_path(cfg: C.RunConfig) -> str | None:
    t = cfg.train
    return t.metrics_file or (f"{t.checkpoint_dir}/metrics.jsonl" if t.checkpoint_dir else None)


def _lock_outputs(cfg: C.RunConfig) -> list[RunLock]:
    """Lock the checkpoint directory (and a metrics file kept elsewhere) for this run: process 0
    takes the locks, and every process learns whether it could, before anything compiles."""
    from jaxpar.distributed import any_process

    t = cfg.train
    targets = []
    if t.checkpoint_dir:
        what = f"train.checkpoint_dir={t.checkpoint_dir!r}"
        targets.append((Path(t.checkpoint_dir), LOCK_NAME, what))
    if t.metrics_file:
        m = Path(t.metrics_file)
        if not t.checkpoint_dir or m.absolute().parent != Path(t.checkpoint_dir).absolute():
            targets.append((m.parent, m.name + ".lock", f"train.metrics_file={t.metrics_file!r}"))
    locks: list[RunLock] = []
    error: Exception | None = None
    if jax.process_index() == 0:
        try:
            for directory, name, what in targets:
                try:
                    directory.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise CheckpointError(f"{what}: not writable: {e.strerror or e}") from None
                locks.append(RunLock(directory / name, what).acquire())
        except CheckpointError as e:
            error = e
    if any_process(error is not None):
        for lock in locks:
            lock.release()
        raise error or CheckpointError(
            "the output directory is in use by another run (process 0 names it)"
        )
    return locks


def _train(
    cfg, trainer, state, start, batches, ckpt, tb, profiler, stop, quiet, devices, div
) -> dict[str, Any]:
    t = cfg.train
    # A run that continues a directory (resume, or the directory's own metrics file) drops
    # the records an earlier attempt wrote after the step this run starts from.
    continues = t.resume or t.resume_or_start or not t.metrics_file
    log = MetricsLog(_metrics_path(cfg), keep_until=start if continues else None)
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
            "dropped_records": log.dropped,
        }
    )

    tokens_per_step = t.global_batch * t.seq_len
    progress = Progress(t.steps, start, enabled=t.progress and not quiet)
    losses, times, evals, skipped, sync = [], [], [], 0, []
    eval_loss = None
    stopped = report = None
    done = saved_at = start
    try:
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
            done = step + 1
            rec = {
                "step": done,
                "loss": loss,
                "grad_norm": float(m["grad_norm"]),
                "lr": float(m["lr"]),
                "step_time_s": dt,
                "tokens_per_s": tokens_per_step / dt,
            }
            if "moe_load" in m:  # MoE: per layer, max/mean expert load and dropped assignments
                rec["moe_load"] = [float(v) for v in m["moe_load"]]
                rec["moe_dropped"] = [int(v) for v in m["moe_dropped"]]
            why = div.check(done, loss, finite)
            if not finite:
                # The step already kept the previous params and optimizer state (see Trainer).
                skipped += 1
                rec["nonfinite"] = True
                rec["nonfinite_leaves"] = nonfinite_leaves(m["leaf_finite"])
            if why:
                rec["diverged"] = why
            log.write(rec)
            if why and (t.on_nonfinite == "stop" or div.exceeded):
                report = str(_write_report(cfg, rec, saved_at if ckpt else None, div))
                rule = (
                    f"more than --max-skipped-steps {t.max_skipped_steps} steps diverged "
                    f"({div.counted}, the first at step {div.first_step})"
                    if t.on_nonfinite == "skip"
                    else "--on-nonfinite stop"
                )
                stopped = f"step {done}: {why}; stopping: {rule} (diagnostic: {report})"
                print(f"jaxpar: {stopped}", file=sys.stderr, flush=True)
                break
            if why:
                progress.warn(f"jaxpar: warning: step {done}: {why} ({div.note()})")
            if tb is not None:
                tb.scalars(done, {k: rec[k] for k in ("loss", "grad_norm", "lr", "tokens_per_s")})
            progress.update(done, loss, tokens_per_step / dt, dt)
            if t.eval_every and (done % t.eval_every == 0 or done == t.steps):
                eval_loss = evaluate(trainer, state["params"], batches, t.eval_batches)
                evals.append({"step": done, "eval_loss": eval_loss})
                log.write({"step": done, "eval_loss": eval_loss})
                if tb is not None:
                    tb.scalars(done, {"eval_loss": eval_loss})
                progress.note(f"step {done}: held-out loss {eval_loss:.4f}")
            t2 = time.perf_counter()
            stop_now = stop.should_stop(done)
            sync.append(time.perf_counter() - t2)
            # No periodic checkpoint at a diverged step: a run that keeps skipping must not
            # rotate its healthy checkpoints out. The final and the preemption checkpoint are
            # written (they keep the data position).
            force = done == t.steps or stop_now
            if ckpt is not None and (force or not why) and ckpt.due(done, force):
                # Checkpoints hold the canonical form, whatever the layout's form at rest.
                canonical = trainer.convert(state, "canonical")
                if ckpt.save(
                    done, canonical, _meta(cfg, done, div, batches.corpus.tokenizer), force=force
                ):
                    saved_at = done
            if stop_now:
                break
        preempted = stop.signal_name
        if preempted:
            log.write({"event": "preempted", "signal": preempted, "step": done})
        if t.export_hf:
            from jaxpar.model import hf

            hf.export(trainer.convert(state["params"], "canonical"), cfg.model, t.export_hf)
    finally:  # also on an error (e.g. a failed save): flush metrics, release files
        progress.close()
        profiler.close()
        if ckpt is not None:
            ckpt.close()
        if tb is not None:
            tb.close()
        log.close()

    steady = times[1:] or times
    step_time = statistics.median(steady) if steady else float("nan")
    return {
        "losses": losses,
        "final_loss": losses[-1] if losses else None,
        "eval_loss": eval_loss,
        "evals": evals,
        "start_step": start,
        "end_step": done,
        "steps": t.steps,
        "skipped_steps": skipped,
        "diverged_steps": div.counted,
        "max_skipped_steps": t.max_skipped_steps,
        "stopped": stopped,
        "nonfinite_report": report,
        "preempted": preempted,
        "checkpoint_step": saved_at if ckpt is not None and saved_at else None,
        "tokens_per_s": tokens_per_step / step_time if steady else None,
        "step_time_s": step_time,
        "compile_time_s": compile_s,
        "params": cfg.model.param_count(),
        "memory": memory,
        # What the compiled step does over dp (jaxpar.train.reduce.REDUCTION_NAMES).
        "layout": {**dataclasses.asdict(cfg.layout), "dp_reduction": trainer.dp_reduction},
        "model": cfg.model.name,
        "mesh": cfg.mesh.name,
        "devices": len(devices),
        "platform": devices[0].platform,
        "processes": jax.process_count(),
        "profiled_steps": profiler.traced,
        "stop_check_s": statistics.median(sync) if sync else None,
    }


def _meta(
    cfg: C.RunConfig, step: int, div: Divergence, tokenizer: dict | None = None
) -> dict[str, Any]:
    t = cfg.train
    return {
        "step": step,
        # the divergence budget continues across resumes
        "first_loss": div.first_loss,
        "diverged_steps": div.counted,
        # Batches are a pure function of (seed, step): the step is the whole data position.
        "data_position": step,
        "model": dataclasses.asdict(cfg.model),
        "layout": dataclasses.asdict(cfg.layout),
        "seed": t.seed,
        "data": {"source": t.data, "global_batch": t.global_batch, "seq_len": t.seq_len},
        # What `jaxpar generate` decodes this model's tokens with.
        "tokenizer": tokenizer,
    }


def _warn_data_changes(meta: dict[str, Any], cfg: C.RunConfig) -> None:
    """A resume with another seed or batch shape continues, but not bitwise like the original."""
    t = cfg.train
    saved = {"seed": meta.get("seed"), **meta.get("data", {})}
    mine = {"seed": t.seed, "source": t.data, "global_batch": t.global_batch, "seq_len": t.seq_len}
    for k, v in mine.items():
        if saved.get(k) is not None and saved[k] != v:
            warnings.warn(
                f"resuming with {k}={v!r} but the checkpoint was written with {k}={saved[k]!r}: "
                "the data order differs from the original run",
                CheckpointWarning,
                stacklevel=3,
            )


def _write_report(cfg: C.RunConfig, rec: dict[str, Any], last_checkpoint: int | None, div):
    """Diagnostic of the step that stopped the run, next to the checkpoints (or metrics, or in
    the cwd)."""
    t = cfg.train
    base = t.checkpoint_dir or (str(Path(t.metrics_file).parent) if t.metrics_file else ".")
    applied = "nonfinite" not in rec
    record = {
        **{k: rec[k] for k in ("step", "loss", "grad_norm", "lr")},
        "nonfinite_leaves": rec.get("nonfinite_leaves", []),
        "why": rec.get("diverged"),
        "loss_finite": math.isfinite(rec["loss"]),
        "grad_norm_finite": math.isfinite(rec["grad_norm"]),
        "policy": t.on_nonfinite,
        "diverged_steps": div.counted,
        "first_diverged_step": div.first_step,
        "max_skipped_steps": t.max_skipped_steps,
        "first_loss": div.first_loss,
        "last_checkpoint_step": last_checkpoint,
        "note": (
            "the loss of step N is that of the weights after step N-1, so checkpoints before "
            "step first_diverged_step - 1 predate the divergence; "
            + ("this step's update was applied" if applied else "this update was not applied")
            + " and its state was not checkpointed"
        ),
    }
    return write_nonfinite_report(Path(base) / f"nonfinite-step{rec['step']}.json", record)


def _open_checkpoints(cfg: C.RunConfig) -> tuple[Checkpointer | None, int | None]:
    """The checkpointer and the step to resume from (None: start fresh); refuses to
    overwrite, and to resume without a complete checkpoint unless ``resume_or_start``."""
    t = cfg.train
    want_resume = t.resume or t.resume_or_start
    if not t.checkpoint_dir:
        if want_resume:
            raise ConfigError("train.resume=True: needs train.checkpoint_dir (--checkpoint-dir)")
        return None, None
    ckpt = Checkpointer(t.checkpoint_dir, keep=t.keep_checkpoints, every=t.checkpoint_every)
    existing = ckpt.all_steps()
    if not want_resume:
        if existing:
            raise CheckpointError(
                f"train.checkpoint_dir={t.checkpoint_dir!r}: already holds checkpoints up to "
                f"step {existing[-1]}; pass --resume to continue, or choose another directory "
                "(nothing was overwritten)"
            )
        return ckpt, None
    latest = ckpt.latest_valid_step()  # warns about and sets aside newer broken ones
    if latest is None:
        if t.resume_or_start:
            print(
                f"jaxpar: no complete checkpoint in {t.checkpoint_dir!r}; starting fresh",
                file=sys.stderr,
            )
            return ckpt, None
        raise CheckpointError(
            f"train.resume=True: no complete checkpoint in {t.checkpoint_dir!r}; pass "
            "--resume-or-start to start fresh there, or drop --resume"
        )
    if latest >= t.steps:
        raise ConfigError(f"train.steps={t.steps}: the checkpoint is already at step {latest}")
    return ckpt, latest
