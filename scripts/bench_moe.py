"""Mixture of experts on simulated CPU devices: step time against the dense model of the same
active parameters, and expert balance with and without the routing-bias rule. Prints JSON.

* ``step_time``: ``tiny-moe`` (8 experts of width 256, top-2, one shared; layer 0 dense) and
  ``tiny`` (d_ff 768 = the three experts one token reads) on the same layout, one process,
  dropless and with a capacity factor; median step time of ``--steps`` steps after the first.
* ``balance``: a small MoE trained ``--balance-steps`` steps on the embedded corpus on one
  device, with ``bias_rate`` 1e-3 and 0: per-layer max/mean expert load at the last step and
  averaged over the last 20, and the held-out loss of both.

Usage: ``python scripts/bench_moe.py [--steps 4] [--balance-steps 200]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _cfg(model: str, steps: int, **layout):
    from jaxpar import config as C

    cfg = C.load("tiny", "cpu-8")
    cfg.model = C.load_model(model)
    cfg.train.steps, cfg.train.eval_every, cfg.train.progress = steps, 0, False
    cfg.train.checkpoint_dir = None
    for k, v in layout.items():
        setattr(cfg.layout, k, v)
    cfg.mesh.devices = cfg.layout.n_devices
    return cfg


def step_times(steps: int) -> dict:
    """Median step time of tiny-moe (dropless, cf 1.25) and tiny on dp 4 x tp 2 (ep 4)."""
    import jax

    from jaxpar.train.loop import run

    layout = dict(pp=1, dp=4, tp=2, microbatches=1)
    out = {"layout": {**layout, "ep_moe": 4}, "steps_timed": steps - 1}
    runs = {
        "dense": _cfg("tiny", steps, **layout),
        "moe_dropless": _cfg("tiny-moe", steps, ep=4, **layout),
        "moe_cf1.25": _cfg("tiny-moe", steps, ep=4, **layout),
    }
    runs["moe_cf1.25"].model.moe.capacity_factor = 1.25
    for name, cfg in runs.items():
        summary = run(cfg, devices=jax.devices()[: cfg.layout.n_devices], quiet=True)
        out[name] = {
            "step_time_s": summary["step_time_s"],
            "params": cfg.model.param_count(),
            "active_params": cfg.model.active_param_count(),
        }
    for name in ("moe_dropless", "moe_cf1.25"):
        out[name]["ratio_to_dense"] = out[name]["step_time_s"] / out["dense"]["step_time_s"]
    return out


def balance(steps: int) -> dict:
    """Expert load and held-out loss after ``steps`` steps, bias rule on and off."""
    import jax

    from jaxpar import config as C
    from jaxpar.train.loop import run

    out = {}
    for name, rate in (("bias_rule", 1e-3), ("no_bias", 0.0)):
        cfg = _cfg("tiny", steps, pp=1, dp=1, tp=1, microbatches=1, remat="none")
        cfg.model = C.ModelConfig(
            name="moe-balance", n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=192,
            vocab_size=256, max_seq_len=64,
            moe=C.MoeConfig(experts=8, top_k=2, shared_experts=1, expert_ff=64,
                            first_dense=1, bias_rate=rate),
        )  # fmt: skip
        cfg.train.global_batch, cfg.train.seq_len, cfg.train.eval_every = 16, 64, steps
        with tempfile.TemporaryDirectory() as tmp:
            cfg.train.metrics_file = str(Path(tmp) / "metrics.jsonl")
            summary = run(cfg, devices=jax.devices()[:1], quiet=True)
            recs = [json.loads(x) for x in Path(cfg.train.metrics_file).read_text().splitlines()]
        loads = [r["moe_load"] for r in recs if "moe_load" in r]
        tail = loads[-20:]
        out[name] = {
            "bias_rate": rate,
            "load_max_over_mean_last": loads[-1],
            "load_max_over_mean_last20": [sum(c) / len(tail) for c in zip(*tail, strict=True)],
            "load_max_over_mean_first": loads[0],
            "final_loss": summary["final_loss"],
            "eval_loss": summary["eval_loss"],
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="steps per timed run (first untimed)")
    p.add_argument("--balance-steps", type=int, default=200)
    p.add_argument("--skip-timing", action="store_true")
    args = p.parse_args()
    from jaxpar.devices import simulate_cpu_devices

    simulate_cpu_devices(8)
    import platform

    result = {"machine": platform.processor() or platform.machine()}
    result["balance"] = balance(args.balance_steps)
    if not args.skip_timing:
        result["step_time"] = step_times(args.steps)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
