"""How long a checkpoint save blocks training: synchronous orbax saves against jaxpar's
asynchronous ones (:class:`jaxpar.checkpoint.Checkpointer`), for the default model and a
>= 100M-parameter model on one CPU device, in one run; and the cost per GB of the token-id check
that every token file gets on load (:func:`jaxpar.data.largest_id`).

For each model the real train state (params and Adam moments, fp32) is saved ``--saves`` times
per mode into a fresh directory. ``blocking_s`` is the time :meth:`Checkpointer.save` holds the
caller (what a training step waits for), ``final_s`` the time until the step is sealed (manifest
written: :meth:`Checkpointer.wait`). Prints one JSON object (medians; ``async_over_sync`` is the
ratio of blocking times).

    python scripts/bench_checkpoint.py [--models tiny gpt2-124m] [--saves 3] [--token-gb 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def state_of(model: str):
    """The train state of ``model`` on one CPU device (canonical form, as checkpoints hold)."""
    from jaxpar import config as C
    from jaxpar.devices import make_mesh
    from jaxpar.train.step import Trainer

    cfg = C.load(model, "cpu-8")
    cfg.layout.dp = cfg.layout.tp = cfg.layout.pp = cfg.layout.microbatches = 1
    cfg.mesh.devices = 1
    cfg.train.global_batch, cfg.train.seq_len = 1, 16
    import jax

    trainer = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[:1]))
    state = trainer.convert(trainer.init_state(0), "canonical")
    jax.block_until_ready(state)
    return cfg, state


def time_saves(state, asynchronous: bool, saves: int) -> dict:
    from jaxpar.checkpoint import Checkpointer

    blocking, final = [], []
    with tempfile.TemporaryDirectory(dir=str(ROOT)) as d:
        ck = Checkpointer(d, keep=2, every=1, asynchronous=asynchronous)
        for i in range(saves):
            t0 = time.perf_counter()
            ck.save(i + 1, state, {"step": i + 1})
            t1 = time.perf_counter()
            ck.wait()
            blocking.append(t1 - t0)
            final.append(time.perf_counter() - t0)
        ck.close()
    return {"blocking_s": statistics.median(blocking), "final_s": statistics.median(final)}


def token_check_cost(gb: float) -> dict:
    """Seconds per GB of :func:`jaxpar.data.largest_id` over a memory-mapped uint16 file (page
    cache warm: the cost of the pass itself, not of the disk)."""
    import numpy as np

    from jaxpar.data import largest_id

    n = int(gb * 1e9) // 2
    with tempfile.NamedTemporaryFile(dir=str(ROOT), suffix=".bin") as f:
        rng = np.random.default_rng(0)
        for i in range(0, n, 1 << 26):
            f.write(rng.integers(0, 50257, min(1 << 26, n - i), dtype=np.uint16).tobytes())
        f.flush()
        tokens = np.memmap(f.name, dtype=np.uint16, mode="r")
        largest_id(tokens)  # warm the page cache
        t0 = time.perf_counter()
        largest_id(tokens)
        seconds = time.perf_counter() - t0
    return {"bytes": 2 * n, "seconds": seconds, "seconds_per_gb": seconds / (2 * n / 1e9)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "gpt2-124m"])
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--token-gb", type=float, default=1.0)
    args = ap.parse_args()
    from jaxpar.devices import simulate_cpu_devices

    simulate_cpu_devices(1)
    out = {"models": {}}
    for model in args.models:
        cfg, state = state_of(model)
        import jax

        size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
        sync = time_saves(state, False, args.saves)
        asyn = time_saves(state, True, args.saves)
        out["models"][model] = {
            "params": cfg.model.param_count(),
            "state_bytes": size,
            "sync": sync,
            "async": asyn,
            "async_over_sync": asyn["blocking_s"] / sync["blocking_s"],
        }
        del state
    if args.token_gb > 0:
        out["token_check"] = token_check_cost(args.token_gb)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
