"""``jaxpar train``: train a model on a mesh (defaults: tiny model, 8 simulated CPU devices)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from jaxpar.commands import _checks as K
from jaxpar.commands.flags import FLAGS  # the train flags (re-exported)

HELP = "train a model on a device mesh (defaults: tiny model on 8 simulated CPU devices)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``jaxpar train``."""
    p.add_argument(
        "--model",
        default=None,
        help="model name (models/NAME.yaml) or YAML path (default: tiny, or the shape of "
        "--init-from-hf)",
    )
    p.add_argument("--mesh", default="cpu-8", help="mesh name (meshes/NAME.yaml) or YAML path")
    for name, (_, typ, text) in FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None, help=text)
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        default=None,
        help="Megatron sequence parallelism over tp",
    )
    p.add_argument(
        "--layout",
        choices=["auto"],
        default=None,
        help="auto: run the planner's best layout that fits the mesh's devices (printed, and "
        "recorded in the run's JSON as auto_layout)",
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument(
        "--resume-or-start",
        action="store_true",
        help="continue from the newest complete checkpoint, or start fresh if there is none",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace outputs jaxpar did not write (a metrics file, an --export-hf directory) "
        "whole",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate, resolve the layout, print the planner's memory estimate and exit; "
        "nothing is compiled",
    )
    p.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="set any config field, e.g. -o train.warmup_steps=10 -o layout.zero=3",
    )
    p.add_argument("--json", action="store_true", help="print one JSON summary as the last line")
    g = p.add_argument_group("multi-host (else JAXPAR_COORDINATOR/..., or SLURM variables)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="process 0's address")
    g.add_argument("--num-processes", type=K.positive_int, default=None,
                   help="processes in the run")  # fmt: skip
    g.add_argument("--process-id", type=K.nonneg_int, default=None,
                   help="this process's id, 0..N-1")  # fmt: skip


def build_config(args: argparse.Namespace):
    """RunConfig from the parsed flags (validated later, before compiling)."""
    from jaxpar import config as C
    from jaxpar.errors import ConfigError

    cfg = C.load(args.model or "tiny", args.mesh)
    if args.model is None and args.init_from_hf:
        from jaxpar.model.hf import model_config

        cfg.model = model_config(args.init_from_hf)
    for name, (dotted, _, _) in FLAGS.items():
        value = getattr(args, name)
        if value is not None:
            C.override(cfg, dotted, value)
    if args.sequence_parallel:
        C.override(cfg, "layout.sequence_parallel", True)
    if args.resume:
        C.override(cfg, "train.resume", True)
    if args.resume_or_start:
        C.override(cfg, "train.resume_or_start", True)
    if args.no_progress:
        C.override(cfg, "train.progress", False)
    if args.force:
        C.override(cfg, "train.force", True)
    seq_stated = args.seq_len is not None
    for item in args.override:
        if "=" not in item:
            raise ConfigError(f"-o {item!r}: expected FIELD=VALUE")
        key, value = item.split("=", 1)
        C.override(cfg, key.strip(), value.strip())
        seq_stated |= key.strip() == "train.seq_len"
    if not seq_stated:  # the default fits the model as it ends up (--init-from-hf, -o model.*)
        cfg.train.seq_len = C.default_seq_len(cfg)
    return cfg


LAYOUT_NAMES = ("dp", "tp", "pp", "sp", "zero", "microbatches", "schedule", "virtual",
                "pipeline_memory", "sp_mode", "remat", "offload", "compute_dtype",
                "fp8")  # fmt: skip


def auto_layout(cfg, args: argparse.Namespace) -> dict | None:
    """``--layout auto``: set the planner's best layout on ``cfg`` and print it with why
    (:func:`jaxpar.planner.auto.resolve_auto_layout`); returns its JSON record, ``None``
    without the flag, or ``{"fits": False, ...}`` (the plan's verdict printed) when nothing
    fits the devices."""
    if getattr(args, "layout", None) != "auto":
        return None
    from jaxpar.errors import ConfigError
    from jaxpar.planner import check_hardware
    from jaxpar.planner.auto import NoLayoutFits, resolve_auto_layout

    # --fp8 is the precision the search prices every layout with (jaxpar plan --fp8)
    given = [n for n in LAYOUT_NAMES if n != "fp8" and getattr(args, n) is not None]
    given += ["sequence_parallel"] if args.sequence_parallel else []
    if given:
        raise ConfigError(f"--layout=auto: conflicts with --{given[0].replace('_', '-')} (the "
                          "planner chooses every layout field)")  # fmt: skip
    check_hardware(K.raw_hardware(args.mesh), cfg.mesh)  # the planner's figures, stated
    try:
        chosen = resolve_auto_layout(cfg)
    except NoLayoutFits as e:
        print(e.result["headline"])
        return {"fits": False, "shortfall_bytes": e.result.get("shortfall_bytes")}
    print(chosen.line())
    return chosen.to_dict()


def memory_estimate(cfg) -> dict:
    """The planner's per-device memory estimate for ``cfg``'s layout, as ``jaxpar plan`` costs
    a given layout: ``per_device_bytes``, ``breakdown_bytes`` (params, grads, grad_accum,
    optimizer, activations with the schedule library's peak stashes, head, host),
    ``usable_bytes`` and ``fits``. The one place ``--dry-run`` reaches into the cost model."""
    from jaxpar.planner import footprint as M
    from jaxpar.planner.search import evaluate

    shape = M.Shape(cfg.train.global_batch, cfg.train.seq_len)
    hw = cfg.mesh.hardware
    if not hw.matmul_efficiency:  # not measured: the run needs none, and memory reads none
        hw = dataclasses.replace(hw, matmul_efficiency=[[1.0, 1.0]])
    c = evaluate(cfg.model, hw, cfg.layout, shape)
    return {
        "per_device_bytes": c.memory["total"],
        "breakdown_bytes": {k: v for k, v in c.memory.items() if k != "total"},
        "usable_bytes": c.usable,
        "fits": c.fits,
    }


def dry_run(cfg, args: argparse.Namespace, verb: str = "train", auto: dict | None = None) -> int:
    """``--dry-run``: everything that can be checked without JAX, then the layout and the
    planner's memory estimate; exit 0. Nothing is compiled, no device is set up."""
    from jaxpar import config as C
    from jaxpar import validation as V
    from jaxpar.distributed import process_config
    from jaxpar.preflight import preflight
    from jaxpar.report import emit_json, human_bytes

    V.validate(cfg, n_devices=cfg.mesh.devices)
    t = cfg.train
    preflight(cfg)  # every check the real run makes before compiling
    outputs = {f: getattr(t, f) for f in ("checkpoint_dir", "tensorboard_dir", "profile_dir",
                                            "export_hf")}  # fmt: skip
    if t.metrics_file:
        outputs["metrics_file"] = str(Path(t.metrics_file).parent)
    for name, path in outputs.items():
        try:
            if path:
                K.writable_dir(path)
        except argparse.ArgumentTypeError as e:
            raise C.ConfigError(f"train.{name}={getattr(t, name)!r}: {e}") from None
    pc = process_config(args.coordinator, args.num_processes, args.process_id)
    mem = memory_estimate(cfg)
    lay = cfg.layout
    out = {
        "dry_run": True,
        "verb": verb,
        "model": cfg.model.name,
        "params": cfg.model.param_count(),
        "mesh": cfg.mesh.name,
        "devices": cfg.mesh.devices,
        "processes": pc.num_processes if pc else 1,
        "layout": C.to_dict(lay),
        "train": {k: getattr(t, k) for k in ("steps", "global_batch", "seq_len", "lr", "seed")},
        "memory": mem,
    }
    if auto is not None:
        out["auto_layout"] = auto
    if args.json:
        emit_json(out)
        return 0
    parts = ", ".join(
        f"{k} {human_bytes(v)}" for k, v in mem["breakdown_bytes"].items() if v and k != "host"
    )
    host = mem["breakdown_bytes"].get("host")
    print(
        f"dry run: model {cfg.model.name} ({cfg.model.param_count() / 1e6:.1f} M params) on "
        f"{cfg.mesh.devices} {cfg.mesh.hardware.platform} devices: pp={lay.pp} dp={lay.dp} "
        f"sp={lay.sp} tp={lay.tp} zero={lay.zero}, {lay.microbatches} micro-batches, "
        f"schedule {lay.schedule if lay.pp > 1 else '-'}, remat {lay.remat}"
    )
    print(
        f"memory per device (planner estimate): {human_bytes(mem['per_device_bytes'])} of "
        f"{human_bytes(mem['usable_bytes'])} usable, {'fits' if mem['fits'] else 'does NOT fit'}"
        f" ({parts}{f'; host {human_bytes(host)}' if host else ''}); nothing was compiled"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    """Validate, set up devices, train, report (or only validate: ``--dry-run``)."""
    from jaxpar import validation as V
    from jaxpar.distributed import setup
    from jaxpar.lock import abort_on_signal
    from jaxpar.preflight import preflight
    from jaxpar.report import emit_json

    cfg = build_config(args)
    auto = auto_layout(cfg, args)
    if auto is not None and auto.get("fits") is False:
        return 1
    if args.dry_run:
        return dry_run(cfg, args, auto=auto)
    V.validate(cfg, n_devices=cfg.mesh.devices)
    preflight(cfg, data=False)  # the run loads (and checks) the data itself
    pc = setup(
        cfg.mesh.hardware, cfg.mesh.devices, args.coordinator, args.num_processes, args.process_id,
        layout=cfg.layout,
    )  # fmt: skip

    from jaxpar.train.guard import resume_command
    from jaxpar.train.loop import run as train_run

    with abort_on_signal():  # a signal before the loop's own handler: locks released, exit 128+N
        result = train_run(cfg)
    code = 0 if result["stopped"] is None else 3
    if result["preempted"]:
        # Preemption is a clean exit (0): the scheduler's requeue runs the printed command.
        # Every process says where it stopped (they agreed on the step).
        step = result["checkpoint_step"]
        how = (
            f"checkpoint at step {step} in {cfg.train.checkpoint_dir}; resume with:\n  "
            f"{resume_command()}"
            if step
            else "no checkpoint was written (no --checkpoint-dir, or no step done); rerun "
            "the same command to start again"
        )
        if pc is not None and pc.process_id != 0:
            how = f"checkpoint at step {step}" if step else "no checkpoint"
        print(
            f"jaxpar train: stopped by {result['preempted']} after step {result['end_step']}; "
            + how,
            file=sys.stderr,
        )
    if pc is not None and pc.process_id != 0:
        return code  # process 0 reports
    if auto is not None:
        result["auto_layout"] = auto
    if args.json:
        emit_json(result)
    else:
        lay = cfg.layout
        print(
            f"model {cfg.model.name} ({cfg.model.param_count() / 1e6:.1f} M params) on "
            f"{result['devices']} {result['platform']} devices: pp={lay.pp} dp={lay.dp} "
            f"sp={lay.sp} tp={lay.tp} zero={lay.zero}"
        )
        if lay.fp8 != "none" and result["platform"] == "cpu":
            print(f"layout.fp8={lay.fp8}: FP8 GEMMs emulated by XLA:CPU (exact FP8 products, fp32 "
                  "accumulation): an FP8 GPU's numerics, not its speed")  # fmt: skip
        ev = result["eval_loss"]
        if result["final_loss"] is None:
            return code
        skipped = (
            f", {result['diverged_steps']} diverged steps ({result['skipped_steps']} skipped)"
            if result["diverged_steps"]
            else ""
        )
        # the measure of `jaxpar eval --max-batches N` on the same held-out tokens
        held = f"{ev:.4f} (first {result['eval_batches']} batches)" if ev is not None else "n/a"
        print(
            f"final loss {result['final_loss']:.4f}, held-out loss "
            f"{held}, {result['tokens_per_s']:,.0f} tokens/s, "
            f"{result['step_time_s'] * 1e3:.1f} ms/step{skipped}"
        )
    return code
