"""``jaxpar launch --local N -- train ...``: N cooperating jaxpar processes on this machine.

Each child runs ``python -m jaxpar.cli <verb> ...`` with ``JAXPAR_COORDINATOR`` (a free local
port), ``JAXPAR_NUM_PROCESSES``, ``JAXPAR_PROCESS_ID`` and ``JAXPAR_LOCAL_DEVICES`` set, so the
verb joins one multi-process JAX run (CPU collectives through gloo, M simulated devices per
process). It is the local stand-in for a pod: the same code path as SLURM on GPUs
(``scripts/slurm_example.sbatch``), testable on a laptop.

Process 0's standard output is passed through unchanged (so ``--json`` still ends stdout with the
run's JSON); everything else goes to standard error prefixed ``[pI]``. When any child fails, the
others are stopped; a run longer than ``--timeout`` seconds is stopped as a whole (exit 124).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from jaxpar.errors import ConfigError

HELP = "start N jaxpar processes on this machine as one multi-process run (CPU, gloo)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``jaxpar launch``."""
    p.add_argument("--local", type=int, required=True, metavar="N", help="processes to start")
    p.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="M",
        help="simulated CPU devices per process (default: the mesh's devices / N)",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before all are stopped")
    p.add_argument(
        "--init-timeout", type=int, default=60, help="seconds to wait for the coordinator"
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- VERB [ARGS...], e.g. -- train")


def _pump(stream, sink, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        sink.write(prefix + line)
        sink.flush()
    stream.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch_local(
    n: int,
    argv: list[str],
    devices_per_process: int | None = None,
    timeout_s: float = 3600.0,
    init_timeout_s: int = 60,
    env: dict[str, str] | None = None,
) -> int:
    """Run ``jaxpar <argv>`` in ``n`` local processes; the first non-zero exit code, or 0."""
    from jaxpar.distributed import free_port

    if n < 1:
        raise ConfigError(f"--local={n}: must be a positive number of processes")
    if devices_per_process is not None and devices_per_process < 1:
        raise ConfigError(f"--devices-per-process={devices_per_process}: must be positive")
    if not argv:
        raise ConfigError("launch: no command; e.g. jaxpar launch --local 2 -- train --steps 5")
    base = dict(os.environ if env is None else env)
    root = str(Path(__file__).resolve().parents[2])
    base["PYTHONPATH"] = os.pathsep.join(p for p in (root, base.get("PYTHONPATH")) if p)
    base.setdefault("JAX_PLATFORMS", "cpu")
    base.update(
        JAXPAR_COORDINATOR=f"127.0.0.1:{free_port()}",
        JAXPAR_NUM_PROCESSES=str(n),
        JAXPAR_INIT_TIMEOUT=str(init_timeout_s),
    )
    if devices_per_process is not None:
        base["JAXPAR_LOCAL_DEVICES"] = str(devices_per_process)
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    try:
        for i in range(n):
            child_env = dict(base, JAXPAR_PROCESS_ID=str(i))
            p = subprocess.Popen(
                [sys.executable, "-m", "jaxpar.cli", *argv],
                env=child_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                bufsize=1,
            )
            procs.append(p)
            out_sink, out_prefix = (sys.stdout, "") if i == 0 else (sys.stderr, f"[p{i}] ")
            for stream, sink, prefix in (
                (p.stdout, out_sink, out_prefix),
                (p.stderr, sys.stderr, f"[p{i}] "),
            ):
                t = threading.Thread(target=_pump, args=(stream, sink, prefix), daemon=True)
                t.start()
                pumps.append(t)
        deadline = time.monotonic() + timeout_s
        rc = 0
        while None in (codes := [p.poll() for p in procs]):  # poll every child each time
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                rc = failed[0]
                print(
                    f"jaxpar launch: a process exited with {rc}; stopping the others",
                    file=sys.stderr,
                )
                break
            if time.monotonic() > deadline:
                print(
                    f"jaxpar launch: timed out after {timeout_s:g}s; stopping all", file=sys.stderr
                )
                rc = 124
                break
            time.sleep(0.1)
        else:
            rc = next((p.returncode for p in procs if p.returncode), 0)
    finally:
        _stop(procs)
        for t in pumps:
            t.join(timeout=5)
    return rc


def run(args: argparse.Namespace) -> int:
    """Start the processes and wait for them."""
    argv = list(args.command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    return launch_local(args.local, argv, args.devices_per_process, args.timeout, args.init_timeout)
