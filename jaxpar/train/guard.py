"""What lets a run survive: preemption signals, non-finite diagnostics, optional TensorBoard.

- :class:`StopRequest` turns the first SIGTERM/SIGINT into a request the loop honours after the
  current step (checkpoint, exit 0); a second signal gets the default behaviour (abort).
- :func:`nonfinite_leaves` / :func:`write_nonfinite_report` name what went non-finite.
- :func:`inject_nonfinite` is the test hook behind ``train.inject_nonfinite_step``.
- :class:`TensorBoard` writes scalar event files when ``tensorboardX`` is installed.
"""

from __future__ import annotations

import json
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
    """Context manager: SIGTERM/SIGINT set :attr:`signal_name` instead of killing the process.

    The loop polls it between steps. The first signal restores the previous handlers, so a
    second Ctrl-C raises ``KeyboardInterrupt`` and a second SIGTERM terminates as usual.
    Outside the main thread (where Python cannot install handlers) it does nothing; nor in a
    multi-process run (``enabled=False``), where one process stopping alone would leave the
    others blocked in a collective: there the signals keep their default behaviour until the
    stop is agreed across processes (not implemented yet).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
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

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> StopRequest:
        if self.enabled and threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._restore()


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
    """Write the diagnostic of a non-finite step (JSON) and return its path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(_clean(record), indent=2) + "\n")  # NaN/inf become null
    return p


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
