"""Orbax checkpoints of the train state: restorable onto any layout, verified before loading.

A checkpoint holds the state tree (params, optimizer state, step) and a JSON record (model
shape, layout, data position, seed). Restoring takes an abstract state whose leaves carry the
*target* shardings, so a checkpoint written under one layout is read directly into another.

Integrity, in two layers:

- orbax writes each step into ``<step>.orbax-checkpoint-tmp-<n>`` and renames it to ``<step>``
  when every item is committed; a step directory that never got renamed is not listed as a
  step, and is removed when a writable :class:`Checkpointer` opens the directory;
- after orbax finalises, jaxpar writes its own record ``jaxpar_manifest.json`` (every file's
  size and CRC-32), atomically (temporary file, fsync, rename), last. A step directory without
  a manifest, or whose files no longer match it, is *incomplete*: it is skipped with a
  :class:`CheckpointWarning`, never loaded, and moved to ``<dir>/quarantine/`` when resuming,
  so the run falls back to the previous complete step. The manifest is read through a schema
  (:data:`MANIFEST_SCHEMA`) and must list every file of the step: a record that lists none, or
  fewer than the directory holds, does not vouch for the step.

Saves are asynchronous (orbax's async checkpointing): :meth:`Checkpointer.save` returns once the
state is copied off the training buffers, a background thread waits for orbax to finalise the
step and then writes the manifest; at most one save is in flight (the next save, :meth:`wait`
and :meth:`close` wait for it), so a SIGKILL during a background save leaves the previous step
as the newest complete one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxpar import typed
from jaxpar.config import MODEL_SHAPE_FIELDS, ModelConfig
from jaxpar.errors import CheckpointError, ConfigError, JaxparWarning

MANIFEST = "jaxpar_manifest.json"
QUARANTINE = "quarantine"
# Test-only: seconds to sleep after orbax finalised a step and before the manifest is written,
# so a test can SIGKILL a run inside a checkpoint write deterministically. Unset in real runs.
SAVE_DELAY_ENV = "JAXPAR_TEST_SAVE_DELAY_S"


class CheckpointWarning(JaxparWarning):
    """A checkpoint was skipped because it is incomplete or corrupted."""


@contextlib.contextmanager
def _held_logs():
    """Hold orbax's log records (absl) and asyncio's back while a save runs: re-emitted when it
    succeeds, dropped when it fails, because the one-line :class:`CheckpointError` then says
    what failed (a full disk otherwise prints each failed write's traceback, and a write future
    collected while the save unwinds logs "Future exception was never retrieved" before
    :func:`_quiet_orphaned_tasks` is in place)."""
    held: list[logging.LogRecord] = []
    logs = [logging.getLogger("absl"), logging.getLogger("asyncio")]

    class Hold(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            held.append(record)
            return False

    hold = Hold()
    for log in logs:
        log.addFilter(hold)
    try:
        yield
    except BaseException:
        held.clear()
        raise
    finally:
        for log in logs:
            log.removeFilter(hold)
        # A logger's filters see only the records logged on it: record.name is that logger.
        for record in held:
            logging.getLogger(record.name).handle(record)


def _quiet_closed_loops() -> None:
    """Drop one kind of unraisable exception: ``RuntimeError('Event loop is closed')``, raised
    when tensorstore completes a write future after orbax closed the event loop that awaited
    it (after a failed save, about 30 of them). Anything else reaches the previous hook."""
    previous = sys.unraisablehook
    if getattr(previous, "jaxpar_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        previous(unraisable)

    hook.jaxpar_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _quiet_orphaned_tasks() -> None:
    """After a failed save, drop asyncio's "Task/Future exception was never retrieved" and
    "Task was destroyed but it is pending!" records: the save's other write tasks and futures
    fail the same way after orbax has raised the first error (or are left pending on its closed
    loop), and asyncio logs each one when it is collected (at exit, ~15 lines). Write
    coroutines that the failed save never started are collected the same way and warn
    ``coroutine '...' was never awaited`` (two lines, when the collector reaches them before
    exit; timing-dependent). The one-line :class:`CheckpointError` already says what failed."""
    log = logging.getLogger("asyncio")
    if any(getattr(f, "jaxpar_quiet", False) for f in log.filters):
        return  # installed by an earlier failed save
    warnings.filterwarnings(
        "ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning
    )

    class Orphans(logging.Filter):
        jaxpar_quiet = True

        def filter(self, record: logging.LogRecord) -> bool:
            first = str(record.msg).split("\n", 1)[0]
            orphan = first.endswith(" exception was never retrieved")
            return not (orphan or first == "Task was destroyed but it is pending!")

    log.addFilter(Orphans())


def _io_reason(e: BaseException) -> str:
    """The OS-level reason inside an orbax/tensorstore error, else its first line."""
    code = re.search(r"os_error_code='(\d+)'", str(e))
    if code:
        return os.strerror(int(code.group(1)))
    return (getattr(e, "strerror", None) or str(e) or type(e).__name__).splitlines()[0]


def _crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def _size_crc(v: Any) -> bool:
    return (
        isinstance(v, list)
        and len(v) == 2
        and all(typed._KINDS["int"](x) and 0 <= x < 2**64 for x in v)
    )


MANIFEST_SCHEMA = {
    "version": typed.Rule(("int",), lambda v: v == 1, "must be 1"),
    "files": typed.Rule(
        ("dict",),
        lambda v: len(v) > 0 and all(typed.plain_path(k) and _size_crc(x) for k, x in v.items()),
        "must map each file of the step (a relative path inside it) to [size, crc32]",
    ),
}


def write_manifest(step_dir: Path) -> None:
    """Record every file's size and CRC-32 of a finalised step; written atomically, last."""
    files = {
        p.relative_to(step_dir).as_posix(): [p.stat().st_size, _crc(p)] for p in _files(step_dir)
    }
    tmp = step_dir / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"version": 1, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / MANIFEST)


def verify_step(step_dir: Path, full: bool = True) -> str | None:
    """Why the step directory is not a complete checkpoint, or None if it is.

    ``full`` compares CRC-32s (reads every byte); otherwise only presence and sizes.
    """
    if not step_dir.is_dir():
        return "no such step (it was never written)"
    if not (step_dir / MANIFEST).exists():
        return "no integrity record (the write was interrupted)"
    try:
        record = typed.read_json(step_dir / MANIFEST)
        files = typed.check_record(MANIFEST, record, MANIFEST_SCHEMA)["files"]
    except ConfigError as e:
        return f"unreadable integrity record ({e})"
    unlisted = sorted({p.relative_to(step_dir).as_posix() for p in _files(step_dir)} - set(files))
    if unlisted:
        return f"file {unlisted[0]} is not in the integrity record"
    for rel, (size, crc) in files.items():
        p = step_dir / rel
        if not p.is_file():
            return f"file {rel} is missing"
        if p.stat().st_size != size:
            return f"file {rel} has {p.stat().st_size} bytes, expected {size}"
        if full and _crc(p) != crc:
            return f"file {rel} fails its CRC-32 check"
    return None


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


@jax.jit
def _copied(tree: Any) -> Any:
    """A device copy of ``tree``: the training step donates the state's buffers, and a
    background save must not read buffers the next step overwrites."""
    return jax.tree.map(jnp.copy, tree)


class Checkpointer:
    """Save every ``every`` steps, keep the newest ``keep``; restore the newest complete one.

    ``writable=False`` opens an existing directory for reading only (nothing is created,
    cleaned or moved). ``asynchronous=False`` makes :meth:`save` wait until the step is final
    (the blocking orbax path, kept for comparison: ``scripts/bench_checkpoint.py``).
    """

    def __init__(
        self,
        directory: str | Path,
        keep: int = 3,
        every: int = 50,
        writable: bool = True,
        asynchronous: bool = True,
    ):
        self.directory = Path(directory).absolute()
        self.every = every
        self.writable = writable
        self.asynchronous = asynchronous
        self._thread: threading.Thread | None = None
        self._error: tuple[int, BaseException] | None = None
        self._broken = False
        where = f"checkpoint_dir={str(self.directory)!r}"
        _quiet_closed_loops()
        if writable:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                probe = self.directory / f".jaxpar-write-probe-{jax.process_index()}-{os.getpid()}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as e:
                raise CheckpointError(f"{where}: not writable: {e.strerror or e}") from None
            if jax.process_index() == 0:
                # orbax's own cleanup option runs in the background; do it here, synchronously,
                # so nothing half-written is around once the directory is open
                for tmp in self.directory.glob("*.orbax-checkpoint-tmp*"):
                    shutil.rmtree(tmp, ignore_errors=True)
        elif not self.directory.is_dir():
            raise CheckpointError(f"{where}: not a directory")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=writable,
            read_only=not writable,
            enable_async_checkpointing=asynchronous,
        )
        try:
            self._mgr = ocp.CheckpointManager(
                self.directory,
                options=options,
                item_handlers={
                    "state": ocp.StandardCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler(),
                },
            )
        except OSError as e:
            raise CheckpointError(f"{where}: {e.strerror or e}") from None

    def _step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def all_steps(self) -> list[int]:
        """Steps orbax finalised, complete or not, oldest first."""
        return sorted(self._mgr.all_steps())

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints (manifest present, sizes match), oldest first."""
        return [s for s in self.all_steps() if verify_step(self._step_dir(s), full=False) is None]

    def latest_valid_step(self) -> int | None:
        """Newest checkpoint that passes the full check; newer broken ones are skipped with a
        warning (and quarantined when writable)."""
        for step in reversed(self.all_steps()):
            why = verify_step(self._step_dir(step))
            if why is None:
                return step
            self._reject(step, why)
        return None

    def _reject(self, step: int, why: str) -> None:
        note = ""
        if self.writable and jax.process_index() == 0:  # one host moves it; all skip it
            dest = self.directory / QUARANTINE / f"{step}-{time.time_ns()}"
            try:
                dest.parent.mkdir(exist_ok=True)
                os.replace(self._step_dir(step), dest)
                note = f"; moved to {dest}"
                self._mgr.reload()
            except OSError as e:
                note = f"; could not move it aside ({e.strerror or e})"
        warnings.warn(
            f"checkpoint step {step} in {self.directory} is incomplete or corrupted: {why}; "
            f"skipped, not loaded{note}",
            CheckpointWarning,
            stacklevel=3,
        )

    def due(self, step: int, force: bool = False) -> bool:
        """Whether :meth:`save` would write at ``step``."""
        return force or step % self.every == 0

    def save(self, step: int, state: Any, meta: dict[str, Any], force: bool = False) -> bool:
        """Start writing ``state`` at ``step`` (when due, or always with ``force``); returns
        once the state is copied off the training buffers, not when its bytes are on disk.

        A save still in flight is waited for first (:meth:`wait`), so at most one runs. A state
        with a non-finite value is refused; a failed write (full or read-only disk) raises a
        one-line :class:`CheckpointError` — here, or from the next :meth:`save`, :meth:`wait`
        or :meth:`close` when it failed in the background — and leaves the previous
        checkpoints as they were (the partial step is removed).
        """
        if not self.due(step, force):
            return False
        if not bool(_all_finite(state)):
            raise CheckpointError(f"step {step}: refusing to checkpoint a non-finite state")
        self.wait()
        if self.asynchronous:
            state = _copied(state)
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        try:
            with _held_logs():
                saved = bool(self._mgr.save(step, args=args, force=force))
        except Exception as e:  # orbax and tensorstore wrap I/O errors in various types
            self._raise_failed(step, e)
        if saved:
            self._thread = threading.Thread(
                target=self._finish, args=(step,), name=f"jaxpar-save-{step}", daemon=True
            )
            self._thread.start()
            if not self.asynchronous:
                self.wait()
        return saved

    def _finish(self, step: int) -> None:
        """Background: wait until orbax has finalised ``step``, then seal it with the manifest."""
        try:
            with _held_logs():
                self._mgr.wait_until_finished()
                if jax.process_index() == 0:
                    if delay := float(os.environ.get(SAVE_DELAY_ENV, "0") or 0):
                        time.sleep(delay)
                    write_manifest(self._step_dir(step))
        except BaseException as e:  # noqa: BLE001  (re-raised by wait() in the caller's thread)
            self._error = (step, e)

    def wait(self) -> None:
        """Block until the save in flight (if any) is final, its manifest written; raises its
        one-line :class:`CheckpointError` if it failed."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        if self._error is not None:
            (step, e), self._error = self._error, None
            self._raise_failed(step, e)

    def _raise_failed(self, step: int, e: BaseException) -> None:
        self._broken = True  # orbax keeps the failure and raises it again on close()
        _quiet_orphaned_tasks()
        self._discard(step)
        raise CheckpointError(
            f"checkpoint_dir={str(self.directory)!r}: saving step {step} failed: "
            f"{_io_reason(e)}; earlier checkpoints are untouched (complete: {self.steps()})"
        ) from e

    def _discard(self, step: int) -> None:
        """Remove a step whose save failed (best effort: a full disk may refuse even that)."""
        shutil.rmtree(self._step_dir(step), ignore_errors=True)
        for tmp in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
            shutil.rmtree(tmp, ignore_errors=True)
        try:
            self._mgr.reload()
        except Exception:  # noqa: BLE001  (the directory is already in trouble; keep the cause)
            pass

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON record of a checkpoint."""
        out = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def check_shapes(self, step: int, abstract_state: Any) -> None:
        """Refuse a checkpoint whose stored parameter arrays differ from the configured ones,
        naming the first mismatching parameter and both shapes (read from orbax metadata)."""
        try:
            stored = self._mgr.item_metadata(step)["state"].tree["params"]
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory}: no jaxpar parameter tree "
                f"({type(e).__name__}); is this a jaxpar checkpoint directory?"
            ) from None
        saved = {_path(k): tuple(m.shape) for k, m in jax.tree.leaves_with_path(stored)}
        mine = {
            _path(k): tuple(a.shape) for k, a in jax.tree.leaves_with_path(abstract_state["params"])
        }
        for name in sorted(saved.keys() | mine.keys()):
            a, b = saved.get(name), mine.get(name)
            if a != b:
                raise CheckpointError(
                    f"checkpoint step {step} in {self.directory}: parameter {name} has shape "
                    f"{a if a is not None else 'absent'} in the checkpoint but "
                    f"{b if b is not None else 'absent'} in the configured model; use another "
                    "--checkpoint-dir or the matching --model"
                )

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """Read a checkpoint into the shardings carried by ``abstract_state``."""
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
        )
        out = self._mgr.restore(step, args=args)
        return out["state"], dict(out["meta"])

    def close(self) -> None:
        """Wait for the save in flight (:meth:`wait`), then release the manager."""
        try:
            self.wait()
        finally:
            try:
                with _held_logs():
                    self._mgr.close()
            except Exception:
                if not self._broken:  # a failure already raised in one line: not twice
                    raise


def _path(keypath: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)


def check_model_matches(meta: dict[str, Any], model: ModelConfig) -> None:
    """Refuse a checkpoint written for another model shape, naming the first difference."""
    saved = meta.get("model", {})
    mine = dataclasses.asdict(model)
    for f in MODEL_SHAPE_FIELDS:
        if f in saved and saved[f] != mine[f]:
            raise CheckpointError(
                f"checkpoint model.{f}={saved[f]!r} does not match the configured "
                f"model.{f}={mine[f]!r}; use another --checkpoint-dir or the matching --model"
            )
