"""A compiled GPU step on disk (``jaxpar compile --save FILE``), and its checked load.

The file is three lines and a body::

    jaxpar-gpu-executable/2                  the format and its version
    sha256:<64 hex digits>                   the checksum of everything after this line
    {"versions": ..., "target": ..., "run": ...}   the header, one JSON line
    <pickle of (payload, in_tree, out_tree)>

``payload`` and the trees are ``jax.experimental.serialize_executable.serialize``'s; the header
records jaxpar's and jax's versions, the target's :meth:`~jaxpar.gpu.targets.Target.describe`
and the run's model and layout. :func:`read` refuses, in one line and before unpickling
anything, a file that is not one (empty, another format, another version of this one) and one
that was truncated or altered (its checksum). :func:`load` then checks the header against the
target the installed plugin gives for the recorded GPU kind and topology (a different GPU,
topology, plugin or jax is refused in one line), unpickles the payload's argument shapes and
shardings onto the target's devices and hashes the executable. Loading the executable itself
needs the GPU runtime: on a machine with NVIDIA GPUs :func:`load` returns it ready to call; on a
compile-only machine XLA cannot deserialize it (``DeserializeLoadedExecutable`` needs a runtime
client), so ``compiled`` is None and everything else has been checked. The checksum catches
damage, not intent: unpickling runs code, so load only files you wrote.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.gpu.targets import GpuSpec, Target, require_plugin

MAGIC = "jaxpar-gpu-executable"
VERSION = 2
FORMAT = f"{MAGIC}/{VERSION}"
_SUM = re.compile(rb"sha256:([0-9a-f]{64})")
_TOPOLOGY = re.compile(r"1x([1-9][0-9]*)x([1-9][0-9]*)")
_TARGET_KEYS = ("gpu", "topology", "compute_capability", "plugin", "cuda", "cudnn")


@dataclass
class Saved:
    """What a saved file holds."""

    format: str
    versions: dict[str, str]
    target: dict[str, Any]
    run: dict[str, Any]
    payload: bytes
    in_tree: Any
    out_tree: Any
    sha256: str = ""  # the file's checksum (of everything after its checksum line)


@dataclass
class Loaded:
    """A loaded file: the header and what was checked; ``compiled`` needs a GPU runtime."""

    saved: Saved
    args: Any  # the executable's argument shapes and shardings (on the target's devices)
    executables: int
    digest: str
    compiled: Any | None
    why_not_loaded: str | None


def _versions() -> dict[str, str]:
    import jax

    import jaxpar

    return {"jaxpar": getattr(jaxpar, "__version__", "0"), "jax": jax.__version__}


def encode(versions: dict, target: dict, run: dict, body: bytes) -> bytes:
    """A saved file's bytes: format line, checksum line, header line, ``body``."""
    header = json.dumps({"versions": versions, "target": target, "run": run},
                        sort_keys=True, separators=(",", ":")).encode()  # fmt: skip
    rest = header + b"\n" + body
    return f"{FORMAT}\nsha256:{hashlib.sha256(rest).hexdigest()}\n".encode() + rest


def save(path: str | Path, compiled: Any, target: Target, run: dict[str, Any]) -> int:
    """Write ``compiled`` (a ``jax.stages.Compiled`` for ``target``) to a new file ``path``;
    an existing file is refused, and a write that fails leaves no file. Returns the bytes
    written."""
    from jax.experimental import serialize_executable as se

    path = Path(path)
    if path.exists():
        raise ConfigError(f"--save={str(path)!r}: file exists; refusing to overwrite it")
    payload, in_tree, out_tree = se.serialize(compiled)
    body = pickle.dumps((payload, in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)
    data = encode(_versions(), target.describe(), run, body)
    with open(path, "xb") as f:  # "x": never replace a file created meanwhile
        try:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            path.unlink(missing_ok=True)  # no half file left behind (it would be refused anyway)
            raise
    return len(data)


def read(path: str | Path) -> Saved:
    """The saved file at ``path``, checked: its format line, its checksum, its header's keys and
    its body's types. Anything else (empty, truncated, altered, hand-made, another format) is a
    :class:`ConfigError` naming ``--load`` and why, in one line."""
    where = f"--load={str(path)!r}"
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it: {e.strerror or type(e).__name__}") from None
    first, _, rest = data.partition(b"\n")
    if not data:
        raise ConfigError(f"{where}: empty file, not a jaxpar GPU executable")
    if not first.startswith(MAGIC.encode() + b"/"):
        raise ConfigError(
            f"{where}: not a jaxpar GPU executable (its first line is not {FORMAT!r}; a file "
            "saved before that format: compile and --save again)"
        )
    if first != FORMAT.encode():
        shown = first.decode("ascii", "replace")[:40]
        raise ConfigError(f"{where}: format {shown!r}: this jaxpar reads {FORMAT!r}; compile and "
                          "--save again")  # fmt: skip
    line, _, rest = rest.partition(b"\n")
    m = _SUM.fullmatch(line)
    if m is None:
        raise ConfigError(f"{where}: damaged: its second line is not the sha256 checksum")
    if hashlib.sha256(rest).hexdigest() != m.group(1).decode():
        raise ConfigError(
            f"{where}: damaged: its contents ({len(data)} bytes) do not match its sha256 "
            "(truncated or altered); compile and --save again"
        )
    header, _, body = rest.partition(b"\n")
    try:
        meta = json.loads(header)
        versions, target, run = meta["versions"], meta["target"], meta["run"]
        if not (isinstance(versions, dict) and isinstance(target, dict)
                and isinstance(run, dict)):  # fmt: skip
            raise TypeError("versions, target and run must be objects")
        for key in _TARGET_KEYS:
            if not isinstance(target.get(key), str):
                raise TypeError(f"target.{key} must be a string")
        if not _TOPOLOGY.fullmatch(target["topology"]):
            raise ValueError(f"target.topology={target['topology']!r}")
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"{where}: not a jaxpar GPU executable (its header: "
                          f"{type(e).__name__}: {e})") from None  # fmt: skip
    try:
        payload, in_tree, out_tree = pickle.loads(body)
        if not isinstance(payload, bytes) or not payload:
            raise TypeError("payload is not bytes")
        for tree in (in_tree, out_tree):
            if not callable(getattr(tree, "unflatten", None)):
                raise TypeError("no pytree definition")
    except Exception as e:  # a checksummed body that is not jaxpar's (hand-made)
        raise ConfigError(f"{where}: not a jaxpar GPU executable (its body: "
                          f"{type(e).__name__})") from None  # fmt: skip
    return Saved(FORMAT, versions, target, run, payload, in_tree, out_tree,
                 m.group(1).decode())  # fmt: skip


class _Unpickler(pickle.Unpickler):
    """The payload's pickle with devices resolved on the target's compile-only devices and the
    executable kept as bytes (jax's own unpickler would deserialize it, which needs a GPU)."""

    def __init__(self, data: bytes, devices: list):
        super().__init__(io.BytesIO(data))
        self.devices = {d.id: d for d in devices}
        self.client = devices[0].client
        self.executables: list[bytes] = []

    def persistent_load(self, pid):
        kind = pid[0]
        if kind == "exec":
            self.executables.append(pid[1])
            return None
        if kind == "device":
            return self.devices[pid[1]]
        if kind == "client":
            return self.client
        raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")


def _check_header(saved: Saved, target: Target, where: str) -> None:
    if saved.format != FORMAT:
        raise ConfigError(f"{where}: not a jaxpar GPU executable ({FORMAT})")
    want, have = target.describe(), saved.target
    for key in _TARGET_KEYS:
        if have.get(key) != want.get(key):
            raise ConfigError(
                f"{where}: target.{key}={have.get(key)!r}: compiled for another target than "
                f"this machine gives ({want.get(key)!r})"
            )
    if saved.versions.get("jax") != _versions()["jax"]:
        raise ConfigError(f"{where}: jax={saved.versions.get('jax')!r}: saved by another jax")


def load(path: str | Path) -> Loaded:
    """Read and check a saved step (module docstring)."""
    where = f"--load={str(path)!r}"
    saved = read(path)
    t = saved.target
    try:
        spec = GpuSpec.load(t["gpu"])
    except ConfigError:
        raise ConfigError(f"{where}: target.gpu={t['gpu']!r}: not a GPU kind this jaxpar "
                          "knows") from None  # fmt: skip
    hosts, per = (int(x) for x in _TOPOLOGY.fullmatch(t["topology"]).groups())
    target = Target(spec, hosts, per, require_plugin())
    _check_header(saved, target, where)
    devices = target.devices()
    up = _Unpickler(saved.payload, devices)
    try:
        _, args_flat, _ = up.load()
        args = saved.in_tree.unflatten(args_flat)
    except Exception as e:  # checksummed and of this target, yet not what jaxpar writes
        raise ConfigError(f"{where}: not a jaxpar GPU executable (its arguments do not unpickle "
                          f"onto the target's devices: {type(e).__name__})") from None  # fmt: skip
    if not up.executables or not all(isinstance(x, bytes) and x for x in up.executables):
        raise ConfigError(f"{where}: the file holds no executable")
    digest = hashlib.sha256(b"".join(up.executables)).hexdigest()
    compiled, why = None, None
    import jax
    from jax.experimental import serialize_executable as se

    try:
        gpus = jax.devices("cuda")
    except RuntimeError as e:  # no CUDA runtime here: jax has no "cuda" backend
        why = f"no GPU runtime to load it on ({type(e).__name__})"
    else:
        try:
            compiled = se.deserialize_and_load(saved.payload, saved.in_tree, saved.out_tree,
                                               backend=gpus[0].client)  # fmt: skip
        except Exception as e:
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            raise ConfigError(f"{where}: its executable does not load on this GPU "
                              f"({type(e).__name__}: {first})") from None  # fmt: skip
    return Loaded(saved, args, len(up.executables), digest, compiled, why)
