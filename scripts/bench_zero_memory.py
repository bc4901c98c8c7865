"""Measured per-device memory of ZeRO stages 0–3 at dp = 1, 2, 4, 8 (compiled, not run).

Compiles the real train step on simulated CPU devices for each (stage, dp) and records XLA's
per-device figures next to jaxpar's prediction. Writes ``OUT.json`` (rows), ``OUT.md`` (a
markdown table) and ``OUT.png`` (model states and temporaries per device vs dp, one line per
stage), and prints the rows as one JSON object last.

    PYTHONPATH=. python scripts/bench_zero_memory.py --model tiny --out zero_memory
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxpar.devices import simulate_cpu_devices
from jaxpar.report import emit_json


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and write the table and the plot."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--dps", default="1,2,4,8")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="global batch")
    p.add_argument("--out", default="zero_memory", help="output path prefix")
    args = p.parse_args(argv)
    dps = [int(x) for x in args.dps.split(",")]
    simulate_cpu_devices(max(dps))

    import jax

    from jaxpar import config as C
    from jaxpar import validation as V
    from jaxpar.analysis.memory import dp_comm_theory, measure, theory

    rows = []
    for dp in dps:
        for zero in range(4):
            cfg = C.load(args.model, "cpu-8")
            lay = cfg.layout
            lay.dp, lay.tp, lay.pp, lay.sp, lay.zero = dp, 1, 1, 1, zero
            cfg.train.global_batch, cfg.train.seq_len = args.batch, args.seq
            V.validate(cfg, dp)
            m = measure(cfg, jax.devices()[:dp])
            th = theory(lay, cfg.model, seq=args.seq, microbatch_size=args.batch // dp)
            rows.append(
                {
                    "dp": dp,
                    "zero": zero,
                    "params": cfg.model.param_count(),
                    "predicted_state_bytes": th["stored"]["at_rest_bytes"],
                    "state_bytes": m["state_bytes"],
                    "temp_bytes": m["temp"],
                    "total_bytes": m["total"],
                    "dp_wire_bytes": m["comm"]["dp_wire_bytes"],
                    "dp_wire_theory_bytes": dp_comm_theory(cfg)["total_bytes"],
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    with open(f"{args.out}.json", "w") as f:
        json.dump(rows, f, indent=1)
    mib = 2**20
    lines = [
        "| dp | ZeRO | states predicted (MiB) | states measured (MiB) | temp (MiB) | "
        "dp traffic measured / theory (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dp']} | {r['zero']} | {r['predicted_state_bytes'] / mib:.2f} | "
            f"{r['state_bytes'] / mib:.2f} | {r['temp_bytes'] / mib:.2f} | "
            f"{r['dp_wire_bytes'] / mib:.2f} / {r['dp_wire_theory_bytes'] / mib:.2f} |"
        )
    with open(f"{args.out}.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    _plot(rows, dps, f"{args.out}.png", args.model)
    emit_json({"rows": rows, "table": f"{args.out}.md", "plot": f"{args.out}.png"})
    return 0


def _plot(rows: list[dict], dps: list[int], path: str, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for zero in range(4):
        mine = [r for r in rows if r["zero"] == zero]
        xs = [r["dp"] for r in mine]
        axes[0].plot(xs, [r["state_bytes"] / 2**20 for r in mine], "o-", label=f"ZeRO-{zero}")
        axes[1].plot(xs, [r["temp_bytes"] / 2**20 for r in mine], "o-", label=f"ZeRO-{zero}")
    for ax, title in zip(axes, ("model states at rest", "XLA temporaries"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(dps, [str(d) for d in dps])
        ax.set_xlabel("dp")
        ax.set_ylabel("MiB per device")
        ax.set_title(f"{model}: {title}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
