"""Regenerate the planner's results in docs/planner.md (``## Results``); print a JSON summary.

    python scripts/make_benchmarks.py                        # a minute or two on 2 shared cores
    python scripts/make_benchmarks.py --memory               # also planner vs compiled memory
    python scripts/make_benchmarks.py --memory-json mem.json # reuse a bench_planner_memory run

Rewrites only the text between ``<!-- planner:begin -->`` and ``<!-- planner:end -->`` (appended
when absent). Sections: the plan for llama2-70b on a100-64 beside the mesh file's production
layout and the rule of thumb, with the pick's MFU against published A100 runs of that size; the
llama3-405b search on h100-1024 (time, every printed layout checked with
``validation.validate``); ZeRO-3 at a fixed global batch from 256 to 2048 GPUs; the planner
against published runs (fitted and held-out rows apart, ZeRO-3 at >= 512 GPUs and H100 rows
apart, sources); optionally planner memory against compiled memory (``bench_planner_memory.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpar import config as C  # noqa: E402
from jaxpar import validation as V  # noqa: E402
from jaxpar.planner import cost_layout, plan  # noqa: E402
from jaxpar.planner import hardware as HW  # noqa: E402
from jaxpar.planner import published as P  # noqa: E402
from jaxpar.report import human_bytes  # noqa: E402

BEGIN, END = "<!-- planner:begin -->", "<!-- planner:end -->"


def printed_layouts(result: dict) -> list[dict]:
    """Every layout a plan prints: the recommendation, the alternatives, the baseline."""
    out = [result] + list(result.get("alternatives") or [])
    if result.get("baseline"):
        out.append(result["baseline"])
    return [s["layout"] for s in out if s and s.get("layout")]


def validates(model: str, mesh: str, lay: dict, shape: tuple[int, int]) -> str | None:
    """``validation.validate`` on a printed layout: None, or the refusal."""
    cfg = C.load(model, mesh)
    keep = ("dp", "tp", "pp", "sp", "zero", "virtual", "microbatches", "remat", "offload",
            "sequence_parallel", "dp_shard")  # fmt: skip
    cfg.mesh.layout = C.LayoutConfig(**{k: lay[k] for k in keep})
    cfg.layout.schedule = lay["schedule"] or "1f1b"
    cfg.layout.sp_mode = lay["sp_mode"] or "ulysses"
    cfg.layout.compute_dtype = "bfloat16"
    cfg.train.global_batch, cfg.train.seq_len = shape
    try:
        V.validate(cfg, n_devices=cfg.mesh.devices)
    except C.ConfigError as e:
        return str(e)
    return None


def desc(lay: dict) -> str:
    """One-line layout."""
    out = f"dp{lay['dp']} tp{lay['tp']}{'+SP' if lay['sequence_parallel'] else ''} pp{lay['pp']}"
    out += f" sp{lay['sp']}" + (f" ({lay['sp_mode']})" if lay.get("sp_mode") else "")
    out += f" ZeRO-{lay['zero']}"
    if lay["pp"] > 1:
        out += f" {lay['schedule']} v{lay['virtual']}"
    out += f" mb {lay['microbatch_size']}×{lay['microbatches']} remat {lay['remat']}"
    return out + (f" offload {lay['offload']}" if lay["offload"] != "none" else "")


def plans() -> dict:
    """The two searches and the production layout, with the printed layouts validated."""
    res = {}
    t0 = time.perf_counter()
    res["plan_70b"] = plan(C.load("llama2-70b", "a100-64"), top=3)
    res["plan_70b_s"] = time.perf_counter() - t0
    res["prod_70b"] = cost_layout(C.load("llama2-70b", "a100-64"))
    t0, c0 = time.perf_counter(), time.process_time()
    res["plan_405b"] = plan(C.load("llama3-405b", "h100-1024"), top=3)
    res["plan_405b_s"] = time.perf_counter() - t0
    res["plan_405b_cpu_s"] = time.process_time() - c0
    res["pick_70b_as_torchtitan"] = as_torchtitan(res["plan_70b"])
    refusals = []
    for key, model, mesh in (("plan_70b", "llama2-70b", "a100-64"),
                             ("plan_405b", "llama3-405b", "h100-1024")):  # fmt: skip
        cfg = C.load(model, mesh)
        for lay in printed_layouts(res[key]):
            err = validates(model, mesh, lay, (cfg.train.global_batch, cfg.train.seq_len))
            refusals.append({"plan": key, "layout": desc(lay), "refused": err})
    res["validated"] = refusals
    return res


def as_torchtitan(pick: dict) -> dict:
    """The 70B pick's layout costed as torchtitan's eager FSDP2 runs it with full recompute
    (the published 64-A100 rows' setting), MFU and HFU (recompute counted)."""
    from jaxpar.planner.published_runs import TORCHTITAN
    from jaxpar.planner.search import evaluate, train_flops
    from jaxpar.planner.workload import Shape

    cfg = C.load("llama2-70b", "a100-64")
    lay = C.LayoutConfig(**{k: pick["layout"][k] for k in ("dp", "tp", "pp", "sp", "zero",
                         "microbatches", "remat", "offload", "sequence_parallel")},
                         compute_dtype="bfloat16")  # fmt: skip
    shape = Shape(cfg.train.global_batch, cfg.train.seq_len)
    out = {}
    for remat in (lay.remat, "full"):
        lay.remat = remat
        c = evaluate(cfg.model, cfg.mesh.hardware, lay, shape, executor=TORCHTITAN)
        mfu = train_flops(cfg.model, shape) / c.step_time / 64 / cfg.mesh.hardware.peak_flops_bf16
        out[remat] = {"mfu": mfu, "hfu": mfu * (4 / 3 if remat == "full" else 1.0)}
    return out


def scaling_section() -> list[str]:
    """ZeRO-3 at a fixed global batch, 256 → 2048 A100s (the test's synthetic case)."""
    from jaxpar.planner.cost import step_cost
    from jaxpar.planner.workload import Shape

    model, shape = C.load_model("llama3-8b"), Shape(2048, 2048)
    hw = C.load_mesh("a100-64").hardware
    L = ["### ZeRO-3 at a fixed global batch (synthetic)", "",
         "Llama-3-8B shape, global batch 2048 × 2048 tokens, pure ZeRO-3 over n A100s (the "
         "a100-64 hardware), full remat: each GPU's batch shrinks with n, each layer's three "
         "collectives do not and cross more hops (`tests/test_planner_auto.py::"
         "test_zero3_per_gpu_throughput_falls_at_fixed_global_batch`).", "",
         "| GPUs | sequences/GPU | tokens/s/GPU | ZeRO-3 calls/step | latency s | hidden s | "
         "exposed s |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for n in (256, 512, 1024, 2048):
        lay = C.LayoutConfig(dp=n, tp=1, zero=3, microbatches=1, remat="full",
                             compute_dtype="bfloat16")  # fmt: skip
        cost = step_cost(model, hw, lay, shape)
        z = next(c for c in cost.comm if c.label.startswith("ZeRO-3 per-layer"))
        L.append(f"| {n} | {shape.global_batch // n} | "
                 f"{shape.global_batch * shape.seq / cost.step_time / n:,.0f} | {z.calls:.0f} | "
                 f"{z.latency_s:.3f} | {z.hidden_s:.3f} | {z.exposed_s:.3f} |")  # fmt: skip
    return L + [""]


def memory_rows(path: str | None) -> dict:
    """bench_planner_memory.py's JSON (run now unless a saved one is given)."""
    if path:
        return json.loads(Path(path).read_text())
    script = ROOT / "scripts" / "bench_planner_memory.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=3000, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def pct(x: float) -> str:
    return f"{x:+.1%}"


def _published_a100_64() -> list[dict]:
    """Published rows on 64 A100s (the a100-64 cluster's size)."""
    return [r for r in P.comparison() if r["gpu"] == "A100" and r["gpus"] == 64]


def plan_section(res: dict) -> list[str]:
    p70 = res["plan_70b"]
    L = ["### llama2-70b on a100-64 (64 × A100-80GB), batch 64 × 4096", "",
         "`jaxpar plan --model llama2-70b --mesh a100-64` (searched in "
         f"{res['plan_70b_s']:.1f} s) beside the mesh file's production layout and the rule "
         "of thumb, jaxpar's executor as this tree compiles it:", "",
         "| | layout | step s | tokens/s | MFU | bubble | exposed comm s | hidden comm s | "
         "memory/device |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for title, s in (("recommended", p70), ("production (mesh file)", res["prod_70b"]),
                     ("rule of thumb", p70.get("baseline"))):  # fmt: skip
        if s:
            exp = sum(c["exposed_s"] for c in s["communication"])
            hid = sum(c["hidden_s"] for c in s["communication"])
            L.append(
                f"| {title} | {desc(s['layout'])} | {s['step_time_s']:.2f} | "
                f"{s['tokens_per_s']:,.0f} | {s['mfu']:.1%} | {s['bubble_fraction']:.1%} | "
                f"{exp:.2f} | {hid:.2f} | {human_bytes(s['memory_per_device_bytes'])} |"
            )
    prod, rec = res["prod_70b"]["step_time_terms_s"], p70["step_time_terms_s"]
    diffs = sorted(((prod[k] - rec[k], k) for k in prod), reverse=True)
    L += ["", "Production vs recommended, by term (s): "
          + ", ".join(f"{k} {d:+.2f}" for d, k in diffs if abs(d) > 0.01) + ".",
          "", f"Cost model vs rule of thumb: {p70['baseline_note']}.", ""]  # fmt: skip
    tt = res["pick_70b_as_torchtitan"]
    L += ["Against published A100 runs of that size (64 GPUs; MFU = 6Ψ + 12·l·h·s per token, "
          "HFU counts a full recompute's forward):", "",
          "| run | MFU published | predicted |", "|---|---|---|"]  # fmt: skip
    for r in _published_a100_64():
        mfu = r["published_tokens_per_s_per_gpu"] * _flops_per_token(r["name"]) / 312e12
        L.append(f"| {r['name']} ({r['layout']}) | {mfu:.1%} | "
                 f"{mfu * (1 + r['error']):.1%} |")  # fmt: skip
    L += [
        "",
        f"The pick ({p70['mfu']:.1%} MFU) keeps selective remat and jaxpar's fused "
        f"elementwise work; the same layout costed as torchtitan runs it (eager elementwise, "
        f"{p70['layout']['remat']} remat): {tt[p70['layout']['remat']]['mfu']:.1%} MFU; with "
        f"its full recompute: {tt['full']['mfu']:.1%} MFU, {tt['full']['hfu']:.1%} HFU.",
        "",
    ]
    p405 = res["plan_405b"]
    bad = [v for v in res["validated"] if v["refused"]]
    L += [
        "### Search time: llama3-405b on h100-1024",
        "",
        f"`jaxpar plan --model llama3-405b --mesh h100-1024` answered in "
        f"{res['plan_405b_s']:.2f} s wall, {res['plan_405b_cpu_s']:.2f} s of CPU (jax already "
        f"imported; {p405['costed']} layouts costed, {p405['refused']} refused by "
        f"`validation.check_layout` before costing, {p405['evaluated']} fit); recommended: "
        f"{desc(p405['layout'])}, {p405['step_time_s']:.1f} s/step, MFU {p405['mfu']:.1%}.",
        "",
        f"Every layout both plans print ({len(res['validated'])}: recommendations, "
        f"alternatives, baselines) passes `validation.validate`: "
        f"{'yes' if not bad else 'NO — ' + '; '.join(b['refused'] for b in bad)}.",
        "",
    ]
    return L


def _flops_per_token(name: str) -> float:
    from jaxpar.analysis.theory import train_flops_per_token

    run = next(r for r in P.RUNS if r.name == name)
    return train_flops_per_token(run.model, run.seq)


def _table(rows: list[dict]) -> list[str]:
    L = ["| run | GPUs | framework | layout | published tok/s/GPU | predicted | error | source |",
         "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        L.append(f"| {r['name']} | {r['gpus']} × {r['gpu']} | {r['framework']} | "
                 f"{r['layout']} | {r['published_tokens_per_s_per_gpu']:,.0f} | "
                 f"{r['predicted_tokens_per_s_per_gpu']:,.0f} | {pct(r['error'])} | "
                 f"{r['source']}; {r['note']} |")  # fmt: skip
    return L + [""]


def published_section(rows: list[dict], fit: P.Fit) -> list[str]:
    s = P.summary(rows)
    consts = "; ".join(f"{n}: matmul_share_max {a}, elementwise_share {b}"
                       for n, a, b in fit.constants)  # fmt: skip
    L = ["### Planner vs published runs", "",
         "Step time predicted by the planner's cost model (the one `jaxpar plan` uses; each "
         "framework described by its `Executor`) on the repository's mesh file for the GPU, "
         "against the published figure. Error = predicted throughput / published − 1. "
         f"Constants fitted on the {s['fitted']['rows']} *fitted* rows only (chosen before the "
         f"fit): {consts}; `kappa` = 1, 2 elementwise passes (6 for eager PyTorch) set.", "",
         "| rows | count | median \\|error\\| | within 20% | largest \\|error\\| |",
         "|---|---|---|---|---|"]  # fmt: skip
    for key, title in (("held_out", "**held out**"), ("held_out_a100", "held out, A100"),
                       ("held_out_h100", "held out, H100"),
                       ("held_out_zero3_512plus", "held out, ZeRO-3 at >= 512 GPUs"),
                       ("fitted", "fitted")):  # fmt: skip
        g = s[key]
        L.append(
            f"| {title} | {g['rows']} | {g['median_abs_error']:.1%} | "
            f"{g['within_20pct']:.0%} | {g['max_abs_error']:.1%} |"
        )
    held = [r for r in rows if not r["fitted"]]
    L += ["", "#### Fitted rows", "", *_table([r for r in rows if r["fitted"]])]
    L += [
        "#### Held-out rows: ZeRO-3 at >= 512 GPUs",
        "",
        *_table([r for r in held if r["zero3"] and r["gpus"] >= 512]),
    ]
    L += ["#### Held-out rows: H100", "", *_table([r for r in held if r["gpu"] == "H100"])]
    L += ["#### Held-out rows: A100", "", *_table([r for r in held if r["gpu"] == "A100"])]
    return L


def memory_section(mem: dict) -> list[str]:
    L = ["### Planner memory vs compiled memory (simulated CPU devices)", "",
         "`python scripts/bench_planner_memory.py`: the test model (4 layers, d 64, 4/2 heads, "
         "batch 16 × 32, fp32); measured = XLA's compiled per-device total (arguments + outputs "
         "− aliased + temporaries); predicted = `jaxpar.planner.footprint.memory`. The XLA "
         "constants were fitted on one-device compiles (`--calibrate`; its base compile is the "
         "dp=1 row), the pp 2 × 1F1B row set `Executor.tick_stashes`: these two rows are marked "
         "*calibration* and not counted.", "",
         f"**{mem['within_10pct']} of {mem['validated']} validated layouts within 10%; largest "
         f"|error| {mem['max_abs_error']:.1%}.**", "",
         "| layout | measured | predicted | error | |", "|---|---|---|---|---|"]  # fmt: skip
    for r in mem["rows"]:
        tag = f"calibration ({r['calibrated']})" if r["calibrated"] else ""
        L.append(
            f"| {r['layout']} | {human_bytes(r['measured_bytes'])} | "
            f"{human_bytes(r['predicted_bytes'])} | {pct(r['rel_error'])} | {tag} |"
        )
    L += ["", "What these rows describe is the train step as it compiles by default: the "
          "blockwise attention kernel, the cross entropy in chunks, the pipeline's fused ticks "
          "with no copy of the scan carry (`Executor.carry_copies` = 0). Rows outside 10% are "
          "the pipelines (the planner's stash, tick and I → W terms are XLA:GPU's; XLA:CPU "
          "holds less of them) and Megatron-SP at this size: open.", ""]  # fmt: skip
    return L


def splice(path: Path, body: str) -> None:
    """Replace the text between the markers (append the block when there is none)."""
    block = f"{BEGIN}\n{body}{END}\n"
    text = path.read_text() if path.exists() else "# jaxpar benchmarks\n\n"
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END) + r"\n?", lambda _: block,
                      text, count=1, flags=re.S)  # fmt: skip
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "docs" / "planner.md"))
    ap.add_argument("--memory", action="store_true", help="run bench_planner_memory.py too")
    ap.add_argument("--memory-json", default=None, help="saved bench_planner_memory.py output")
    args = ap.parse_args()
    res = plans()
    fit, rows = P.fit()
    machine = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True,
                             text=True).stdout.split(":", 1)[-1].strip()  # fmt: skip
    head = [f"Regenerated by `python scripts/make_benchmarks.py` on {machine}, "
            f"{time.strftime('%Y-%m-%d', time.gmtime())} (pure Python: the cost model, no "
            "device).", ""]  # fmt: skip
    stale = [
        m
        for m in HW.GPU_MESHES
        if C.load_mesh(m).hardware.matmul_efficiency != HW.gpu_curve(C.load_mesh(m).hardware)
    ]
    mem = memory_rows(args.memory_json) if args.memory or args.memory_json else None
    body = head + plan_section(res) + scaling_section() + published_section(rows, fit)
    body += memory_section(mem) if mem else []
    splice(Path(args.out), "\n".join(body) + "\n")
    print(json.dumps({
        "plan_405b_s": res["plan_405b_s"], "plan_70b_s": res["plan_70b_s"],
        "printed_layouts": len(res["validated"]),
        "refused": [v for v in res["validated"] if v["refused"]],
        "fit": fit.constants, "published": P.summary(rows), "stale_mesh_curves": stale,
        "memory": {k: mem[k] for k in ("validated", "within_10pct", "max_abs_error")} if mem
        else None,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
