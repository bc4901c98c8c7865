"""The JSON report of a step compiled for a GPU target (``jaxpar compile --json``).

Keys: ``target`` (:meth:`jaxpar.gpu.targets.Target.describe`), ``layout``, ``attention``
(``chosen``: what ``model.attention`` resolved to on the target; ``in_program``: the cuDNN
attention custom calls found in the compiled program), ``memory`` (XLA's per-device
``argument``/``output``/``alias``/``temp``/``total`` bytes, ``planner_bytes`` and ``ratio`` =
total / planner, ``usable_bytes``, ``fits``), ``collectives`` (per mesh-axis set: ``count``,
``wire_bytes`` per device per step, ``sync_share``/``exposed_share`` of those bytes, per kind;
``planner_wire_bytes`` per axis and ``ratio``), ``overlap`` (``exposed_share`` and
``sync_share`` of all collective bytes; ``async_collectives``: the largest collectives with the
compute the scheduler placed between start and done), ``xla_flags``, ``compile_seconds``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar.analysis.hlo import compiled_memory
from jaxpar.analysis.hlo_gpu import async_collectives, custom_calls, overlap_by_axes
from jaxpar.config import RunConfig
from jaxpar.gpu.compile import Compiled, planner_traffic

TOP = 40  # async collectives listed (largest wire bytes first)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def memory(cfg: RunConfig, c: Compiled) -> dict[str, Any]:
    """XLA's memory figures beside the planner's for the same layout."""
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
    return out


def collectives(cfg: RunConfig, c: Compiled) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per-axis collective bytes beside the planner's, and the overlap summary."""
    items = async_collectives(c.compiled, c.mesh)
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


def overlap_share(c: Compiled) -> float:
    """Share of the program's collective wire bytes with no compute between start and done."""
    items = async_collectives(c.compiled, c.mesh)
    total = sum(i.wire_bytes for i in items)
    return sum(i.wire_bytes for i in items if i.exposed) / total if total else 0.0


def report(cfg: RunConfig, c: Compiled) -> dict[str, Any]:
    """The whole report (module docstring)."""
    text = c.compiled.as_text()
    calls = custom_calls(text)
    axes, overlap = collectives(cfg, c)
    lay = cfg.layout
    return {
        "model": cfg.model.name,
        "mesh": cfg.mesh.name,
        "target": c.target.describe(),
        "layout": {**dataclasses.asdict(lay), "dp_reduction": c.trainer.dp_reduction},
        "attention": {
            "chosen": c.attention,
            "in_program": {k: v for k, v in calls.items() if k.startswith("__cudnn$fmha")},
        },
        "memory": memory(cfg, c),
        "collectives": axes,
        "overlap": overlap,
        "xla_flags": {
            **dataclasses.asdict(c.flags),
            "effective": c.flags_effective,
            # the collective pipeliner's work (the mesh's --xla_gpu_enable_pipelined_* flags)
            "pipelined_collectives": overlap["pipelined"],
        },
        "compile_seconds": c.seconds,
    }
