"""A compiled GPU step on disk (``jaxpar compile --save FILE``), and its checked load.

The file is a pickle of :class:`Saved`: a header (format, jaxpar's and jax's versions, the
target's :meth:`~jaxpar.gpu.targets.Target.describe`, the run's model and layout) and
``jax.experimental.serialize_executable.serialize``'s payload with its input/output trees.
:func:`load` checks the header against the target the installed plugin gives for the recorded
GPU kind and topology (a different GPU, topology, plugin or jax is refused in one line), then
unpickles the payload's argument shapes and shardings onto the target's devices and checks the
executable's digest. Loading the executable itself needs the GPU runtime: on a machine with
NVIDIA GPUs :func:`load` returns it ready to call; on a compile-only machine XLA cannot
deserialize it (``DeserializeLoadedExecutable`` needs a runtime client), so ``compiled`` is None
and everything else has been checked. Unpickling runs code: load only files you wrote.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.gpu.targets import GpuSpec, Target, require_plugin

FORMAT = "jaxpar-gpu-executable/1"


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


def save(path: str | Path, compiled: Any, target: Target, run: dict[str, Any]) -> int:
    """Write ``compiled`` (a ``jax.stages.Compiled`` for ``target``) to a new file ``path``;
    an existing file is refused. Returns the bytes written."""
    from jax.experimental import serialize_executable as se

    path = Path(path)
    if path.exists():
        raise ConfigError(f"--save {str(path)!r}: file exists; refusing to overwrite it")
    payload, in_tree, out_tree = se.serialize(compiled)
    saved = Saved(FORMAT, _versions(), target.describe(), run, payload, in_tree, out_tree)
    data = pickle.dumps(saved, protocol=pickle.HIGHEST_PROTOCOL)
    with open(path, "xb") as f:  # "x": never replace a file created meanwhile
        f.write(data)
    return len(data)


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
    if getattr(saved, "format", None) != FORMAT:
        raise ConfigError(f"{where}: not a jaxpar GPU executable ({FORMAT})")
    want, have = target.describe(), saved.target
    for key in ("gpu", "topology", "compute_capability", "plugin", "cuda", "cudnn"):
        if have.get(key) != want.get(key):
            raise ConfigError(
                f"{where}: target.{key}={have.get(key)!r}: compiled for another target than "
                f"this machine gives ({want.get(key)!r})"
            )
    if saved.versions.get("jax") != _versions()["jax"]:
        raise ConfigError(f"{where}: jax={saved.versions.get('jax')!r}: saved by another jax")


def load(path: str | Path) -> Loaded:
    """Read and check a saved step (module docstring)."""
    where = f"--load {str(path)!r}"
    try:
        saved = pickle.loads(Path(path).read_bytes())
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
        raise ConfigError(f"{where}: not a jaxpar GPU executable ({type(e).__name__})") from e
    if not isinstance(saved, Saved):
        raise ConfigError(f"{where}: not a jaxpar GPU executable ({FORMAT})")
    t = saved.target
    hosts, per = (int(x) for x in t["topology"].split("x")[1:])
    target = Target(GpuSpec.load(t["gpu"]), hosts, per, require_plugin())
    _check_header(saved, target, where)
    devices = target.devices()
    up = _Unpickler(saved.payload, devices)
    _, args_flat, _ = up.load()
    if not up.executables or not all(up.executables):
        raise ConfigError(f"{where}: the file holds no executable")
    digest = hashlib.sha256(b"".join(up.executables)).hexdigest()
    args = saved.in_tree.unflatten(args_flat)
    compiled, why = None, None
    try:
        import jax
        from jax.experimental import serialize_executable as se

        gpus = jax.devices("cuda")
        compiled = se.deserialize_and_load(saved.payload, saved.in_tree, saved.out_tree,
                                           backend=gpus[0].client)  # fmt: skip
    except RuntimeError as e:  # no CUDA runtime here: jax has no "cuda" backend
        why = f"no GPU runtime to load it on ({type(e).__name__})"
    return Loaded(saved, args, len(up.executables), digest, compiled, why)
