"""One run per output directory: an exclusive lock file naming its holder.

A run takes ``<checkpoint_dir>/jaxpar.lock`` (and ``<metrics_file>.lock`` when its metrics go
elsewhere) before it opens anything for writing, so a second run into the same directory is
refused before it compiles, in one line naming the holder — instead of deleting the first
run's half-written step and interleaving its metrics. Process 0 holds it for a multi-process
run (:func:`jaxpar.train.loop.run` makes every process agree on the outcome).

Mechanism, in two layers:

- ``fcntl.flock`` on the open lock file: exclusive, and released by the kernel when the holder
  dies however it dies (also SIGKILL), so a crash never leaves a live-looking lock on this
  host;
- the file's content: the holder's host name, PID, process start time and command line, to
  name it in the refusal and to judge a lock whose ``flock`` is free but whose file remains
  (the holder was killed): a dead process on this host (its PID gone, or reused by a process
  started later) is taken over with a :class:`~jaxpar.errors.JaxparWarning`; a record from
  another host is never taken over, because from here it cannot be told alive (``flock`` does
  not reach across every network file system): the refusal says which file to delete.

The holder removes the file when it finishes. Acquisition re-checks, after ``flock``, that the
file it locked is still the one at the path (another run may have removed it meanwhile);
a SIGTERM/SIGINT handled by :func:`abort_on_signal` is deferred while it runs, so it never lands
between taking the lock and recording it.

Every other output (token files and sidecars, tokenizers, metrics files, exported Hugging Face
directories) is owned the same way: :func:`output_lock` locks ``<output>.lock`` beside it, and
the bytes go to a temporary name unique to the run (:func:`temp_name`) that is moved into place
in one rename (:func:`write_atomic`, :func:`replace_dir`), so a reader sees the old output or the
new one, never a mixture. :func:`abort_on_signal` makes a SIGTERM/SIGINT before training starts
end the run through its ``finally`` blocks (locks released) instead of killing it on the spot.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxpar.errors import CheckpointError, JaxparWarning

LOCK_NAME = "jaxpar.lock"


class LockWarning(JaxparWarning):
    """A stale lock of a dead run was taken over."""


def _proc_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (Linux), to tell a reused PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    now = _proc_start(pid)
    return start is None or now is None or now == start


def describe(record: dict[str, Any]) -> str:
    """``host h, pid 12, started 2025-01-01T00:00:00Z: jaxpar train ...`` (for messages)."""
    cmd = record.get("command") or "?"
    if len(cmd) > 120:
        cmd = cmd[:117] + "..."
    return (
        f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, started "
        f"{record.get('started', '?')}: {cmd}"
    )


_HELD: set[RunLock] = set()  # the locks this process holds, for release_all()


def release_all() -> None:
    """Release every lock this process holds (a process about to ``os._exit``)."""
    for lock in list(_HELD):
        lock.release()


class RunLock:
    """Exclusive lock file at ``path``; ``what`` names the guarded setting in messages."""

    def __init__(self, path: str | Path, what: str):
        self.path = Path(path).absolute()
        self.what = what
        self._fd: int | None = None

    def _record(self) -> dict[str, Any]:
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "proc_start": _proc_start(os.getpid()),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": shlex.join(["jaxpar", *sys.argv[1:]]),
        }

    def _refuse(self, record: dict[str, Any] | None, why: str) -> CheckpointError:
        holder = describe(record) if record else "a run whose record is being written"
        return CheckpointError(f"{self.what}: in use by another run ({holder}); {why}")

    def acquire(self) -> RunLock:
        """Take the lock or raise :class:`CheckpointError` naming the holder."""
        try:
            with _signals_held():
                return self._acquire()
        except BaseException:  # e.g. a held-back signal raised on the way out: not kept
            self.release()
            raise

    def _acquire(self) -> RunLock:
        for _ in range(10):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise CheckpointError(
                    f"{self.what}: cannot create the lock {self.path}: {e.strerror or e}"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _read(self.path)
                os.close(fd)
                raise self._refuse(
                    record, "wait for it to finish or choose another directory"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the holder removed the file between our open and our flock
                os.close(fd)
                continue
            record = _read_fd(fd)
            try:
                self._judge(record)
            except BaseException:
                os.close(fd)
                raise
            data = (json.dumps(self._record()) + "\n").encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
            self._fd = fd
            _HELD.add(self)
            return self
        raise CheckpointError(f"{self.what}: could not take the lock {self.path} (contended)")

    def _judge(self, record: dict[str, Any] | None) -> None:
        """A lock file whose ``flock`` is free: empty, stale, or held from another host."""
        if record is None:
            return
        if not isinstance(record, dict) or "pid" not in record:
            warnings.warn(
                f"{self.what}: unreadable lock {self.path} with no live holder; taken over",
                LockWarning,
                stacklevel=3,
            )
            return
        if record.get("host") != socket.gethostname():
            raise self._refuse(
                record,
                "it is on another host, so it is not taken over; if that run is gone, "
                f"delete {self.path}",
            )
        pid = record.get("pid")
        if isinstance(pid, int) and pid != os.getpid() and _alive(pid, record.get("proc_start")):
            raise self._refuse(record, "its lock is not held but the process lives; "
                               f"if it is not a jaxpar run, delete {self.path}")  # fmt: skip
        warnings.warn(
            f"{self.what}: taking over the stale lock of a run that is gone ({describe(record)})",
            LockWarning,
            stacklevel=3,
        )

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        try:
            if os.fstat(self._fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()  # before unlocking: a waiter then sees the file is gone
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
        _HELD.discard(self)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


_SIGNALS = (signal.SIGTERM, signal.SIGINT)


_deferred: list[int] = []  # signals abort_on_signal's handler held back inside _signals_held
_depth = 0


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """While the block runs, :func:`abort_on_signal`'s handler defers its exception (a signal
    mask would not do: another thread of the process takes the signal and the main thread runs
    the handler at its next bytecode); it is raised when the block ends, by which time the
    lock is recorded (and :meth:`RunLock.acquire` releases it again)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth and _deferred:
            raise Interrupted(_deferred.pop())


class Interrupted(CheckpointError):
    """A SIGTERM/SIGINT that ends the run at once: before training started (nothing was run
    or saved: the default ``message``), or a second signal during training, whose message the
    loop writes (:func:`jaxpar.train.loop.run`: the step reached, the checkpoint kept)."""

    def __init__(self, signum: int, message: str | None = None):
        self.signum = signum
        self.exit_code = 128 + signum  # the shell's convention for a process ended by a signal
        name = signal.Signals(signum).name
        super().__init__(
            message or f"stopped by {name} before training started; no step was run or saved"
        )


@contextlib.contextmanager
def abort_on_signal() -> Iterator[None]:
    """While the block runs, SIGTERM/SIGINT raise :class:`Interrupted` (so ``finally`` blocks
    release locks and remove temporary files) instead of killing the process; the training
    loop's own handler (:class:`jaxpar.train.guard.StopRequest`) takes over while it steps and
    restores this one after. A multi-process run leaves SIGTERM to JAX's preemption service
    (installed by ``jax.distributed.initialize``), which stops every process at an agreed step.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: Any) -> None:
        if _depth:  # inside a lock's acquisition: raised when it is recorded
            _deferred.append(signum)
            return
        raise Interrupted(signum)

    import jax

    sigs = _SIGNALS if jax.process_count() == 1 else (signal.SIGINT,)
    previous = {s: signal.signal(s, handle) for s in sigs}
    before = set(_HELD)
    try:
        yield
    except BaseException:
        # a signal between a lock's acquire and its owner noting it: release it here
        for lock in _HELD - before:
            lock.release()
        raise
    finally:
        for s, h in previous.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)


def output_lock(path: str | Path, what: str) -> RunLock:
    """The lock of one output file or directory: ``<path>.lock`` beside it, taken."""
    p = Path(path).absolute()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{what}: cannot create {p.parent}: {e.strerror or e}") from None
    return RunLock(p.with_name(p.name + ".lock"), what).acquire()


def temp_name(path: str | Path) -> Path:
    """A hidden name beside ``path`` unique to this process (host and pid): two runs never
    write the same temporary file, and a crash's leftovers are recognisable."""
    p = Path(path)
    return p.with_name(f".{p.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def write_atomic(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to :func:`temp_name`, fsync, rename over ``path``; the temporary file is
    removed on any failure (a full disk leaves the old file as it was)."""
    p = Path(path)
    tmp = temp_name(p)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return p


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished directory ``tmp`` to ``final``, replacing what was there whole: the old
    directory is renamed aside first and removed after, so ``final`` never mixes the two."""
    old = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f".{final.name}.old-{socket.gethostname()}-{os.getpid()}")
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _read(path: Path) -> dict[str, Any] | None:
    for _ in range(20):  # the holder may be between truncate and write
        try:
            text = path.read_text()
        except OSError:
            return None
        if text.strip():
            try:
                record = json.loads(text)
            except (ValueError, RecursionError):
                pass
            else:  # a record is a mapping; anything else names no holder
                return record if isinstance(record, dict) else None
        time.sleep(0.01)
    return None


def _read_fd(fd: int) -> Any:
    size = os.fstat(fd).st_size
    text = os.pread(fd, size, 0).decode(errors="replace") if size else ""
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except (ValueError, RecursionError):
        return "unreadable"
    return record if isinstance(record, dict) else "unreadable"
