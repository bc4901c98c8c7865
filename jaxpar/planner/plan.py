"""Entry points: :func:`plan` (search and recommend) and :func:`cost_layout` (one layout)."""

from __future__ import annotations

import math
from typing import Any

from jaxpar import config as C
from jaxpar import validation as V
from jaxpar.errors import ConfigError
from jaxpar.planner import explain as X
from jaxpar.planner import memory as M
from jaxpar.planner import search as S
from jaxpar.report import human_bytes

HARDWARE_NEEDED = (
    "device_memory_bytes",
    "peak_flops_bf16",
    "hbm_bw",
    "intra_node_bw",
    "devices_per_node",
    "nics_per_node",
    "nic_bw",
    "matmul_efficiency",
)


def check_hardware(raw: dict[str, Any] | None, mesh: C.MeshConfig) -> None:
    """Refuse a mesh whose YAML lacks a hardware figure the cost model needs.

    ``raw`` is the mesh file's ``hardware`` mapping as written (defaults would silently cost a
    GPU pod with laptop figures). Values must be positive.
    """
    raw = raw or {}
    missing = [k for k in HARDWARE_NEEDED if k not in raw]
    if missing:
        raise ConfigError(
            f"mesh {mesh.name!r}: hardware.{missing[0]} missing; the planner needs "
            f"{', '.join('hardware.' + k for k in HARDWARE_NEEDED)}"
        )
    for k in (*HARDWARE_NEEDED, "host_to_device_bw"):
        v = getattr(mesh.hardware, k)
        if k == "matmul_efficiency":
            _check_curve(mesh.name, v)
        elif not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"mesh {mesh.name!r}: hardware.{k}={v!r}: must be a positive number")


def _check_curve(name: str, curve) -> None:
    ok = isinstance(curve, list) and curve and all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, (int, float)) for x in p)
        and p[0] >= 1 and 0 < p[1] <= 1 for p in curve
    )  # fmt: skip
    if not ok or [p[0] for p in curve] != sorted(p[0] for p in curve):
        raise ConfigError(
            f"mesh {name!r}: hardware.matmul_efficiency={curve!r}: must be [[size, share], ...] "
            "with sizes >= 1 ascending and shares in (0, 1]"
        )


def check_layout(cfg: C.RunConfig) -> None:
    """Refuse a layout that cannot run (``validation.validate``: the trainer's own rules)."""
    V.validate(cfg, n_devices=cfg.mesh.devices)


def _finish(c: S.Candidate, cfg: C.RunConfig, shape: M.Shape) -> dict:
    return X.summary(c, cfg.model, cfg.mesh.hardware, shape)


def cost_layout(cfg: C.RunConfig) -> dict:
    """Cost exactly ``cfg``'s layout: the summary plus ``verdict`` ('fits'/'does not fit')."""
    check_layout(cfg)
    shape = M.Shape(cfg.train.global_batch, cfg.train.seq_len)
    c = S.evaluate(cfg.model, cfg.mesh.hardware, cfg.layout, shape)
    out = _finish(c, cfg, shape)
    verdict = "fits" if c.fits else "does not fit"
    out["verdict"] = verdict
    out["headline"] = (
        f"{cfg.model.name} on {cfg.mesh.name} ({cfg.mesh.devices} devices), given layout: "
        f"{verdict} ({human_bytes(c.memory['total'])} of {human_bytes(c.usable)} usable "
        "per device)"
    )
    out["best"] = {k: v for k, v in out.items() if k not in ("best", "headline", "verdict")}
    return out


def plan(cfg: C.RunConfig, top: int = 3) -> dict:
    """Search layouts for ``cfg.model`` on ``cfg.mesh`` at ``cfg.train``'s batch and sequence.

    Returns the recommended layout's summary at the top level, ``alternatives`` (the best
    layout of each other (dp, tp, pp, sp, schedule) split, with ``why`` it loses), the
    ``baseline`` (rule of thumb) with a note on where the cost model disagrees, and
    ``evaluated`` (how many layouts fit) and ``costed`` (how many were costed). When nothing
    fits: ``fits`` false, ``shortfall_bytes`` and ``suggestion``.
    """
    model, hw, n = cfg.model, cfg.mesh.hardware, cfg.mesh.devices
    shape = M.Shape(cfg.train.global_batch, cfg.train.seq_len)
    for name, v in (("train.global_batch", shape.global_batch), ("train.seq_len", shape.seq)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r}: must be a positive integer")
    if shape.seq > model.max_seq_len:
        raise ConfigError(
            f"train.seq_len={shape.seq}: must be <= model.max_seq_len={model.max_seq_len}"
        )
    groups: dict[tuple, S.Candidate] = {}  # the best of each (dp, tp, pp, sp, schedule) split
    evaluated = 0
    counter: dict[str, int] = {}
    for c in S.candidates(model, hw, n, shape, counter=counter):
        evaluated += 1
        lay = c.layout
        key = (lay.dp, lay.tp, lay.pp, lay.sp, lay.sp_mode, lay.schedule, lay.virtual,
               lay.pipeline_memory)  # fmt: skip
        if key not in groups or _rank(c) < _rank(groups[key]):
            groups[key] = c
    ranked = sorted(groups.values(), key=_rank)
    base_lay, rule = S.baseline_layout(model, hw, n, shape)
    base = S.evaluate(model, hw, base_lay, shape) if base_lay else None
    head = f"{model.name} ({model.param_count() / 1e9:.1f} B params) on {cfg.mesh.name} "
    head += f"({n} devices), global batch {shape.global_batch} × {shape.seq} tokens"
    if not ranked:
        return _no_fit(cfg, shape, head, base)
    best = ranked[0]
    out = _finish(best, cfg, shape)
    out["alternatives"] = []
    for alt in ranked[1 : 1 + top]:
        s = _finish(alt, cfg, shape)
        s["why"] = X.why_loses(alt, best)
        out["alternatives"].append(s)
    out["baseline"] = _finish(base, cfg, shape) if base else None
    out["baseline_note"] = X.disagreement(base, best, rule)
    out["baseline_rule"] = rule
    out["evaluated"] = evaluated
    out["costed"] = counter["costed"]
    out["refused"] = counter["refused"]
    out["headline"] = head + f": {counter['costed']} layouts costed, {evaluated} fit; recommended:"
    out["best"] = _finish(best, cfg, shape)
    return out


def _rank(c: S.Candidate) -> tuple[float, float]:
    """Step time first (to 6 significant digits), then the smaller memory footprint: ZeRO-1
    ties with ZeRO-0 on time and wins on memory."""
    return (float(f"{c.step_time:.6g}"), c.memory["total"])


def _no_fit(cfg: C.RunConfig, shape: M.Shape, head: str, base: S.Candidate | None) -> dict:
    hw, n = cfg.mesh.hardware, cfg.mesh.devices
    lean = S.smallest_shortfall(cfg.model, hw, n, shape)
    usable = S.usable(hw)
    if lean["layout"] is None:  # no split runs: batch, heads or layers rule every one out
        head += (
            f": NO valid layout — no split of {n} devices that the trainer accepts divides the "
            f"global batch {shape.global_batch} (or leaves micro-batches a schedule accepts); "
            "choose a global batch divisible by the device count"
        )
        return _verdict(head, None, {}, 0.0, f"a global batch divisible by {n}", base, cfg, shape)
    total = lean["memory"]["total"]
    short = total - usable
    # model states dominate the leanest layout and shrink ~1/devices under ZeRO-3
    states = sum(lean["memory"][k] for k in ("params", "grads", "optimizer", "grad_accum"))
    rest = total - states
    more = math.inf if rest >= usable else n * states / (usable - rest)
    more_dev = 2 ** math.ceil(math.log2(more)) if math.isfinite(more) else None
    suggestion = f"devices with ≥ {human_bytes(total / S.HEADROOM)} memory"
    if more_dev:
        suggestion += f", or about {more_dev} devices of this kind"
    suggestion += ", or a shorter sequence / smaller batch"
    head += (
        f": NO layout fits. Smallest shortfall {human_bytes(short)} per device (leanest "
        f"layout needs {human_bytes(total)}, {human_bytes(usable)} usable); would fit with "
        f"{suggestion}."
    )
    return _verdict(head, lean["layout"], lean["memory"], short, suggestion, base, cfg, shape)


def _verdict(head, lay, mem, short, suggestion, base, cfg, shape) -> dict:
    return {
        "headline": head,
        "fits": False,
        "verdict": "does not fit",
        "layout": S.layout_dict(lay, shape) if lay else None,
        "memory_per_device_bytes": mem.get("total"),
        "memory_breakdown_bytes": {k: v for k, v in mem.items() if k != "total"},
        "shortfall_bytes": max(short, 0.0),
        "suggestion": suggestion,
        "step_time_s": None,
        "tokens_per_s": None,
        "tflops_per_device": None,
        "mfu": None,
        "bubble_fraction": None,
        "alternatives": [],
        "baseline": _finish(base, cfg, shape) if base else None,
        "evaluated": 0,
    }
