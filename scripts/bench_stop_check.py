"""Per-step cost of agreeing on a stop across processes: JAX's preemption sync point (what
``jaxpar train`` checks after every step of a multi-process run) against an all-gather of a
stop flag (the alternative: one tiny collective per step), interleaved in one run.

Starts two local processes (gloo CPU collectives, 2 simulated devices each), runs ``--steps``
steps of a small all-reduce standing in for a train step, and after each step times both
checks. Prints one JSON object: medians in microseconds and their ratio to the step.

    python scripts/bench_stop_check.py [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(pid: int, port: int, steps: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid, cluster_detection_method="deactivate")
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxpar.distributed import any_process

    mesh = jax.make_mesh((4,), ("dp",))
    x = jax.make_array_from_callback(
        (4, 1 << 16), NamedSharding(mesh, PartitionSpec("dp")), lambda i: np.ones((1, 1 << 16))
    )
    step = jax.jit(lambda a: a + jnp.sum(a, axis=0, keepdims=True) * 1e-9)  # one all-reduce
    times = {"step": [], "sync_point": [], "allgather": []}
    for i in range(steps):
        t0 = time.perf_counter()
        x = step(x)
        x.block_until_ready()
        t1 = time.perf_counter()
        multihost_utils.reached_preemption_sync_point(i + 1)
        t2 = time.perf_counter()
        any_process(False)
        t3 = time.perf_counter()
        if i >= 10:  # past compilation and warm-up
            times["step"].append(t1 - t0)
            times["sync_point"].append(t2 - t1)
            times["allgather"].append(t3 - t2)
    if pid == 0:
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        print(json.dumps({
            "steps": steps,
            "step_us": med["step"],
            "sync_point_us": med["sync_point"],
            "allgather_us": med["allgather"],
            "sync_point_over_step": med["sync_point"] / med["step"],
            "allgather_over_step": med["allgather"] / med["step"],
            "allgather_over_sync_point": med["allgather"] / med["sync_point"],
        }))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(args.child, args.port, args.steps)
        return
    from jaxpar.distributed import free_port

    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, __file__, "--steps", str(args.steps), "--port", str(port), "--child"]
    procs = [
        subprocess.Popen(
            [*cmd, str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )  # fmt: skip
        for i in range(2)
    ]
    out = [proc.communicate(timeout=600)[0] for proc in procs]
    print(out[0].strip().splitlines()[-1])


if __name__ == "__main__":
    main()
