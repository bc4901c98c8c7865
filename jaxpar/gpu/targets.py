"""GPU targets: the kinds a mesh file's ``hardware.gpu`` names, as XLA:GPU's compiler takes them.

A kind (``a100-sxm4-80gb``, ``h100-sxm5-80gb``, ...) is one YAML file of published device figures
under ``jaxpar/gpu/specs/`` (SMs, clock, memory size and bandwidth, L2, shared memory, compute
capability). :func:`target_config` turns it into the ``GpuTargetConfig`` text proto that
``jax.experimental.topologies.get_topology_desc(platform="cuda", ...)`` takes, with the CUDA and
cuDNN versions the installed plugin was built against (a target must not claim a cuDNN the
plugin's XLA does not know). :func:`target_for` checks a mesh against it (a known kind, devices
that divide into nodes of ``devices_per_node``) and :meth:`Target.devices` gives the devices to
build jaxpar's mesh from; nothing runs on them, everything compiles.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxpar import typed
from jaxpar.config import MeshConfig
from jaxpar.errors import ConfigError

SPECS_DIR = Path(__file__).resolve().parent / "specs"
KINDS = tuple(sorted(p.stem for p in SPECS_DIR.glob("*.yaml")))
# The plugins jaxpar can compile with, newest first: (import name, distribution of its PJRT).
PLUGINS = (("jax_cuda13_plugin", "jax-cuda13-pjrt"), ("jax_cuda12_plugin", "jax-cuda12-pjrt"))
# Lines XLA's CUDA stubs print on a machine without a driver (harmless for compiling).
NOISE = ("cudart_stub.cc", "All log messages before absl::InitializeLog()")


@dataclass(frozen=True)
class GpuSpec:
    """Published figures of one GPU kind (one file of ``jaxpar/gpu/specs``)."""

    kind: str
    name: str  # the device kind XLA reports (``device_description_str``)
    compute_capability: tuple[int, int]
    core_count: int
    fpus_per_core: int
    clock_rate_ghz: float
    device_memory_size: int
    memory_bandwidth: int
    l2_cache_size: int
    shared_memory_per_block: int
    shared_memory_per_block_optin: int
    shared_memory_per_core: int
    threads_per_core_limit: int
    registers_per_core_limit: int
    registers_per_block_limit: int

    @classmethod
    def load(cls, kind: str) -> GpuSpec:
        """The spec of ``kind``; an unknown kind is refused naming the known ones."""
        if kind not in KINDS:
            raise ConfigError(f"hardware.gpu={kind!r}: unknown GPU kind; known: {', '.join(KINDS)}")
        data = typed.read_yaml(SPECS_DIR / f"{kind}.yaml")
        data["compute_capability"] = tuple(data["compute_capability"])
        return cls(kind=kind, **data)


@dataclass(frozen=True)
class Plugin:
    """The installed CUDA plugin: its version and the CUDA/cuDNN it was built against."""

    module: str
    version: str
    cuda: tuple[int, int]
    cudnn: tuple[int, int, int]


def plugin() -> Plugin | None:
    """The installed jax CUDA plugin (None when there is none)."""
    for module, dist in PLUGINS:
        if importlib.util.find_spec(module) is None:
            continue
        versions = importlib.import_module(f"{module}._versions")
        cuda, cudnn = versions.cuda_runtime_build_version(), versions.cudnn_build_version()
        return Plugin(
            module=module,
            version=importlib.metadata.version(dist),
            cuda=(cuda // 1000, cuda % 1000 // 10),
            cudnn=(cudnn // 10000, cudnn % 10000 // 100, cudnn % 100),
        )
    return None


def require_plugin() -> Plugin:
    """:func:`plugin`, or a one-line refusal saying what to install."""
    found = plugin()
    if found is None:
        import jax

        v = jax.__version__
        raise ConfigError(
            "GPU target: the jax CUDA plugin is not installed; install it with "
            f"pip install 'jax-cuda12-plugin=={v}' 'jax-cuda12-pjrt=={v}' "
            "(or pip install -e '.[gpu-aot]')"
        )
    return found


def target_config(spec: GpuSpec, plug: Plugin) -> str:
    """The ``GpuTargetConfig`` text proto of ``spec`` for the plugin ``plug``."""
    major, minor = spec.compute_capability
    info = {
        "threads_per_block_limit": 1024,
        "threads_per_warp": 32,
        "shared_memory_per_block": spec.shared_memory_per_block,
        "shared_memory_per_block_optin": spec.shared_memory_per_block_optin,
        "shared_memory_per_core": spec.shared_memory_per_core,
        "threads_per_core_limit": spec.threads_per_core_limit,
        "core_count": spec.core_count,
        "fpus_per_core": spec.fpus_per_core,
        "block_dim_limit_x": 2147483647,
        "block_dim_limit_y": 65535,
        "block_dim_limit_z": 65535,
        "memory_bandwidth": spec.memory_bandwidth,
        "l2_cache_size": spec.l2_cache_size,
        "clock_rate_ghz": spec.clock_rate_ghz,
        "device_memory_size": spec.device_memory_size,
        "registers_per_core_limit": spec.registers_per_core_limit,
        "registers_per_block_limit": spec.registers_per_block_limit,
    }
    body = "\n".join(f"  {k}: {v}" for k, v in info.items())
    cd = plug.cudnn
    return (
        f"gpu_device_info {{\n  cuda_compute_capability {{ major: {major} minor: {minor} }}\n"
        f"{body}\n}}\n"
        'platform_name: "CUDA"\n'
        f"dnn_version_info {{ major: {cd[0]} minor: {cd[1]} patch: {cd[2]} }}\n"
        f"runtime_version {{ major: {plug.cuda[0]} minor: {plug.cuda[1]} patch: 0 }}\n"
        f'device_description_str: "{spec.name}"\n'
    )


@dataclass(frozen=True)
class Target:
    """A pod of one GPU kind: ``hosts`` nodes of ``per_host`` devices."""

    spec: GpuSpec
    hosts: int
    per_host: int
    plugin: Plugin

    @property
    def topology(self) -> str:
        """XLA's topology string: one slice of ``hosts`` × ``per_host`` devices."""
        return f"1x{self.hosts}x{self.per_host}"

    @property
    def config_text(self) -> str:
        """The target's ``GpuTargetConfig`` text proto."""
        return target_config(self.spec, self.plugin)

    def describe(self) -> dict[str, Any]:
        """JSON view (what a saved executable records and its loader checks)."""
        return {
            "gpu": self.spec.kind,
            "device_kind": self.spec.name,
            "compute_capability": ".".join(map(str, self.spec.compute_capability)),
            "topology": self.topology,
            "devices": self.hosts * self.per_host,
            "plugin": f"{self.plugin.module} {self.plugin.version}",
            "cuda": ".".join(map(str, self.plugin.cuda)),
            "cudnn": ".".join(map(str, self.plugin.cudnn)),
        }

    def devices(self) -> list:
        """The target's compile-only devices (host-major: node ``i`` holds ids
        ``i·per_host ..``), from XLA:GPU's deviceless client."""
        with quiet_native_stderr():
            from jax.experimental import topologies

            topo = topologies.get_topology_desc(
                platform="cuda", target_config=self.config_text, topology=self.topology
            )
        return list(topo.devices)


def target_for(mesh: MeshConfig, plug: Plugin | None = None) -> Target:
    """The target of a GPU mesh file: its kind, and nodes of ``devices_per_node`` devices."""
    hw = mesh.hardware
    if hw.platform != "gpu" or not hw.gpu:
        raise ConfigError(
            f"mesh {mesh.name!r}: hardware.gpu={hw.gpu!r}: a GPU target needs a GPU mesh file "
            f"naming its kind ({', '.join(KINDS)})"
        )
    spec = GpuSpec.load(hw.gpu)
    n, per = mesh.devices, hw.devices_per_node
    if n <= per:
        hosts, per = 1, n
    elif n % per:
        raise ConfigError(
            f"mesh.devices={n}: must divide into nodes of hardware.devices_per_node={per}"
        )
    else:
        hosts = n // per
    return Target(spec, hosts, per, plug or require_plugin())


@contextlib.contextmanager
def quiet_native_stderr():
    """Drop the CUDA stubs' no-driver notices that native code writes to fd 2 while the block
    runs; every other line is written back to stderr."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().decode(errors="replace").splitlines()
            kept = [ln for ln in lines if ln.strip() and not any(s in ln for s in NOISE)]
            if kept:
                print("\n".join(kept), file=sys.stderr)
