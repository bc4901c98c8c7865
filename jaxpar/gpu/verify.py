"""``jaxpar plan --verify N``: the planner's ranked layouts compiled by XLA:GPU for the mesh's pod.

The planner ranks layouts by its own memory and time model (:mod:`jaxpar.planner`). For a GPU
mesh the memory that decides "fits" is the GPU program's, so ``N`` ranked layouts are compiled
for the mesh's target (:func:`jaxpar.gpu.compile.compile_step`, the exact train step
the trainer would run) and each compiled per-device total is set beside the planner's figure
and the device's usable memory, and each program's step is timed by :mod:`jaxpar.gpu.timing`
(the scheduled module simulated on the mesh file's hardware) beside the planner's step. The
verified pick is the layout with the shortest **simulated** step among those whose compiled
program fits: the planner proposes, the compiled program decides. A planner pick that XLA:GPU
says does not fit is never the verified one, nor one the planner ranks first by an overlap the
program does not have. Nothing runs on a GPU.

Which ``N`` (:func:`candidates`): the planner's best layout of each family — pipelined or not,
by ZeRO stage — in rank order, then the next ranked ones. The planner's errors against the
compiled programs are per family (a pipeline's lock-step ticks, ZeRO-3's gathers: BENCHMARKS.md
"The planner held to the program"), and its first ``N`` are often ``N`` variants of one family:
for llama2-70b on a100-64 its first five are pipelined (BENCHMARKS.md, "plan --verify by
family").
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from jaxpar import config as C
from jaxpar import validation as V
from jaxpar.errors import ConfigError


@dataclass(frozen=True)
class Verified:
    """One ranked layout as XLA:GPU compiled it (``refused``: why it was not compiled)."""

    rank: int
    layout: dict[str, Any]
    predicted_bytes: float
    compiled_bytes: float | None = None
    usable_bytes: float | None = None
    fits: bool | None = None  # the compiled program within the usable memory
    compile_s: float | None = None
    exposed_share: float | None = None  # collective wire bytes with no compute beside them
    refused: str | None = None
    step_s: float | None = None  # the compiled program's simulated step (jaxpar.gpu.timing)
    planner_step_s: float | None = None  # the planner's step for the same layout
    exposed_s: dict[str, float] | None = None  # simulated exposed seconds per mesh axis, total
    tflops_per_device: float | None = None  # model TFLOP/s per device at the simulated step
    xla_flags: list[str] | None = None  # the mesh's flags its compile started with

    @property
    def ratio(self) -> float | None:
        """Compiled over predicted memory."""
        return self.compiled_bytes / self.predicted_bytes if self.compiled_bytes else None

    @property
    def step_ratio(self) -> float | None:
        """The planner's step over the compiled program's simulated step."""
        return self.planner_step_s / self.step_s if self.step_s and self.planner_step_s else None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of this row (``verified`` in ``jaxpar plan --json``)."""
        return {**dataclasses.asdict(self), "ratio": self.ratio, "step_ratio": self.step_ratio}


def family(layout: Any) -> tuple[bool, int]:
    """A layout's family (:func:`candidates`): whether it is pipelined, and its ZeRO stage."""
    return (layout.pp > 1, layout.zero)


def candidates(ranked: list[Any], n: int) -> list[int]:
    """The 0-based ranks of the ``n`` layouts to compile (module docstring), in rank order;
    ``ranked[i].layout`` each candidate's layout."""
    first: dict[tuple[bool, int], int] = {}
    for i, cand in enumerate(ranked):
        first.setdefault(family(cand.layout), i)
    picked = sorted(first.values())[:n]
    rest = [i for i in range(len(ranked)) if i not in set(picked)]
    return sorted(picked + rest[: max(0, n - len(picked))])


def verify_ranked(cfg: C.RunConfig, n: int) -> list[Verified]:
    """Compile ``n`` of the layouts the planner ranks for ``cfg`` (:func:`candidates`) on its
    GPU target.

    Raises :class:`ConfigError` (one line) for a mesh that is not a GPU pod or a missing CUDA
    plugin, before anything compiles."""
    from jaxpar.gpu.targets import require_plugin, target_for
    from jaxpar.planner import explain as X
    from jaxpar.planner.recommend import rank_layouts

    if cfg.mesh.hardware.platform != "gpu":
        raise ConfigError(f"--verify: mesh {cfg.mesh.name!r} is not a GPU pod (hardware.gpu)")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process runs on the CPU
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to check
    plug = require_plugin()
    target_for(cfg.mesh, plug)  # refuses a mesh without a GPU target before ranking
    r = rank_layouts(cfg)
    from jaxpar.gpu.compile import apply_flags

    # the mesh's flags checked once, up front, on a copy of the environment (one line for an
    # unknown name); each layout's program compiles in its own process (_compile_row)
    apply_flags(list(cfg.mesh.hardware.xla_flags), plug.module, env=dict(os.environ))
    out = []
    for i in candidates(r.ranked, n):
        rank, cand = i + 1, r.ranked[i]
        trial = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, layout=cand.layout))
        summary = X.summary(cand, cfg.model, cfg.mesh.hardware, r.shape)
        row = Verified(rank, summary["layout"], float(summary["memory_per_device_bytes"]))
        try:
            V.validate(trial, n_devices=cfg.mesh.devices)
        except ConfigError as e:  # a rule beyond the search's check_layout
            out.append(dataclasses.replace(row, refused=str(e)))
            continue
        out.append(dataclasses.replace(row, **_in_fresh_process(_compile_row, trial)))
    return out


def _in_fresh_process(fn, *args: Any) -> Any:
    """``fn(*args)`` in a new Python process: XLA reads ``XLA_FLAGS`` once, when its GPU
    compiler starts, so each layout's own flags need a process of their own."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result()


def _compile_row(trial: C.RunConfig) -> dict[str, Any]:
    """Compile ``trial``'s train step with the flags a run of its layout starts with
    (:func:`jaxpar.distributed.run_xla_flags`, as ``jaxpar compile`` and ``jaxpar train``) and
    read its memory and simulated step (fields of :class:`Verified`)."""
    from jaxpar.distributed import run_xla_flags
    from jaxpar.gpu.compile import apply_flags, compile_step
    from jaxpar.gpu.report import estimate, memory, overlap_share
    from jaxpar.gpu.targets import require_plugin, target_for

    plug = require_plugin()
    flags = apply_flags(run_xla_flags(trial.mesh.hardware, trial.layout), plug.module)
    compiled = compile_step(trial, target_for(trial.mesh, plug), flags)
    mem = memory(trial, compiled)
    est, _ = estimate(trial, compiled)
    return {
        "compiled_bytes": float(mem["total"]),
        "usable_bytes": float(mem["usable_bytes"]),
        "fits": bool(mem["fits"]),
        "compile_s": compiled.seconds,
        "exposed_share": overlap_share(compiled),
        "step_s": est["step_s"],
        "planner_step_s": est["planner_step_s"],
        "exposed_s": dict(est["exposed_s"]),
        "tflops_per_device": est["tflops_per_device"],
        "xla_flags": list(flags.from_mesh),
    }


def verified_pick(rows: list[Verified]) -> Verified | None:
    """Among the layouts whose compiled program fits, the one with the shortest simulated
    step (ties: the planner's rank), or None. A row without a simulated step (none was
    made) ranks after every row with one."""
    fits = [v for v in rows if v.fits]
    return min(fits, key=lambda v: (v.step_s is None, v.step_s or 0.0, v.rank), default=None)


def render(rows: list[Verified]) -> str:
    """The verification table of ``jaxpar plan --verify``."""
    from jaxpar.planner import explain as X
    from jaxpar.report import human_bytes

    lines = ["", "Compiled by XLA:GPU for the mesh's pod (per device):"]
    for v in rows:
        head = f"  {v.rank}. {X.layout_text(v.layout)}: "
        if v.refused:
            lines.append(head + f"not compiled: {v.refused}")
            continue
        verdict = "fits" if v.fits else "does NOT fit"
        lines.append(
            head + f"compiled {human_bytes(v.compiled_bytes)} (planner "
            f"{human_bytes(v.predicted_bytes)}, ratio {v.ratio:.2f}), {verdict} "
            f"{human_bytes(v.usable_bytes)}; exposed collectives {v.exposed_share:.0%}; "
            f"compiled in {v.compile_s:.1f} s"
        )
        if v.step_s is not None:
            exposed = ", ".join(f"{k} {s:.3g} s" for k, s in (v.exposed_s or {}).items()
                                if k != "total" and s >= 1e-4) or "none"  # fmt: skip
            tf = f", {v.tflops_per_device:.0f} TFLOP/s" if v.tflops_per_device else ""
            lines.append(f"     simulated step {v.step_s:.4g} s (planner {v.planner_step_s:.4g} s, "
                         f"ratio {v.step_ratio:.2f}){tf}; exposed: {exposed}")  # fmt: skip
    pick = verified_pick(rows)
    lines.append(
        f"verified pick (shortest simulated step that fits): rank {pick.rank}, "
        f"{X.layout_text(pick.layout)}"
        if pick
        else f"verified pick: none of the {len(rows)} compiled layouts fits"
    )
    return "\n".join(lines)
