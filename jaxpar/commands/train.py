"""``jaxpar train``: train a model on a mesh (defaults: tiny model, 8 simulated CPU devices)."""

from __future__ import annotations

import argparse
import sys

HELP = "train a model on a device mesh (defaults: tiny model on 8 simulated CPU devices)"

# CLI flag -> dotted config field. Flags left unset keep the YAML/embedded value.
FLAGS: dict[str, tuple[str, type, str]] = {
    "steps": ("train.steps", int, "number of optimizer steps"),
    "seed": ("train.seed", int, "seed of init and data order"),
    "global_batch": ("train.global_batch", int, "sequences per step, all devices together"),
    "seq_len": ("train.seq_len", int, "tokens per sequence"),
    "lr": ("train.lr", float, "peak learning rate"),
    "data": ("train.data", str, "'stdlib' (embedded corpus), 'synthetic', or a .bin token file"),
    "eval_data": (
        "train.eval_data",
        str,
        "held-out .bin token file (default: the sidecar's validation file, else the last 5%%)",
    ),
    "data_dtype": ("train.data_dtype", str, "uint8 | uint16 | uint32: a .bin without sidecar"),
    "checkpoint_dir": ("train.checkpoint_dir", str, "where orbax checkpoints go"),
    "checkpoint_every": ("train.checkpoint_every", int, "steps between checkpoints"),
    "keep_checkpoints": ("train.keep_checkpoints", int, "complete checkpoints to keep"),
    "metrics_file": ("train.metrics_file", str, "JSONL metrics (appended)"),
    "tensorboard": ("train.tensorboard_dir", str, "also write TensorBoard scalars here"),
    "eval_every": ("train.eval_every", int, "steps between held-out evaluations (0: end only)"),
    "on_nonfinite": ("train.on_nonfinite", str, "skip | stop on a non-finite loss/gradient"),
    "devices": ("mesh.devices", int, "devices of the cluster (simulated on CPU)"),
    "dp": ("layout.dp", int, "data-parallel size"),
    "tp": ("layout.tp", int, "tensor-parallel size"),
    "pp": ("layout.pp", int, "pipeline stages"),
    "sp": ("layout.sp", int, "sequence/context-parallel size"),
    "zero": ("layout.zero", int, "ZeRO stage 0-3"),
    "microbatches": ("layout.microbatches", int, "micro-batches per step"),
    "schedule": ("layout.schedule", str, "pipeline schedule"),
    "virtual": ("layout.virtual", int, "virtual pipeline stages per rank"),
    "sp_mode": ("layout.sp_mode", str, "ulysses | ring"),
    "remat": ("layout.remat", str, "none | full | selective | offload"),
    "offload": ("layout.offload", str, "none | optimizer | params"),
    "compute_dtype": ("layout.compute_dtype", str, "float32 | bfloat16"),
    "profile_steps": ("train.profile_steps", str, "A:B: write a jax.profiler trace of steps A..B"),
    "profile_dir": ("train.profile_dir", str, "directory of the profiler trace"),
    "init_from_hf": ("train.init_from_hf", str, "start from a Hugging Face Llama directory"),
    "export_hf": ("train.export_hf", str, "write the final weights as a Hugging Face directory"),
}


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
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument(
        "--resume-or-start",
        action="store_true",
        help="continue from the newest complete checkpoint, or start fresh if there is none",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
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
    g.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    g.add_argument("--process-id", type=int, default=None, help="this process's id, 0..N-1")


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
    for item in args.override:
        if "=" not in item:
            raise ConfigError(f"-o {item!r}: expected FIELD=VALUE")
        key, value = item.split("=", 1)
        C.override(cfg, key.strip(), value.strip())
    return cfg


def run(args: argparse.Namespace) -> int:
    """Validate, set up devices, train, report."""
    from jaxpar import config as C
    from jaxpar.distributed import setup
    from jaxpar.report import emit_json

    cfg = build_config(args)
    C.validate(cfg, n_devices=cfg.mesh.devices)
    pc = setup(
        cfg.mesh.hardware, cfg.mesh.devices, args.coordinator, args.num_processes, args.process_id
    )

    from jaxpar.train.guard import resume_command
    from jaxpar.train.loop import run as train_run

    result = train_run(cfg)
    if pc is not None and pc.process_id != 0:
        return 0 if result["stopped"] is None else 3  # process 0 reports
    if result["preempted"]:
        # Preemption is a clean exit (0): the scheduler's requeue runs the printed command.
        step = result["checkpoint_step"]
        how = (
            f"checkpoint at step {step} in {cfg.train.checkpoint_dir}; resume with:\n  "
            f"{resume_command()}"
            if step
            else "no checkpoint was written (no --checkpoint-dir, or no step done); rerun "
            "the same command to start again"
        )
        print(
            f"jaxpar train: stopped by {result['preempted']} after step {result['end_step']}; "
            + how,
            file=sys.stderr,
        )
    if args.json:
        emit_json(result)
    else:
        lay = cfg.layout
        print(
            f"model {cfg.model.name} ({cfg.model.param_count() / 1e6:.1f} M params) on "
            f"{result['devices']} {result['platform']} devices: pp={lay.pp} dp={lay.dp} "
            f"sp={lay.sp} tp={lay.tp} zero={lay.zero}"
        )
        ev = result["eval_loss"]
        if result["final_loss"] is None:
            return 0 if result["stopped"] is None else 3
        print(
            f"final loss {result['final_loss']:.4f}, held-out loss "
            f"{'n/a' if ev is None else f'{ev:.4f}'}, {result['tokens_per_s']:,.0f} tokens/s, "
            f"{result['step_time_s'] * 1e3:.1f} ms/step"
        )
    return 0 if result["stopped"] is None else 3
