"""The critical path of a simulated step (:mod:`jaxpar.gpu.timing`): the links the simulation
leaves behind, and the walk back along them.

**Critical path** (:class:`CriticalPath`): the chain of intervals that set the step's end, walked
back from the event that ends the step along the dependency that set each one's start — a
kernel or synchronous collective starts when the compute stream's previous interval ends, and
after a done that waited, that interval is the collective itself; an asynchronous collective
starts when its start op is reached (the compute stream before it) or, when later, when the
previous collective of its stream ends. The chain tiles the step: its compute seconds plus its
collective seconds (per mesh-axis set, the ``exposed_s`` keys) are ``step_s``. A collective on
it counts whole (its window's compute, hidden under it, is not on the path), so in one walk its
seconds on the path are at least its exposed ones; a collective hidden entirely is not on it.
With a pipeline's ranks walked (:mod:`jaxpar.gpu.ranks`) a rank's wait for the others is
exposed on that rank, while the path runs on through the rank that reached the collective
last (its compute, its collectives), so there an axis's seconds on the path can be below its
exposed ones. It is built
while simulating: every interval holds a link to the chain that ends at its start, so the walk
back is the length of the path, and the loop iterations added without walking
(:mod:`jaxpar.gpu.timing`) add their iteration's stretch of each chain once per trip.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

TOP_PATH = 10  # instructions listed on the critical path (most seconds first)


@dataclass
class PathOp:
    """One HLO instruction on the critical path, all its executions on it together."""

    name: str  # the HLO instruction
    kind: str  # "matmul", "attention", "memory" or a collective kind
    axes: str  # a collective's mesh-axis set ("dp", "dp,tp"); "" for a kernel
    op_name: str  # JAX's op_name metadata, where the instruction has it
    seconds: float
    count: int  # executions on the path (loops run by their trip counts)


@dataclass
class CriticalPath:
    """What the simulated step's critical path is made of (module docstring):
    ``compute_s`` + ``comm_s["total"]`` = the step's ``step_s``."""

    compute_s: float
    comm_s: dict[str, float]  # mesh-axis set -> collective seconds on the path; plus "total"
    top: list[PathOp]  # the instructions with the most seconds on it, at most TOP_PATH

    def to_dict(self) -> dict[str, Any]:
        return {"compute_s": self.compute_s, "comm_s": dict(self.comm_s),
                "top": [asdict(op) for op in self.top]}  # fmt: skip


# A critical-path link: (the link before it, what it adds, seconds). What it adds is one
# execution of an instruction (its name) or, for loop iterations added without walking, the
# stretch of one iteration as {name: [seconds, executions]}. None is the step's start.
Link = tuple[Any, "str | dict[str, list[float]]", float] | None


def repeat_links(before: list[Link], now: list[Link], r: int) -> list[Link]:
    """The links ``now`` after ``r`` more loop iterations like the last one, which turned the
    links ``before`` into ``now``: each link of ``now`` is one of ``before`` plus the stretch
    the iteration added, and each further iteration adds that stretch again to the link it
    extends then."""
    index: dict[int, int] = {}
    for j, link in enumerate(before):
        index.setdefault(id(link), j)
    grow: list[tuple[int | None, Link, dict[str, list[float]] | None, float]] = []
    for link in now:
        stretch: dict[str, list[float]] = {}
        dur, x = 0.0, link
        while x is not None and id(x) not in index:  # back to where the iteration began
            x, what, s = x
            dur += s
            _add(stretch, what, s)
        j = index.get(id(x))  # None: a link from before the loop, kept as it is
        grow.append((j, x, stretch or None, dur))
    for _ in range(r):
        now = [(now[j] if j is not None else x) if stretch is None else
               ((now[j] if j is not None else x), stretch, dur)
               for j, x, stretch, dur in grow]  # fmt: skip
    return now


def walk_back(end: Link, info: dict[str, tuple[str, str, str]],
              exposed_keys: list[str]) -> CriticalPath:  # fmt: skip
    """Walk ``end`` back to the step's start (module docstring). ``info``: each instruction's
    kind, mesh-axis set ("" for a kernel) and op_name; ``exposed_keys``: the step's mesh-axis
    sets, each listed in ``comm_s`` even where none of its seconds are on the path."""
    got: dict[str, list[float]] = {}
    while end is not None:
        end, what, s = end
        _add(got, what, s)
    comm = dict.fromkeys(exposed_keys, 0.0)
    compute = 0.0
    ops = []
    for name, (s, count) in got.items():
        kind, axes, op_name = info[name]
        if axes:
            comm[axes] = comm.get(axes, 0.0) + s
        else:
            compute += s
        ops.append(PathOp(name, kind, axes, op_name, s, int(round(count))))
    comm = dict(sorted(comm.items()))
    comm["total"] = sum(comm.values())
    top = sorted(ops, key=lambda o: -o.seconds)[:TOP_PATH]
    return CriticalPath(compute, comm, top)


def _add(into: dict[str, list[float]], what: str | dict[str, list[float]], s: float) -> None:
    """Add one link's contents (an execution, or a repeated stretch) to ``into``."""
    if isinstance(what, str):
        got = into.get(what)
        if got is None:
            into[what] = [s, 1]
        else:
            got[0] += s
            got[1] += 1
    else:
        for name, (sec, count) in what.items():
            got = into.get(name)
            if got is None:
                into[name] = [sec, count]
            else:
                got[0] += sec
                got[1] += count
