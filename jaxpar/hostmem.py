"""Host memory for XLA CPU: keep each execution's buffers in the heap, not in fresh pages.

XLA's CPU runtime allocates the temporaries of every execution as one block (530 MB for the
train step of the 4-layer d-256 Llama at batch 16 × 256) with ``posix_memalign``, from one of
its worker threads. glibc serves a block that large from a worker thread's arena with a fresh
``mmap`` (a thread arena grows in 64 MiB heaps at most) and unmaps it on free, so every step
page-faults its whole temporary buffer again: 140 thousand minor faults and about 0.29 s of
kernel time per 0.9 s step on 2 cores, measured with ``getrusage``.

:func:`keep_host_buffers` sets three ``mallopt`` parameters so those blocks are reused:

- ``M_ARENA_MAX = 1``: every thread allocates from the main arena, the only one that grows with
  ``brk`` past 64 MiB (it must be set before JAX starts its thread pool: a thread keeps the arena
  it got on its first allocation);
- ``M_MMAP_MAX = 0``: no block is served by its own ``mmap``;
- ``M_TRIM_THRESHOLD = 2**31 - 1``: a free block at the top of the heap is returned to the
  system only above 2 GiB, so the next step finds its pages mapped.

The costs: memory freed below that size stays with the process (its peak is what it held
anyway), and XLA's compile threads share the one arena's lock (that step compiled in
8.1 s against 6.3 s), which about 12 of its faster steps pay back. PyTorch's eager CPU step of
the same shape faults 47 MB and spends 0.037 s in the kernel per step: its activations are
separate blocks of tens of MB from the main thread, which glibc's adaptive ``mmap`` threshold
keeps in the heap after the first step.

Only for glibc (Linux) and only for CPU runs; ``JAXPAR_HOST_ALLOCATOR=system`` keeps glibc's
defaults.
"""

from __future__ import annotations

import ctypes
import os
import sys

from jaxpar.errors import ConfigError

# mallopt(3) parameter numbers from glibc's malloc.h.
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int
ENV = "JAXPAR_HOST_ALLOCATOR"

_state: str | None = None


def backend_started() -> bool:
    """Whether JAX has started a backend in this process (then its threads have their malloc
    arenas, and the device count is fixed)."""
    import jax._src.xla_bridge as xb  # private, but the only reliable probe; imported late so
    # that importing this module does not import JAX (the CLI's start-up)

    return bool(getattr(xb, "_backends", None))


def glibc() -> bool:
    """Whether this process runs on glibc (the only allocator :func:`keep_host_buffers` tunes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError):
        return False


def keep_host_buffers() -> str:
    """Make glibc keep XLA CPU's per-execution buffers mapped between executions.

    Call before JAX starts its backend (``jaxpar.devices.simulate_cpu_devices`` does). Returns
    what happened, for the run summary: ``"kept"`` (applied before JAX started), ``"late"``
    (applied, but JAX's threads already had their arenas, so blocks they allocate may still be
    mapped afresh), ``"system"`` (turned off with ``JAXPAR_HOST_ALLOCATOR=system``) or
    ``"unsupported"`` (not glibc). Calling it again returns the first answer.
    """
    global _state
    if _state is not None:
        return _state
    choice = os.environ.get(ENV, "keep")
    if choice not in ("keep", "system"):
        raise ConfigError(f"{ENV}={choice!r}: must be 'keep' (the default) or 'system'")
    if choice == "system":
        _state = "system"
    elif not glibc():
        _state = "unsupported"
    else:
        late = backend_started()
        libc = ctypes.CDLL(None)
        ok = all(
            libc.mallopt(param, value) == 1
            for param, value in (
                (_M_ARENA_MAX, 1),
                (_M_MMAP_MAX, 0),
                (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            )
        )
        _state = "unsupported" if not ok else ("late" if late else "kept")
    return _state


def state() -> str | None:
    """What :func:`keep_host_buffers` did in this process, or None when it was not called."""
    return _state
