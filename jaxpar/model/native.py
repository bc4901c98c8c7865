"""The attention core as a native XLA:CPU kernel: causal grouped-query flash attention in C++.

XLA:CPU runs a batched matmul's batch on one thread and does not run loops side by side, so the
blockwise kernel (:mod:`jaxpar.model.flash`) leaves every core but one idle while its tiles
run. ``jaxpar/native/flash_cpu.cc`` holds the same math
(FlashAttention-2: the forward keeps the log-sum-exp, the backward recomputes the tiles) as two
XLA FFI handlers that split the (batch row, kv head) pairs over XLA's intra-op thread pool.

Build. On first use the source is compiled with the machine's C++ compiler (``$CXX``, else
``g++``, ``c++`` or ``clang++`` on the PATH; ``-O3 -march=native``, against the XLA FFI headers
that jaxlib ships) into ``$JAXPAR_CACHE_DIR/native`` (default ``~/.cache/jaxpar/native``),
one file per source, compiler, jax version and host, written under a temporary name and renamed
into place so that concurrent processes never load a half-written library. The cache directory
is created private to the user (0700) and used only if it still is (owned by the user, writable
by no one else); beside each library its SHA-256, written by the build, is checked before the
library is loaded, so a library that this jaxpar did not build is never loaded (a mismatch
rebuilds it). Without a compiler, with a cache that cannot be written or is not private, or
when the build fails, :func:`unavailable` says why, ``model.attention=auto`` keeps the
blockwise kernel with one warning line (:func:`usable`) and a forced ``native`` is refused in
one line.

Why on first use and not as an extension built at install (scikit-build-core and nanobind, as
JAX's FFI examples ship theirs): the kernel is tuned with ``-march=native`` for the CPU that runs
it, which on a cluster is not the machine that ran ``pip install``; it compiles against the FFI
headers of the jaxlib installed now, and jaxlib can be upgraded under an installed jaxpar (the
cache key holds the jax version, so an upgrade rebuilds); and an install-time build would make
every install need a C++ toolchain for a kernel that only CPU runs use and that is optional
anyway (the blockwise kernel computes the same values).

Envelope: CPU, float32, head dim 16, 32, 64 or 128. Under a mesh the kernel runs per device in a
``jax.shard_map`` over the mesh axes that shard its operands (batch over dp, heads over tp, as
the layout's rules say), so GSPMD never gathers q, k or v for it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import ConfigError, JaxparWarning
from jaxpar.sharding import active_rules

SOURCE = Path(__file__).resolve().parent.parent / "native" / "flash_cpu.cc"
HEAD_DIMS = (16, 32, 64, 128)
_FWD, _BWD = "jaxpar_flash_cpu_forward", "jaxpar_flash_cpu_backward"


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    return next((p for c in ("g++", "c++", "clang++") if (p := shutil.which(c))), None)


def _cache_dir() -> Path:
    root = os.environ.get("JAXPAR_CACHE_DIR") or Path.home() / ".cache" / "jaxpar"
    return Path(root) / "native"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _private_dir(path: Path) -> str | None:
    """Create ``path`` (0700) if needed; why it cannot hold libraries to load, or None."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError as e:
        return f"cache directory {path} cannot be created: {e.strerror or e}"
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"cache directory {path} is not private to this user (owner or mode); not used"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"cache directory {path} is not writable"
    return None


@functools.cache
def _build() -> tuple[Path | None, str | None]:
    """``(library, None)`` once built (or found with the hash its build recorded), or
    ``(None, reason)``."""
    cxx = _compiler()
    if cxx is None:
        return None, "no C++ compiler found ($CXX, g++, c++ or clang++)"
    flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w"]
    key = hashlib.sha256(
        b"\0".join(
            [
                SOURCE.read_bytes(),
                cxx.encode(),
                " ".join(flags).encode(),
                jax.__version__.encode(),
                platform.node().encode(),
                platform.machine().encode(),
            ]
        )
    ).hexdigest()[:16]
    lib = _cache_dir() / f"flash_cpu-{key}.so"
    digest = lib.with_name(lib.name + ".sha256")
    why = _private_dir(lib.parent)
    if why is not None:
        return None, why
    try:
        if lib.exists() and digest.exists() and digest.read_text().strip() == _sha256(lib):
            return lib, None
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
    except OSError as e:
        return None, f"cache directory {lib.parent}: {e.strerror or e}"
    cmd = [cxx, *flags, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["(no output)"])[0]
            return None, f"compiling {SOURCE.name} with {cxx} failed: {first}"
        # the hash first: a library without its recorded hash is never loaded
        from jaxpar.lock import write_atomic

        write_atomic(digest, (_sha256(Path(tmp)) + "\n").encode())
        os.replace(tmp, lib)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"compiling {SOURCE.name} failed: {getattr(e, 'strerror', None) or e}"
    finally:
        Path(tmp).unlink(missing_ok=True)
    return lib, None


@functools.cache
def _register() -> str | None:
    """Build and register the two FFI targets once; the reason when that is impossible."""
    lib, why = _build()
    if lib is None:
        return why
    try:
        so = ctypes.CDLL(str(lib))
        for name, sym in ((_FWD, so.JaxparFlashCpuForward), (_BWD, so.JaxparFlashCpuBackward)):
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(sym), platform="cpu")
    except (OSError, AttributeError) as e:
        return f"loading {lib} failed: {e}"
    return None


def unavailable() -> str | None:
    """Why the native kernel cannot run in this process (None: it can)."""
    return _register()


@functools.cache
def usable() -> bool:
    """Whether ``model.attention=auto`` can pick the native kernel; when it cannot, one
    warning line (once per process) says why and that the blockwise kernel runs instead."""
    why = unavailable()
    if why is not None:
        warnings.warn(
            f"model.attention=auto: the native CPU kernel is not available ({why}); running "
            "the blockwise kernel",
            JaxparWarning,
            stacklevel=2,
        )
    return why is None


def applies(platform_name: str, dtype, head_dim: int) -> str | None:
    """Why the native kernel does not apply to this platform, dtype and head dim (None: it
    does, if :func:`unavailable` agrees)."""
    if platform_name != "cpu":
        return f"the native kernel runs on CPU only; this run is on {platform_name}"
    if jnp.dtype(dtype) != jnp.dtype(jnp.float32):
        return (
            "the native kernel computes in float32 only; this run computes in "
            f"{jnp.dtype(dtype).name}"
        )
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim}: the native kernel takes {', '.join(map(str, HEAD_DIMS))}"
    return None


# --------------------------------------------------------------------------------------------
# The core


def _threaded() -> np.bool_:
    """Whether the kernel splits its tasks over XLA's intra-op pool: only in a one-device
    process. With several (simulated) devices their programs already share the cores, and that
    pool also runs their thunks, collectives included. Threaded there, the default ``jaxpar
    train`` job (pp 2 · dp 2 · tp 2 on 8 simulated devices) once stalled in a collective
    rendezvous; later runs forced threaded ran clean but no faster than serial. No gain, and a
    stall whose cause is unknown, so several devices run each call serially."""
    return np.bool_(jax.device_count() == 1)


def _forward(q, k, v):
    b, s, h, _ = q.shape
    o, lse = jax.ffi.ffi_call(
        _FWD, (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, s), q.dtype))
    )(q, k, v, threaded=_threaded())
    return o, (q, k, v, o, lse)


def _backward(res, do):
    q, k, v, o, lse = res
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    return tuple(jax.ffi.ffi_call(_BWD, shapes)(q, k, v, o, lse, do, threaded=_threaded()))


@jax.custom_vjp
def _local(q_BxSxHxDh: jax.Array, k_BxSxKxDh: jax.Array, v_BxSxKxDh: jax.Array) -> jax.Array:
    return _forward(q_BxSxHxDh, k_BxSxKxDh, v_BxSxKxDh)[0]


_local.defvjp(_forward, _backward)


def flash_attention(
    q_BxSxHxDh: jax.Array, k_BxSxKxDh: jax.Array, v_BxSxKxDh: jax.Array
) -> jax.Array:
    """Causal grouped-query attention (H = K·G, query head h reads kv head h // G), fp32.

    Saves q, k, v, o and the log-sum-exp for the backward, as the blockwise kernel does. Under
    active sharding rules it runs per device (``shard_map`` over the axes that shard q, k, v).
    """
    why = unavailable()
    if why is not None:
        raise ConfigError(f"model.attention='native': {why}")
    rules = active_rules()
    if rules is None:
        return _local(q_BxSxHxDh, k_BxSxKxDh, v_BxSxKxDh)
    if rules.attention == "ring":  # resolve() never picks it there: each device needs all keys
        raise ConfigError("model.attention='native': the sequence is sharded (ring attention)")
    # The layouts the Ulysses wrapper constrained q, k and v to (attention.ulysses).
    q_spec = rules.spec(("batch", "attn_seq", "attn_heads", "head_dim"))
    kv_spec = rules.spec(("batch", "attn_seq", "attn_kv_heads", "head_dim"))
    axes = {
        a for part in (*q_spec, *kv_spec) if part
        for a in (part if isinstance(part, tuple) else (part,))
    }  # fmt: skip
    if not axes:
        return _local(q_BxSxHxDh, k_BxSxKxDh, v_BxSxKxDh)
    # check_vma off: the FFI results carry no varying-axes type for the custom VJP to match.
    fn = jax.shard_map(
        _local,
        in_specs=(q_spec, kv_spec, kv_spec),
        out_specs=q_spec,
        axis_names=axes,
        check_vma=False,
    )
    return fn(q_BxSxHxDh, k_BxSxKxDh, v_BxSxKxDh)
