"""``--layout auto`` and ``jaxpar plan --emit-flags N``: the planner's ranked layouts as layouts
the trainer runs.

:func:`resolve_auto_layout` is what ``jaxpar train``, ``jaxpar bench`` and ``jaxpar compile``
call: it ranks the layouts that fit the mesh's devices (:func:`jaxpar.planner.recommend.
rank_layouts`, every candidate drawn through ``validation.check_layout``), keeps the fastest one
the full ``validation.validate`` accepts for this run, sets it on the config and returns what
was chosen and why (the run records it in its JSON). :func:`train_flags` turns a ranked layout
into ``jaxpar train`` flags (``jaxpar plan --emit-flags N``), so that
``jaxpar plan ... --emit-flags 1 | xargs jaxpar train --dry-run`` runs the layout planned.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxpar import config as C
from jaxpar import validation as V
from jaxpar.errors import ConfigError
from jaxpar.planner import explain as X
from jaxpar.planner.recommend import Ranking, plan, rank_layouts
from jaxpar.planner.search import Candidate

# Layout fields a ranked layout sets, with the `jaxpar train` flag of each (None: `-o`).
FLAG_OF = {
    "dp": "--dp", "tp": "--tp", "pp": "--pp", "sp": "--sp", "zero": "--zero",
    "microbatches": "--microbatches", "schedule": "--schedule", "virtual": "--virtual",
    "pipeline_memory": "--pipeline-memory", "sp_mode": "--sp-mode", "remat": "--remat",
    "offload": "--offload", "compute_dtype": "--compute-dtype", "ep": "--ep", "dp_shard": None,
    "sequence_parallel": None, "param_dtype": None, "reduce_dtype": None, "fp8": "--fp8",
}  # fmt: skip


class NoLayoutFits(ConfigError):
    """``--layout auto`` found no layout that fits: ``result`` is the plan's verdict (its
    smallest shortfall); the command exits 1 with its headline."""

    def __init__(self, result: dict):
        super().__init__(result["headline"])
        self.result = result


@dataclass(frozen=True)
class AutoLayout:
    """The layout ``--layout auto`` chose: its rank, the plan's summary of it, and why."""

    rank: int
    summary: dict
    why: str

    def to_dict(self) -> dict:
        """The ``auto_layout`` JSON object a run records."""
        s = self.summary
        return {"rank": self.rank, "layout": s["layout"], "why": self.why,
                "predicted_step_time_s": s["step_time_s"], "predicted_mfu": s["mfu"],
                "memory_per_device_bytes": s["memory_per_device_bytes"]}  # fmt: skip

    def line(self) -> str:
        """One line for the run's output."""
        return (f"layout auto: {X.layout_text(self.summary['layout'])} (rank {self.rank}) — "
                f"{self.why}")  # fmt: skip


def _apply(cfg: C.RunConfig, c: Candidate) -> C.RunConfig:
    """A copy of ``cfg`` running candidate ``c``'s layout."""
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, layout=c.layout))


def resolve_auto_layout(cfg: C.RunConfig) -> AutoLayout:
    """Set the planner's best layout that the trainer accepts on ``cfg`` (in place: its mesh's
    layout) and return it. Raises :class:`NoLayoutFits` when no layout fits the devices, and
    :class:`ConfigError` for a bad workload or when the trainer refuses every ranked layout."""
    r = rank_layouts(cfg)
    if not r.ranked:
        raise NoLayoutFits(plan(cfg, top=0))
    refusals = []
    for i, c in enumerate(r.ranked, 1):
        trial = _apply(cfg, c)
        try:
            V.validate(trial, n_devices=cfg.mesh.devices)
        except ConfigError as e:  # a rule beyond check_layout (data, attention, ...)
            refusals.append(f"rank {i}: {e}")
            continue
        cfg.mesh.layout = c.layout
        summary = X.summary(c, cfg.model, cfg.mesh.hardware, r.shape)
        why = _why(c, r.ranked, i, len(r.ranked), refusals)
        return AutoLayout(i, summary, why)
    raise ConfigError(
        f"layout=auto: the trainer refuses all {len(r.ranked)} ranked layouts ({refusals[0]})"
    )


def _why(c: Candidate, ranked: list[Candidate], i: int, n: int, refusals: list[str]) -> str:
    text = (f"the fastest of {n} layouts that fit" if i == 1
            else f"rank {i} of {n} (the faster ones refused: {'; '.join(refusals)})")  # fmt: skip
    text += f", predicted {c.step_time:.3g} s/step"
    if len(ranked) > i:
        text += f"; the next loses {X.why_loses(ranked[i], c)}"
    return text


def train_flags(
    cfg: C.RunConfig, index: int, model_arg: str, mesh_arg: str, ranking: Ranking | None = None
) -> list[str]:
    """``jaxpar train`` flags running ranked layout ``index`` (1 = the recommendation) of
    ``cfg``'s plan (``model_arg``/``mesh_arg``: the names or paths it was loaded from; a
    ``ranking`` of ``cfg`` already searched is reused): model, mesh, workload and every layout
    field. Raises :class:`ConfigError` for an index past the ranking."""
    r = ranking or rank_layouts(cfg)
    if not 1 <= index <= len(r.ranked):
        raise ConfigError(
            f"--emit-flags={index}: must be between 1 and {len(r.ranked)} (the ranked layouts "
            "that fit)"
            if r.ranked
            else f"--emit-flags={index}: no layout fits, nothing to emit"
        )
    return layout_flags(cfg, r.ranked[index - 1].layout, model_arg, mesh_arg)


def layout_flags(cfg: C.RunConfig, lay: C.LayoutConfig, model_arg: str, mesh_arg: str) -> list[str]:
    """``jaxpar train`` flags running ``lay`` on ``cfg``'s model, mesh and workload (every
    layout field stated; ``jaxpar plan --emit-flags`` of a ranked or a given layout)."""
    t = cfg.train
    out = ["--model", model_arg, "--mesh", mesh_arg,
           "--global-batch", str(t.global_batch), "--seq-len", str(t.seq_len)]  # fmt: skip
    for name, flag in FLAG_OF.items():
        value = getattr(lay, name)
        text = str(value).lower() if isinstance(value, bool) else str(value)
        out += [flag, text] if flag else ["-o", f"layout.{name}={text}"]
    if cfg.mesh.devices != C.load_mesh(mesh_arg).devices:
        out += ["--devices", str(cfg.mesh.devices)]
    return out
