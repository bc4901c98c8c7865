"""Entry points: :func:`plan` (search and recommend) and :func:`cost_layout` (one layout)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from jaxpar import config as C
from jaxpar import validation as V
from jaxpar.errors import ConfigError
from jaxpar.planner import explain as X
from jaxpar.planner import search as S
from jaxpar.planner.workload import DEFAULT_WORKLOAD_NOTE, Shape
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
    """The run's own rule (:func:`jaxpar.validation.check_curve`); the planner needs a curve."""
    where = f"mesh {name!r}: hardware.matmul_efficiency"
    V.check_curve(where, curve)
    if not curve:
        raise ConfigError(f"{where}=[]: must be [[size, share], ...] (jaxpar bench --calibrate "
                          "measures it)")  # fmt: skip


def check_layout(cfg: C.RunConfig) -> None:
    """Refuse a layout that cannot run (``validation.validate``: the trainer's own rules)."""
    V.validate(cfg, n_devices=cfg.mesh.devices)


def _finish(c: S.Candidate, cfg: C.RunConfig, shape: Shape) -> dict:
    return X.summary(c, cfg.model, cfg.mesh.hardware, shape)


def params_text(model: C.ModelConfig) -> str:
    """'46.7 B params' (a MoE model: ', 12.9 B active' too: its FLOPs come from those)."""
    text = f"{model.param_count() / 1e9:.1f} B params"
    if model.moe.enabled:
        text += f", {model.active_param_count() / 1e9:.1f} B active"
    return text


def cost_layout(cfg: C.RunConfig, given: dict[str, str] | None = None) -> dict:
    """Cost exactly ``cfg``'s layout: the summary plus ``verdict`` ('fits'/'does not fit'),
    ``workload`` and ``assumed`` (as :func:`plan`)."""
    check_layout(cfg)
    shape = Shape(cfg.train.global_batch, cfg.train.seq_len)
    c = S.evaluate(cfg.model, cfg.mesh.hardware, cfg.layout, shape)
    out = _finish(c, cfg, shape)
    verdict = "fits" if c.fits else "does not fit"
    out["verdict"] = verdict
    moe = f" ({params_text(cfg.model)})" if cfg.model.moe.enabled else ""
    out["headline"] = (
        f"{cfg.model.name}{moe} on {cfg.mesh.name} ({cfg.mesh.devices} devices), given layout: "
        f"{verdict} ({human_bytes(c.memory['total'])} of {human_bytes(c.usable)} usable "
        "per device)"
    )
    out["best"] = {k: v for k, v in out.items() if k not in ("best", "headline", "verdict")}
    sources = workload_sources(cfg, given)
    out["workload"] = {"global_batch": shape.global_batch, "seq_len": shape.seq,
                       "source": sources}  # fmt: skip
    out["assumed"] = _assumed(cfg, sources, c)
    return out


@dataclass
class Ranking:
    """Every layout split's best candidate that fits, fastest first, with the search's counts."""

    ranked: list[S.Candidate]
    shape: Shape
    evaluated: int
    costed: int
    refused: int


def check_workload(cfg: C.RunConfig) -> Shape:
    """The workload of ``cfg`` as a :class:`Shape`, refused when not positive or longer than
    the model's context."""
    shape = Shape(cfg.train.global_batch, cfg.train.seq_len)
    for name, v in (("train.global_batch", shape.global_batch), ("train.seq_len", shape.seq)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r}: must be a positive integer")
    if shape.seq > cfg.model.max_seq_len:
        raise ConfigError(
            f"train.seq_len={shape.seq}: must be <= model.max_seq_len={cfg.model.max_seq_len}"
        )
    # int32 sizes no layout changes: one line here, not "no valid layout" after the search
    V.check_sizes(cfg.model, shape.global_batch, shape.seq)
    return shape


def rank_layouts(cfg: C.RunConfig) -> Ranking:
    """Search ``cfg.model`` on ``cfg.mesh`` at ``cfg.train``'s workload: the best layout of
    each (dp, tp, pp, sp, schedule, ep) split that fits, ranked by step time (what ``plan``,
    ``--emit-flags`` and ``--layout auto`` share), with ``cfg.layout.fp8``'s recipe."""
    shape = check_workload(cfg)
    groups: dict[tuple, S.Candidate] = {}
    evaluated = 0
    counter: dict[str, int] = {}
    for c in S.candidates(cfg.model, cfg.mesh.hardware, cfg.mesh.devices, shape, counter=counter,
                          fp8=cfg.layout.fp8):  # fmt: skip
        evaluated += 1
        lay = c.layout
        key = (lay.dp, lay.tp, lay.pp, lay.sp, lay.sp_mode, lay.schedule, lay.virtual,
               lay.pipeline_memory, lay.ep)  # fmt: skip
        if key not in groups or _rank(c) < _rank(groups[key]):
            groups[key] = c
    ranked = sorted(groups.values(), key=_rank)
    return Ranking(ranked, shape, evaluated, counter["costed"], counter["refused"])


def workload_sources(cfg: C.RunConfig, given: dict[str, str] | None = None) -> dict[str, str]:
    """Where each workload figure came from: 'command line' (``given``), 'mesh file' (its
    ``train:`` section), 'model max_seq_len' (the mesh file's or the default sequence cut to
    the model's context, :func:`jaxpar.config.default_seq_len`) or 'default' (jaxpar's
    training defaults)."""
    out = {}
    for key in ("global_batch", "seq_len"):
        src = (given or {}).get(key)
        out[key] = src or ("mesh file" if key in (cfg.mesh.train or {}) else "default")
    stated = cfg.mesh.train.get("seq_len", C.TrainConfig.seq_len)
    if "seq_len" not in (given or {}) and cfg.train.seq_len == cfg.model.max_seq_len < stated:
        out["seq_len"] = "model max_seq_len"
    return out


def _assumed(cfg: C.RunConfig, sources: dict[str, str], best: S.Candidate | None) -> list[str]:
    out = [
        f"train.{k}={getattr(cfg.train, k)} ({DEFAULT_WORKLOAD_NOTE}; mesh "
        f"{cfg.mesh.name!r} states no train.{k})"
        for k, v in sources.items()
        if v == "default"
    ]
    if sources.get("seq_len") == "model max_seq_len":
        stated = cfg.mesh.train.get("seq_len", C.TrainConfig.seq_len)
        out.append(
            f"train.seq_len={cfg.train.seq_len} (model.max_seq_len; mesh {cfg.mesh.name!r} "
            f"plans {stated}, longer than the model's context)"
        )
    return out + (list(best.cost.assumed) if best else [])


def plan(cfg: C.RunConfig, top: int = 3, given: dict[str, str] | None = None) -> dict:
    """Search layouts for ``cfg.model`` on ``cfg.mesh`` at ``cfg.train``'s batch and sequence.

    Returns the recommended layout's summary at the top level, ``alternatives`` (the best
    layout of each other split, with ``why`` it loses), ``mesh_layout`` (the mesh file's own
    layout costed beside the pick, with the terms that separate them), the ``baseline`` (rule
    of thumb), ``workload`` (the figures planned for and where each came from), ``assumed``
    (every default taken: workload, link latencies), and ``evaluated``/``costed``/``refused``.
    When nothing fits: ``fits`` false, ``shortfall_bytes`` and ``suggestion``.
    """
    model, hw, n = cfg.model, cfg.mesh.hardware, cfg.mesh.devices
    r = rank_layouts(cfg)
    shape, ranked = r.shape, r.ranked
    sources = workload_sources(cfg, given)
    base_lay, rule = S.baseline_layout(model, hw, n, shape, cfg.layout.fp8)
    base = S.evaluate(model, hw, base_lay, shape) if base_lay else None
    head = f"{model.name} ({params_text(model)}) on {cfg.mesh.name} "
    head += f"({n} devices), global batch {shape.global_batch} × {shape.seq} tokens"
    if "default" in sources.values():
        head += " (jaxpar's defaults: the mesh file states no workload)"
    if not ranked:
        out = _no_fit(cfg, shape, head, base)
        out["workload"] = {"global_batch": shape.global_batch, "seq_len": shape.seq,
                           "source": sources}  # fmt: skip
        out["assumed"] = _assumed(cfg, sources, None)
        return out
    best = ranked[0]
    out = _finish(best, cfg, shape)
    out["alternatives"] = []
    for alt in ranked[1 : 1 + top]:
        s = _finish(alt, cfg, shape)
        s["why"] = X.why_loses(alt, best)
        out["alternatives"].append(s)
    out["mesh_layout"] = _mesh_layout(cfg, shape, best)
    out["baseline"] = _finish(base, cfg, shape) if base else None
    out["baseline_note"] = X.disagreement(base, best, rule)
    out["baseline_rule"] = rule
    out["ranked"] = len(ranked)
    out["evaluated"], out["costed"], out["refused"] = r.evaluated, r.costed, r.refused
    out["workload"] = {"global_batch": shape.global_batch, "seq_len": shape.seq,
                       "source": sources}  # fmt: skip
    out["assumed"] = _assumed(cfg, sources, best)
    out["headline"] = head + f": {r.costed} layouts costed, {r.evaluated} fit; recommended:"
    out["best"] = _finish(best, cfg, shape)
    return out


def _mesh_layout(cfg: C.RunConfig, shape: Shape, best: S.Candidate) -> dict:
    """The mesh file's own layout costed beside the pick (or why it cannot be)."""
    lay = cfg.mesh.layout
    try:
        V.check_layout(cfg.model, lay, shape.global_batch, shape.seq, cfg.mesh.devices)
    except ConfigError as e:
        return {"refused": str(e)}
    c = S.evaluate(cfg.model, cfg.mesh.hardware, lay, shape)
    out = _finish(c, cfg, shape)
    if c.step_time >= best.step_time:
        out["vs_recommended"] = X.why_loses(c, best)
    else:
        out["vs_recommended"] = f"{best.step_time / c.step_time - 1:.1%} faster than the pick" + (
            "" if c.fits else " but does not fit"
        )
    return out


def _rank(c: S.Candidate) -> tuple[float, float]:
    """Step time first (to 6 significant digits), then the smaller memory footprint: ZeRO-1
    ties with ZeRO-0 on time and wins on memory."""
    return (float(f"{c.step_time:.6g}"), c.memory["total"])


def _no_fit(cfg: C.RunConfig, shape: Shape, head: str, base: S.Candidate | None) -> dict:
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
