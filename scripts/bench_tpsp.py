"""Benchmark tensor and sequence parallelism on simulated CPU devices; prints one JSON object.

    python scripts/bench_tpsp.py [--degrees 2 4] [--layers 4] [--seq 64] [--batch 8] [--steps 3]

Rows: mode × degree (dp = 1, the degree is the device count) with ``step_s`` (median wall time
of a training step after compilation; simulated devices share the host's cores, so compare
within one run only), ``temp_bytes`` (compiled temporaries per device of the loss-and-gradient
function: activations), ``temp_ratio`` (to the one-device run) next to theory's
``theory_act_ratio`` (Korthikanti et al. per-layer formula, :mod:`jaxpar.analysis.theory`),
``layer_collectives`` (per layer per device, by kind/axes/pass, bytes) and ``expected``
(theory's per-layer bytes for the same shapes, :func:`jaxpar.analysis.tpsp.expected_per_layer`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

MODES = ("tp", "tp+sp", "ulysses", "ring")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--degrees", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    n = max(args.degrees)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from jaxpar.devices import simulate_cpu_devices

    simulate_cpu_devices(n)
    import jax
    import numpy as np

    from jaxpar import config as C
    from jaxpar import validation as V
    from jaxpar.analysis import theory, tpsp
    from jaxpar.data import Batches, load_corpus
    from jaxpar.report import emit_json

    def make(mode: str, degree: int) -> C.RunConfig:
        cfg = C.load("tiny", "cpu-8")
        cfg.model = C.ModelConfig(
            name="bench",
            n_layers=args.layers,
            d_model=args.d_model,
            n_heads=args.heads,
            n_kv_heads=args.kv_heads,
            d_ff=2 * args.d_model,
            vocab_size=256,
            max_seq_len=args.seq,
        )
        cfg.train.global_batch, cfg.train.seq_len = args.batch, args.seq
        cfg.train.steps, cfg.train.progress = args.steps + 1, False
        lay = cfg.layout
        lay.dp, lay.tp, lay.sp = 1, 1, 1
        if mode in ("tp", "tp+sp"):
            lay.tp, lay.sequence_parallel = degree, mode == "tp+sp"
        elif mode in ("ulysses", "ring"):
            lay.sp, lay.sp_mode = degree, mode
        cfg.mesh.devices = lay.n_devices
        V.validate(cfg, lay.n_devices)
        return cfg

    def theory_act(cfg: C.RunConfig) -> float:
        m, lay = cfg.model, cfg.layout
        return theory.activation_bytes_per_layer(
            args.seq, args.batch, m.d_model, m.n_heads, lay.tp, lay.sequence_parallel, cp=lay.sp
        )

    corpus = load_corpus("stdlib", 256)
    rows = []
    base = make("none", 1)
    base_temp = base_act = None
    for mode, degree in [("none", 1)] + [(m, d) for m in args.modes for d in args.degrees]:
        cfg = base if mode == "none" else make(mode, degree)
        devices = jax.devices()[: cfg.layout.n_devices]
        got = tpsp.measure(cfg, devices)
        tr = got["trainer"]
        step = tr.compile_step()
        state = tr.init_state(0)
        data = Batches(corpus, args.batch, args.seq, seed=0)
        times = []
        for i in range(args.steps + 1):
            batch = data.global_array(i, tr.batch_sharding)
            t0 = time.perf_counter()
            state, met = step(state, batch)
            jax.block_until_ready(met["loss"])
            if i:
                times.append(time.perf_counter() - t0)
        act = theory_act(cfg)
        if mode == "none":
            base_temp, base_act = got["temp_bytes"], act
        rows.append(
            {
                "mode": mode,
                "degree": degree,
                "devices": cfg.layout.n_devices,
                "step_s": statistics.median(times),
                "loss": float(np.asarray(met["loss"])),
                "temp_bytes": got["temp_bytes"],
                "temp_ratio": got["temp_bytes"] / base_temp,
                "theory_act_ratio": act / base_act,
                "layer_collectives": got["layer"].to_dict(),
                "tp_wire_bytes": tpsp.tp_wire_bytes(got["layer"], cfg.layout.tp)
                if cfg.layout.tp > 1
                else 0.0,
                "expected": tpsp.expected_per_layer(cfg),
            }
        )
        msg = f"{mode:8s} {degree}: {rows[-1]['step_s']:.3f}s temp {got['temp_bytes']}"
        print(msg, file=sys.stderr)
    emit_json({"model": C.to_dict(base.model), "batch": args.batch, "seq": args.seq, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
