"""``jaxpar schedule``: print (and optionally plot) a pipeline schedule and its statistics.

Human output: the lock-step tick table (one row per rank, one column per tick, wrapped to 120
columns) and a stats block. ``--json`` prints one JSON object last with keys ``kind``,
``stages``, ``microbatches``, ``virtual``, ``pipeline_memory`` (``fast`` or ``lean``), ``ranks``
(per rank its order as action strings like ``F3.5``), ``makespan``, ``bubble_fraction``,
``span_bubble_fraction`` (per rank), ``start_skew``, ``lockstep_ticks``, ``lockstep_makespan``
(a tick lasts as long as its slowest rank's work, fused ticks' forward and backward added),
``lockstep_bubble_fraction``, ``peak_inflight`` (per rank, in its order), ``peak_stashes`` (per
rank, in the lock-step table: what the executor holds), ``fused_ticks`` (ticks in which some
rank runs a forward and a backward) and ``plot`` (the PNG path or null). Costs: F=1, B=2, I=W=1
per stage, a chunk 1/v of that.
"""

from __future__ import annotations

import argparse

from jaxpar.commands import _checks as K
from jaxpar.errors import ConfigError
from jaxpar.pipeline.schedules import KINDS, make_schedule
from jaxpar.pipeline.timing import stats
from jaxpar.report import emit_json
from jaxpar.validation import MAX_SCHEDULE_ACTIONS

HELP = "Show a pipeline schedule (GPipe, 1F1B, interleaved, ZB-H1, ZB-V, DualPipeV) and its bubble."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``jaxpar schedule``."""
    parser.add_argument("--kind", default="1f1b", help=f"one of {', '.join(KINDS)}")
    parser.add_argument("--stages", type=K.positive_int, default=4, help="pipeline ranks p")
    parser.add_argument("--microbatches", type=K.positive_int, default=8, help="micro-batches m")
    parser.add_argument(
        "--virtual",
        type=K.positive_int,
        default=None,
        help="virtual stages per rank v (default 2 for interleaved/zbv/dualpipev, else 1)",
    )
    parser.add_argument(
        "--pipeline-memory",
        default="fast",
        help="fast (fused ticks at the asynchronous makespan) | lean (1f1b: stashes capped at "
        "p - rank, a longer lock step)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument(
        "--plot", metavar="FILE.png", type=K.image_file, help="write a PNG (or .pdf/.svg) timeline"
    )
    parser.add_argument(
        "--max-ticks", type=K.positive_int, default=None, help="truncate the ASCII table"
    )


def run(args: argparse.Namespace) -> int:
    """Build, print and optionally plot the schedule; errors raise ConfigError (exit 2)."""
    size = args.stages * args.microbatches * (args.virtual or 2)
    if size > MAX_SCHEDULE_ACTIONS:
        raise ConfigError(
            f"--stages*--microbatches*--virtual={size}: at most {MAX_SCHEDULE_ACTIONS} (a "
            "larger table takes minutes to build and cannot be read)"
        )
    sched = make_schedule(
        args.kind, args.stages, args.microbatches, args.virtual, args.pipeline_memory
    )
    st = stats(sched)
    if args.plot:
        from jaxpar.pipeline.render import plot_schedule  # lazy on purpose: CLI start-up

        plot_schedule(sched, args.plot)
    if args.json:
        emit_json(
            {
                "kind": sched.kind,
                "stages": sched.p,
                "microbatches": sched.m,
                "virtual": sched.v,
                "pipeline_memory": sched.memory,
                "ranks": [[str(a) for a in row] for row in sched.orders],
                "makespan": st.makespan,
                "bubble_fraction": st.bubble_fraction,
                "span_bubble_fraction": st.span_bubble,
                "start_skew": st.start_skew,
                "lockstep_ticks": st.lockstep_ticks,
                "lockstep_makespan": st.lockstep_makespan,
                "lockstep_bubble_fraction": st.lockstep_bubble_fraction,
                "peak_inflight": st.peak_inflight,
                "peak_stashes": st.peak_stashes,
                "fused_ticks": sum(
                    any(len(c) > 1 for c in col) for col in zip(*sched.ticks, strict=True)
                ),
                "plot": args.plot,
            }
        )
        return 0
    from jaxpar.pipeline.render import ascii_table, stats_block  # lazy: CLI start-up

    print(ascii_table(sched, args.max_ticks))
    print()
    print(stats_block(sched, st))
    if args.plot:
        print(f"wrote {args.plot}")
    return 0
