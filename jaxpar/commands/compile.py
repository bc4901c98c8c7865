"""``jaxpar compile``: compile the train step for a GPU pod on this machine and read the program.

The mesh file names the pod (``hardware.gpu``, ``devices``, ``devices_per_node``,
``xla_flags``); the layout flags are ``jaxpar train``'s. Nothing runs on a GPU: XLA:GPU compiles
for the described target (:mod:`jaxpar.gpu`), and the report puts the program's memory,
collectives and their overlap beside the planner's figures (keys: :mod:`jaxpar.gpu.report`).
``--save FILE`` writes the serialized executable (:mod:`jaxpar.gpu.saved`: a format line, a
sha256 checksum, a header); ``--load FILE`` checks one against this machine's target and prints
its header (a damaged, hand-made or foreign file is refused in one line). The output files
(``OUTPUTS``: ``--save``, ``--hlo``, ``--trace``) are checked before anything compiles: files in
writable directories (``--save`` and ``--hlo`` new ones, when the flags are parsed), no two the
same file, none beside ``--load``. Without the jax CUDA plugin the command says what to install
(exit 2).

``--trace FILE.json`` writes the step as :mod:`jaxpar.gpu.timing` simulates it on the target, in
the Chrome/Perfetto trace format (a compute track and one per communication stream); a path
that is not ``.json``, whose directory is missing or unwritable, or that exists (without
``--force``) is refused before compiling. ``--timeline FILE.png`` draws the same step as a Gantt
chart (:mod:`jaxpar.gpu.timeline`, exposed communication marked), its path checked alike.
"""

from __future__ import annotations

import argparse
import os

HELP = "compile the train step for a GPU pod (no GPU needed): memory, collectives, overlap"

# jaxpar train's flags that shape the compiled step (the rest concern running it); every flag
# `jaxpar plan --emit-flags` prints is one (tests/test_planner_auto.py).
STEP_FLAGS = ("global_batch", "seq_len", "devices", "dp", "tp", "pp", "sp", "zero", "ep",
              "microbatches", "schedule", "virtual", "pipeline_memory", "sp_mode", "remat",
              "offload", "compute_dtype", "fp8")  # fmt: skip

# The files the command writes (flag dests), no two the same file and none beside --load
# (check_outputs, before compiling); --save and --hlo are new files (_checks.new_file, when
# parsing), --trace is checked by jaxpar.gpu.trace.check_trace_path.
OUTPUTS = ("save", "hlo", "trace", "timeline")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``jaxpar compile``."""
    from jaxpar.commands import _checks as K
    from jaxpar.commands.flags import FLAGS

    p.add_argument("--model", default="tiny", help="model name (models/NAME.yaml) or YAML path")
    p.add_argument("--mesh", default="h100-8", help="GPU mesh name (meshes/NAME.yaml) or path")
    for name in STEP_FLAGS:
        _, typ, text = FLAGS[name]
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None, help=text)
    p.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="Megatron sequence parallelism over tp")  # fmt: skip
    p.add_argument("--layout", choices=["auto"], default=None,
                   help="auto: compile the planner's best layout that fits the pod (printed, "
                   "recorded in the JSON as auto_layout)")  # fmt: skip
    p.add_argument("-o", "--override", action="append", default=[], metavar="FIELD=VALUE",
                   help="set any config field, e.g. -o model.attention=blockwise")  # fmt: skip
    p.add_argument("--save", type=K.new_file, default=None, metavar="FILE",
                   help="write the executable (a new file)")  # fmt: skip
    p.add_argument("--load", default=None, metavar="FILE", help="check a saved executable")
    p.add_argument("--hlo", type=K.new_file, default=None, metavar="FILE",
                   help="write the optimized HLO text (a new file)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--trace", default=None, metavar="FILE.json",
                   help="write the simulated step as a Chrome trace (Perfetto)")  # fmt: skip
    p.add_argument("--timeline", default=None, metavar="FILE.png",
                   help="draw the simulated step as a Gantt chart (PNG)")  # fmt: skip
    p.add_argument("--force", action="store_true",
                   help="let --trace/--timeline replace an existing file")  # fmt: skip


def build_config(args: argparse.Namespace):
    """RunConfig of the mesh file and the flags, as ``jaxpar train`` builds it (validated
    before anything compiles)."""
    from jaxpar import validation as V
    from jaxpar.commands import train

    values = {name: getattr(args, name, None) for name in train.FLAGS}
    ns = argparse.Namespace(**values, model=args.model, mesh=args.mesh,
                            sequence_parallel=args.sequence_parallel, override=args.override,
                            resume=False, resume_or_start=False, no_progress=True,
                            force=False)  # fmt: skip
    cfg = train.build_config(ns)
    ns.layout = getattr(args, "layout", None)
    # --layout auto: the planner's pick set on cfg (None without the flag); kept on args for run
    args.auto_layout = train.auto_layout(cfg, ns)
    if args.auto_layout is None or args.auto_layout.get("fits") is not False:
        V.validate(cfg, n_devices=cfg.mesh.devices)
    return cfg


def _load(path: str, as_json: bool) -> int:
    from jaxpar.gpu.saved import load
    from jaxpar.report import emit_json

    got = load(path)
    out = {
        "file": path,
        "format": got.saved.format,
        "file_sha256": got.saved.sha256,
        "versions": got.saved.versions,
        "target": got.saved.target,
        "run": got.saved.run,
        "executables": got.executables,
        "sha256": got.digest,
        "arguments": len(__import__("jax").tree.leaves(got.args)),
        "loaded": got.compiled is not None,
        "why_not_loaded": got.why_not_loaded,
    }
    if as_json:
        emit_json(out)
    else:
        print(f"{path}: {got.saved.target['gpu']} {got.saved.target['topology']}, "
              f"{out['arguments']} arguments, executable sha256 {got.digest[:16]}..; "
              + ("loaded" if out["loaded"] else f"not loaded: {got.why_not_loaded}"))  # fmt: skip
    return 0


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before anything compiles, two output flags naming one file (``--save X --hlo
    X``, or the same file by two spellings) and outputs or layout flags beside ``--load``
    (which compiles and writes nothing). ``--save`` and ``--hlo`` are already new files in
    writable directories (``_checks.new_file``, when parsing)."""
    from jaxpar.errors import ConfigError

    given = [(name, getattr(args, name, None)) for name in OUTPUTS]
    given = [(name, path) for name, path in given if path is not None]
    if args.load is not None:
        layout = [n for n in STEP_FLAGS if getattr(args, n, None) is not None]
        layout += [n for n in ("sequence_parallel", "layout") if getattr(args, n, None)]
        layout += ["override"] if getattr(args, "override", None) else []
        other = [f"--{n}" for n, _ in given] + [f"--{n.replace('_', '-')}" for n in layout]
        if other:
            raise ConfigError(f"--load={args.load!r}: checks a saved executable and compiles "
                              f"nothing; {other[0]} does not apply to it")  # fmt: skip
    seen: dict[str, str] = {}
    for name, path in given:
        real = os.path.realpath(path)
        if real in seen:
            raise ConfigError(f"--{name}={path!r}: the same file as --{seen[real]}; each "
                              "output needs its own file")  # fmt: skip
        seen[real] = name


def run(args: argparse.Namespace) -> int:
    """Compile and report; bad input is refused in one line (exit 2) before compiling."""
    from jaxpar.gpu.targets import require_plugin, target_for

    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the process itself runs on the CPU
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to check
    check_outputs(args)
    if args.load is not None:
        return _load(args.load, args.json)
    if args.trace is not None:
        from jaxpar.gpu.trace import check_trace_path

        check_trace_path(args.trace, args.force)
    if getattr(args, "timeline", None) is not None:
        from jaxpar.gpu.timeline import check_timeline_path

        check_timeline_path(args.timeline, args.force)
    cfg = build_config(args)
    from jaxpar.gpu.report import check_estimate

    check_estimate(cfg)
    if args.auto_layout is not None and args.auto_layout.get("fits") is False:
        return 1  # nothing fits the pod: the plan's verdict is printed
    plug = require_plugin()
    target = target_for(cfg.mesh, plug)
    from jaxpar.distributed import run_xla_flags
    from jaxpar.gpu.compile import apply_flags, compile_step
    from jaxpar.gpu.report import estimate_lines, report
    from jaxpar.report import emit_json, human_bytes

    run_flags = run_xla_flags(cfg.mesh.hardware, cfg.layout)
    flags = apply_flags(run_flags, plug.module)
    compiled = compile_step(cfg, target, flags)
    program = compiled.program  # printed and parsed once: the report reads it, --hlo keeps it
    out = report(cfg, compiled, trace=args.trace, timeline=getattr(args, "timeline", None))
    # the mesh file's flags this layout runs without (as `jaxpar train` starts it)
    out["xla_flags"]["withheld"] = [f for f in cfg.mesh.hardware.xla_flags if f not in run_flags]
    if args.auto_layout is not None:
        out["auto_layout"] = args.auto_layout
    if args.hlo is not None:
        with open(args.hlo, "x") as f:
            f.write(program.text)
    if args.save is not None:
        from jaxpar.gpu.saved import save

        run_info = {"model": cfg.model.name, "mesh": cfg.mesh.name, "layout": out["layout"]}
        out["saved"] = {"file": args.save,
                        "bytes": save(args.save, compiled.compiled, target, run_info)}  # fmt: skip
    if args.json:
        emit_json(out)
        return 0
    m, ov = out["memory"], out["overlap"]
    print(
        f"{cfg.model.name} on {cfg.mesh.name} ({target.spec.name}, {target.topology}): "
        f"compiled in {out['compile_seconds']:.1f} s, attention {out['attention']['chosen']}"
    )
    print(
        f"memory per device {human_bytes(m['total'])} (temp {human_bytes(m['temp'])}); "
        f"planner {human_bytes(m['planner_bytes'])}, ratio {m['ratio']:.2f}; "
        + ("fits" if m["fits"] else "does NOT fit")
        + f" {human_bytes(m['usable_bytes'])}"
    )
    lim = m["xla_memory_limit"]
    if lim and lim["first_bytes"] is not None:
        kept = "kept" if lim["recompiled"] else "not kept: it does not fit either"
        print(
            f"  compiled at {human_bytes(lim['first_bytes'])} under the mesh's XLA memory limit, "
            f"past the usable memory: compiled again at XLA's default ({kept})"
        )
    if m["recomputed_by_xla"]:
        print(
            f"  XLA's rematerialization recomputes {m['recomputed_by_xla']} instructions to "
            "meet its memory limit (hardware.xla_flags: --xla_gpu_memory_limit_slop_factor)"
        )
    for name, a in sorted(out["collectives"].items()):
        plan = a.get("planner_wire_bytes")
        print(f"  {name:<10} x{a['count']:<8.0f} {human_bytes(a['wire_bytes']):>11} on the wire"
              + (f", planner {human_bytes(plan)}" if plan is not None else "")
              + f", exposed {a.get('exposed_share', 0.0):.0%}")  # fmt: skip
    print(f"collective bytes synchronous {ov['sync_share']:.0%}, exposed {ov['exposed_share']:.0%}")
    print("\n".join(estimate_lines(out["estimate"])))
    return 0
