"""The simulated step (:class:`jaxpar.gpu.timing.StepTime`) drawn as a Gantt chart (PNG,
matplotlib): one row per stream — compute, collective, p2p — each interval coloured by its kind
(matmul, attention, memory-bound, collective), and the compute stream's waits on a collective —
the exposed communication — drawn in red on the compute row and marked again on a row of their
own, so what the step loses to communication is visible at a glance (``jaxpar compile
--timeline FILE.png``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxpar.gpu.timing import StepTime

ROWS = ("exposed", "compute", "collective", "p2p")  # top to bottom
COLOURS = {"matmul": "#4c72b0", "attention": "#8172b2", "memory": "#9aa5b1",
           "wait": "#d62728", "p2p": "#55a868"}  # fmt: skip
COLLECTIVE = "#dd8452"


def check_timeline_path(path: str, force: bool) -> None:
    """:func:`jaxpar.gpu.trace.check_output_path` for ``--timeline`` (a PNG image)."""
    from jaxpar.gpu.trace import check_output_path

    check_output_path("--timeline", path, ".png", "a PNG image", force)


def spans(st: StepTime) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Row → colour key → [(start, duration)] in milliseconds (what :func:`draw_timeline`
    draws); the ``exposed`` row holds the compute stream's waits."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = {r: {} for r in ROWS}
    for e in st.events:
        key = e.kind if e.kind in COLOURS else ("p2p" if e.stream == "p2p" else "collective")
        out[e.stream].setdefault(key, []).append((e.start * 1e3, e.dur * 1e3))
        if e.kind == "wait":
            out["exposed"].setdefault("wait", []).append((e.start * 1e3, e.dur * 1e3))
    return out


def draw_timeline(path: str | Path, st: StepTime, name: str = "step") -> int:
    """Write the Gantt chart of ``st`` to ``path`` (PNG); returns the intervals drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = spans(st)
    fig, ax = plt.subplots(figsize=(14, 3.6), dpi=110)
    drawn = 0
    labels = {}
    for y, row in enumerate(reversed(ROWS)):
        for key, bars in rows[row].items():
            colour = COLOURS.get(key, COLLECTIVE)
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colour, linewidth=0)
            drawn += len(bars)
            labels[key] = colour
    ax.set_yticks(range(len(ROWS)), [r if r != "exposed" else "exposed comm." for r in
                                     reversed(ROWS)])  # fmt: skip
    ax.set_xlim(0, max(st.step_s * 1e3, 1e-9))
    ax.set_xlabel("milliseconds into the step (simulated)")
    exposed = st.exposed_s.get("total", 0.0)
    share = exposed / st.step_s if st.step_s else 0.0
    title = (f"{name}: step {st.step_s * 1e3:.1f} ms, compute {st.compute_s * 1e3:.1f} ms, "
             f"exposed communication {exposed * 1e3:.1f} ms ({share:.0%})")  # fmt: skip
    if st.events_dropped:
        title += f"; {st.events_dropped} intervals past the trace's limit not drawn"
    ax.set_title(title, fontsize=10)
    names = {"wait": "exposed (compute waits)", "memory": "memory-bound", "p2p": "send/recv"}
    ax.legend(handles=[Patch(color=c, label=names.get(k, k)) for k, c in labels.items()],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return drawn
