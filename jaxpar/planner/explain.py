"""Summaries and explanations of costed layouts: the JSON shape, why an alternative loses,
where the rule of thumb and the cost model disagree, and the text report."""

from __future__ import annotations

from typing import Any

from jaxpar.config import HardwareConfig, ModelConfig
from jaxpar.planner import footprint as M
from jaxpar.planner.search import Candidate, layout_dict, tokens_per_step, train_flops
from jaxpar.report import human_bytes

TERM_NAMES = {
    "compute": "compute",
    "recompute": "recompute (remat)",
    "optimizer": "optimizer update",
    "tick_weights": "pipeline ticks' weight casts and gradient adds",
    "tick_slots": "pipeline ticks' slot reads and writes",
    "weights": "weight slices, casts and gradient writes",
    "tp_comm": "exposed TP collectives",
    "sp_comm": "exposed sequence-parallel collectives",
    "bubble": "pipeline bubble",
    "pp_p2p": "exposed pipeline sends",
    "dp_comm": "exposed dp/ZeRO traffic",
    "ep_comm": "exposed MoE all-to-all over ep",
    "offload": "host transfers",
}


def summary(c: Candidate, model: ModelConfig, hw: HardwareConfig, shape: M.Shape) -> dict:
    """The JSON object of one layout (keys documented in docs/reference.md, ``jaxpar plan``)."""
    t = c.step_time
    tps = tokens_per_step(shape) / t
    flops = train_flops(model, shape) / t / c.layout.n_devices
    return {
        "layout": layout_dict(c.layout, shape),
        "fits": c.fits,
        "memory_per_device_bytes": c.memory["total"],
        "memory_breakdown_bytes": {k: v for k, v in c.memory.items() if k != "total"},
        "memory_usable_bytes": c.usable,
        "zero_paper_model_states_bytes": M.paper_model_states(model, c.layout)["total"],
        "step_time_s": t,
        "step_time_terms_s": dict(c.cost.terms),
        "tokens_per_s": tps,
        "tflops_per_device": flops / 1e12,
        "mfu": flops / hw.peak_flops_bf16,
        "matmul_efficiency": c.cost.efficiency,
        "pipeline": _pipeline(c),
        "bubble_fraction": c.bubble,
        "traffic_bytes_per_device": dict(c.cost.traffic),
        # every collective kind: bytes, calls, seconds with their latency, hidden and exposed
        "communication": [t.to_dict() for t in c.cost.comm if t.calls],
        "flags": list(c.flags),
        # MoE: total and active parameters, the dispatch buffer and its all-to-all (else null)
        "moe": _moe(c, model, shape, hw.platform),
    }


def _moe(c: Candidate, model: ModelConfig, shape: M.Shape, platform: str) -> dict | None:
    from jaxpar.analysis.theory import DTYPE_BYTES
    from jaxpar.planner import moe as MOE

    rows = shape.microbatch_size(c.layout) or 1
    wc = DTYPE_BYTES[c.layout.compute_dtype]
    return MOE.report(model, c.layout, rows, shape.seq, wc, platform) or None


def _pipeline(c: Candidate) -> dict | None:
    """Schedule-library figures of a pipeline layout (None without one)."""
    pf = c.cost.pipe
    if pf is None:
        return None
    return {"makespan_over_busy": pf.makespan / pf.busy, "ticks": pf.ticks,
            "peak_stashes": list(pf.peak_stashes), "sends": pf.sends}  # fmt: skip


def why_loses(alt: Candidate, best: Candidate) -> str:
    """'+12% step time: pipeline bubble +0.21 s, ...' — the two terms that grow most."""
    diff = {k: alt.cost.terms[k] - best.cost.terms[k] for k in alt.cost.terms}
    worst = sorted((d, k) for k, d in diff.items() if d > 0)[::-1][:2]
    pct = alt.step_time / best.step_time - 1
    parts = [f"{TERM_NAMES[k]} +{d:.3g} s" for d, k in worst]
    gains = [f"{TERM_NAMES[k]} {d:.3g} s" for k, d in diff.items() if d < -0.02 * best.step_time]
    text = f"+{pct:.1%} step time: " + ", ".join(parts or ["ties"])
    if gains:
        text += " (saves " + ", ".join(gains) + ")"
    return text


def disagreement(base: Candidate | None, best: Candidate, base_reason: str) -> str:
    """Where the rule of thumb and the cost model part ways, and why."""
    if base is None:
        return f"the rule of thumb gives no layout here ({base_reason})"
    if not base.fits:
        return (
            f"the rule of thumb's layout does not fit: {human_bytes(base.memory['total'])} > "
            f"{human_bytes(base.usable)} usable per device"
        )
    lb, lp = base.layout, best.layout
    same = (lb.dp, lb.tp, lb.pp, lb.sp) == (lp.dp, lp.tp, lp.pp, lp.sp)
    ratio = base.step_time / best.step_time
    if ratio < 0.98:
        return (
            f"the rule of thumb is {1 - ratio:.0%} FASTER than the search's pick: the "
            "search space missed it (please report)"
        )
    if ratio < 1.02:
        return "the cost model agrees with the rule of thumb (within 2%)"
    head = "same axes, different knobs" if same else "the cost model picks another split"
    return f"{head}: the rule of thumb is {ratio - 1:.0%} slower — " + why_loses(base, best)


def render(result: dict[str, Any]) -> str:
    """Human-readable plan (``jaxpar plan`` without ``--json``)."""
    lines = [result["headline"]]
    first = "given layout" if "verdict" in result else "recommended"
    for title, s in ((first, result.get("best")), ("baseline", result.get("baseline"))):
        if s:
            lines += ["", f"{title}: {layout_text(s['layout'])}", *_details(s)]
    if result.get("baseline_note"):
        lines.append(f"  vs cost model: {result['baseline_note']}")
    mesh = result.get("mesh_layout")
    if mesh and mesh.get("layout"):
        lines += ["", f"the mesh file's own layout: {layout_text(mesh['layout'])}",
                  *_details(mesh), f"  vs recommended: {mesh['vs_recommended']}"]  # fmt: skip
    elif mesh:
        lines += ["", f"the mesh file's own layout is refused here: {mesh['refused']}"]
    alts = result.get("alternatives") or []
    if alts:
        lines += ["", "alternatives:"]
        for a in alts:
            lines.append(
                f"  {layout_text(a['layout'])}: {a['step_time_s']:.3f} s/step, "
                f"{human_bytes(a['memory_per_device_bytes'])}/device — {a['why']}"
            )
    lines += [f"assumed: {a}" for a in result.get("assumed") or []]
    return "\n".join(lines)


def layout_text(lay: dict) -> str:
    """One line: a ``layout`` JSON object as ``dp=.. tp=.. ...``."""
    extra = f" {lay['schedule']} v={lay['virtual']}" if lay["pp"] > 1 else ""
    extra += " lean" if lay.get("pipeline_memory") == "lean" else ""
    sp = " +SP" if lay.get("sequence_parallel") else ""
    sp += f" ({lay['sp_mode']})" if lay.get("sp_mode") else ""
    sp += f" ep={lay['ep']}" if lay.get("ep", 1) > 1 else ""
    return (
        f"dp={lay['dp']} tp={lay['tp']}{sp} pp={lay['pp']} sp={lay['sp']} zero={lay['zero']}"
        f"{extra} micro-batch {lay['microbatch_size']}×{lay['microbatches']} "
        f"remat={lay['remat']} offload={lay['offload']}"
        + (f" fp8={lay['fp8']}" if lay.get("fp8", "none") != "none" else "")
    )


def _details(s: dict) -> list[str]:
    mem = s["memory_breakdown_bytes"]
    fit = "fits" if s["fits"] else "DOES NOT FIT"
    terms = ", ".join(
        f"{TERM_NAMES[k]} {v:.3g}" for k, v in s["step_time_terms_s"].items() if v > 0
    )
    traffic = ", ".join(
        f"{k} {human_bytes(v)}" for k, v in s["traffic_bytes_per_device"].items() if v
    )
    out = [
        f"  step {s['step_time_s']:.3f} s, {s['tokens_per_s']:,.0f} tokens/s, "
        f"{s['tflops_per_device']:.0f} TFLOP/s/device, MFU {s['mfu']:.1%}, "
        f"bubble {s['bubble_fraction']:.1%}",
        f"  memory/device {human_bytes(s['memory_per_device_bytes'])} ({fit}; usable "
        f"{human_bytes(s['memory_usable_bytes'])}): "
        + ", ".join(f"{k} {human_bytes(v)}" for k, v in mem.items() if v),
        f"  (ZeRO-paper convention, bf16 params/grads + 12Ψ optimizer: "
        f"{human_bytes(s['zero_paper_model_states_bytes'])} of model states)",
        f"  time terms (s): {terms}",
        f"  traffic per device per step: {traffic or 'none'}",
        *_communication(s.get("communication") or []),
    ]
    out += [f"  ! {f}" for f in s["flags"]]
    return out


def _communication(terms: list[dict]) -> list[str]:
    """One line per collective kind: what it moves, how often, and how much of it hides."""
    out = []
    for c in terms:
        out.append(
            f"  {c['name']} {c['label']}: {human_bytes(c['bytes'])} in {c['calls']:,.0f} calls "
            f"({c['algorithm']}, {c['link']}), {c['seconds']:.3g} s of which latency "
            f"{c['latency_s']:.3g} s; hidden {c['hidden_s']:.3g} s behind {c['behind']}, "
            f"exposed {c['exposed_s']:.3g} s"
        )
    return out
