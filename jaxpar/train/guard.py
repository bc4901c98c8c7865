"""What lets a run survive: preemption signals, non-finite diagnostics, optional TensorBoard.

- :class:`StopRequest` turns the first SIGTERM/SIGINT into a request the loop honours after the
  current step (checkpoint, exit 0), agreed across processes in a multi-process run.
- :class:`Divergence` counts non-finite and blown-up steps against ``train.max_skipped_steps``.
- :func:`nonfinite_leaves` / :func:`write_nonfinite_report` name what went non-finite.
- :func:`inject_nonfinite` is the test hook behind ``train.inject_nonfinite_step``.
- :class:`TensorBoard` writes scalar event files when ``tensorboardX`` is installed.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.errors import ConfigError
from jaxpar.report import _clean


class StopRequest:
    """Context manager: SIGTERM/SIGINT become a request the loop honours between steps.

    One process: the first signal sets :attr:`signal_name` and restores the previous handlers,
    so a second Ctrl-C raises ``KeyboardInterrupt`` and a second SIGTERM terminates as usual.

    Several processes (``multi_process=True``): one process stopping alone would leave the
    others blocked in the step's collectives, so the stop must be agreed. JAX's preemption
    service does that: its own SIGTERM handler (installed by ``jax.distributed.initialize``)
    tells the coordination service, which picks the step after the furthest any process has
    reported, and :func:`jax.experimental.multihost_utils.reached_preemption_sync_point`
    turns true on every process at that same step. SIGTERM is therefore left to JAX here, and
    SIGINT (Ctrl-C) is passed on to it as a SIGTERM to this process. The per-step check is a
    local flag read (no collective; measured in BENCHMARKS.md).

    Outside the main thread (where Python cannot install handlers) it does nothing.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, enabled: bool = True, multi_process: bool = False) -> None:
        self.enabled = enabled
        self.multi_process = multi_process
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name
        self._restore()
        print(
            f"jaxpar: {self.signal_name} received; finishing the current step, then "
            "checkpointing and exiting (send it again to abort now)",
            file=sys.stderr,
            flush=True,
        )

    def _forward(self, signum: int, frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name
        self._restore()
        print(
            f"jaxpar: {self.signal_name} received; all processes will stop at an agreed step, "
            "checkpoint it and exit",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption service

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            # None: the handler was not installed from Python (e.g. by JAX); the default then
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous = {}

    def __enter__(self) -> StopRequest:
        if self.enabled and threading.current_thread() is threading.main_thread():
            if self.multi_process:
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._forward)
            else:
                for sig in self.SIGNALS:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._restore()

    def should_stop(self, step: int) -> bool:
        """Whether to stop after ``step`` (1-based, the step just done); every process of a
        multi-process run answers the same at the same step. Call it after every step."""
        if not self.multi_process:
            return self.signal_name is not None
        from jax.experimental import multihost_utils

        if multihost_utils.reached_preemption_sync_point(step):
            self.signal_name = self.signal_name or "SIGTERM"
            return True
        return False


class Divergence:
    """The divergence budget of a run (``train.max_skipped_steps``).

    A step *counts* when its loss or gradient is non-finite (the step itself then keeps the
    previous state: the update is skipped), or when its loss is finite but above
    ``factor`` x the run's first loss (a blow-up: the weights have grown without overflowing,
    e.g. ``lr=1e9``; that update was applied). A loss twice the untrained model's is worse
    than the model has ever been and does not come back by itself. Counts and the first loss
    are kept in checkpoints, so a resumed run continues the same budget.
    """

    def __init__(self, budget: int, factor: float, first_loss: float | None = None,
                 counted: int = 0) -> None:  # fmt: skip
        self.budget, self.factor = budget, factor
        self.first_loss, self.counted = first_loss, counted
        self.first_step: int | None = None

    def check(self, step: int, loss: float, finite: bool) -> str | None:
        """Why ``step`` counts against the budget (one phrase), or None."""
        why = None
        if not finite:
            why = "non-finite loss or gradient; update skipped"
        elif self.first_loss is None:
            self.first_loss = loss
        elif self.factor and loss > self.factor * self.first_loss:
            why = (
                f"loss {loss:.4g} above {self.factor:g}x the first loss {self.first_loss:.4g} "
                "(diverging; this update was applied)"
            )
        if why is not None:
            self.counted += 1
            self.first_step = self.first_step or step
        return why

    @property
    def exceeded(self) -> bool:
        """More steps counted than the budget allows."""
        return self.counted > self.budget

    def note(self) -> str:
        """``k of K allowed`` for the warning line."""
        return f"{self.counted} counted, --max-skipped-steps {self.budget}"


def resume_command(argv: list[str] | None = None) -> str:
    """The command line that resumes this run: the same arguments plus ``--resume``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--resume" not in args and "--resume-or-start" not in args:
        args.append("--resume")
    return shlex.join(["jaxpar", *args])


def _leaf_name(keypath: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)


def nonfinite_leaves(finite_tree: Any) -> list[str]:
    """Paths (``layers/attn/wq``) of the leaves whose flag in ``finite_tree`` is False."""
    return [_leaf_name(path) for path, ok in jax.tree.leaves_with_path(finite_tree) if not bool(ok)]


def write_nonfinite_report(path: str | Path, record: dict[str, Any]) -> Path:
    """Write the diagnostic of a non-finite step (JSON, atomically: a temporary name of this
    run, renamed) and return its path. It lands beside the run's locked outputs."""
    from jaxpar.lock import write_atomic

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(p, (json.dumps(_clean(record), indent=2) + "\n").encode())  # NaN: null


def inject_nonfinite(grads: Any, poison: jax.Array) -> Any:
    """Test hook: where ``poison`` is true, the first gradient leaf (``embed/table``) is NaN.

    Used by ``train.inject_nonfinite_step`` to exercise the non-finite policies without
    contriving a diverging run; costs one select when enabled, nothing when not.
    """
    leaves, treedef = jax.tree.flatten(grads)
    leaves[0] = jnp.where(poison, jnp.full_like(leaves[0], jnp.nan), leaves[0])
    return jax.tree.unflatten(treedef, leaves)


class TensorBoard:
    """Scalar TensorBoard event files through ``tensorboardX`` (an optional dependency).

    A resumed run appends a new event file to the same directory; TensorBoard merges them by
    step. Only process 0 writes.
    """

    def __init__(self, logdir: str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError(
                f"train.tensorboard_dir={logdir!r}: needs the optional package tensorboardX "
                "(pip install 'jaxpar[tensorboard]')"
            ) from None
        self._w = SummaryWriter(logdir) if jax.process_index() == 0 else None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Write ``values`` as ``train/<name>`` scalars at ``step``."""
        if self._w is not None:
            for k, v in values.items():
                self._w.add_scalar(f"train/{k}", v, step)

    def close(self) -> None:
        """Flush and close the event file."""
        if self._w is not None:
            self._w.close()
            self._w = None
