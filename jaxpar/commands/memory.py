"""``jaxpar memory``: per-device memory of a layout — theory, and with ``--measure`` the compiled
program's figures and collectives.

JSON keys (``--json``, one object last): ``model_states_bytes``, ``params_bytes``,
``grads_bytes``, ``optimizer_bytes`` (ZeRO paper's convention: mixed-precision Adam, 2 + 2 + 12
bytes per parameter, over the ZeRO shards N), ``params_count``, ``params_per_device`` (after
tp/pp), ``zero_shards``; from the planner's memory model — the function ``jaxpar plan`` calls,
so both give the same bytes for the same layout — ``memory_per_device_bytes`` and
``memory_breakdown_bytes`` (``jaxpar plan``'s keys), ``activations_bytes`` and ``stored``
(params, grads, optimizer, activations and ``at_rest_bytes`` = params + optimizer, as jaxpar
holds them); ``moe`` (a MoE model: ``params_total``, ``params_active``, ``ep``, ``capacity``,
``dispatch_slots``, ``dispatch_buffer_bytes``, ``all_to_all_bytes_per_layer`` per micro-batch,
``padding_compute_share``, ``assumed_load_factor``; null for a dense model); all null with
``--params``. With ``--measure`` ``measured``: XLA's
per-device ``argument``/``output``/``alias``/``temp``/``host_*``/``total`` bytes,
``state_bytes`` (arguments − the batch shard: model states at rest), ``comm`` (collectives per
kind and mesh axes, bytes per device per step, ``dp_wire_bytes``) and ``comm_theory``.
"""

from __future__ import annotations

import argparse

from jaxpar.report import emit_json, human_bytes

HELP = "Per-device memory (ZeRO convention and jaxpar's storage); --measure compiles the step."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``jaxpar memory``."""
    from jaxpar.commands import _checks as K
    from jaxpar.config import DTYPES, OFFLOAD, PIPELINE_MEMORY, REMAT, SCHEDULES, SP_MODES

    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="model name or YAML (default tiny)")
    src.add_argument(
        "--params", type=K.positive_float, default=None, help="parameter count Ψ instead"
    )
    for axis in ("dp", "tp", "pp", "sp", "ep"):
        parser.add_argument(f"--{axis}", type=K.positive_int, default=1, help=f"{axis} size")
    parser.add_argument("--zero", type=K.int_in(0, 3), default=0, help="ZeRO stage 0-3")
    parser.add_argument("--dp-shard", type=K.nonneg_int, default=0, help="hybrid sharding group")
    parser.add_argument("--microbatch-size", type=K.positive_int, default=1, help="per dp rank")
    parser.add_argument("--microbatches", type=K.positive_int, default=1, help="accumulation")
    parser.add_argument("--seq", type=K.positive_int, default=None, help="sequence length")
    parser.add_argument("--remat", default="none", choices=REMAT, help="recompute policy")
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pp > 1")
    parser.add_argument("--virtual", type=K.positive_int, default=1, help="stages per pp rank")
    parser.add_argument("--pipeline-memory", default="fast", choices=PIPELINE_MEMORY,
                        help="fast | lean (1f1b: stashes capped at pp - rank)")  # fmt: skip
    parser.add_argument("--sp-mode", default="ulysses", choices=SP_MODES, help="sp > 1")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="Megatron sequence parallelism over tp")  # fmt: skip
    parser.add_argument("--offload", default="none", choices=OFFLOAD, help="host offload")
    parser.add_argument("--compute-dtype", default="float32", choices=DTYPES)
    parser.add_argument("--measure", action="store_true", help="compile on simulated devices")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")


def _config(args: argparse.Namespace):
    from jaxpar import config as C

    cfg = C.load(args.model or "tiny", "cpu-8")
    lay = cfg.layout
    lay.dp, lay.tp, lay.pp, lay.sp, lay.ep = args.dp, args.tp, args.pp, args.sp, args.ep
    lay.zero, lay.dp_shard, lay.remat = args.zero, args.dp_shard, args.remat
    lay.microbatches, lay.compute_dtype = args.microbatches, args.compute_dtype
    lay.schedule, lay.virtual, lay.sp_mode = args.schedule, args.virtual, args.sp_mode
    lay.pipeline_memory = args.pipeline_memory
    lay.sequence_parallel, lay.offload = args.sequence_parallel, args.offload
    cfg.train.seq_len = args.seq or min(cfg.model.max_seq_len, 128)
    cfg.train.global_batch = args.microbatch_size * args.microbatches * args.dp
    cfg.mesh.devices = lay.n_devices
    return cfg


def run(args: argparse.Namespace) -> int:
    """Print the theory (and measurement); bad input raises ConfigError (exit 2)."""
    from jaxpar import config as C
    from jaxpar import validation as V
    from jaxpar.analysis.memory import dp_comm_theory, theory

    cfg = _config(args)
    if args.params is not None:
        if args.measure:
            raise C.ConfigError("--measure: needs --model (a shape to compile), not --params")
        if args.zero not in (0, 1, 2, 3):
            raise C.ConfigError(f"layout.zero={args.zero!r}: ZeRO stage must be 0, 1, 2 or 3")
        out = theory(cfg.layout, params=args.params)
    else:
        V.validate(cfg)
        out = theory(
            cfg.layout, cfg.model, seq=cfg.train.seq_len, microbatch_size=args.microbatch_size,
            platform=cfg.mesh.hardware.platform,
        )  # fmt: skip
    if args.measure:
        from jaxpar.devices import simulate_cpu_devices

        simulate_cpu_devices(cfg.layout.n_devices)
        from jaxpar.analysis.memory import measure

        out["measured"] = measure(cfg)
        out["measured"]["comm_theory"] = dp_comm_theory(cfg)
    if args.json:
        emit_json(out)
        return 0
    print(
        f"Ψ = {out['params_count']:.4g} parameters, {out['params_per_device']:.4g} per device "
        f"after tp/pp, ZeRO-{args.zero} over N = {out['zero_shards']}"
    )
    if out.get("moe"):
        m = out["moe"]
        print(
            f"MoE: {m['params_active']:.4g} of {m['params_total']:.4g} parameters active per "
            f"token; ep={m['ep']}, capacity {m['capacity']} slots/expert/sequence, dispatch "
            f"buffer {human_bytes(m['dispatch_buffer_bytes'])}, all-to-all "
            f"{human_bytes(m['all_to_all_bytes_per_layer'])} per MoE layer per micro-batch"
        )
    print("ZeRO convention (2+2+12 bytes/param):")
    for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "model_states_bytes"):
        print(f"  {k:<22} {out[k] / 1e9:10.3f} GB")
    if out["memory_breakdown_bytes"]:
        print(f"jaxpar's compiled step (planner): {human_bytes(out['memory_per_device_bytes'])}")
        for k, v in out["memory_breakdown_bytes"].items():
            print(f"  {k:<22} {human_bytes(v):>12}")
    if "measured" in out:
        m = out["measured"]
        print("measured (XLA, per device):")
        for k in ("argument", "output", "temp", "host_argument", "state_bytes"):
            if m.get(k) is not None:
                print(f"  {k:<22} {human_bytes(m[k]):>12}")
        for e in m["comm"]["entries"]:
            print(
                f"  {e['kind']:<15} {','.join(e['axes']):<8} x{e['count']:<4} "
                f"{human_bytes(e['wire_bytes']):>12} on the wire"
            )
        print(
            f"  dp traffic {human_bytes(m['comm']['dp_wire_bytes'])} "
            f"(theory {human_bytes(m['comm_theory']['total_bytes'])})"
        )
    return 0
