"""``jaxpar plan``: recommend a layout for a model on a cluster, or cost a given layout."""

from __future__ import annotations

import argparse

from jaxpar.commands import _checks as K

HELP = "choose the layout for a model on a cluster; predict its memory and step time"

LAYOUT_FLAGS = (
    "dp",
    "tp",
    "pp",
    "sp",
    "ep",
    "zero",
    "microbatches",
    "schedule",
    "virtual",
    "pipeline_memory",
    "sp_mode",
    "remat",
    "offload",
    "compute_dtype",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``jaxpar plan``."""
    from jaxpar.commands.flags import FLAGS

    p.add_argument("--model", required=True, help="model name (models/NAME.yaml) or YAML path")
    p.add_argument("--mesh", required=True, help="mesh name (meshes/NAME.yaml) or YAML path")
    # --global-batch, --seq and --devices are checked as the fields they set (check_values)
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    p.add_argument("--top", type=K.nonneg_int, default=3, help="alternatives to show")
    p.add_argument("--devices", type=int, default=None, help="override the mesh's device count")
    for name in LAYOUT_FLAGS:
        _, typ, text = FLAGS[name]
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None,
                       help=text + " (costs that exact layout)")  # fmt: skip
    _, typ, text = FLAGS["fp8"]
    p.add_argument("--fp8", dest="fp8", type=typ, default=None,
                   help=text + "; every layout searched, or the given one, with it")  # fmt: skip
    p.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="Megatron sequence parallelism over tp (given layout)")  # fmt: skip
    p.add_argument(
        "--layout-from-mesh",
        action="store_true",
        help="cost the mesh file's own layout instead of searching",
    )
    p.add_argument(
        "--layout",
        choices=["auto"],
        default=None,
        help="auto: search every layout and rank them (what plan does without layout flags; "
        "as `jaxpar train --layout auto` picks)",
    )
    p.add_argument(
        "--emit-flags",
        type=K.positive_int,
        default=None,
        metavar="N",
        help="print the `jaxpar train` flags of ranked layout N (1 = the recommendation), or "
        "of the given layout (N = 1), and nothing else (with --json, a JSON object follows): "
        "jaxpar plan ... --emit-flags 1 | xargs jaxpar train --dry-run",
    )
    p.add_argument(
        "--verify",
        type=K.positive_int,
        default=None,
        metavar="N",
        help="compile N ranked layouts (the best of each family: pipelined or not, ZeRO stage; "
        "then the next ranked) with XLA:GPU for the mesh's pod (no GPU needed; the CUDA "
        "plugin: pip install -e '.[gpu-aot]') and pick the fastest that fits",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run(args: argparse.Namespace) -> int:
    """Search (or cost the given layout), print the plan; exit 1 when nothing fits."""
    from jaxpar import config as C
    from jaxpar import validation as V
    from jaxpar.planner import check_hardware, cost_layout, plan
    from jaxpar.planner.explain import render
    from jaxpar.report import emit_json

    cfg = C.load(args.model, args.mesh)
    check_hardware(K.raw_hardware(args.mesh), cfg.mesh)
    if args.global_batch is not None:
        C.override(cfg, "train.global_batch", args.global_batch)
    if args.seq is not None:
        C.override(cfg, "train.seq_len", args.seq)
    if args.devices is not None:
        C.override(cfg, "mesh.devices", args.devices)
    if args.fp8 is not None:  # a precision for the search or the given layout alike
        C.override(cfg, "layout.fp8", args.fp8)
        if args.fp8 != "none":
            C.override(cfg, "layout.compute_dtype", "bfloat16")
    V.check_values(cfg)  # model, hardware and batch figures, before any search
    V.check_fp8(cfg.model, cfg.layout)
    V.check_fp8_device(cfg.layout.fp8, cfg.mesh.hardware.platform, cfg.mesh.hardware.gpu)
    stated = {"global_batch": args.global_batch, "seq_len": args.seq}
    sources = {k: "command line" for k, v in stated.items() if v is not None}
    given = [n for n in LAYOUT_FLAGS if getattr(args, n) is not None]
    if args.sequence_parallel:
        given.append("sequence_parallel")
    _check_modes(args, given)
    if given or args.layout_from_mesh:
        if not args.layout_from_mesh:
            # a given layout starts from the defaults, not from the mesh file's layout
            cfg.mesh.layout = C.LayoutConfig(dp=1, tp=1, compute_dtype=_dtype(cfg),
                                             fp8=cfg.layout.fp8)  # fmt: skip
        for n in given:
            C.override(cfg, f"layout.{n}", getattr(args, n) if n != "sequence_parallel" else True)
        result = cost_layout(cfg, given=sources)
        if args.emit_flags is not None:
            return _emit_flags(args, cfg, result)
    elif args.emit_flags is not None:
        return _emit_flags(args, cfg, None)
    else:
        if args.top < 0:
            from jaxpar.errors import ConfigError

            raise ConfigError(f"--top {args.top}: must be >= 0")
        stated = {"global_batch": args.global_batch, "seq_len": args.seq}
        result = plan(
            cfg, top=args.top, given={k: "command line" for k, v in stated.items() if v is not None}
        )
    rows = None
    if args.verify is not None:
        from jaxpar.gpu.verify import verified_pick, verify_ranked

        rows = verify_ranked(cfg, args.verify)
        pick = verified_pick(rows)
        result["verified"] = [v.to_dict() for v in rows]
        result["verified_pick"] = pick.rank if pick else None
    if args.json:
        print(result["headline"])
        emit_json({k: v for k, v in result.items() if k != "headline"})
    else:
        print(render(result))
        if rows is not None:
            from jaxpar.gpu.verify import render as render_verified

            print(render_verified(rows))
    if rows is not None:
        return 0 if result["verified_pick"] is not None else 1
    return 0 if result.get("fits", False) else 1


def _check_modes(args: argparse.Namespace, given: list[str]) -> None:
    """Refuse flags that ask for two things at once (one line, before any search)."""
    from jaxpar.errors import ConfigError

    if args.layout == "auto" and (given or args.layout_from_mesh):
        first = given[0] if given else "layout_from_mesh"
        raise ConfigError(f"--layout=auto: conflicts with --{first.replace('_', '-')} (the "
                          "planner chooses every layout field)")  # fmt: skip
    if args.verify is not None and args.emit_flags is not None:
        raise ConfigError(f"--verify={args.verify}: conflicts with --emit-flags (--emit-flags "
                          "prints a ranked layout without compiling; run --verify first, then "
                          "--emit-flags with the verified pick's rank)")  # fmt: skip
    if args.verify is not None and (given or args.layout_from_mesh):
        raise ConfigError("--verify: verifies the searched ranking; compile a given layout "
                          "with jaxpar compile")  # fmt: skip
    if args.emit_flags not in (None, 1) and (given or args.layout_from_mesh):
        raise ConfigError(f"--emit-flags={args.emit_flags}: a given layout is one layout; "
                          "must be 1")  # fmt: skip


def _emit_flags(args: argparse.Namespace, cfg, costed: dict | None) -> int:
    """``--emit-flags N``: the train flags of ranked layout N, or of the given layout
    (``costed``: its :func:`cost_layout` result; refused when it does not fit). With
    ``--json`` one JSON object follows them: ``rank`` (null for a given layout), ``layout``
    (as ``jaxpar plan --json`` shows it), ``flags``."""
    from jaxpar.errors import ConfigError
    from jaxpar.planner.auto import layout_flags, train_flags
    from jaxpar.planner.explain import summary
    from jaxpar.planner.recommend import rank_layouts
    from jaxpar.report import emit_json, human_bytes

    if costed is None:
        ranking = rank_layouts(cfg)
        rank = args.emit_flags
        flags = train_flags(cfg, rank, args.model, args.mesh, ranking)
        shown = summary(ranking.ranked[rank - 1], cfg.model, cfg.mesh.hardware, ranking.shape)
        layout = shown["layout"]
    else:
        if not costed.get("fits", False):
            need, usable = costed["memory_per_device_bytes"], costed["memory_usable_bytes"]
            raise ConfigError(f"--emit-flags={args.emit_flags}: the given layout does not fit "
                              f"({human_bytes(need)} of {human_bytes(usable)} usable per "
                              "device); nothing to emit")  # fmt: skip
        rank, layout = None, costed["layout"]
        flags = layout_flags(cfg, cfg.mesh.layout, args.model, args.mesh)
    print(" ".join(flags))
    if args.json:
        emit_json({"rank": rank, "layout": layout, "flags": flags})
    return 0


def _dtype(cfg) -> str:
    return "bfloat16" if cfg.mesh.hardware.platform == "gpu" else "float32"
