"""Regenerate BENCHMARKS.md and its plots (docs/benchmarks/*.png); print a JSON summary.

    python scripts/make_benchmarks.py            # about 5-10 minutes on 2 shared CPU cores

Sections: planner recommendations (llama2-70b on a100-64 beside its production layout; the
llama3-405b search time), planner vs published throughput (Megatron-LM 2021), predicted vs
measured per-device memory on simulated CPU devices, parallel overhead of each layout against
one device (step-time ratio, same machine), ZeRO memory scaling (measured), and the schedule
comparison (schedule library; ``scripts/bench_schedules.py`` too when it exists).
Measurements use ``jaxpar.commands.bench.bench`` (Trainer, compiled memory, median step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpar.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402

from jaxpar import config as C  # noqa: E402
from jaxpar.analysis import theory as T  # noqa: E402
from jaxpar.commands.bench import bench  # noqa: E402
from jaxpar.planner import cost_layout, plan  # noqa: E402
from jaxpar.planner import memory as M  # noqa: E402
from jaxpar.planner.pipe import figures  # noqa: E402
from jaxpar.planner.published import megatron_comparison  # noqa: E402
from jaxpar.report import human_bytes  # noqa: E402

PNG = ROOT / "docs" / "benchmarks"

# Small layouts on the test model (4 layers, d 64, 4 heads, 2 kv heads, batch 16 × 32 tokens).
LAYOUTS = [
    dict(dp=1),
    dict(dp=8, zero=0),
    dict(dp=8, zero=1),
    dict(dp=8, zero=2),
    dict(dp=8, zero=3),
    dict(dp=2, tp=4, zero=1),
    dict(dp=4, tp=2, zero=3),
    dict(dp=2, tp=4, zero=3, remat="selective"),
    dict(dp=8, zero=1, remat="full"),
    dict(dp=8, zero=1, remat="selective"),
    dict(dp=8, zero=1, microbatches=2),
    dict(dp=4, tp=2, sequence_parallel=True),
    dict(dp=2, pp=4, microbatches=4, schedule="1f1b"),
    dict(dp=4, pp=2, microbatches=4, schedule="zbv", virtual=2),
]


def landed(layout: dict) -> str | None:
    """Why a layout's feature is not implemented in this checkout (its measurement is then of
    a program without the feature, e.g. pp replicating instead of pipelining), else None."""
    if layout.get("pp", 1) > 1 and not (ROOT / "jaxpar" / "pipeline" / "executor.py").exists():
        return "pipeline executor not in this checkout"
    if (
        layout.get("sequence_parallel")
        and "sequence_parallel" not in (ROOT / "jaxpar" / "sharding.py").read_text()
    ):
        return "Megatron sequence parallelism not in this checkout"
    return None


def small_config(**layout) -> C.RunConfig:
    """The test suite's small run (tests/conftest.py), layout applied."""
    cfg = C.load("tiny", "cpu-8")
    cfg.model = C.ModelConfig(name="test", n_layers=4, d_model=64, n_heads=4, n_kv_heads=2,
                              d_ff=128, vocab_size=256, max_seq_len=64)  # fmt: skip
    cfg.train.global_batch, cfg.train.seq_len, cfg.train.steps = 16, 32, 5
    cfg.train.warmup_steps, cfg.train.eval_every, cfg.train.progress = 2, 0, False
    cfg.layout.dp, cfg.layout.tp = 1, 1
    for k, v in layout.items():
        setattr(cfg.layout, k, v)
    cfg.mesh.devices = cfg.layout.n_devices
    return cfg


def name_of(layout: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items())


def predict_memory(cfg: C.RunConfig) -> dict[str, float]:
    lay = cfg.layout
    stashes = figures(lay.schedule, lay.pp, lay.microbatches, lay.virtual).peak_stashes
    return M.memory(cfg.model, lay, M.Shape(cfg.train.global_batch, cfg.train.seq_len), stashes)


def measure(layout: dict) -> dict | None:
    cfg = small_config(**layout)
    try:
        C.validate(cfg, n_devices=cfg.layout.n_devices)
        cfg.train.steps = 3
        out = bench(cfg, devices=jax.devices()[: cfg.layout.n_devices], warmup=1)
    except Exception as e:  # noqa: BLE001  (a feature not landed yet: reported, not fatal)
        return {"layout": name_of(layout), "failed": f"{type(e).__name__}: {str(e)[:160]}"}
    pred = predict_memory(cfg)
    return {
        "layout": name_of(layout),
        "not_landed": landed(layout),
        "measured_bytes": out["memory_per_device_bytes"],
        "predicted_bytes": pred["total"],
        "predicted": pred,
        "rel_error": pred["total"] / out["memory_per_device_bytes"] - 1,
        "step_time_s": out["step_time_s"],
        "compile_s": out["compile_s"],
        "collective_bytes": out["collective_bytes"],
    }


def zero_scaling(known: list[dict], dps: list[int]) -> list[dict]:
    rows = []
    for dp in dps:
        for zero in (0, 1, 2, 3):
            name = name_of(dict(dp=dp, zero=zero))
            r = next((dict(x) for x in known if x["layout"] == name), None)
            r = r or measure(dict(dp=dp, zero=zero))
            r.update(dp=dp, zero=zero)
            cfg = small_config(dp=dp, zero=zero)
            st = T.stored_model_states(cfg.model, cfg.layout)
            r["stored_states_bytes"] = st["params"] + st["optimizer"]
            rows.append(r)
    return rows


def schedule_table() -> list[dict]:
    rows = []
    for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2),
                    ("dualpipev", 2)):  # fmt: skip
        for p, m in ((4, 8), (4, 16)):
            lock = figures(kind, p, m, v)
            asyn = figures(kind, p, m, v, lockstep=False)
            rows.append({"schedule": kind, "p": p, "m": m, "v": v,
                         "bubble_async": asyn.bubble_fraction,
                         "bubble_lockstep": lock.bubble_fraction,
                         "peak_stashes": lock.peak_stashes, "ticks": lock.ticks})  # fmt: skip
    return rows


def external(script: str) -> dict | None:
    """The last JSON line of ``scripts/<script>`` (None when the script does not exist)."""
    path = ROOT / "scripts" / script
    if not path.exists():
        return None
    res = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=900)
    lines = [x for x in res.stdout.splitlines() if x.startswith("{")]
    return json.loads(lines[-1]) if res.returncode == 0 and lines else {"error": res.stderr[-300:]}


def plots(mem: list[dict], zero: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    PNG.mkdir(parents=True, exist_ok=True)
    ok = [r for r in mem if "failed" not in r and not r.get("not_landed")]
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=80)
    xs = range(len(ok))
    ax.bar([x - 0.2 for x in xs], [r["measured_bytes"] / 2**20 for r in ok], 0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [r["predicted_bytes"] / 2**20 for r in ok], 0.4,
           label="predicted")  # fmt: skip
    ax.set_xticks(list(xs), [r["layout"] for r in ok], rotation=60, ha="right", fontsize=6)
    ax.set_ylabel("MiB per device")
    ax.set_title("planner memory vs compiled memory (test model)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PNG / "memory_predicted_vs_measured.png")
    fig, ax = plt.subplots(figsize=(5, 3), dpi=80)
    for zst in (0, 1, 2, 3):
        pts = [r for r in zero if r["zero"] == zst and "failed" not in r]
        ax.plot([r["dp"] for r in pts], [r["measured_bytes"] / 2**20 for r in pts], "o-",
                label=f"ZeRO-{zst}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("dp")
    ax.set_ylabel("compiled MiB per device")
    ax.set_title("ZeRO memory scaling (measured)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PNG / "zero_memory_scaling.png")
    fig, ax = plt.subplots(figsize=(6, 3), dpi=80)
    base = next(r for r in ok if r["layout"] == "dp=1")["step_time_s"]
    ax.barh([r["layout"] for r in ok], [r["step_time_s"] / base for r in ok])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.tick_params(labelsize=6)
    ax.set_xlabel("step time / one device")
    ax.set_title("parallel overhead on one CPU machine (simulated devices)", fontsize=9)
    fig.tight_layout()
    fig.savefig(PNG / "parallel_overhead.png")
    plt.close("all")


def pct(x: float) -> str:
    return f"{x:+.1%}"


def write_md(res: dict) -> str:
    L = ["# jaxpar benchmarks", "",
         "Generated by `python scripts/make_benchmarks.py` (do not edit by hand). CPU figures",
         "come from simulated devices on a 2-core machine shared with other jobs: memory is",
         "exact (XLA's compiled buffers), times are noisy and say nothing about GPUs.",
         ""]  # fmt: skip
    p70 = res["plan_70b"]
    L += ["## Planner: llama2-70b on a100-64 (64 × A100-80GB), batch 64 × 4096", "",
          "`jaxpar plan --model llama2-70b --mesh a100-64` and "
          "`jaxpar plan --model llama2-70b --mesh a100-64 --layout-from-mesh`:", "",
          "| | layout | step s | tokens/s | MFU | bubble | memory/device | params | grads(+accum) "
          "| optimizer | activations |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for title, s in (("recommended", p70), ("production (mesh file)", res["prod_70b"]),
                     ("rule of thumb", p70["baseline"])):  # fmt: skip
        if not s:
            continue
        b, lay = s["memory_breakdown_bytes"], s["layout"]
        desc = (f"dp{lay['dp']} tp{lay['tp']}{'+SP' if lay['sequence_parallel'] else ''} "
                f"pp{lay['pp']} sp{lay['sp']} ZeRO-{lay['zero']} "
                f"{lay['schedule'] or ''} v{lay['virtual']} mb {lay['microbatch_size']}"
                f"×{lay['microbatches']} remat {lay['remat']}")  # fmt: skip
        L.append(f"| {title} | {desc} | {s['step_time_s']:.2f} | {s['tokens_per_s']:,.0f} | "
                 f"{s['mfu']:.1%} | {s['bubble_fraction']:.1%} | "
                 f"{human_bytes(s['memory_per_device_bytes'])} | {human_bytes(b['params'])} | "
                 f"{human_bytes(b['grads'] + b['grad_accum'])} | {human_bytes(b['optimizer'])} | "
                 f"{human_bytes(b['activations'])} |")  # fmt: skip
    prod, rec = res["prod_70b"]["step_time_terms_s"], p70["step_time_terms_s"]
    diffs = sorted(((prod[k] - rec[k], k) for k in prod), reverse=True)
    L += ["", "Production layout vs recommended, by term (s): "
          + ", ".join(f"{k} {d:+.2f}" for d, k in diffs if abs(d) > 0.01)
          + ". jaxpar's executor runs the schedule table in lock step (a tick lasts as long as "
          "its slowest action), so interleaved 1F1B, whose ticks mix forwards and backwards, "
          "pays a much larger bubble than its asynchronous figure (see the schedule table); "
          "zero-bubble schedules split the backward into equal-cost pieces and do not.",
          "", f"Cost model vs rule of thumb: {p70['baseline_note']}.", "",
          f"`jaxpar plan --model llama3-405b --mesh h100-1024` answered in "
          f"{res['plan_405b_s']:.2f} s ({res['plan_405b']['costed']} layouts costed, "
          f"{res['plan_405b']['evaluated']} fit).",
          ""]  # fmt: skip
    L += ["## Planner vs published throughput (Megatron-LM, Narayanan et al. 2021, Table 1)", "",
          "TFLOP/s per A100 counting recomputation, as the paper does. Rows marked *fit* "
          "calibrated the planner's two matmul-efficiency constants; the others are held out.",
          "", "| model | tp | pp | dp | GPUs | batch | published | predicted | error | |",
          "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res["megatron"]:
        L.append(f"| {r['model']} | {r['tp']} | {r['pp']} | {r['dp']} | {r['gpus']} | "
                 f"{r['batch']} | {r['published_tflops']:.0f} | {r['predicted_tflops']:.0f} | "
                 f"{pct(r['error'])} | {'fit' if r['fitted'] else 'held out'} |")  # fmt: skip
    L += ["", "## Predicted vs measured memory per device (simulated CPU devices)", "",
          "Test model (4 layers, d 64, 4/2 heads, batch 16 × 32, fp32). Measured: "
          "`compiled_memory(Trainer.compile_step())['total']` (arguments + outputs − aliased + "
          "temporaries). Predicted: `jaxpar.planner.memory.memory` (what jaxpar stores: fp32 "
          "params, grads, Adam m and v).", "",
          "| layout | measured | predicted | error | step ms | vs one device |",
          "|---|---|---|---|---|---|"]  # fmt: skip
    base = next((r["step_time_s"] for r in res["memory"] if r["layout"] == "dp=1"
                 and "failed" not in r), None)  # fmt: skip
    for r in res["memory"]:
        if "failed" in r:
            L.append(f"| {r['layout']} | not run: {r['failed']} | | | | |")
            continue
        ratio = f"{r['step_time_s'] / base:.2f}×" if base else ""
        if r.get("not_landed"):
            ratio += f" (not validated: {r['not_landed']})"
        L.append(f"| {r['layout']} | {human_bytes(r['measured_bytes'])} | "
                 f"{human_bytes(r['predicted_bytes'])} | {pct(r['rel_error'])} | "
                 f"{r['step_time_s'] * 1e3:.1f} | {ratio} |")  # fmt: skip
    valid = [r for r in res["memory"] if "failed" not in r and not r.get("not_landed")]
    worst = max(valid, key=lambda r: abs(r["rel_error"]))
    L += ["", f"{len(valid)} layouts validated; largest error {pct(worst['rel_error'])} "
          f"({worst['layout']}). Rows marked *not validated* measure a program without the "
          "feature (it had not landed when this was generated).",
          "", "![memory](docs/benchmarks/memory_predicted_vs_measured.png)", "",
          "## Parallel overhead against one device", "",
          "Step-time ratio, same global batch, same machine (last column above). On one CPU "
          "host the simulated devices share 2 cores, so the ratio measures the partitioned "
          "program's extra work and collectives, not a speed-up.", "",
          "![overhead](docs/benchmarks/parallel_overhead.png)", "",
          "## ZeRO memory scaling (measured, test model)", "",
          "| dp | ZeRO-0 | ZeRO-1 | ZeRO-2 | ZeRO-3 |", "|---|---|---|---|---|"]  # fmt: skip
    for dp in sorted({r["dp"] for r in res["zero"]}):
        cells = []
        for z in (0, 1, 2, 3):
            r = next(x for x in res["zero"] if x["dp"] == dp and x["zero"] == z)
            cells.append(human_bytes(r["measured_bytes"]) if "measured_bytes" in r else "n/a")
        L.append(f"| {dp} | " + " | ".join(cells) + " |")
    L += ["", "![zero](docs/benchmarks/zero_memory_scaling.png)", "",
          "## Schedule comparison (schedule library, f = i = w = 1)", "",
          "| schedule | p | m | v | bubble (async) | bubble (lock-step, jaxpar's executor) | "
          "peak stashes | ticks |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res["schedules"]:
        L.append(f"| {r['schedule']} | {r['p']} | {r['m']} | {r['v']} | "
                 f"{r['bubble_async']:.1%} | {r['bubble_lockstep']:.1%} | {r['peak_stashes']} | "
                 f"{r['ticks']} |")  # fmt: skip
    if res.get("bench_schedules"):
        L += ["", "`scripts/bench_schedules.py`:", "", "```",
              json.dumps(res["bench_schedules"], indent=1)[:3000], "```"]  # fmt: skip
    L += data_section(res.get("bench_data"))
    return "\n".join(L) + "\n"


def data_section(d: dict | None) -> list[str]:
    """`scripts/bench_data.py`: data preparation throughput and decode speed."""
    if not d or "decode" not in d:
        return [] if not d else ["", "`scripts/bench_data.py` failed: " + str(d)[:300]]
    L = ["", "## Data preparation and decoding (`scripts/bench_data.py`)", ""]
    if "prepare" in d:
        pr = d["prepare"]
        rates = ", ".join(f"{w} worker(s) {v:.2f} MB/s" for w, v in pr["mb_per_s"].items())
        L += [f"`jaxpar data prepare stdlib` ({pr['input_mb']:.1f} MB, BPE of {pr['vocab_size']} "
              f"tokens trained in {pr['train_tokenizer_s']:.1f} s, {pr['bytes_per_token']:.2f} "
              f"bytes/token): {rates}; {pr['runs']} runs byte-identical: "
              f"{pr['byte_identical']}.", ""]  # fmt: skip
    L += ["Decode: tiny model, greedy, 16-token prompts, 128 new tokens, simulated CPU devices.",
          "",
          "| tp | batch | tokens/s | prefill ms | compile s | compilations on later calls |",
          "|---|---|---|---|---|---|"]  # fmt: skip
    for r in d["decode"]["rows"]:
        L.append(f"| {r['tp']} | {r['batch']} | {r['tokens_per_s']:,.0f} | "
                 f"{r['prefill_ms']:.1f} | {r['compile_s']:.1f} | "
                 f"{r['compiles_after_first_call']} |")  # fmt: skip
    return L


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--raw", default=None, help="also save the raw results (JSON) here")
    ap.add_argument(
        "--from-raw", default=None, help="reuse saved measurements; recompute the planner parts"
    )
    ap.add_argument("--zero-dp", type=int, nargs="+", default=[2, 4, 8], help="dp sizes")
    args = ap.parse_args()
    res: dict = {}
    if args.from_raw:  # reuse the measurements, recompute the (cheap) planner sections
        res = json.loads(Path(args.from_raw).read_text())
    res["plan_70b"] = plan(C.load("llama2-70b", "a100-64"), top=3)
    res["prod_70b"] = cost_layout(C.load("llama2-70b", "a100-64"))
    t0 = time.perf_counter()
    res["plan_405b"] = plan(C.load("llama3-405b", "h100-1024"), top=3)
    res["plan_405b_s"] = time.perf_counter() - t0
    res["megatron"] = megatron_comparison()
    res["schedules"] = schedule_table()
    if args.from_raw:
        plots(res["memory"], res["zero"])
        Path(args.out).write_text(write_md(res))
        return
    res["memory"] = []
    for lay in LAYOUTS:
        res["memory"].append(measure(lay))
        print(json.dumps(res["memory"][-1], default=str), file=sys.stderr, flush=True)
    res["zero"] = zero_scaling(res["memory"], args.zero_dp)
    res["bench_schedules"] = external("bench_schedules.py")
    res["bench_data"] = external("bench_data.py")
    if args.raw:
        Path(args.raw).write_text(json.dumps(res, default=str))
    plots(res["memory"], res["zero"])
    Path(args.out).write_text(write_md(res))
    summary = {
        "plan_405b_s": res["plan_405b_s"],
        "memory_errors": {r["layout"]: r.get("rel_error", r.get("failed")) for r in res["memory"]},
        "megatron_errors": {r["model"]: r["error"] for r in res["megatron"]},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
