"""The training run: set up (validate, lock, resume or initialise, compile), then the loop.

:func:`run` builds the run's hooks (:mod:`jaxpar.train.hooks`, :mod:`jaxpar.train.checkpointing`)
and hands them to the loop's core (:func:`jaxpar.train.core.train_loop`: data → step → metrics,
metrics read one step late), then gathers the summary: the core's keys and each hook's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax

from jaxpar import config as C
from jaxpar import validation as V
from jaxpar.checkpoint import Checkpointer, verify_step
from jaxpar.data import Batches, SequentialBatches
from jaxpar.devices import make_mesh
from jaxpar.errors import ConfigError
from jaxpar.lock import Interrupted, RunLock
from jaxpar.metrics import MetricsLog, Progress, device_memory
from jaxpar.model.attention import implementation_for
from jaxpar.profiling import StepProfiler
from jaxpar.train import load_data
from jaxpar.train.checkpointing import (
    CheckpointHook,
    ExportHook,
    Saver,
    open_checkpoints,
    restore,
)
from jaxpar.train.core import Hook, LoopContext, Sinks, train_loop
from jaxpar.train.hooks import (
    DivergenceHook,
    EvalHook,
    MetricsHook,
    PreemptionHook,
    ProfilerHook,
    ProgressHook,
)
from jaxpar.train.nonfinite import Divergence
from jaxpar.train.preempt import StopRequest
from jaxpar.train.step import Trainer
from jaxpar.train.tensorboard import TensorBoard

_open_checkpoints = open_checkpoints  # the name existing callers import


def _devices_for(cfg: C.RunConfig, devices):
    n = cfg.layout.n_devices
    if devices is None:
        devices = jax.devices()
        if len(devices) != n:
            raise ConfigError(
                f"layout pp*dp*sp*tp={n}: must equal the number of devices JAX sees "
                f"({len(devices)}); on CPU simulate them before JAX starts (--devices {n} on the "
                f"command line, jaxpar.devices.simulate_cpu_devices({n}) in Python) or pass "
                "devices="
            )
    if len(devices) != n:
        raise ConfigError(f"layout pp*dp*sp*tp={n}: got {len(devices)} devices")
    return list(devices)


@dataclasses.dataclass
class RunParts:
    """What :func:`run` sets up before the loop (all of it validated before compiling)."""

    cfg: C.RunConfig
    trainer: Trainer
    batches: Batches
    heldout: SequentialBatches | None  # the evaluation's batches (None: no evaluation)
    checkpointer: Checkpointer | None
    resume_step: int | None
    tensorboard: TensorBoard | None
    profiler: StepProfiler
    stop: StopRequest
    quiet: bool
    devices: list
    extra_hooks: list[Hook]  # the caller's, after jaxpar's own
    ctx: LoopContext | None = None  # the loop's, once it starts (what an abort reports)


def run(
    cfg: C.RunConfig, devices=None, quiet: bool = False, hooks: Sequence[Hook] = ()
) -> dict[str, Any]:
    """Train as configured and return the run's summary (the ``--json`` object).

    ``devices`` defaults to all of JAX's devices; tests pass a subset (e.g. one device for the
    reference run). Everything is validated before anything is compiled, and the checkpoint
    directory is locked for this run (:mod:`jaxpar.lock`). A SIGTERM/SIGINT ends the run after
    an agreed step with a checkpoint (``"preempted"`` in the summary); a non-finite or
    blown-up step is skipped or stops the run per ``train.on_nonfinite`` and the divergence
    budget ``train.max_skipped_steps``. ``hooks`` run after jaxpar's own (each phase in order;
    :class:`jaxpar.train.core.Hook`), and their summaries join the returned one.
    """
    V.validate(cfg, n_devices=len(devices) if devices is not None else cfg.mesh.devices)
    t = cfg.train
    batches = Batches(load_data(cfg), t.global_batch, t.seq_len, t.seed)
    heldout = _heldout(batches) if t.eval_every else None
    profiler = StepProfiler.from_config(t)
    locks = _lock_outputs(cfg)
    try:
        ckpt, resume_step = open_checkpoints(cfg)
        if t.init_from_hf and resume_step is None:
            from jaxpar.model import hf

            hf.check(t.init_from_hf, cfg.model)  # names a mismatching tensor before compiling
        tb = TensorBoard(t.tensorboard_dir) if t.tensorboard_dir else None
        devices = _devices_for(cfg, devices)
        attention = implementation_for(cfg, devices[0])  # refuses e.g. cudnn on CPU, pre-compile
        trainer = Trainer(cfg, make_mesh(cfg.layout, devices))
        with StopRequest(multi_process=jax.process_count() > 1, saves=ckpt is not None) as stop:
            parts = RunParts(cfg, trainer, batches, heldout, ckpt, resume_step, tb, profiler,
                             stop, quiet, devices, list(hooks))  # fmt: skip
            try:
                out = _train(parts)
            except Interrupted as e:  # a second signal (the first only asks to stop)
                raise _aborted(e, parts) from None
        from jaxpar import hostmem

        # jaxpar.hostmem's answer on CPU, None elsewhere (as `jaxpar bench` reports it).
        return {**out, "attention": attention, "host_allocator": hostmem.state()}
    finally:
        for lock in locks:
            lock.release()


def _aborted(e: Interrupted, p: RunParts) -> Interrupted:
    """The error of a signal that ended training at once (after the first asked it to stop
    after a step): the step this run reached and the newest complete checkpoint on disk —
    read after the hooks have closed, so a save that was in flight counts once sealed."""
    name = signal.Signals(e.signum).name
    first = p.stop.signal_name
    what = f"a second {name}" if first == name else f"{name} after {first}" if first else name
    ctx = p.ctx
    ran = (
        f"after step {ctx.done}"
        if ctx is not None and ctx.done > ctx.start
        else "before this run finished a step"
    )
    directory = p.cfg.train.checkpoint_dir
    step = _newest_sealed(Path(directory)) if directory else None
    if step is not None:
        kept = (
            f"the newest complete checkpoint is step {step} in {directory}; --resume continues "
            "from it"
        )
    elif directory:
        kept = f"no complete checkpoint is in {directory}"
    else:
        kept = "no checkpoint was saved (no --checkpoint-dir)"
    return Interrupted(e.signum, f"stopped by {what} {ran}; {kept}")


def _newest_sealed(directory: Path) -> int | None:
    """The newest step of ``directory`` whose manifest vouches for its files (sizes)."""
    try:
        steps = [int(d.name) for d in directory.iterdir()
                 if d.name.isascii() and d.name.isdigit() and d.is_dir()]  # fmt: skip
    except OSError:
        return None
    for step in sorted(steps, reverse=True):
        if verify_step(directory / str(step), full=False) is None:
            return step
    return None


def _heldout(batches: Batches) -> SequentialBatches:
    """The held-out split as consecutive windows (:func:`jaxpar.train.hooks.heldout_loss`)."""
    corpus = batches.corpus
    name = f"held-out split of {corpus.name} ({len(corpus.heldout)} tokens)"
    return SequentialBatches(corpus.heldout, batches.global_batch, batches.seq_len, name)


def _metrics_path(cfg: C.RunConfig) -> str | None:
    from jaxpar.outputs import metrics_path

    return metrics_path(cfg)


def _lock_outputs(cfg: C.RunConfig) -> list[RunLock]:
    """Lock this run's outputs before anything compiles (:func:`jaxpar.outputs.lock_outputs`)."""
    from jaxpar.outputs import lock_outputs

    return lock_outputs(cfg)


@contextlib.contextmanager
def _announce(text: str, enabled: bool) -> Iterator[None]:
    """``jaxpar: TEXT ...`` on stderr, then the seconds the block took, on the same line."""
    if not enabled:
        yield
        return
    print(f"jaxpar: {text} ...", end="", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        yield
    except BaseException:
        print(file=sys.stderr, flush=True)  # the error's line starts a line of its own
        raise
    print(f" {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def _initial_state(p: RunParts, announce: bool) -> tuple[dict, int, dict, float]:
    """The state to start from (restored, or initialised, optionally from Hugging Face
    weights), its step, the checkpoint's record, and the step's compile time."""
    cfg, trainer, t = p.cfg, p.trainer, p.cfg.train
    state, start, meta = None, 0, {}
    if p.resume_step is not None:  # may warn (data changes, broken checkpoints): before the line
        state, meta, start = restore(trainer, p.checkpointer, p.resume_step, cfg)
    lay = cfg.layout
    what = (f"compiling the train step ({cfg.model.name}, {len(p.devices)} "
            f"{p.devices[0].platform} devices: pp={lay.pp} dp={lay.dp} sp={lay.sp} tp={lay.tp} "
            f"zero={lay.zero})")  # fmt: skip
    with _announce(what, announce):
        if state is None:
            state = trainer.init_state(t.seed)
            if t.init_from_hf:
                from jaxpar.model import hf

                params = hf.load(t.init_from_hf, cfg.model, trainer.canonical_param_shardings)
                if trainer.model.fp8_history:  # delayed FP8: empty amax histories, as fresh
                    params = _with_histories(params, trainer.convert(state["params"], "canonical"))
                state["params"] = trainer.convert(params, "rest")
        t0 = time.perf_counter()
        trainer.compile_step()
        compile_s = time.perf_counter() - t0
    return state, start, meta, compile_s


def _with_histories(params: dict, fresh: dict) -> dict:
    """``params`` with the leaves only ``fresh`` has (a delayed FP8 recipe's amax histories,
    which Hugging Face weights do not carry) taken from ``fresh``."""
    out = dict(params)
    for k, v in fresh.items():
        if k not in out:
            out[k] = v
        elif isinstance(v, dict):
            out[k] = _with_histories(out[k], v)
    return out


def _hooks(p: RunParts, div: Divergence) -> list[Hook]:
    """The run's hooks, in the order they run (see :mod:`jaxpar.train.hooks`)."""
    t = p.cfg.train
    hooks: list[Hook] = [
        DivergenceHook(div),
        MetricsHook(),
        ProgressHook(),
        ProfilerHook(p.profiler),
    ]
    if p.heldout is not None:
        hooks.append(EvalHook(t.eval_every, p.heldout, min(t.eval_batches, p.heldout.steps)))
    hooks.append(PreemptionHook(p.stop))  # before the checkpoint: a preemption forces a save
    if p.checkpointer is not None:
        hooks.append(CheckpointHook(Saver(p.checkpointer), div))
    if t.export_hf:
        hooks.append(ExportHook(t.export_hf))
    return hooks + p.extra_hooks


def _train(p: RunParts) -> dict[str, Any]:
    cfg, t = p.cfg, p.cfg.train
    show = t.progress and not p.quiet
    state, start, meta, compile_s = _initial_state(p, announce=show)
    div = Divergence(t.max_skipped_steps, t.divergence_factor, meta.get("first_loss"),
                     int(meta.get("diverged_steps", 0)))  # fmt: skip
    # A run that continues a directory (resume, or the directory's own metrics file) drops
    # the records an earlier attempt wrote after the step this run starts from.
    continues = t.resume or t.resume_or_start or not t.metrics_file
    from jaxpar.outputs import metrics_field

    log = MetricsLog(_metrics_path(cfg), keep_until=start if continues else None,
                     what=metrics_field(cfg))  # fmt: skip
    memory = device_memory(p.trainer)
    log.write({"event": "start", "step": start, "layout": dataclasses.asdict(cfg.layout),
               "params": cfg.model.param_count(), "compile_s": compile_s, "memory": memory,
               "dropped_records": log.dropped})  # fmt: skip
    sinks = Sinks(log, Progress(t.steps, start, enabled=show), p.tensorboard)
    ctx = LoopContext(cfg, p.trainer, p.batches, state, start, sinks,
                      checkpointed=start if p.checkpointer is not None else None)  # fmt: skip
    p.ctx = ctx
    hooks = _hooks(p, div)
    try:
        train_loop(ctx, hooks)
        for h in hooks:
            h.on_end(ctx)
    finally:  # also on an error (e.g. a failed save): finish saves, flush metrics, release files
        try:
            for h in hooks:
                h.close()
        finally:
            sinks.close()
    return _summary(ctx, hooks, p, compile_s, memory)


def _summary(ctx: LoopContext, hooks: list[Hook], p: RunParts, compile_s: float, memory) -> dict:
    """The core's keys of the run's summary, then every hook's."""
    cfg, t = ctx.cfg, ctx.cfg.train
    steady = ctx.step_times[1:] or ctx.step_times
    step_time = statistics.median(steady) if steady else float("nan")
    out: dict[str, Any] = {
        "losses": ctx.losses,
        "final_loss": ctx.losses[-1] if ctx.losses else None,
        "eval_loss": None,
        "evals": [],
        "eval_batches": None,
        "start_step": ctx.start,
        "end_step": ctx.done,
        "steps": t.steps,
        "checkpoint_step": ctx.checkpointed or None,
        "tokens_per_s": ctx.tokens_per_step / step_time if steady else None,
        "step_time_s": step_time,
        "compile_time_s": compile_s,
        "params": cfg.model.param_count(),
        "memory": memory,
        # What the compiled step does over dp (jaxpar.train.reduce.REDUCTION_NAMES).
        "layout": {**dataclasses.asdict(cfg.layout), "dp_reduction": ctx.trainer.dp_reduction},
        "model": cfg.model.name,
        "mesh": cfg.mesh.name,
        "devices": len(p.devices),
        "platform": p.devices[0].platform,
        "processes": jax.process_count(),
    }
    for h in hooks:
        out.update(h.summary(ctx))
    return out
