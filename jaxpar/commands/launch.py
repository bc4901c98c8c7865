"""``jaxpar launch --local N -- train ...``: N cooperating jaxpar processes on this machine.

Each child runs ``python -m jaxpar.cli <verb> ...`` with ``JAXPAR_COORDINATOR`` (a free local
port), ``JAXPAR_NUM_PROCESSES``, ``JAXPAR_PROCESS_ID`` and ``JAXPAR_LOCAL_DEVICES`` set, so the
verb joins one multi-process JAX run (CPU collectives through gloo, M simulated devices per
process). It is the local stand-in for a pod: the same code path as SLURM on GPUs
(``scripts/slurm_example.sbatch``), testable on a laptop.

Process 0's standard output is passed through unchanged (so ``--json`` still ends stdout with the
run's JSON); everything else goes to standard error prefixed ``[pI]``. A run longer than
``--timeout`` seconds is stopped as a whole (exit 124).

When a child dies, the launcher says in one line which process died and how (``process 1 (pid
N) was killed by SIGKILL`` or ``exited with code 3``), gives the survivors ``--grace`` seconds
to stop on their own (each notices the dead peer in its next collective, says so in one line,
and releases its outputs' locks; the newest complete checkpoint stays as it was), then
SIGTERMs and finally SIGKILLs whoever is left. Exit codes of the launcher: 0 when every process
exited 0; the failed process's own code when it exited non-zero; ``128 + N`` when it was killed
by signal N (the shell's convention: 137 for SIGKILL); 124 on ``--timeout``.

Before starting anything the command is parsed and, for ``train``/``bench``, its configuration
validated here, so a bad flag is one line from the launcher rather than one per process; the
flags ``jaxpar launch`` sets itself (``--coordinator``, ``--num-processes``, ``--process-id``)
are refused in the command. A SIGTERM or SIGINT to the launcher is passed on to every process
as SIGTERM: they agree on a step, checkpoint it and exit 0 (see
:class:`jaxpar.train.guard.StopRequest`), and the launcher waits for them (a second signal
kills them).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from jaxpar.commands import _checks as K
from jaxpar.errors import ConfigError

HELP = "start N jaxpar processes on this machine as one multi-process run (CPU, gloo)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``jaxpar launch``."""
    p.add_argument(
        "--local", type=K.positive_int, required=True, metavar="N", help="processes to start"
    )
    p.add_argument(
        "--devices-per-process",
        type=K.positive_int,
        default=None,
        metavar="M",
        help="simulated CPU devices per process (default: the mesh's devices / N)",
    )
    p.add_argument(
        "--timeout", type=K.positive_float, default=3600.0, help="seconds before all are stopped"
    )
    p.add_argument(
        "--grace",
        type=K.positive_float,
        default=30.0,
        help="seconds the survivors get to stop on their own after a process dies (default 30)",
    )
    p.add_argument(
        "--init-timeout",
        type=K.positive_int,
        default=60,
        help="seconds to wait for the coordinator",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- VERB [ARGS...], e.g. -- train")


def _pump(stream, sink, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        sink.write(prefix + line)
        sink.flush()
    stream.close()


def _kill(procs: list[subprocess.Popen]) -> None:
    # SIGTERM would ask for an agreed checkpoint, which processes whose peer is gone cannot
    # reach (they would wait in a collective): stop them outright.
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def how_it_ended(code: int) -> str:
    """``exited with code 3`` / ``was killed by SIGKILL`` (a Popen returncode)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def exit_code(code: int) -> int:
    """The launcher's exit code for a child's returncode: its own, or 128 + N for signal N."""
    return 128 - code if code < 0 else code


def _stop_survivors(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Give the survivors ``grace_s`` to stop on their own (their next collective fails and
    they release their locks), then SIGTERM (2 s), then SIGKILL."""
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in procs if p.poll() is None]
    for p in left:
        p.terminate()
    deadline = time.monotonic() + 2.0
    while any(p.poll() is None for p in left) and time.monotonic() < deadline:
        time.sleep(0.05)


class _Forward:
    """While installed: the first SIGTERM/SIGINT to the launcher becomes a SIGTERM to every
    child (an agreed, checkpointed stop); a second one kills them."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs, self.count, self._previous = procs, 0, {}

    def _handle(self, signum, frame) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.count == 1:
            print(f"jaxpar launch: {name}: asking every process to checkpoint and stop",
                  file=sys.stderr, flush=True)  # fmt: skip
            for p in self.procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
        else:
            print(f"jaxpar launch: {name} again: killing every process", file=sys.stderr)
            for p in self.procs:
                if p.poll() is None:
                    p.kill()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


SET_BY_LAUNCH = ("--coordinator", "--num-processes", "--process-id")


def check_command(n: int, argv: list[str], devices_per_process: int | None) -> None:
    """Refuse, in one line, a command that every process would refuse: parse it with jaxpar's
    own parser and validate a ``train``/``bench`` configuration (no JAX is started)."""
    from jaxpar.cli import build_parser

    for arg in argv:
        name = arg.split("=", 1)[0]
        if name in SET_BY_LAUNCH:
            raise ConfigError(
                f"-- {argv[0]} ... {name}: set by jaxpar launch for each process "
                f"(0..{n - 1}); remove it from the command"
            )
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(argv)
    except SystemExit as e:
        if e.code == 0:  # --help: nothing to run
            raise ConfigError(f"-- {shlex.join(argv)}: asks for help, not a run") from None
        why = said.getvalue().strip().split(": error: ", 1)[-1]
        raise ConfigError(f"in the command ({shlex.join(argv[:1])} ...): {why}") from None
    if args.verb == "launch":
        raise ConfigError("-- launch: a launch cannot start launches")
    if args.verb in ("train", "bench"):
        from jaxpar import validation as V
        from jaxpar.commands.train import build_config

        cfg = build_config(args)
        V.validate(cfg, n_devices=cfg.mesh.devices)
        if args.verb == "train":
            from jaxpar.preflight import preflight

            preflight(cfg, data=False)  # every process would refuse the same, once here
        have = n * devices_per_process if devices_per_process else cfg.mesh.devices
        if have != cfg.mesh.devices:
            raise ConfigError(
                f"--local {n} x --devices-per-process {devices_per_process} = {have} devices: "
                f"must equal mesh.devices={cfg.mesh.devices}"
            )
        if cfg.mesh.devices % n:
            raise ConfigError(
                f"mesh.devices={cfg.mesh.devices}: must be divisible by --local {n} "
                "(each process simulates devices/processes CPU devices)"
            )


def launch_local(
    n: int,
    argv: list[str],
    devices_per_process: int | None = None,
    timeout_s: float = 3600.0,
    init_timeout_s: int = 60,
    env: dict[str, str] | None = None,
    grace_s: float = 30.0,
) -> int:
    """Run ``jaxpar <argv>`` in ``n`` local processes; the first non-zero exit code, or 0."""
    from jaxpar.distributed import free_port

    if n < 1:
        raise ConfigError(f"--local={n}: must be a positive number of processes")
    if devices_per_process is not None and devices_per_process < 1:
        raise ConfigError(f"--devices-per-process={devices_per_process}: must be positive")
    if not argv:
        raise ConfigError("launch: no command; e.g. jaxpar launch --local 2 -- train --steps 5")
    check_command(n, argv, devices_per_process)
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
    forward = _Forward(procs)
    try:
        with forward:
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
            rc = _wait(procs, timeout_s, forward, grace_s)
    finally:
        _kill(procs)
        for t in pumps:
            t.join(timeout=5)
    return rc


def _wait(
    procs: list[subprocess.Popen], timeout_s: float, forward: _Forward, grace_s: float = 30.0
) -> int:
    """The launcher's exit code (:func:`exit_code` of the first failed process; the others
    stopped by :func:`_stop_survivors`), 124 on timeout, else 0."""
    deadline = time.monotonic() + timeout_s
    while None in (codes := [p.poll() for p in procs]):  # poll every child each time
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed and not forward.count:
            i, code = failed[0]
            print(
                f"jaxpar launch: process {i} (pid {procs[i].pid}) {how_it_ended(code)}; "
                f"stopping the others (up to {grace_s:g}s for them to stop on their own)",
                file=sys.stderr,
                flush=True,
            )
            _stop_survivors(procs, grace_s)
            return exit_code(code)
        if time.monotonic() > deadline:
            print(f"jaxpar launch: timed out after {timeout_s:g}s; stopping all", file=sys.stderr)
            return 124
        time.sleep(0.1)
    return next((exit_code(p.returncode) for p in procs if p.returncode), 0)


def run(args: argparse.Namespace) -> int:
    """Start the processes and wait for them."""
    argv = list(args.command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    return launch_local(
        args.local,
        argv,
        args.devices_per_process,
        args.timeout,
        args.init_timeout,
        grace_s=args.grace,
    )
