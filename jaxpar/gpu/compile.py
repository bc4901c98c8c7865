"""Compile the train step a GPU pod would run, on any machine, and read the GPU program.

:func:`compile_step` builds jaxpar's own mesh (:func:`jaxpar.devices.make_mesh`) over the
target's compile-only devices and compiles :meth:`jaxpar.train.step.Trainer.compile_step`
unchanged: the same shardings, precision, remat, schedule and attention choice (``auto`` reads
the mesh's devices: cuDNN where it applies). :func:`report` puts the GPU program's figures beside
the planner's for the same layout: memory per device, collective wire bytes per mesh axis, and
which of them the scheduler overlapped (:mod:`jaxpar.analysis.hlo_gpu`).

XLA reads ``XLA_FLAGS`` once per process, when a backend starts, and aborts on a name it does
not know: :func:`apply_flags` checks every name against the plugin's binary first and must run
before the first GPU target of the process is created (:attr:`Compiled.flags_effective` says
whether it did).
"""

from __future__ import annotations

import functools
import mmap
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxpar.config import RunConfig
from jaxpar.errors import ConfigError
from jaxpar.gpu.targets import Target, quiet_native_stderr

if TYPE_CHECKING:
    from jaxpar.analysis.hlo_text import Module

_STARTED = {"gpu": False}  # whether this process created a GPU target (XLA_FLAGS read then)


@dataclass
class XlaFlags:
    """The flags in ``XLA_FLAGS`` when the GPU compiler started, and where they came from."""

    applied: list[str]  # everything XLA_FLAGS held
    from_mesh: list[str]  # added from the mesh file's hardware.xla_flags
    overridden: list[str]  # mesh flags whose name the user's XLA_FLAGS already set


def _binary(module: str) -> Path:
    import importlib.util

    # jax_cuda12_plugin's XLA lives in its PJRT package, jax_plugins.xla_cuda12.
    spec = importlib.util.find_spec(f"jax_plugins.xla_{module.split('_')[1]}")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"GPU target: {module}'s PJRT plugin (its XLA) is not installed")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.so"))
    if not found:
        raise ConfigError(f"GPU target: no XLA library in {spec.submodule_search_locations[0]}")
    return found[0]


def unknown_flags(flags: list[str], library: Path) -> list[str]:
    """The flags whose name the XLA library does not hold as a whole word (it would abort on
    them). The binary stores flag names NUL-terminated or run together (``...filexla_gpu_...``),
    so a name counts when it is followed by neither a name character nor only by ``xla_``."""
    names = {f: f.split("=", 1)[0].lstrip("-") for f in flags}
    if not names:
        return []
    alts = b"|".join(re.escape(n.encode()) for n in sorted(set(names.values()), key=len)[::-1])
    word = re.compile(b"(" + alts + b")(?:(?![a-z0-9_])|(?=xla_))")
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        found = {x.group(1).decode() for x in word.finditer(m)}
    return [f for f in flags if names[f] not in found]


def apply_flags(mesh_flags: list[str], plugin_module: str, env: dict | None = None) -> XlaFlags:
    """Check the mesh's flags (and the user's ``XLA_FLAGS``) against the plugin's XLA, then add
    the mesh's to ``XLA_FLAGS``; the user's own settings win. Unknown names are refused."""
    from jaxpar.distributed import apply_xla_flags

    env = os.environ if env is None else env
    have = env.get("XLA_FLAGS", "").split()
    bad = unknown_flags([f for f in [*mesh_flags, *have] if f.startswith("--xla_gpu")],
                        _binary(plugin_module))  # fmt: skip
    if bad:
        where = "hardware.xla_flags" if bad[0] in mesh_flags else "XLA_FLAGS"
        raise ConfigError(f"{where}: {bad[0]!r}: not a flag of the installed {plugin_module}'s XLA")
    # Values as XLA parses them (the plugin's XLA aborts on one it cannot read, printing
    # nothing a user would read); names are the plugin's, checked above.
    from jaxpar.preflight import check_xla_values

    check_xla_values([(f, "XLA_FLAGS") for f in have] + [(f, "hardware.xla_flags") for f in
                      mesh_flags if f not in have], known_names=False)  # fmt: skip
    scratch = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": env.get("XLA_FLAGS", "")}
    added = apply_xla_flags("gpu", list(mesh_flags), scratch)
    env["XLA_FLAGS"] = scratch["XLA_FLAGS"]
    overridden = [f for f in mesh_flags if f not in added]
    return XlaFlags(env["XLA_FLAGS"].split(), added, overridden)


@dataclass
class Compiled:
    """A train step compiled for a GPU target."""

    compiled: Any  # jax.stages.Compiled
    mesh: Any
    trainer: Any
    target: Target
    attention: str  # what model.attention resolved to on the target
    seconds: float
    flags: XlaFlags
    flags_effective: bool  # False: a GPU target already existed, XLA_FLAGS was read before

    @functools.cached_property
    def program(self) -> Module:
        """The optimized HLO (:func:`~jaxpar.analysis.hlo_text.program_text`), printed and
        parsed once: every figure of the report (:mod:`jaxpar.gpu.report`) reads it."""
        from jaxpar.analysis.hlo_text import parse, program_text

        return parse(program_text(self.compiled))


def compile_step(cfg: RunConfig, target: Target, flags: XlaFlags) -> Compiled:
    """Compile ``cfg``'s train step for ``target`` (nothing executes on its devices)."""
    effective = not _STARTED["gpu"]
    devices = target.devices()
    _STARTED["gpu"] = True
    from jaxpar.devices import make_mesh
    from jaxpar.model.attention import implementation_for
    from jaxpar.train.step import Trainer

    attention = implementation_for(cfg, devices[0])  # refuses e.g. a forced kernel it lacks
    mesh = make_mesh(cfg.layout, devices=devices)
    trainer = Trainer(cfg, mesh)
    t0 = time.perf_counter()
    with quiet_native_stderr():
        compiled = trainer.compile_step()
    seconds = time.perf_counter() - t0
    return Compiled(compiled, mesh, trainer, target, attention, seconds, flags, effective)


def planner_traffic(cfg: RunConfig) -> dict[str, float]:
    """The planner's wire bytes per device per step for each mesh axis of ``cfg``'s layout:
    its communication terms (:mod:`jaxpar.planner.comm`), by the axis each runs over."""
    from jaxpar.planner.search import evaluate
    from jaxpar.planner.workload import Shape

    shape = Shape(cfg.train.global_batch, cfg.train.seq_len)
    cost = evaluate(cfg.model, cfg.mesh.hardware, cfg.layout, shape).cost
    axis = {"dp_comm": "dp", "tp_comm": "tp", "sp_comm": "sp", "pp_p2p": "pp"}
    out = dict.fromkeys(("dp", "tp", "sp", "pp"), 0.0)
    for term in cost.comm:
        if term.name in axis:
            out[axis[term.name]] += term.bytes
    return out
