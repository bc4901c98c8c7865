"""Multi-host runs through JAX's own distributed runtime (``jax.distributed.initialize``).

One jaxpar process runs per host (or per GPU); together they form one program over the global
device mesh. This module finds out which process this is and connects it to the others, before
JAX starts its backend:

1. explicit arguments (``jaxpar train --coordinator HOST:PORT --num-processes N --process-id I``),
2. else the ``JAXPAR_COORDINATOR`` / ``JAXPAR_NUM_PROCESSES`` / ``JAXPAR_PROCESS_ID`` environment
   (set by ``jaxpar launch --local N``; ``JAXPAR_LOCAL_DEVICES`` simulates CPU devices per process),
3. else SLURM (``SLURM_NTASKS`` > 1): JAX's own cluster detection takes the coordinator from the
   first node of the step and the process id from ``SLURM_PROCID``.

Nothing else in jaxpar changes for many processes: the mesh spans ``jax.devices()`` (all
processes), each process builds only the batch rows of its own devices
(``jax.make_array_from_callback`` in :mod:`jaxpar.data`), only process 0 writes metrics, and orbax
coordinates checkpoint writes across processes.

Failure modes are reported, not hung on: XLA aborts the whole process (no Python exception) when
the coordinator cannot be reached, so a non-coordinator process first waits for the coordinator's
TCP port itself, up to the timeout, and raises :class:`DistributedError` with what to check.

A process that dies mid-run leaves its peers blocked in their next collective (gloo waits for
it, and JAX's own heartbeat gives up only after 100 s, by aborting the process). Each process
therefore runs a :class:`PeerWatch`: a thread that stamps a heartbeat into the coordination
service's key-value store every second and reads its peers'. A peer silent for
``JAXPAR_PEER_TIMEOUT_S`` seconds (default 10), or a coordinator that cannot be reached, ends
this process with one line naming the peer and exit code :data:`EXIT_PEER_LOST`, after releasing
its locks (:func:`jaxpar.lock.release_all`); a save in flight is abandoned, so the newest
complete checkpoint stays the newest. A process that finishes says so first, so its peers'
watches stand down.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from jaxpar.errors import ConfigError, JaxparError

DEFAULT_TIMEOUT_S = 300
PEER_TIMEOUT_S = 10.0  # JAXPAR_PEER_TIMEOUT_S: silence after which a peer counts as gone
EXIT_PEER_LOST = 5  # exit code of a process that stopped because a peer died


class DistributedError(JaxparError):
    """The processes of a multi-host run could not be connected."""


@dataclass(frozen=True)
class ProcessConfig:
    """Where this process sits in a multi-process run."""

    coordinator: str | None  # HOST:PORT of process 0's coordination service (None: SLURM detects)
    num_processes: int
    process_id: int
    local_devices: int | None = None  # simulated CPU devices of this process (CPU runs only)
    source: str = "flags"  # "flags", "env" or "slurm"
    timeout_s: int = DEFAULT_TIMEOUT_S


def _int(value: str | int | None, where: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}={value!r}: expected an integer") from None


def _check_address(addr: str, where: str) -> None:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{where}={addr!r}: expected HOST:PORT (e.g. 10.0.0.1:1234)")


def process_config(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_devices: int | None = None,
    timeout_s: int | None = None,
    env: Mapping[str, str] | None = None,
) -> ProcessConfig | None:
    """This process's place in a multi-process run, or None for a single-process run.

    Explicit arguments win over ``JAXPAR_*`` variables, which win over SLURM's. Bad values raise
    a one-line :class:`ConfigError` naming the setting (e.g. a process id out of range).
    """
    env = os.environ if env is None else env
    timeout = _int(timeout_s, "timeout") or _int(
        env.get("JAXPAR_INIT_TIMEOUT"), "JAXPAR_INIT_TIMEOUT"
    )
    timeout = timeout or DEFAULT_TIMEOUT_S
    # Each setting on its own: a flag, else its JAXPAR_* variable (so a flag given under
    # ``jaxpar launch``, which sets the variables, is checked against the others).
    picked = {}
    for key, flag, value, var in (
        ("coord", "--coordinator", coordinator, "JAXPAR_COORDINATOR"),
        ("n", "--num-processes", num_processes, "JAXPAR_NUM_PROCESSES"),
        ("pid", "--process-id", process_id, "JAXPAR_PROCESS_ID"),
    ):
        if value is not None:
            picked[key] = (value, flag)
        else:
            raw = env.get(var)
            picked[key] = (raw if key == "coord" else _int(raw, var), var)
    (coord, coord_name), (n, n_name), (pid, pid_name) = picked["coord"], picked["n"], picked["pid"]
    explicit = any(v is not None for v in (coordinator, num_processes, process_id))
    source = "flags" if explicit else "env"
    local = local_devices or _int(env.get("JAXPAR_LOCAL_DEVICES"), "JAXPAR_LOCAL_DEVICES")
    if coord is None and n is None and pid is None:
        slurm_n = _int(env.get("SLURM_NTASKS"), "SLURM_NTASKS")
        if slurm_n is None or slurm_n <= 1:
            return None
        n, pid, source = slurm_n, _int(env.get("SLURM_PROCID"), "SLURM_PROCID"), "slurm"
        n_name, pid_name = "SLURM_NTASKS", "SLURM_PROCID"
        if pid is None:
            raise ConfigError("SLURM_PROCID: not set although SLURM_NTASKS > 1")
    if n is None or n < 1:
        raise ConfigError(f"{n_name}={n!r}: must be a positive integer (number of processes)")
    if pid is None:
        raise ConfigError(f"{pid_name}: not set (this process's id, 0..{n - 1})")
    if not 0 <= pid < n:
        of = "num_processes" if n_name == "--num-processes" else n_name
        raise ConfigError(f"{pid_name}={pid}: must be in 0..{n - 1} ({of}={n})")
    if source != "slurm":
        if coord is None:
            raise ConfigError(f"{coord_name}: not set (HOST:PORT of process 0)")
        _check_address(coord, coord_name)
    if local is not None and local < 1:
        raise ConfigError(f"JAXPAR_LOCAL_DEVICES={local}: must be a positive integer")
    return ProcessConfig(coord, n, pid, local, source, timeout)


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Block until ``address`` accepts TCP connections, or raise :class:`DistributedError`."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError as e:  # refused, unreachable, unresolvable: retry until the deadline
            last = e
            time.sleep(0.2)
    raise DistributedError(
        f"coordinator {address}: not reachable within {timeout_s:g}s ({last}); check that "
        "process 0 is running, the address and port, and the firewall"
    )


def initialize(pc: ProcessConfig, platform: str = "cpu") -> None:
    """Connect this process to the others; call before JAX starts its backend.

    On CPU, cross-process collectives go through gloo and ``pc.local_devices`` CPU devices are
    simulated in this process.
    """
    import jax

    from jaxpar.devices import simulate_cpu_devices

    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if pc.local_devices:
            simulate_cpu_devices(pc.local_devices)
    if pc.source == "slurm":
        # JAX reads SLURM_STEP_NODELIST / SLURM_PROCID / SLURM_LOCALID itself (GPU ids too).
        jax.distributed.initialize(initialization_timeout=pc.timeout_s)
        return
    assert pc.coordinator is not None
    if pc.process_id != 0:
        wait_for_coordinator(pc.coordinator, pc.timeout_s)
    jax.distributed.initialize(
        coordinator_address=pc.coordinator,
        num_processes=pc.num_processes,
        process_id=pc.process_id,
        initialization_timeout=pc.timeout_s,
        cluster_detection_method="deactivate",
    )


class PeerWatch(threading.Thread):
    """Heartbeats through the coordination service; ends the process when a peer is gone."""

    def __init__(self, client, me: int, n: int, timeout_s: float):
        super().__init__(name="jaxpar-peer-watch", daemon=True)
        self.client, self.me, self.n, self.timeout_s = client, me, n, timeout_s
        self._done = threading.Event()

    def finish(self) -> None:
        """This process is ending normally: tell the peers, stop watching."""
        if not self._done.is_set():
            self._done.set()
            try:
                self.client.key_value_set(f"jaxpar/done/{self.me}", "1", allow_overwrite=True)
            except Exception:  # noqa: BLE001  (the service may already be gone at exit)
                pass

    def _get(self, key: str) -> str | None:
        try:
            return self.client.key_value_try_get(key)
        except Exception as e:  # noqa: BLE001  (XlaRuntimeError NOT_FOUND: not written yet)
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                return None
            raise

    def run(self) -> None:
        peers = [p for p in range(self.n) if p != self.me]
        seen = {p: (None, time.monotonic()) for p in peers}
        unreachable_since: float | None = None
        seq = 0
        while not self._done.wait(1.0):
            seq += 1
            now = time.monotonic()
            try:
                self.client.key_value_set(f"jaxpar/alive/{self.me}", str(seq), allow_overwrite=True)
                if any(self._get(f"jaxpar/done/{p}") for p in peers):
                    return  # the run is ending: a finished peer stops beating
                for p in peers:
                    beat = self._get(f"jaxpar/alive/{p}")
                    if beat != seen[p][0]:
                        seen[p] = (beat, now)
                    elif now - seen[p][1] > self.timeout_s:
                        self._lost(p, f"no heartbeat for {self.timeout_s:g} s")
                unreachable_since = None
            except Exception as e:  # noqa: BLE001  (the coordination service is gone)
                unreachable_since = unreachable_since or now
                if now - unreachable_since > min(self.timeout_s, 5.0) and not self._done.is_set():
                    first = (str(e) or type(e).__name__).splitlines()[0][:120]
                    self._lost(0, f"the coordinator cannot be reached: {first}")

    def _lost(self, peer: int, why: str) -> None:
        if self._done.is_set():
            return
        from jaxpar.lock import release_all

        print(
            f"jaxpar: error: process {peer} of this {self.n}-process run is gone ({why}); "
            f"process {self.me} stops without a checkpoint (the newest complete one is kept)",
            file=sys.stderr,
            flush=True,
        )
        release_all()
        os._exit(EXIT_PEER_LOST)


_WATCH: PeerWatch | None = None


def watch_peers(pc: ProcessConfig, env: Mapping[str, str] | None = None) -> PeerWatch | None:
    """Start this process's :class:`PeerWatch` (after ``jax.distributed.initialize``)."""
    global _WATCH
    import atexit

    from jax._src import distributed as jd

    env = os.environ if env is None else env
    client = jd.global_state.client
    if client is None or pc.num_processes < 2:
        return None
    timeout = peer_timeout(env)
    _WATCH = PeerWatch(client, pc.process_id, pc.num_processes, timeout)
    _WATCH.start()
    atexit.register(_WATCH.finish)
    _quiet_peer_errors_in_threads()
    return _WATCH


def _quiet_peer_errors_in_threads() -> None:
    """A background thread (orbax's asynchronous save) whose collective fails because a peer
    died ends without its traceback, raised or logged: the watch names the dead peer in one
    line within its timeout. Any other thread error is reported as before."""
    import logging

    previous = threading.excepthook

    def hook(args: Any) -> None:
        if args.exc_value is not None and caused_by_peer(args.exc_value):
            return
        previous(args)

    threading.excepthook = hook
    quiet = _PeerErrorFilter()
    for name in ("", "absl"):  # the root's handlers (absl's among them) and absl's own
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(quiet)


class _PeerErrorFilter:
    """Drops a log record that carries a dead peer's error (:func:`caused_by_peer`)."""

    def filter(self, record: Any) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and caused_by_peer(exc))


def stop_after_failure(prefix: str, error: BaseException) -> None:
    """In a multi-process run, an error that escaped the command (typically a collective that
    failed because a peer died: gloo's "Connection reset by peer") ends the process in one
    line: the watch names the silent peer within its timeout, else the error's first line is
    the line; locks are released and the process exits :data:`EXIT_PEER_LOST` at once (JAX's
    shutdown would wait for the dead peer). Returns only in a single-process run."""
    watch = _WATCH
    if watch is None or watch._done.is_set():
        return
    from jaxpar.lock import release_all

    release_all()
    # While the watch waits for the dead peer's heartbeat to lapse, the threads the failed
    # collective left (orbax's background save threads) end with errors of their own, which
    # they log with tracebacks: the one line below, or the watch's, is what this process says.
    import logging

    logging.disable(logging.CRITICAL)
    threading.excepthook = lambda args: None
    watch.join(timeout=watch.timeout_s + 3.0)  # its _lost() exits the process when it names one
    first = (str(error) or type(error).__name__).strip().splitlines()[0][:200]
    print(f"{prefix}: error: {first}; stopping this process", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)


# What a collective or a transfer says when the process on the other end died (gloo, sockets).
_PEER_ERROR = re.compile(
    r"Connection reset by peer|Connection refused|Broken pipe|Connection closed by peer|"
    r"\bgloo\b|DEADLINE_EXCEEDED|UNAVAILABLE"
)


def caused_by_peer(error: BaseException) -> bool:
    """Whether ``error`` or an error it was raised from reads like a dead peer's (a collective
    that failed because the process on the other end died), in a multi-process run."""
    if _WATCH is None or _WATCH._done.is_set():
        return False
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if _PEER_ERROR.search(str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False


def peer_timeout(env: Mapping[str, str] | None = None) -> float:
    """``JAXPAR_PEER_TIMEOUT_S`` (seconds), checked."""
    env = os.environ if env is None else env
    raw = env.get("JAXPAR_PEER_TIMEOUT_S")
    if raw is None or raw == "":
        return PEER_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 1.0 <= value <= 3600.0:
        raise ConfigError(f"JAXPAR_PEER_TIMEOUT_S={raw!r}: must be a number of seconds in 1..3600")
    return value


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is true on any process (every process must call it; one small
    all-gather). A single-process run answers ``flag`` without a collective."""
    import jax

    if jax.process_count() == 1:
        return bool(flag)
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.int32(bool(flag)))))


def free_port() -> int:
    """A TCP port free on this machine now (for local multi-process runs and tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- before JAX starts: XLA flags, devices, processes ---------------------------------------


def target_platform(env: Mapping[str, str] | None = None) -> str:
    """The platform JAX will pick, guessed without starting JAX: ``JAX_PLATFORMS`` when set,
    else ``gpu`` when a CUDA/ROCm plugin of jaxlib is installed, else ``cpu``."""
    import importlib.util

    env = os.environ if env is None else env
    first = env.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if first:
        return "gpu" if first in ("cuda", "rocm", "gpu") else first
    for plugin in ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_rocm7_plugin"):
        if importlib.util.find_spec(plugin) is not None:
            return "gpu"
    return "cpu"


def _zero3(layout, hardware) -> bool:
    return layout.zero == 3


def zero3_across_nodes(layout, hardware) -> bool:
    """ZeRO-3 whose shard group (dp × tp × sp ranks) is larger than a node: its per-layer
    gathers and reduce-scatters cross nodes."""
    return layout.zero == 3 and layout.dp * layout.tp * layout.sp > hardware.devices_per_node


def _two_in_flight(layout, hardware) -> bool:
    """Layouts whose step has several collectives to keep in flight at once: Megatron-SP's
    collective matmul (:mod:`jaxpar.model.collective_matmul`: bf16 GEMMs on tp > 1 with
    sequence parallelism; an FP8 recipe gathers its quantized input instead, except where
    ZeRO-3 crosses nodes, :func:`jaxpar.sharding.fp8_rings`), and ZeRO-3 whose gathers cross
    nodes (its shard group, dp × tp × sp ranks, larger than a node). A pipeline with
    Megatron-SP keeps the flag though its ticks run no rings
    (:func:`jaxpar.model.collective_matmul.axes`): there it changes nothing measured (the
    a100-64 production layout 9.574 s at four in flight, 9.578 s at one)."""
    rings = layout.tp > 1 and layout.sequence_parallel and layout.fp8 == "none"
    return rings or zero3_across_nodes(layout, hardware)


# Mesh-file flags that serve one kind of layout: a run of another layout starts without them.
#
# XLA:GPU's collective pipeliner moves a loop's all-gathers into the iteration before. In
# jaxpar's step its one target is ZeRO-3's per-layer weight gather (llama2-70b dp 32 x tp 2 +
# SP ZeRO-3 on a100-64: 68% of the collective bytes exposed with it, 89% without). Outside
# ZeRO-3 it finds only the micro-batch loop's gathers, and to start one a micro-batch early
# it clones that micro-batch's forward: llama3-8b tp 8 + SP, ZeRO-1, 2 micro-batches on h100-8
# compiles to 35.8 GiB with it and 24.5 without (tp bytes 1.43x / 1.02x the planner's).
#
# More than one collective in flight (times by jaxpar's model of the compiled step, limit 1 ->
# 2; limit 4 gave as much or more on every such row, BENCHMARKS.md):
# * Each step of a column-parallel collective matmul's backward sends two chunks (the
#   input's ring and the gradient's reduce-scatter ring) beside one matmul; with XLA's
#   default of one, the scheduler runs one of them synchronously. llama3-8b tp 8 + SP on
#   h100-8: 0.513 -> 0.491 s, tp exposed 0.065 -> 0.042 s.
# * ZeRO-3's backward starts a layer's reduce-scatter, then the next layer's gathers: with one
#   in flight the scatter is waited on right after it starts. Across nodes that wait is long:
#   llama3-70b dp 1024 on h100-1024 8.570 -> 7.425 s, llama2-70b dp 64 on a100-64 9.589 ->
#   8.171 s. Inside a node it is short and more in flight cost a little: llama3-8b dp 8 on
#   h100-8 0.383 -> 0.389 s (0.398 s at 4), so those layouts start without it.
# * With both (llama2-70b dp 32 x tp 2 + SP ZeRO-3 on a100-64) the rings' two sends fill two
#   slots and the scatter was still waited on: 11.108 s at 1, 11.143 at 2, 9.699 at 4.
LAYOUT_XLA_FLAGS: dict[str, Callable[[Any, Any], bool]] = {
    "--xla_gpu_enable_pipelined_all_gather": _zero3,
    "--xla_gpu_experimental_parallel_collective_overlap_limit": _two_in_flight,
}


def run_xla_flags(hardware, layout=None) -> list[str]:
    """The XLA flags a run of ``layout`` starts with: the mesh file's ``hardware.xla_flags``,
    less those that serve another kind of layout (:data:`LAYOUT_XLA_FLAGS`). ``layout=None``
    (several layouts in one process): the mesh file's, unchanged."""
    flags = list(hardware.xla_flags or ())
    if layout is None:
        return flags
    kept = []
    for f in flags:
        only = LAYOUT_XLA_FLAGS.get(f.split("=", 1)[0])
        if only is None or only(layout, hardware):
            kept.append(f)
    return kept


def apply_xla_flags(platform: str, flags: list[str], env: dict | None = None) -> list[str]:
    """Add a mesh file's ``hardware.xla_flags`` to ``XLA_FLAGS`` when its platform is the one
    JAX will run on; flags the user already set in ``XLA_FLAGS`` win. Returns the flags added.

    XLA reads ``XLA_FLAGS`` once, when the backend starts, and aborts on an unknown flag, so this
    runs before any JAX computation and the mesh files list only flags that the jaxlib binary
    knows (tests/test_pods.py starts XLA with each of them).
    """
    env = os.environ if env is None else env
    if not flags or platform != target_platform(env):
        return []
    have = env.get("XLA_FLAGS", "").split()
    names = {f.split("=", 1)[0] for f in have}
    added = [f for f in flags if f.split("=", 1)[0] not in names]
    env["XLA_FLAGS"] = " ".join([*have, *added])
    return added


def setup(
    hardware,
    devices: int,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    layout=None,
) -> ProcessConfig | None:
    """Everything that must precede JAX's start for a run on ``devices`` devices in total.

    Applies the platform's XLA flags (:func:`run_xla_flags` for ``layout``), then either
    simulates ``devices`` CPU devices (one process) or joins a multi-process run (each process
    simulating ``devices / processes`` CPU devices on CPU, or using its own GPUs).
    """
    from jaxpar.devices import simulate_cpu_devices

    apply_xla_flags(hardware.platform, run_xla_flags(hardware, layout))
    pc = process_config(coordinator, num_processes, process_id)
    if pc is None:
        if hardware.platform == "cpu":
            simulate_cpu_devices(devices)
        return None
    if hardware.platform == "cpu" and pc.local_devices is None:
        if devices % pc.num_processes:
            raise ConfigError(
                f"mesh.devices={devices}: must be divisible by the number of processes "
                f"{pc.num_processes} (each simulates devices/processes CPU devices)"
            )
        pc = ProcessConfig(
            pc.coordinator,
            pc.num_processes,
            pc.process_id,
            devices // pc.num_processes,
            pc.source,
            pc.timeout_s,
        )
    initialize(pc, hardware.platform)
    watch_peers(pc)
    return pc
