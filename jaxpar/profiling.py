"""Profile chosen training steps with ``jax.profiler``: one trace, one annotation per step.

``jaxpar train --profile-steps A:B --profile-dir D`` traces steps ``A`` to ``B`` inclusive
(numbered from 1, as in the metrics). The trace lands in ``D/plugins/profile/<run>/`` (with
several processes ``D/process_<i>/plugins/...``, one per process) as an ``.xplane.pb`` file:
open it with TensorBoard's profile plugin or xprof, or convert it for Perfetto. Each step is
wrapped in ``jax.profiler.StepTraceAnnotation("train", step_num=i)``, so the viewers split the
timeline per step and show, inside each, the compute kernels and the collectives (all-gather,
reduce-scatter, all-reduce) of that step on every device's stream.

Compilation happens before the first step, so it never pollutes the trace. The trace is stopped
after step ``B``'s loss has been read back (the device work of the step has finished).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from jaxpar.errors import ConfigError

DEFAULT_DIR = "jaxpar_profile"


def parse_steps(spec: str | None, total_steps: int) -> tuple[int, int] | None:
    """``"A:B"`` → ``(A, B)``, 1-based inclusive; None when not profiling.

    Raises :class:`ConfigError` for a malformed or out-of-range range.
    """
    if spec is None or spec == "":
        return None
    parts = str(spec).split(":")
    try:
        if len(parts) == 1:
            a = b = int(parts[0])
        elif len(parts) == 2:
            a, b = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"train.profile_steps={spec!r}: expected A:B (steps A to B, from 1) or one step A"
        ) from None
    if not 1 <= a <= b <= total_steps:
        raise ConfigError(
            f"train.profile_steps={spec!r}: need 1 <= A <= B <= train.steps={total_steps}"
        )
    return a, b


class StepProfiler:
    """Starts a trace before step ``A``, annotates every step, stops after step ``B``.

    The loop calls :meth:`begin` before a step and :meth:`end` once the step's results are on
    the host; outside the range both are no-ops, so the loop needs no conditionals.
    """

    def __init__(self, steps: tuple[int, int] | None, directory: str | None = None):
        self.steps = steps
        self.directory = Path(directory or DEFAULT_DIR)
        self._tracing = False
        self._annotation: contextlib.ExitStack | None = None
        self.traced: list[int] = []

    @classmethod
    def from_config(cls, train_cfg) -> StepProfiler:
        """From ``train.profile_steps`` / ``train.profile_dir`` (validated here)."""
        rng = parse_steps(getattr(train_cfg, "profile_steps", None), train_cfg.steps)
        return cls(rng, getattr(train_cfg, "profile_dir", None))

    def begin(self, step: int) -> None:
        """Before step ``step`` (1-based): start the trace at ``A``, open the step annotation."""
        import jax

        if self.steps is None:
            return
        a, b = self.steps
        if step == a and not self._tracing:
            if jax.process_count() > 1:  # one trace per process, side by side
                self.directory = self.directory / f"process_{jax.process_index()}"
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self._tracing = True
        if self._tracing:
            self._annotation = contextlib.ExitStack()
            self._annotation.enter_context(jax.profiler.StepTraceAnnotation("train", step_num=step))

    def end(self, step: int) -> None:
        """After step ``step``'s results are on the host: close the annotation; stop at ``B``."""
        if self._annotation is not None:
            self._annotation.close()
            self._annotation = None
            self.traced.append(step)
        if self._tracing and self.steps is not None and step >= self.steps[1]:
            self.close()

    def close(self) -> None:
        """Stop the trace if it is running (also when the loop stops early)."""
        import jax

        if self._annotation is not None:
            self._annotation.close()
            self._annotation = None
        if self._tracing:
            jax.profiler.stop_trace()
            self._tracing = False

    def trace_files(self) -> list[Path]:
        """The ``.xplane.pb`` files written under the profile directory (all processes)."""
        return sorted(self.directory.glob("**/plugins/profile/*/*.xplane.pb"))
