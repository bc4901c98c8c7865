"""The loop's core: data → step → metrics, and the hooks that do everything else.

:func:`train_loop` dispatches each step, then reads the *previous* step's metrics on the host
while the device runs this one, so the host never leaves the device idle between steps (nanodo
reads metrics one step late for the same reason). A :class:`Hook` registers a concern with a
cadence (``every``): evaluation, checkpoints, metrics files, the divergence budget, preemption,
the progress bar (:mod:`jaxpar.train.hooks`).

Two kinds of hook, told apart by :attr:`Hook.needs_state`:

- metrics hooks (``needs_state=False``) see a step's :class:`StepMetrics` on the host, in step
  order, one step late (after the next step was dispatched);
- state hooks (``needs_state=True``) need the state *after* step n, which the step donates to
  step n+1: on a step where one is :meth:`~Hook.due`, the loop reads that step's metrics at once
  (metrics hooks first), runs the due state hooks, and only then dispatches the next step. The
  last step is always read at once.

A metrics hook may end the run (``ctx.stop``, e.g. the divergence budget); the step dispatched
after the one that stopped it is then dropped unread: it is neither recorded, counted nor
checkpointed. Its state is not the stopped step's, which is why a hook that needs the final
state (the Hugging Face export) is a state hook due every step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from jaxpar.config import RunConfig
from jaxpar.data import Batches
from jaxpar.metrics import MetricsLog, Progress
from jaxpar.train.tensorboard import TensorBoard

State = dict[str, Any]
# The step's outputs read on the host each step (the MoE pair only for a MoE model).
HOST_METRICS = frozenset(
    {"loss", "grad_norm", "lr", "finite", "moe_load", "moe_dropped", "fp8_overflow"}
)


@dataclass
class StepMetrics:
    """One step's figures on the host; hooks annotate it before the metrics hook writes it."""

    step: int  # 1-based: the step just done
    loss: float
    grad_norm: float
    lr: float
    finite: bool
    step_time_s: float  # time from the previous step's completion (or this dispatch) to this one's
    tokens_per_s: float
    leaf_finite: Any  # per-leaf finite flags, still on the device (read only when needed)
    nonfinite_leaves: list[str] | None = None  # set by the divergence hook on a non-finite step
    diverged: str | None = None  # why the step counts against the divergence budget
    moe_load: list[float] | None = None  # MoE: per layer, busiest expert's load / mean load
    moe_dropped: list[int] | None = None  # MoE: per layer, assignments the capacity dropped
    # layout.fp8='delayed': operands (x, w or dy of a GEMM in a layer) whose values this step
    # needed a larger scale than their amax history gave, so were clipped (jaxpar.model.fp8)
    fp8_overflow: int | None = None

    def record(self) -> dict[str, Any]:
        """The JSONL metrics record of this step."""
        rec: dict[str, Any] = {
            "step": self.step,
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "lr": self.lr,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
        }
        if not self.finite:
            rec["nonfinite"] = True
            rec["nonfinite_leaves"] = self.nonfinite_leaves or []
        if self.diverged:
            rec["diverged"] = self.diverged
        if self.moe_load is not None:
            rec["moe_load"], rec["moe_dropped"] = self.moe_load, self.moe_dropped
        if self.fp8_overflow is not None:
            rec["fp8_overflow"] = self.fp8_overflow
        return rec


@dataclass
class Stop:
    """Why the loop ended before ``train.steps``: ``kind`` is ``"diverged"`` or ``"preempted"``."""

    kind: str
    message: str


@dataclass
class Sinks:
    """Where a run's records go: the JSONL metrics file, TensorBoard, the progress bar."""

    log: MetricsLog
    progress: Progress
    tensorboard: TensorBoard | None = None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """TensorBoard scalars, when it is on."""
        if self.tensorboard is not None:
            self.tensorboard.scalars(step, values)

    def close(self) -> None:
        """Finish the bar, flush and close the files."""
        self.progress.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        self.log.close()


@dataclass
class LoopContext:
    """What the loop and its hooks share: the run's fixed parts and what evolves."""

    cfg: RunConfig
    trainer: Any  # jaxpar.train.step.Trainer
    batches: Batches
    state: State
    start: int  # steps done before this run (a resume's checkpoint step)
    sinks: Sinks
    done: int = 0  # the last step whose metrics were read
    last: StepMetrics | None = None  # its metrics
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    stop: Stop | None = None
    preempted: str | None = None  # the signal, once a preemption was agreed
    checkpointed: int | None = None  # the last step saved (a resume: its step); None: no saving
    ready_at: float = 0.0  # when the last read step's metrics reached the host

    def __post_init__(self) -> None:
        self.done = self.start

    @property
    def total(self) -> int:
        """``train.steps``: the step the run ends at."""
        return self.cfg.train.steps

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one global batch."""
        return self.cfg.train.global_batch * self.cfg.train.seq_len


class Hook:
    """A loop concern with a cadence; every method is optional.

    ``every``: the hook is due after steps divisible by it and after the last step (0: never;
    override :meth:`due` for another rule). ``needs_state``: see the module docstring.
    """

    every: int = 1
    needs_state: bool = False

    def due(self, ctx: LoopContext, step: int) -> bool:
        """Whether the hook runs after ``step``; state hooks are asked once per step, in order."""
        return self.every > 0 and (step % self.every == 0 or step == ctx.total)

    def before_step(self, ctx: LoopContext, step: int) -> None:
        """Just before ``step`` is dispatched."""

    def on_step(self, ctx: LoopContext, m: StepMetrics) -> None:
        """After step ``m.step`` (state hooks: ``ctx.state`` is the state after it)."""

    def on_end(self, ctx: LoopContext) -> None:
        """Once the loop has ended normally (finished, stopped or preempted)."""

    def close(self) -> None:
        """Always, also after an error: release what the hook holds."""

    def summary(self, ctx: LoopContext) -> dict[str, Any]:
        """This hook's keys of the run's summary (the ``--json`` object)."""
        return {}


@dataclass
class _InFlight:
    """A dispatched step whose metrics are not yet on the host."""

    step: int
    metrics: dict[str, jax.Array]
    dispatched: float

    def read(self, ctx: LoopContext) -> StepMetrics:
        """Block until the metrics are on the host. The step time runs from the previous step's
        completion, or this dispatch if later: queued ahead, steps follow one another."""
        host = jax.device_get({k: self.metrics[k] for k in HOST_METRICS if k in self.metrics})
        now = time.perf_counter()
        dt = now - max(self.dispatched, ctx.ready_at)
        ctx.ready_at = now
        m = StepMetrics(self.step, float(host["loss"]), float(host["grad_norm"]),
                        float(host["lr"]), bool(host["finite"]), dt,
                        ctx.tokens_per_step / dt, self.metrics["leaf_finite"])  # fmt: skip
        if "moe_load" in host:
            m.moe_load = [float(v) for v in host["moe_load"]]
            m.moe_dropped = [int(v) for v in host["moe_dropped"]]
        if "fp8_overflow" in host:
            m.fp8_overflow = int(host["fp8_overflow"])
        return m


def _read(ctx: LoopContext, hooks: Sequence[Hook], flight: _InFlight) -> None:
    """The step's metrics on the host, then every due metrics hook, in order."""
    m = flight.read(ctx)
    ctx.done, ctx.last = m.step, m
    ctx.losses.append(m.loss)
    ctx.step_times.append(m.step_time_s)
    for h in hooks:
        if not h.needs_state and h.due(ctx, m.step):
            h.on_step(ctx, m)


def train_loop(ctx: LoopContext, hooks: Sequence[Hook]) -> None:
    """Steps ``ctx.start + 1 .. ctx.total`` with ``hooks``; ends early on ``ctx.stop``."""
    pending: _InFlight | None = None
    for step in range(ctx.start + 1, ctx.total + 1):
        batch = ctx.batches.global_array(step - 1, ctx.trainer.batch_sharding)
        for h in hooks:
            h.before_step(ctx, step)
        t = time.perf_counter()
        ctx.state, metrics = ctx.trainer.step(ctx.state, batch)
        for name in HOST_METRICS & metrics.keys():
            metrics[name].copy_to_host_async()  # on the host by the time they are read
        flight = _InFlight(step, metrics, t)
        if pending is not None:
            _read(ctx, hooks, pending)  # the previous step, while this one runs
            if ctx.stop:
                return  # this step is dropped unread
        due = [h for h in hooks if h.needs_state and h.due(ctx, step)]  # every one is asked
        if not due and step < ctx.total:
            pending = flight
            continue
        pending = None
        _read(ctx, hooks, flight)
        if ctx.stop:
            return
        for h in due:
            h.on_step(ctx, ctx.last)  # type: ignore[arg-type]  (just read)
        if ctx.stop:
            return
