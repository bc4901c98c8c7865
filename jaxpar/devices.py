"""Devices and meshes: simulated CPU devices before JAX initialises, and the ``pp×dp×sp×tp`` mesh.

Device simulation must happen before the JAX backend starts; :func:`simulate_cpu_devices` does it
through ``jax_num_cpu_devices`` (and ``XLA_FLAGS`` for subprocesses) and raises a clear error when
the backend is already up with another count (the notebook case).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from jaxpar.config import AXES, LayoutConfig
from jaxpar.errors import ConfigError
from jaxpar.hostmem import backend_started, keep_host_buffers


def simulate_cpu_devices(n: int) -> None:
    """Make JAX expose ``n`` CPU devices; call before any JAX computation.

    When JAX is already initialised with a different count this raises a :class:`ConfigError`
    explaining how to restart (in a notebook: restart the kernel and call this first). It also
    makes the host allocator keep XLA CPU's per-execution buffers between steps
    (:func:`jaxpar.hostmem.keep_host_buffers`).
    """
    import jax

    keep_host_buffers()
    if backend_started():
        have = jax.device_count("cpu") if jax.default_backend() == "cpu" else None
        if have is not None and have != n:
            raise ConfigError(
                f"devices={n}: JAX is already initialised with {have} CPU devices; the count can "
                "only be set before JAX starts (restart the Python process or notebook kernel and "
                "call jaxpar.devices.simulate_cpu_devices first)"
            )
        return
    jax.config.update("jax_num_cpu_devices", n)
    flag = f"--xla_force_host_platform_device_count={n}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, flag])


def make_mesh(layout: LayoutConfig, devices: Sequence | None = None):
    """Build the ``Mesh`` with axes ``('pp', 'dp', 'sp', 'tp')`` for ``layout``.

    Devices are laid out row-major, so ``tp`` is innermost: consecutive device ids (the same node
    on a GPU pod, NVLink-connected) form a tensor-parallel group and ``pp`` spans the farthest
    devices. Every axis exists even at size 1, so one code path serves every layout.

    Axis types are ``Auto``: the model expresses Megatron TP and sequence parallelism through
    ``with_sharding_constraint`` and lets GSPMD place the collectives; ``Explicit`` axes would
    turn those constraints into assertions and demand ``out_sharding=`` on every contraction.
    """
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    sizes = layout.axis_sizes()
    n = layout.n_devices
    if devices is None:
        devices = jax.devices()
        if len(devices) != n:
            raise ConfigError(
                f"layout pp*dp*sp*tp={n}: must equal the number of available devices {len(devices)}"
            )
    devices = list(devices)
    if len(devices) != n:
        raise ConfigError(f"layout pp*dp*sp*tp={n}: got {len(devices)} devices")
    grid = np.array(devices, dtype=object).reshape(tuple(sizes[a] for a in AXES))
    axes: tuple[str, ...] = AXES
    if 0 < layout.dp_shard < layout.dp:
        # Hybrid sharding: dp = dpr (replica groups, outer: across nodes) x dps (ZeRO shards,
        # inner: consecutive devices of one node). The batch spans both; ZeRO shards over dps.
        shape = (layout.pp, layout.dp // layout.dp_shard, layout.dp_shard, layout.sp, layout.tp)
        grid, axes = grid.reshape(shape), ("pp", "dpr", "dps", "sp", "tp")
    if layout.ep > 1:
        # Expert parallelism folded onto dp: dp = edp (replicas of an expert shard, outer) x ep
        # (expert shards, inner: the all-to-all stays among consecutive devices of one node).
        shape = (layout.pp, layout.dp // layout.ep, layout.ep, layout.sp, layout.tp)
        grid, axes = grid.reshape(shape), ("pp", "edp", "ep", "sp", "tp")
    return Mesh(grid, axes, axis_types=(AxisType.Auto,) * len(axes))
