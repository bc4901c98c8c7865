"""The concerns of a training run, each a :class:`~jaxpar.train.core.Hook` on the loop.

Metrics hooks (read one step late, in this order): :class:`DivergenceHook` (the budget of
``train.max_skipped_steps``, ``train.on_nonfinite``), :class:`MetricsHook` (JSONL records and
TensorBoard), :class:`ProgressHook` (the bar). State hooks (they see the state after their step,
before the next one is dispatched): :class:`ProfilerHook`, :class:`EvalHook`,
:class:`PreemptionHook`, :class:`CheckpointHook`, :class:`ExportHook`.

Which of them need step n's figures before step n+1 is dispatched: the checkpoint (it skips a
periodic save of a diverged step, and the state after step n is donated to step n+1), the
held-out evaluation (the parameters after step n), the preemption check (it decides whether a
step n+1 comes at all) and the export. They are state hooks, so those steps are read at once;
every other step runs one ahead of its metrics.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from jaxpar.data import SequentialBatches
from jaxpar.profiling import StepProfiler
from jaxpar.train.core import Hook, LoopContext, StepMetrics, Stop
from jaxpar.train.nonfinite import Divergence, nonfinite_leaves, write_stop_report
from jaxpar.train.preempt import StopRequest


class DivergenceHook(Hook):
    """Counts non-finite and blown-up steps; warns, or stops the run (exit 3) with a diagnostic
    per ``train.on_nonfinite`` and the budget. The step itself already skipped a non-finite
    update, so reading its flag one step late is safe: only the dropped next step ran on."""

    def __init__(self, div: Divergence) -> None:
        self.div = div
        self.skipped = 0
        self.report: str | None = None
        self.stopped: str | None = None

    def on_step(self, ctx: LoopContext, m: StepMetrics) -> None:
        m.diverged = self.div.check(m.step, m.loss, m.finite)
        if not m.finite:
            self.skipped += 1
            m.nonfinite_leaves = nonfinite_leaves(m.leaf_finite)
        if not m.diverged:
            return
        t = ctx.cfg.train
        if t.on_nonfinite == "stop" or self.div.exceeded:
            self.report = str(write_stop_report(ctx.cfg, m, ctx.checkpointed, self.div))
            rule = (
                f"more than --max-skipped-steps {t.max_skipped_steps} steps diverged "
                f"({self.div.counted}, the first at step {self.div.first_step})"
                if t.on_nonfinite == "skip"
                else "--on-nonfinite stop"
            )
            self.stopped = (
                f"step {m.step}: {m.diverged}; stopping: {rule} (diagnostic: {self.report})"
            )
            print(f"jaxpar: {self.stopped}", file=sys.stderr, flush=True)
            ctx.stop = Stop("diverged", self.stopped)
        else:
            ctx.sinks.progress.warn(
                f"jaxpar: warning: step {m.step}: {m.diverged} ({self.div.note()})"
            )

    def summary(self, ctx: LoopContext) -> dict[str, Any]:
        return {
            "skipped_steps": self.skipped,
            "diverged_steps": self.div.counted,
            "max_skipped_steps": ctx.cfg.train.max_skipped_steps,
            "stopped": self.stopped,
            "nonfinite_report": self.report,
        }


class MetricsHook(Hook):
    """One JSONL record per step (and its TensorBoard scalars, except for a step that stopped
    the run)."""

    def on_step(self, ctx: LoopContext, m: StepMetrics) -> None:
        rec = m.record()
        ctx.sinks.log.write(rec)
        if ctx.stop is None:
            ctx.sinks.scalars(
                m.step, {k: rec[k] for k in ("loss", "grad_norm", "lr", "tokens_per_s")}
            )


class ProgressHook(Hook):
    """The progress bar: loss, tokens/s and step time of the latest step read."""

    def on_step(self, ctx: LoopContext, m: StepMetrics) -> None:
        if ctx.stop is None:
            ctx.sinks.progress.update(m.step, m.loss, m.tokens_per_s, m.step_time_s)


class ProfilerHook(Hook):
    """``train.profile_steps`` A:B through :class:`~jaxpar.profiling.StepProfiler`: each step's
    annotation spans its dispatch (and the host's work until the next dispatch); the trace is
    stopped once step B's results are on the host (a state hook due at B only, so B is read at
    once)."""

    needs_state = True

    def __init__(self, profiler: StepProfiler) -> None:
        self.profiler = profiler

    def due(self, ctx: LoopContext, step: int) -> bool:
        return self.profiler.steps is not None and step == self.profiler.steps[1]

    def before_step(self, ctx: LoopContext, step: int) -> None:
        if self.profiler.steps is not None and step - 1 < self.profiler.steps[1]:
            self.profiler.end(step - 1)  # closes the previous step's annotation, if open
        self.profiler.begin(step)

    def on_step(self, ctx: LoopContext, m: StepMetrics) -> None:
        self.profiler.end(m.step)

    def close(self) -> None:
        self.profiler.close()

    def summary(self, ctx: LoopContext) -> dict[str, Any]:
        return {"profiled_steps": self.profiler.traced}


def heldout_loss(trainer: Any, params: Any, batches: SequentialBatches, n: int) -> float:
    """Mean loss of ``params`` over the first ``n`` batches of consecutive held-out windows.

    The one held-out measure of jaxpar: training's ``eval_loss`` (``n = train.eval_batches``) is
    what ``jaxpar eval --max-batches n`` reports on the same tokens; ``jaxpar eval`` without
    ``--max-batches`` takes every batch the tokens hold.
    """
    losses = [
        trainer.eval_loss(params, batches.global_array(i, trainer.batch_sharding)) for i in range(n)
    ]  # fmt: skip  (all dispatched, then read)
    return sum(float(x) for x in losses) / n


class EvalHook(Hook):
    """Held-out loss every ``train.eval_every`` steps and after the last (0: never)."""

    needs_state = True

    def __init__(self, every: int, batches: SequentialBatches, n: int) -> None:
        self.every, self.batches, self.n = every, batches, n
        self.evals: list[dict[str, Any]] = []

    def on_step(self, ctx: LoopContext, m: StepMetrics) -> None:
        loss = heldout_loss(ctx.trainer, ctx.state["params"], self.batches, self.n)
        self.evals.append({"step": m.step, "eval_loss": loss})
        ctx.sinks.log.write({"step": m.step, "eval_loss": loss})
        ctx.sinks.scalars(m.step, {"eval_loss": loss})
        ctx.sinks.progress.note(f"step {m.step}: held-out loss {loss:.4f} ({self.n} batches)")

    def summary(self, ctx: LoopContext) -> dict[str, Any]:
        return {
            "eval_loss": self.evals[-1]["eval_loss"] if self.evals else None,
            "evals": self.evals,
            # the measure: the first eval_batches batches of consecutive held-out windows
            "eval_batches": self.n,
        }


class PreemptionHook(Hook):
    """A SIGTERM/SIGINT (agreed across processes) ends the run after a step, with a checkpoint
    of that step (:class:`CheckpointHook` comes after this hook). Asked after every step."""

    needs_state = True

    def __init__(self, stop: StopRequest) -> None:
        self.stop = stop
        self.check_s: list[float] = []

    def due(self, ctx: LoopContext, step: int) -> bool:
        t = time.perf_counter()
        now = self.stop.should_stop(step)  # every process, every step (multi-process agreement)
        self.check_s.append(time.perf_counter() - t)
        if now:
            ctx.preempted = self.stop.signal_name
        return now

    def on_step(self, ctx: LoopContext, m: StepMetrics) -> None:
        ctx.stop = Stop("preempted", f"stopped by {ctx.preempted} after step {m.step}")

    def on_end(self, ctx: LoopContext) -> None:
        ctx.preempted = self.stop.signal_name
        if ctx.preempted:
            ctx.sinks.log.write({"event": "preempted", "signal": ctx.preempted, "step": ctx.done})

    def summary(self, ctx: LoopContext) -> dict[str, Any]:
        from statistics import median

        return {
            "preempted": self.stop.signal_name,
            "stop_check_s": median(self.check_s) if self.check_s else None,
        }
