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
file it locked is still the one at the path (another run may have removed it meanwhile).
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import socket
import sys
import time
import warnings
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

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _read(path: Path) -> dict[str, Any] | None:
    for _ in range(20):  # the holder may be between truncate and write
        try:
            text = path.read_text()
        except OSError:
            return None
        if text.strip():
            try:
                return json.loads(text)
            except ValueError:
                pass
        time.sleep(0.01)
    return None


def _read_fd(fd: int) -> Any:
    size = os.fstat(fd).st_size
    text = os.pread(fd, size, 0).decode(errors="replace") if size else ""
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except ValueError:
        return "unreadable"
