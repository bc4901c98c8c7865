"""Drawing schedules: an aligned ASCII tick table and PNG timelines (matplotlib, Agg backend).

The ASCII form shows the lock-step table the executor runs (one column per tick; a fused tick
reads ``F4.2+B0.1``). The PNG shows, per schedule, the asynchronous timing (box widths are the
action costs; what the bubble figures measure) above the lock-step timing (each tick as long as
its slowest rank's work, a fused tick's forward and backward side by side; what the executor
runs). :func:`plot_schedules` stacks several schedules on one time axis so their lengths compare
at a glance.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from jaxpar.pipeline.schedules import Schedule
from jaxpar.pipeline.timing import ScheduleStats, action_costs, simulate_async, stats

COLOURS = {"F": "#4c72b0", "B": "#55a868", "I": "#8fd19e", "W": "#c7a26b"}
IDLE = "."


def ascii_table(schedule: Schedule, max_ticks: int | None = None) -> str:
    """One row per rank, one column per lock-step tick, cells like ``F3.5`` (``.`` idle)."""
    ticks = schedule.num_ticks if max_ticks is None else min(max_ticks, schedule.num_ticks)
    cells = [
        ["+".join(map(str, cell)) if cell else IDLE for cell in row[:ticks]]
        for row in schedule.ticks
    ]
    width = max([len(str(ticks - 1))] + [len(c) for row in cells for c in row])
    label = len(f"rank {schedule.p - 1}")
    lines = [" " * label + " " + " ".join(f"{t:>{width}}" for t in range(ticks))]
    for r, row in enumerate(cells):
        lines.append(f"{f'rank {r}':<{label}} " + " ".join(f"{c:>{width}}" for c in row))
    if ticks < schedule.num_ticks:
        lines.append(f"... {schedule.num_ticks - ticks} more ticks")
    return "\n".join(lines)


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
                times[(a.kind, a.stage, a.mb)] = (t, t + costs[a.kind])
                t += costs[a.kind]
        start += max(sum(costs[a.kind] for a in cell) for cell in col)
    return times


def _draw(ax, schedule: Schedule, times: dict, title: str) -> float:
    """Draw one timeline (``times`` of every action) on ``ax``; return its makespan."""
    span = max(end for _, end in times.values())
    for (kind, s, j), (start, end) in times.items():
        r = schedule.placement[s]
        ax.add_patch(_rect((start, r - 0.4), end - start, 0.8, COLOURS[kind]))
        # Label only boxes wide enough to hold the text, so long schedules stay readable.
        if (end - start) / span > 0.012 * len(f"{s}.{j}"):
            ax.text(
                (start + end) / 2,
                r,
                f"{kind}{s}.{j}",
                ha="center",
                va="center",
                fontsize=6,
                color="white" if kind in "FB" else "black",
            )
    ax.set_ylim(schedule.p - 0.5, -0.5)
    ax.set_yticks(range(schedule.p), [f"rank {r}" for r in range(schedule.p)])
    ax.set_title(title, fontsize=9, loc="left")
    return span


def _rect(xy: tuple[float, float], w: float, h: float, colour: str):
    from matplotlib.patches import Rectangle

    return Rectangle(xy, w, h, facecolor=colour, edgecolor="black", linewidth=0.3)


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
    green, W ochre. Returns the path written.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display: files only, and safe inside tests and on pods
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    heights = [0.35 * s.p + 0.6 for s in schedules for _ in range(2)]
    fig, axes = plt.subplots(
        len(heights),
        1,
        figsize=(14, sum(heights) + 0.6),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
        sharex=True,
    )
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
    axes[-1, 0].set_xlabel("time (F of a full stage = 1)")
    fig.legend(
        handles=[Patch(facecolor=c, label=k) for k, c in COLOURS.items()],
        loc="upper right",
        ncol=4,
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_schedule(schedule: Schedule, path: str | Path, **costs: float) -> Path:
    """PNG timeline of one schedule (see :func:`plot_schedules`)."""
    return plot_schedules([schedule], path, **costs)
