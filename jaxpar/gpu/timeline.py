"""The simulated step (:class:`jaxpar.gpu.timing.StepTime`) drawn as a Gantt chart (PNG,
matplotlib; ``jaxpar compile --timeline FILE.png``). One row per stream — compute, collective,
p2p — with kernels coloured by kind (matmul, attention, memory-bound) and collectives by the
mesh axes they run over (dp, tp, pp, sp; several axes in one colour). Above them, the
**exposed** row: every stretch the compute stream spends on communication — its waits on a
collective's done (red on the compute row) and the synchronous collectives it runs itself —
coloured by mesh axes, so where each axis costs the step shows at a glance. Below them, the
**phase** the compute stream is in (forward or backward, from JAX's ``jvp``/``transpose``
scopes; a wait takes the phase of the kernel before it). The title gives the step, its exposed
seconds per axis and its critical path (:class:`jaxpar.gpu.timing.CriticalPath`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxpar.gpu.timing import StepTime

ROWS = ("exposed", "compute", "collective", "p2p", "phase")  # top to bottom
KERNELS = {"matmul": "#4c72b0", "attention": "#8172b2", "memory": "#9aa5b1"}
WAIT = "#d62728"  # the compute stream waiting on a collective
AXES = {"dp": "#dd8452", "tp": "#17becf", "pp": "#55a868", "sp": "#bcbd22", "ep": "#e377c2"}
SEVERAL = "#8c613c"  # a collective over several mesh axes ("pp,dp")
PHASES = {"forward": "#d9d9d9", "backward": "#737373"}
NAMES = {"memory": "memory-bound", "wait": "compute waits (exposed)"}


def check_timeline_path(path: str, force: bool) -> None:
    """:func:`jaxpar.gpu.trace.check_output_path` for ``--timeline`` (a PNG image)."""
    from jaxpar.gpu.trace import check_output_path

    check_output_path("--timeline", path, ".png", "a PNG image", force)


def colour(key: str) -> str:
    """The colour of a :func:`spans` key: a kernel kind, ``wait``, a phase or a mesh-axis set."""
    for table in (KERNELS, PHASES, AXES):
        if key in table:
            return table[key]
    return WAIT if key == "wait" else SEVERAL


def spans(st: StepTime) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Row → key → [(start, duration)] in milliseconds (what :func:`draw_timeline` draws). Keys:
    a kernel's kind, ``wait`` for the compute stream's waits, a collective's mesh-axis set
    (``dp``, ``pp,dp``); on the ``exposed`` row the waits and synchronous collectives by axis
    set (their sums are ``exposed_s``); on the ``phase`` row ``forward``/``backward``, merged."""
    from jaxpar.gpu.trace import phase

    out: dict[str, dict[str, list[tuple[float, float]]]] = {r: {} for r in ROWS}
    now = ""  # the compute stream's phase
    for e in st.events:
        bar = (e.start * 1e3, e.dur * 1e3)
        axes = ",".join(e.axes) or "-"
        if e.kind == "wait":
            out[e.stream].setdefault("wait", []).append(bar)
            out["exposed"].setdefault(axes, []).append(bar)
        elif e.kind in KERNELS:
            out[e.stream].setdefault(e.kind, []).append(bar)
        else:  # a collective; on the compute stream it is synchronous, all of it exposed
            out[e.stream].setdefault(axes, []).append(bar)
            if e.stream == "compute":
                out["exposed"].setdefault(axes, []).append(bar)
        if e.stream == "compute":
            now = phase(e.op_name) or now
            if now:
                bars = out["phase"].setdefault(now, [])
                if bars and abs(bars[-1][0] + bars[-1][1] - bar[0]) <= 1e-9 * max(bar[0], 1):
                    bars[-1] = (bars[-1][0], bar[0] + bar[1] - bars[-1][0])
                else:
                    bars.append(bar)
    return out


def _ms(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {v * 1e3:.1f}" for k, v in d.items() if k != "total" and v > 0)


def draw_timeline(path: str | Path, st: StepTime, name: str = "step") -> int:
    """Write the Gantt chart of ``st`` to ``path`` (PNG); returns the intervals drawn (each
    event of the step once, and again on the exposed row where it is exposed; the phase row is
    not counted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = spans(st)
    fig, ax = plt.subplots(figsize=(14, 4.2), dpi=110)
    drawn = 0
    keys: dict[str, None] = {}  # legend entries, in drawing order
    ys = {row: len(ROWS) - 1 - i for i, row in enumerate(ROWS)}
    for row, by_key in rows.items():
        height = 0.35 if row == "phase" else 0.8
        for key, bars in by_key.items():
            ax.broken_barh(bars, (ys[row] - height / 2, height), facecolors=colour(key),
                           linewidth=0)  # fmt: skip
            drawn += len(bars) if row != "phase" else 0
            keys[key] = None
    ax.set_yticks([ys[r] for r in ROWS], ["exposed comm.", "compute", "collective stream",
                                          "p2p stream", "phase"])  # fmt: skip
    ax.set_xlim(0, max(st.step_s * 1e3, 1e-9))
    ax.set_xlabel("milliseconds into the step (simulated)")
    exposed = st.exposed_s.get("total", 0.0)
    share = exposed / st.step_s if st.step_s else 0.0
    title = (f"{name}: step {st.step_s * 1e3:.1f} ms = compute {st.compute_s * 1e3:.1f} ms + "
             f"exposed communication {exposed * 1e3:.1f} ms ({share:.0%}: "
             f"{_ms(st.exposed_s)} ms)")  # fmt: skip
    cp = st.critical_path
    if cp is not None:
        title += (f"\ncritical path: compute {cp.compute_s * 1e3:.1f} ms + communication "
                  f"{cp.comm_s['total'] * 1e3:.1f} ms ({_ms(cp.comm_s)} ms)")  # fmt: skip
    if st.events_dropped:
        title += f"; {st.events_dropped} intervals past the trace's limit not drawn"
    ax.set_title(title, fontsize=10)
    order = [*KERNELS, "wait", *AXES, *PHASES]
    ordered = sorted(keys, key=lambda k: order.index(k) if k in order else len(order))
    labels = {k: NAMES.get(k, k if k in KERNELS or k in PHASES or k == "wait" else
                           f"comm. over {k}" if k in AXES else "comm. over several axes")
              for k in ordered}  # fmt: skip
    handles = {label: Patch(color=colour(k), label=label) for k, label in labels.items()}
    ax.legend(handles=list(handles.values()), loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=8)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return drawn
