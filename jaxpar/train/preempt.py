"""Preemption: the first SIGTERM/SIGINT becomes a request the loop honours after a step.

:class:`StopRequest` turns the signal into a request (checkpoint, exit 0), agreed across
processes in a multi-process run; :func:`resume_command` is the command line that continues the
run. The loop's side of it is :class:`jaxpar.train.hooks.PreemptionHook`.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from typing import Any

_UNSAVED = "no --checkpoint-dir: nothing is saved"


class StopRequest:
    """Context manager: SIGTERM/SIGINT become a request the loop honours between steps.

    One process: the first signal sets :attr:`signal_name` and restores the previous handlers,
    so a second signal is handled as before the run: under ``jaxpar train`` it ends the run at
    once (:class:`jaxpar.lock.Interrupted`, whose line names the step reached and the newest
    complete checkpoint); elsewhere a second Ctrl-C raises ``KeyboardInterrupt`` and a second
    SIGTERM terminates as usual. ``saves``: whether the run writes checkpoints (what the first
    signal's line promises).

    Several processes (``multi_process=True``): one process stopping alone would leave the
    others blocked in the step's collectives, so the stop must be agreed. JAX's preemption
    service does that: its own SIGTERM handler (installed by ``jax.distributed.initialize``)
    tells the coordination service, which picks the step after the furthest any process has
    reported, and :func:`jax.experimental.multihost_utils.reached_preemption_sync_point`
    turns true on every process at that same step. SIGTERM is therefore left to JAX here, and
    SIGINT (Ctrl-C) is passed on to it as a SIGTERM to this process. The per-step check is a
    local flag read (no collective, so it costs microseconds, not a round trip).

    Outside the main thread (where Python cannot install handlers) it does nothing.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, enabled: bool = True, multi_process: bool = False, saves: bool = True):
        self.enabled = enabled
        self.multi_process = multi_process
        self.saves = saves
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def _received(self, signum: int, what_next: str) -> None:
        """Record the first signal, restore the previous handlers, say what happens next."""
        self.signal_name = signal.Signals(signum).name
        self._restore()
        print(f"jaxpar: {self.signal_name} received; {what_next}", file=sys.stderr, flush=True)

    def _handle(self, signum: int, frame: Any) -> None:
        then = "checkpointing and exiting" if self.saves else f"exiting ({_UNSAVED})"
        self._received(signum, f"finishing the current step, then {then} (send it again to "
                       "abort now)")  # fmt: skip

    def _forward(self, signum: int, frame: Any) -> None:
        then = "checkpoint it and exit" if self.saves else f"exit ({_UNSAVED})"
        self._received(signum, f"all processes will stop at an agreed step, {then}")
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


def resume_command(argv: list[str] | None = None) -> str:
    """The command line that resumes this run: the same arguments plus ``--resume``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--resume" not in args and "--resume-or-start" not in args:
        args.append("--resume")
    return shlex.join(["jaxpar", *args])
