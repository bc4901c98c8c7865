"""Regenerate the planner's sections of BENCHMARKS.md; print a JSON summary.

    python scripts/make_benchmarks.py                        # about 6 minutes on 2 shared cores
    python scripts/make_benchmarks.py --memory-json mem.json # reuse a bench_planner_memory run

Rewrites only the text between ``<!-- planner:begin -->`` and ``<!-- planner:end -->`` (appended
when absent), so other sections of BENCHMARKS.md are left as their own scripts wrote them.
Sections: the plan for llama2-70b on a100-64 beside the mesh file's production layout and the
rule of thumb; the llama3-405b search on h100-1024 (time, and every printed layout checked with
``validation.validate``); the planner against published runs (fitted and held-out rows, sources);
planner memory against compiled memory on simulated devices (``bench_planner_memory.py``).
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
    t0 = time.perf_counter()
    res["plan_405b"] = plan(C.load("llama3-405b", "h100-1024"), top=3)
    res["plan_405b_s"] = time.perf_counter() - t0
    refusals = []
    for key, model, mesh in (("plan_70b", "llama2-70b", "a100-64"),
                             ("plan_405b", "llama3-405b", "h100-1024")):  # fmt: skip
        cfg = C.load(model, mesh)
        for lay in printed_layouts(res[key]):
            err = validates(model, mesh, lay, (cfg.train.global_batch, cfg.train.seq_len))
            refusals.append({"plan": key, "layout": desc(lay), "refused": err})
    res["validated"] = refusals
    return res


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


def plan_section(res: dict) -> list[str]:
    p70 = res["plan_70b"]
    L = ["## Planner: llama2-70b on a100-64 (64 × A100-80GB), batch 64 × 4096", "",
         "`jaxpar plan --model llama2-70b --mesh a100-64` (searched in "
         f"{res['plan_70b_s']:.1f} s) and `--layout-from-mesh` (the mesh file's production "
         "layout), jaxpar's executor as this tree compiles it:", "",
         "| | layout | step s | tokens/s | MFU | bubble | memory/device |",
         "|---|---|---|---|---|---|---|"]  # fmt: skip
    for title, s in (("recommended", p70), ("production (mesh file)", res["prod_70b"]),
                     ("rule of thumb", p70.get("baseline"))):  # fmt: skip
        if s:
            L.append(f"| {title} | {desc(s['layout'])} | {s['step_time_s']:.2f} | "
                     f"{s['tokens_per_s']:,.0f} | {s['mfu']:.1%} | {s['bubble_fraction']:.1%} | "
                     f"{human_bytes(s['memory_per_device_bytes'])} |")  # fmt: skip
    prod, rec = res["prod_70b"]["step_time_terms_s"], p70["step_time_terms_s"]
    diffs = sorted(((prod[k] - rec[k], k) for k in prod), reverse=True)
    L += ["", "Production vs recommended, by term (s): "
          + ", ".join(f"{k} {d:+.2f}" for d, k in diffs if abs(d) > 0.01) + ".",
          "", f"Cost model vs rule of thumb: {p70['baseline_note']}.", ""]  # fmt: skip
    p405 = res["plan_405b"]
    bad = [v for v in res["validated"] if v["refused"]]
    L += [
        "## Planner search: llama3-405b on h100-1024",
        "",
        f"`jaxpar plan --model llama3-405b --mesh h100-1024` answered in "
        f"{res['plan_405b_s']:.2f} s ({p405['costed']} layouts costed, {p405['refused']} "
        f"refused by `validation.check_layout` before costing, {p405['evaluated']} fit); "
        f"recommended: {desc(p405['layout'])}, {p405['step_time_s']:.1f} s/step, MFU "
        f"{p405['mfu']:.1%}.",
        "",
        f"Every layout both plans print ({len(res['validated'])}: recommendations, "
        f"alternatives, baselines) passes `validation.validate`: "
        f"{'yes' if not bad else 'NO — ' + '; '.join(b['refused'] for b in bad)}.",
        "",
    ]
    return L


def published_section(rows: list[dict], fit: P.Fit) -> list[str]:
    s = P.summary(rows)
    h = s["held_out"]
    L = ["## Planner vs published runs", "",
         "Step time predicted by the planner's cost model (the one `jaxpar plan` uses; each "
         "framework described by its `Executor`: attention kernel, asynchronous pipeline, "
         "overlapped collectives) on the repository's mesh file for the GPU, against the "
         "published figure. Error = predicted throughput / published − 1. Constants: "
         f"`share_max` = {fit.share_max} fitted on the three *fit* rows only; `kappa` = "
         f"{fit.kappa} and {fit.elementwise_passes:g} elementwise passes set (see "
         "`jaxpar/planner/published.py`).", "",
         f"**Held out ({h['rows']} rows): median |error| {h['median_abs_error']:.1%}, "
         f"{h['within_20pct']:.0%} within 20%, largest {h['max_abs_error']:.1%}.** Fitted rows: "
         f"median |error| {s['fitted']['median_abs_error']:.1%}.", ""]  # fmt: skip
    for title, sel in (("Fitted rows", True), ("Held-out rows", False)):
        L += [f"### {title}", "",
              "| run | GPUs | framework | layout | published tok/s/GPU | predicted | error | "
              "source |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in (r for r in rows if r["fitted"] == sel):
            L.append(f"| {r['name']} | {r['gpus']} × {r['gpu']} | {r['framework']} | "
                     f"{r['layout']} | {r['published_tokens_per_s_per_gpu']:,.0f} | "
                     f"{r['predicted_tokens_per_s_per_gpu']:,.0f} | {pct(r['error'])} | "
                     f"{r['source']}; {r['note']} |")  # fmt: skip
        L.append("")
    return L


def memory_section(mem: dict) -> list[str]:
    L = ["## Planner memory vs compiled memory (simulated CPU devices)", "",
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
          "where the memory model is still coarse: the pipeline under `remat full` (a stage's "
          "recompute holds its whole chunk), the zero-bubble split (the I → W stash) and ring "
          "attention with Megatron-SP.", ""]  # fmt: skip
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
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--memory-json", default=None, help="saved bench_planner_memory.py output")
    args = ap.parse_args()
    res = plans()
    fit, rows = P.fit()
    stale = [
        m
        for m in HW.GPU_MESHES
        if C.load_mesh(m).hardware.matmul_efficiency != HW.gpu_curve(C.load_mesh(m).hardware)
    ]
    mem = memory_rows(args.memory_json)
    body = "\n".join(plan_section(res) + published_section(rows, fit) + memory_section(mem))
    splice(Path(args.out), body + "\n")
    print(json.dumps({
        "plan_405b_s": res["plan_405b_s"], "plan_70b_s": res["plan_70b_s"],
        "printed_layouts": len(res["validated"]),
        "refused": [v for v in res["validated"] if v["refused"]],
        "fit": fit.__dict__, "published": P.summary(rows), "stale_mesh_curves": stale,
        "memory": {k: mem[k] for k in ("validated", "within_10pct", "max_abs_error")},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
