"""Drawing schedules: an aligned ASCII tick table and PNG timelines (matplotlib, Agg backend).

The ASCII form shows the lock-step table the executor runs (one column per tick; a fused tick
reads ``F4.2+B0.1``), wrapped to 120 columns. The PNG shows, per schedule, the asynchronous
timing (box widths are the action costs; what the bubble figures measure) above the lock-step
timing (each tick as long as its slowest rank's work, a fused tick's forward and backward side
by side; what the executor runs). Each box is labelled with its micro-batch; with several chunks
per rank a box's hatch says which chunk it is; the legend lists only the action kinds (and
chunks) the schedules run. :func:`plot_schedules` stacks several schedules on one time axis so
their lengths compare at a glance.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from jaxpar.pipeline.timing import ScheduleStats, action_costs, simulate_async, stats
from jaxpar.pipeline.types import Action, Schedule

COLOURS = {"F": "#4c72b0", "B": "#55a868", "I": "#8fd19e", "W": "#c7a26b"}
CHUNK_HATCH = ("", "///", "...", "xx")  # chunk c of a rank (virtual stages): hatch c
IDLE = "."
WIDTH = 120  # the ASCII table's columns at most (a terminal, a code review)


def ascii_table(schedule: Schedule, max_ticks: int | None = None, width: int = WIDTH) -> str:
    """One row per rank, one column per lock-step tick, cells like ``F3.5`` (``.`` idle).

    The ticks are wrapped into blocks of at most ``width`` columns, each block headed by its
    tick numbers (all columns of one width, so every block lines up)."""
    ticks = schedule.num_ticks if max_ticks is None else min(max_ticks, schedule.num_ticks)
    cells = [
        ["+".join(map(str, cell)) if cell else IDLE for cell in row[:ticks]]
        for row in schedule.ticks
    ]
    cw = max([len(str(max(ticks - 1, 0)))] + [len(c) for row in cells for c in row])
    label = len(f"rank {schedule.p - 1}")
    per_block = max(1, (width - label) // (cw + 1))
    blocks = []
    for t0 in range(0, ticks, per_block):
        cols = range(t0, min(t0 + per_block, ticks))
        lines = [" " * label + "".join(f" {t:>{cw}}" for t in cols)]
        for r, row in enumerate(cells):
            lines.append(f"{f'rank {r}':<{label}}" + "".join(f" {row[t]:>{cw}}" for t in cols))
        blocks.append("\n".join(lines))
    out = "\n\n".join(blocks)
    if ticks < schedule.num_ticks:
        out += f"\n... {schedule.num_ticks - ticks} more ticks"
    return out


def stats_block(schedule: Schedule, st: ScheduleStats) -> str:
    """A few human-readable lines of statistics."""
    return "\n".join(
        [
            f"schedule {schedule.kind}: p={schedule.p} m={schedule.m} v={schedule.v} "
            f"(costs per stage F=1 B=2 I=W=1, chunks 1/v)",
            f"async     makespan {st.makespan:g}  bubble {st.bubble_fraction:.4f}  "
            f"max per-rank-span bubble {max(st.span_bubble):.4f}  start skew {st.start_skew:g}",
            f"lock-step ticks {st.lockstep_ticks}  makespan {st.lockstep_makespan:g}  "
            f"bubble {st.lockstep_bubble_fraction:.4f}",
            f"peak stashes per rank (lock step) {st.peak_stashes}",
        ]
    )


def lockstep_times(schedule: Schedule, costs: dict[str, float]) -> dict:
    """``(start, end)`` of every action in the lock-step table: a tick starts when the slowest
    rank's work of the previous one ends; a fused tick runs its forward, then its backward."""
    times, start = {}, 0.0
    for col in zip(*schedule.ticks, strict=True):
        for cell in col:
            t = start
            for a in cell:
                times[a] = (t, t + costs[a.kind])
                t += costs[a.kind]
        start += max(sum(costs[a.kind] for a in cell) for cell in col)
    return times


def box_label(a: Action) -> str:
    """A box's text: its micro-batch (the kind is the colour, the chunk the hatch)."""
    return str(a.mb)


def legend_entries(schedules: Sequence[Schedule]) -> list[tuple[str, str, str]]:
    """``(label, colour, hatch)`` of the action kinds the schedules run (in F, B, I, W order)
    and, where a rank holds several chunks, of each chunk's hatch."""
    kinds = set().union(*(s.kinds() for s in schedules))
    out = [(k, c, "") for k, c in COLOURS.items() if k in kinds]
    v = max(s.v for s in schedules)
    if v > 1:
        out += [(f"chunk {c}", "white", CHUNK_HATCH[c % len(CHUNK_HATCH)]) for c in range(v)]
    return out


def _draw(ax, schedule: Schedule, times: dict[Action, tuple[float, float]], title: str) -> float:
    """Draw one timeline (``times`` of every action) on ``ax``; return its makespan."""
    span = max(end for _, end in times.values())
    for a, (start, end) in times.items():
        r, chunk = schedule.placement[a.stage], schedule.chunk_of(a.stage)
        hatch = CHUNK_HATCH[chunk % len(CHUNK_HATCH)] if schedule.v > 1 else ""
        ax.add_patch(_rect((start, r - 0.4), end - start, 0.8, COLOURS[a.kind], hatch))
        text = box_label(a)
        # Label only boxes wide enough to hold the text (about 0.6% of the axis per character).
        if (end - start) / span > 0.006 * (len(text) + 1):
            ax.text((start + end) / 2, r, text, ha="center", va="center", fontsize=6,
                    color="white" if a.kind in ("F", "B") else "black",
                    bbox=dict(boxstyle="round,pad=0.05", fc=COLOURS[a.kind], ec="none")
                    if hatch else None)  # fmt: skip
    ax.set_ylim(schedule.p - 0.5, -0.5)
    ax.set_yticks(range(schedule.p), [f"rank {r}" for r in range(schedule.p)])
    ax.set_title(title, fontsize=9, loc="left")
    return span


def _rect(xy: tuple[float, float], w: float, h: float, colour: str, hatch: str = ""):
    from matplotlib.patches import Rectangle  # lazy: matplotlib only when drawing (CLI start-up)

    return Rectangle(xy, w, h, facecolor=colour, edgecolor="black", linewidth=0.3, hatch=hatch)


def schedule_figure(
    schedules: Sequence[Schedule],
    f: float = 1.0,
    b: float | None = None,
    i: float = 1.0,
    w: float = 1.0,
):
    """The matplotlib figure of :func:`plot_schedules` (the caller closes it)."""
    import matplotlib  # lazy: matplotlib only when drawing (CLI start-up)

    matplotlib.use("Agg")  # no display: files only, and safe inside tests and on pods
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    heights = [0.35 * s.p + 0.6 for s in schedules for _ in range(2)]
    fig, axes = plt.subplots(len(heights), 1, figsize=(14, sum(heights) + 0.6), squeeze=False,
                             gridspec_kw={"height_ratios": heights}, sharex=True)  # fmt: skip
    longest = 0.0
    for k, sched in enumerate(schedules):
        st = stats(sched, f, b, i, w)
        costs = action_costs(sched, f, b, i, w)
        head = f"{sched.kind}  p={sched.p} m={sched.m} v={sched.v}"
        async_title = f"{head}  async makespan {st.makespan:g}  bubble {st.bubble_fraction:.3f}"
        lock_title = (
            f"{head}  lock step: {st.lockstep_ticks} ticks, makespan {st.lockstep_makespan:g}, "
            f"peak stashes {max(st.peak_stashes)}"
        )
        span = _draw(axes[2 * k, 0], sched, simulate_async(sched, costs), async_title)
        span2 = _draw(axes[2 * k + 1, 0], sched, lockstep_times(sched, costs), lock_title)
        longest = max(longest, span, span2)
    axes[-1, 0].set_xlim(0, longest)
    axes[-1, 0].set_xlabel("time (F of a full stage = 1); box text: micro-batch")
    entries = legend_entries(schedules)
    handles = [Patch(facecolor=c, edgecolor="black", hatch=h, label=k) for k, c, h in entries]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


def plot_schedules(
    schedules: Sequence[Schedule],
    path: str | Path,
    f: float = 1.0,
    b: float | None = None,
    i: float = 1.0,
    w: float = 1.0,
) -> Path:
    """Write one PNG with the timelines of ``schedules`` stacked on one time axis: per schedule
    the asynchronous timing, then the lock-step timing of its tick table.

    Each panel is titled with the kind, shape and makespan; colours: F blue, B green, I light
    green, W ochre; boxes carry their micro-batch, hatches tell a rank's chunks apart. Returns
    the path written.
    """
    import matplotlib.pyplot as plt  # lazy, as in schedule_figure

    fig = schedule_figure(schedules, f, b, i, w)
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_schedule(schedule: Schedule, path: str | Path, **costs: float) -> Path:
    """PNG timeline of one schedule (see :func:`plot_schedules`)."""
    return plot_schedules([schedule], path, **costs)
