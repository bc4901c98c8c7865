"""The JSON report of a step compiled for a GPU target (``jaxpar compile --json``).

Keys: ``target`` (:meth:`jaxpar.gpu.targets.Target.describe`), ``layout``, ``attention``
(``chosen``: what ``model.attention`` resolved to on the target; ``in_program``: the cuDNN
attention custom calls found in the compiled program), ``memory`` (XLA's per-device
``argument``/``output``/``alias``/``temp``/``total`` bytes, ``planner_bytes`` and ``ratio`` =
total / planner, ``usable_bytes``, ``fits``), ``collectives`` (per mesh-axis set: ``count``,
``wire_bytes`` per device per step, ``sync_share``/``exposed_share`` of those bytes, per kind;
``planner_wire_bytes`` per axis and ``ratio``), ``overlap`` (``exposed_share`` and
``sync_share`` of all collective bytes; ``async_collectives``: the largest collectives with the
compute the scheduler placed between start and done), ``estimate`` (the simulated step,
:func:`estimate`), ``xla_flags``, ``compile_seconds``.

``estimate``: :mod:`jaxpar.gpu.timing`'s simulation of the scheduled program on the mesh file's
hardware: ``step_s``, ``compute_s``, ``exposed_s`` (seconds the compute stream waits on
collectives, per mesh-axis set, and ``total``), ``rank_wait_s`` (of those, the seconds a pipeline
rank waited for the other ranks to reach a collective over ``pp``: the bubble and the stages'
imbalance, not transfer time), ``comm_s`` (all collective time, hidden or not),
``tflops_per_device`` and ``mfu`` (model FLOPs, PaLM's convention: recomputation not counted),
``hardware_flops`` (what the program's matmuls and attention kernels do, per device),
``planner_step_s`` (``jaxpar plan``'s step time for the same layout), ``step_ratio`` =
planner / estimate, ``critical_path`` (the chain of kernels and collectives that sets the step:
``compute_s``, ``comm_s`` per mesh-axis set and ``total``, and the ``top`` instructions on it,
:class:`jaxpar.gpu.timing.CriticalPath`), ``assumptions``, ``gemms`` (the program's GEMM call
sites by operand type: ``fp8`` for the FP8 GEMMs of ``layout.fp8``, else e.g. ``bf16``; counted
once per place in the program, as the cuDNN attention calls).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar.analysis.hlo import compiled_memory
from jaxpar.analysis.hlo_gpu import async_collectives, custom_calls, overlap_by_axes
from jaxpar.analysis.hlo_text import Module, parse, remat_clones
from jaxpar.config import RunConfig
from jaxpar.gpu.compile import Compiled, planner_traffic

TOP = 40  # async collectives listed (largest wire bytes first)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _program(c: Compiled, text: str | Module | None) -> Module:
    """The program the report reads: ``text`` (its HLO, printed or parsed by the caller), else
    the compiled step's, parsed once (:attr:`Compiled.program`)."""
    return c.program if text is None else parse(text)


def memory(cfg: RunConfig, c: Compiled, text: str | Module | None = None) -> dict[str, Any]:
    """XLA's memory figures beside the planner's for the same layout; ``recomputed_by_xla``:
    the instructions XLA's rematerialization pass cloned into the program (``text``) to meet
    its memory limit (the mesh's ``--xla_gpu_memory_limit_slop_factor`` sets that limit);
    ``xla_memory_limit``: the factor the program was compiled under, and whether it was
    compiled again at XLA's default because it did not fit (:mod:`jaxpar.xla_limit`)."""
    from jaxpar.commands.train import memory_estimate

    got = compiled_memory(c.compiled)
    plan = memory_estimate(cfg)
    keep = ("argument", "output", "alias", "temp", "total")
    out: dict[str, Any] = {k: got[k] for k in keep}
    out["planner_bytes"] = plan["per_device_bytes"]
    out["planner_breakdown_bytes"] = plan["breakdown_bytes"]
    out["ratio"] = _ratio(got["total"], plan["per_device_bytes"])
    out["usable_bytes"] = plan["usable_bytes"]
    out["fits"] = got["total"] is not None and got["total"] <= plan["usable_bytes"]
    out["recomputed_by_xla"] = remat_clones(_program(c, text).text)
    lim = c.trainer.memory_limit  # the XLA memory limit the program was compiled under
    out["xla_memory_limit"] = dataclasses.asdict(lim) if lim is not None else None
    return out


def collectives(
    cfg: RunConfig, c: Compiled, text: str | Module | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per-axis collective bytes beside the planner's, and the overlap summary."""
    items = async_collectives(_program(c, text), c.mesh)
    axes = {k: v.to_dict() for k, v in overlap_by_axes(items).items()}
    plan = planner_traffic(cfg)
    for name, planned in plan.items():
        got = axes.get(name, {}).get("wire_bytes", 0.0)
        axes.setdefault(name, {"axes": [name], "count": 0.0, "wire_bytes": 0.0})
        axes[name]["planner_wire_bytes"] = planned
        axes[name]["ratio"] = _ratio(got, planned)
    total = sum(i.wire_bytes for i in items)
    top = sorted(items, key=lambda i: -i.wire_bytes)[:TOP]
    listed = []
    for i in top:
        d = dataclasses.asdict(i)
        d["axes"], d["exposed"] = list(i.axes), i.exposed
        listed.append(d)
    overlap = {
        "wire_bytes": total,
        "sync_share": sum(i.wire_bytes for i in items if i.sync) / total if total else 0.0,
        "exposed_share": sum(i.wire_bytes for i in items if i.exposed) / total if total else 0.0,
        "asynchronous": sum(i.asynchronous for i in items),
        "synchronous": sum(i.sync for i in items),
        "collectives": len(items),
        "pipelined": sum(i.pipelined for i in items),
        "async_collectives": listed,
    }
    return axes, overlap


def overlap_share(c: Compiled, text: str | Module | None = None) -> float:
    """Share of the program's collective wire bytes with no compute between start and done."""
    items = async_collectives(_program(c, text), c.mesh)
    total = sum(i.wire_bytes for i in items)
    return sum(i.wire_bytes for i in items if i.exposed) / total if total else 0.0


def planner_step_time(cfg: RunConfig) -> float:
    """``jaxpar plan``'s step time (seconds) for ``cfg``'s layout and workload."""
    from jaxpar.planner.search import evaluate
    from jaxpar.planner.workload import Shape

    shape = Shape(cfg.train.global_batch, cfg.train.seq_len)
    return evaluate(cfg.model, cfg.mesh.hardware, cfg.layout, shape).step_time


def check_estimate(cfg: RunConfig) -> None:
    """Refuse, before compiling, a mesh without a hardware figure the time model needs."""
    from jaxpar.errors import ConfigError
    from jaxpar.gpu.timing import check_hardware

    try:
        check_hardware(cfg.mesh.hardware)
    except ValueError as e:
        raise ConfigError(f"mesh {cfg.mesh.name!r}: {e}") from None


def estimate(
    cfg: RunConfig, c: Compiled, text: str | Module | None = None
) -> tuple[dict[str, Any], Any]:
    """The simulated step's figures (module docstring) and the :class:`StepTime` itself."""
    import numpy as np

    from jaxpar.analysis.theory import train_flops_per_token
    from jaxpar.errors import ConfigError
    from jaxpar.gpu.timing import simulate

    t = cfg.train
    model_flops = train_flops_per_token(cfg.model, t.seq_len) * t.global_batch * t.seq_len
    per_host = c.target.per_host
    nodes = [int(d.id) // per_host for d in np.ravel(c.mesh.devices)]
    try:
        st = simulate(_program(c, text), c.mesh, cfg.mesh.hardware, nodes,
                      model_flops / cfg.layout.n_devices)  # fmt: skip
    except ValueError as e:
        raise ConfigError(f"mesh {cfg.mesh.name!r}: {e}") from None
    out = st.to_dict()
    planner = planner_step_time(cfg)
    out["planner_step_s"] = planner
    out["step_ratio"] = _ratio(planner, st.step_s)
    return out, st


def report(cfg: RunConfig, c: Compiled, trace: str | None = None, timeline: str | None = None,
           text: str | Module | None = None) -> dict[str, Any]:  # fmt: skip
    """The whole report (module docstring); ``trace``: write the simulated step there as a
    Chrome trace (:func:`jaxpar.gpu.trace.write_trace`), recorded as ``trace``; ``timeline``:
    draw it there as a PNG Gantt chart (:func:`jaxpar.gpu.timeline.draw_timeline`), recorded
    as ``timeline``; ``text``: the program's HLO when the caller printed or parsed it
    (:func:`jaxpar.analysis.hlo_text.program_text`); by default :attr:`Compiled.program`, the
    one parse every figure reads."""
    text = _program(c, text)
    calls = custom_calls(text)
    axes, overlap = collectives(cfg, c, text)
    est, step = estimate(cfg, c, text)
    lay = cfg.layout
    out = {
        "model": cfg.model.name,
        "mesh": cfg.mesh.name,
        "target": c.target.describe(),
        "layout": {**dataclasses.asdict(lay), "dp_reduction": c.trainer.dp_reduction},
        "attention": {
            "chosen": c.attention,
            "in_program": {k: v for k, v in calls.items() if k.startswith("__cudnn$fmha")},
        },
        "memory": memory(cfg, c, text),
        "collectives": axes,
        "overlap": overlap,
        "estimate": est,
        "xla_flags": {
            **dataclasses.asdict(c.flags),
            "effective": c.flags_effective,
            # the collective pipeliner's work (the mesh's --xla_gpu_enable_pipelined_* flags)
            "pipelined_collectives": overlap["pipelined"],
        },
        "compile_seconds": c.seconds,
    }
    if trace is not None:
        from jaxpar.gpu.trace import write_trace

        name = f"{cfg.model.name} on {cfg.mesh.name}"
        out["trace"] = {"file": trace, "events": write_trace(trace, step, name)}
    if timeline is not None:
        from jaxpar.gpu.timeline import draw_timeline

        name = f"{cfg.model.name} on {cfg.mesh.name}"
        out["timeline"] = {"file": timeline, "intervals": draw_timeline(timeline, step, name)}
    return out


def estimate_lines(est: dict[str, Any]) -> list[str]:
    """The human table of ``estimate`` (``jaxpar compile``'s output)."""
    ex, comm = est["exposed_s"], est["comm_s"]
    ratio = f"{est['step_ratio']:.2f}" if est["step_ratio"] is not None else "-"
    lines = [
        f"step time simulated on the target {est['step_s'] * 1e3:.3f} ms (planner "
        f"{est['planner_step_s'] * 1e3:.3f} ms, planner / simulated {ratio}): compute "
        f"{est['compute_s'] * 1e3:.3f} ms + exposed communication {ex['total'] * 1e3:.3f} ms",
        f"  {'axes':<10} {'comm ms':>10} {'exposed ms':>11} {'of step':>8}",
    ]
    for key in [k for k in ex if k != "total"]:
        share = ex[key] / est["step_s"] if est["step_s"] else 0.0
        lines.append(f"  {key:<10} {comm.get(key, 0.0) * 1e3:>10.3f} {ex[key] * 1e3:>11.3f} "
                     f"{share:>8.0%}")  # fmt: skip
    if est.get("gemms"):  # FP8 GEMMs (layout.fp8) beside the compute dtype's
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(est["gemms"].items()))
        lines.append(f"  GEMM call sites in the program by operand type: {kinds}")
    wait = est.get("rank_wait_s") or 0.0
    if wait > 0:  # the pipeline's bubble and imbalance, inside the pp rows above
        rest = (ex["total"] - wait) * 1e3
        lines.append(f"  of the exposed, waiting for other pipeline ranks (bubble, imbalance) "
                     f"{wait * 1e3:.3f} ms; transfers {rest:.3f} ms")  # fmt: skip
    cp = est.get("critical_path")
    if cp:  # what set the step's end (jaxpar.gpu.timing): its compute, its collectives per axis
        on = cp["comm_s"]
        axes = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in on.items() if k != "total" and v > 0)
        lines.append(f"critical path: compute {cp['compute_s'] * 1e3:.3f} ms + communication "
                     f"{on['total'] * 1e3:.3f} ms" + (f" ({axes} ms)" if axes else ""))  # fmt: skip
        top = [f"{o['name']} ({o['kind']}{' ' + o['axes'] if o['axes'] else ''}) "
               f"{o['seconds'] * 1e3:.3f} ms in {o['count']}" for o in cp["top"][:3]]  # fmt: skip
        if top:
            lines.append("  most of it: " + "; ".join(top))
    ranks = est.get("ranks") or []
    if ranks:  # a pipeline's ranks, each walked (jaxpar.gpu.ranks): its work and its waits
        lines.append("pipeline ranks (device: compute ms + exposed ms, of which waiting for the "
                     "other ranks):")  # fmt: skip
        lines += [f"  {r['partition']:>5}: {r['compute_s'] * 1e3:.3f} + "
                  f"{r['exposed_s']['total'] * 1e3:.3f} ({r.get('rank_wait_s', 0.0) * 1e3:.3f})"
                  for r in ranks]  # fmt: skip
    if est["tflops_per_device"] is not None:
        lines.append(f"model TFLOP/s per device {est['tflops_per_device']:.1f}, "
                     f"MFU {est['mfu']:.1%} (PaLM model FLOPs: recompute not counted)")  # fmt: skip
    lines += [f"  assumed: {a}" for a in est["assumptions"]]
    return lines
