"""How long one step of a compiled XLA:GPU program takes on its target: an event simulation of
the scheduled module, two kinds of stream, every instruction costed (:mod:`jaxpar.gpu.costs`).

The optimized module is scheduled (``is_scheduled=true``): each computation's instructions are
printed in the order the GPU runs them. :func:`simulate` walks the entry computation in that
order and follows what it calls:

* ``while``: the body runs its trip count times: ``known_trip_count``, else what
  :func:`jaxpar.analysis.hlo_text.infer_trips` reads from the loop (``i < N`` with a constant
  ``N``: the micro-batch loop XLA leaves unannotated), else what the condition gives when run
  on the values the loop's state starts with (:class:`jaxpar.analysis.hlo_text.Values`; the
  walk carries the small integer arrays — counters, bounds, tables of bounds — as it goes: a
  blockwise attention's causal row visits ``i + 1`` key blocks, a bound JAX keeps in a table),
  else once, said in ``assumptions``; the loop condition is not costed. Once an iteration
  leaves the streams and the in-flight collectives where the previous one left them (relative
  to the compute clock) and read the same trip counts for the loops inside it, the remaining
  iterations are taken to be the same and are added without walking them, the integer values
  they leave in the state computed all the same (loops whose body holds an annotated
  conditional are always walked);
* ``conditional``: the branch its index says where the walk knows the index's value (a
  pipeline tick's: the rank's row of the schedule table, a constant the program indexes by the
  tick and ``partition-id``). Else, a pipeline tick's switch states how often it takes each
  branch (:func:`jaxpar.analysis.hlo_text.branch_weights`, from the schedule table); execution
  ``n`` takes the branch furthest behind its share (``argmax w_i·(n+1) − taken_i``), so the
  counts are the table's. An unannotated conditional is assumed to take its slowest branch
  every time (said in ``assumptions``);
* ``call``: the callee, inline. Fusions, custom calls and the rest are kernels.

Streams, as XLA:GPU runs them (``xla/backends/gpu``: a synchronous collective runs on the
compute stream, stream id 0; async all-reduce/all-gather/reduce-scatter/all-to-all share the
``ASYNC_STREAM_KIND_COLLECTIVE`` stream; collective-permute, send and recv run on the P2P stream,
``GetStreamKindForP2P``): the **compute** stream runs kernels one after another; a ``*-start``
enqueues its collective on its communication stream, where it begins when both the compute
stream reached the start and the stream is free; its ``*-done`` makes the compute stream wait
until it ends. The wait is the collective's **exposed** time, booked to its mesh axes. A start
marked ``"is_sync":true`` (the scheduler found nothing to overlap) or a collective without a
start/done pair runs on the compute stream: all of it exposed. A start's result reaches its done
through the loop state when the collective pipeliner split them across iterations (start at the
end of one iteration, done early in the next): the simulation follows values through tuples,
``get-tuple-element``, ``while`` and ``conditional`` operands and results, so such windows
wrap around the loop body as they do on the GPU.

Result (:class:`StepTime`): ``step_s`` = ``compute_s`` + ``exposed_s["total"]`` (the compute
stream is either running a kernel or waiting on a collective); TFLOP/s and MFU from the model's
FLOPs (PaLM's convention, :func:`jaxpar.analysis.theory.train_flops_per_token`: recomputation
not counted), ``hardware_flops`` the FLOPs the program's matmuls and attention kernels do.
The program is one device's (SPMD). A pipeline's ranks take different branches: one device of
each is walked, side by side, each reading its own rows of the table, the walks meeting at the
collectives over ``pp`` (:mod:`jaxpar.gpu.ranks`: a tick lasts as long as the slowest rank
it exchanges with, and the others' wait is exposed ``pp`` time). The figures are those of the
rank that ends the step last; ``ranks`` holds each rank's. ``rank_wait_s`` is the part of the
exposed time a rank spent waiting for the other ranks to reach a collective over ``pp`` (the
schedule's bubble and the stages' imbalance: time no faster network would save), the rest of
``exposed_s`` being the transfers themselves. Where the ranks' collectives do not
pair up, one walk with the table's branch counts averaged over ranks (said in
``assumptions``).

**Critical path** (:class:`CriticalPath`): built while simulating, see :mod:`jaxpar.gpu.critical`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from jaxpar.analysis.hlo import KINDS, collective_bytes
from jaxpar.analysis.hlo_text import (
    _TRIP,
    Instr,
    Module,
    Values,
    branch_weights,
    callees,
    infer_trips,
    parse,
    program_text,
    source_target_pairs,
)
from jaxpar.config import HardwareConfig
from jaxpar.gpu.costs import Coster, Transfer, backend_config
from jaxpar.gpu.critical import TOP_PATH, CriticalPath, Link, PathOp, repeat_links, walk_back
from jaxpar.gpu.ranks import Diverged, Rendezvous, pipeline_partitions, run_ranks

# PathOp, CriticalPath, Link and TOP_PATH live in jaxpar.gpu.critical and are re-exported here
__all__ = ["COLLECTIVE", "COMPUTE", "MAX_EVENTS", "P2P", "P2P_KINDS", "STREAMS", "TOP_PATH",
           "CriticalPath", "Event", "Link", "PathOp", "RankTime", "StepTime", "check_hardware",
           "simulate"]  # fmt: skip

COMPUTE, COLLECTIVE, P2P = "compute", "collective", "p2p"  # jaxpar.gpu.trace.STREAMS
STREAMS = (COMPUTE, COLLECTIVE, P2P)
P2P_KINDS = ("collective-permute",)
MAX_EVENTS = 200_000  # events kept for the trace (the step's figures count all of them)
# instructions that carry their operand's value (async handles too)
_PASS = ("copy", "bitcast", "opt-barrier", "async-update")
_SYNC = "sync"  # the value of a synchronous collective's start: its done waits for nothing


@dataclass
class Event:
    """One interval on a stream: a kernel, a collective, or the compute stream waiting."""

    name: str
    stream: str
    start: float  # seconds from the step's start
    dur: float
    kind: str  # "matmul", "attention", "memory", a collective kind, or "wait"
    axes: tuple[str, ...] = ()
    op_name: str = ""
    loop: str = ""  # enclosing loops and their iteration, "while.1[3]/while.2[0]"


@dataclass
class RankTime:
    """One pipeline rank's walk (:mod:`jaxpar.gpu.ranks`): its device, when its step ends,
    its compute seconds and its exposed seconds per mesh-axis set (the wait for the other
    ranks at the collectives over ``pp`` included)."""

    partition: int
    end_s: float
    compute_s: float
    exposed_s: dict[str, float]
    rank_wait_s: float = 0.0  # of exposed_s: waiting for the other ranks (module docstring)


@dataclass
class StepTime:
    """The simulated step (module docstring)."""

    step_s: float
    compute_s: float
    exposed_s: dict[str, float]  # mesh-axis set ("dp", "dp,tp", ...) -> seconds; plus "total"
    comm_s: dict[str, float]  # all collective time per axis set (hidden or not); plus "total"
    hardware_flops: float  # per device per step, recompute included
    model_flops: float | None = None  # per device per step (PaLM), when given
    tflops_per_device: float | None = None
    mfu: float | None = None
    events: list[Event] = field(default_factory=list)
    events_dropped: int = 0
    assumptions: list[str] = field(default_factory=list)
    critical_path: CriticalPath | None = None
    ranks: list[RankTime] = field(default_factory=list)  # a pipeline's, each walked (above)
    rank_wait_s: float = 0.0  # of exposed_s: waiting for other pipeline ranks (docstring)
    gemms: dict[str, int] = field(default_factory=dict)  # GEMM call sites by precision

    def to_dict(self) -> dict[str, Any]:
        """The JSON ``estimate`` keys (events left out)."""
        return {
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "exposed_s": dict(self.exposed_s),
            "rank_wait_s": self.rank_wait_s,
            "comm_s": dict(self.comm_s),
            "hardware_flops": self.hardware_flops,
            "model_flops": self.model_flops,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "critical_path": self.critical_path.to_dict() if self.critical_path else None,
            "ranks": [asdict(r) for r in self.ranks],
            "assumptions": list(self.assumptions),
            "gemms": dict(self.gemms),
        }


@dataclass
class _Handle:
    end: float
    axes: tuple[str, ...]
    name: str
    path: Link = None  # the critical path to the collective's end
    peer_wait: float = 0.0  # how much later it began for waiting on its pipeline peers


def _key(axes: tuple[str, ...]) -> str:
    return ",".join(axes) or "-"


class _Sim:
    def __init__(self, comps, entry, hw, mesh, nodes, colls, partition=None, rank=0,
                 meet: Rendezvous | None = None) -> None:  # fmt: skip
        self.comps, self.entry, self.hw = comps, entry, hw
        self.coster = Coster(comps, hw, nodes)
        self.values = Values(comps, partition)
        self.rank, self.meet = rank, meet  # a pipeline rank's walk (jaxpar.gpu.ranks)
        self.parts: list[int] | None = None  # every rank's partition, where walked side by side
        self.met = 0  # collectives over pp met so far
        self.trying = 0  # inside a branch tried only to time it: no meeting
        self.read: list[int] = []  # trip counts read from values, in the order walked
        shape = tuple(int(s) for s in np.shape(mesh.devices))
        self.n_parts = int(np.prod(shape))
        self.t = 0.0
        self.free = dict.fromkeys(STREAMS, 0.0)
        self.handles: dict[int, _Handle] = {}
        self.exposed: dict[str, float] = {}
        self.comm: dict[str, float] = {}
        self.compute_s = 0.0
        self.flops = 0.0
        self.events: list[Event] = []
        self.dropped = 0
        self.assumptions: list[str] = []
        self.taken: dict[tuple[str, str], list[float]] = {}
        self.loops: list[str] = []
        self._cond_reach: dict[str, bool] = {}
        self.colls: dict[tuple[str, str], Any] = colls
        self._pp_reach: dict[str, bool] = {}
        self.next_handle = 0
        self.rank_wait = 0.0  # exposed seconds spent waiting for other pipeline ranks
        self.unmatched: set[str] = set()
        self.path: Link = None  # the critical path to the compute stream's clock
        self.free_path: dict[str, Link] = dict.fromkeys(STREAMS)  # ... to each stream's free
        self.info: dict[str, tuple[str, str, str]] = {}  # name -> kind, axes ("" kernel), op

    # --------------------------------------------------------------------------- bookkeeping

    def emit(self, ev: Event) -> None:
        if len(self.events) < MAX_EVENTS:
            self.events.append(ev)
        else:
            self.dropped += 1

    def snapshot(self):
        handles = {k: replace(h) for k, h in self.handles.items()}
        return (self.t, dict(self.free), handles, dict(self.exposed), dict(self.comm),
                self.compute_s, self.flops, len(self.events), self.dropped,
                {k: list(v) for k, v in self.taken.items()}, self.path,
                dict(self.free_path), len(self.read), self.rank_wait)  # fmt: skip

    def restore(self, s) -> None:
        (self.t, self.free, self.handles, self.exposed, self.comm, self.compute_s, self.flops,
         n, self.dropped, self.taken, self.path, self.free_path, r, self.rank_wait) = s  # fmt: skip
        del self.read[r:]
        self.handles = {k: replace(h) for k, h in self.handles.items()}
        self.free_path = dict(self.free_path)
        del self.events[n:]

    def reaches_conditional(self, comp: str) -> bool:
        if comp not in self._cond_reach:
            self._cond_reach[comp] = False  # cycles: no
            hit = False
            for ins in self.comps.get(comp, []):
                if ins.opcode == "conditional" and branch_weights(ins) is not None:
                    hit = True
                elif ins.opcode in ("while", "call", "conditional"):
                    hit = hit or any(self.reaches_conditional(c) for c in callees(ins))
            self._cond_reach[comp] = hit
        return self._cond_reach[comp]

    def reaches_pp(self, comp: str) -> bool:
        """Whether ``comp`` (or what it calls) runs a collective over ``pp``."""
        if comp not in self._pp_reach:
            self._pp_reach[comp] = False  # cycles: no
            hit = any("pp" in self.colls[(comp, i.name)].axes for i in self.comps.get(comp, [])
                      if (comp, i.name) in self.colls)  # fmt: skip
            for ins in self.comps.get(comp, []):
                if ins.opcode in ("while", "call", "conditional", "async-start", "fusion"):
                    hit = hit or any(self.reaches_pp(c) for c in callees(ins))
            self._pp_reach[comp] = hit
        return self._pp_reach[comp]

    # --------------------------------------------------------------------------- walking

    def run(self, comp: str, args: list) -> Any:
        """Walk ``comp`` with parameter values ``args``; returns its root's value."""
        env: dict[str, Any] = {}
        body = self.comps.get(comp, [])
        for ins in body:
            op = ins.opcode
            if op == "parameter":
                k = int(ins.operands[0]) if ins.operands and ins.operands[0].isdigit() else 0
                env[ins.name] = args[k] if k < len(args) else None
            elif op == "tuple":
                env[ins.name] = [env.get(o) for o in ins.operands]
            elif op == "get-tuple-element":
                v = env.get(ins.operands[0]) if ins.operands else None
                m = re.search(r"index=(\d+)", ins.attrs)
                k = int(m.group(1)) if m else 0
                env[ins.name] = v[k] if isinstance(v, list) and k < len(v) else v
            elif op == "while":
                state = env.get(ins.operands[0]) if ins.operands else None
                env[ins.name] = self.loop(comp, ins, state)
            elif op == "conditional":
                env[ins.name] = self.conditional(comp, ins, env)
            elif op == "call":
                env[ins.name] = self.run(callees(ins)[0], [env.get(o) for o in ins.operands])
            elif self.collective(comp, ins, env):
                pass
            else:
                self.kernel(comp, ins)
                if op in _PASS and ins.operands:
                    env[ins.name] = env.get(ins.operands[0])
                if self.values.wanted(ins.shape):  # a counter, a bound, an index
                    got = self.values.of(comp, ins, [env.get(o) for o in ins.operands])
                    if got is not None:
                        env[ins.name] = got
        return env.get(body[-1].name) if body else None

    def kernel(self, comp: str, ins: Instr) -> None:
        k = self.coster.kernel(comp, ins)
        if k.seconds <= 0:
            return
        om = re.search(r'op_name="([^"]*)"', ins.attrs)
        self.emit(Event(ins.name, COMPUTE, self.t, k.seconds, k.kind,
                        op_name=om.group(1) if om else "", loop="/".join(self.loops)))  # fmt: skip
        if ins.name not in self.info:
            self.info[ins.name] = (k.kind, "", om.group(1) if om else "")
        self.path = (self.path, ins.name, k.seconds)  # it starts where the stream's last ended
        self.t += k.seconds
        self.compute_s += k.seconds
        self.flops += k.flops

    def _transfer(self, comp: str, ins: Instr) -> tuple[str, Transfer] | None:
        kind = ins.opcode.removesuffix("-start")
        where = (comp, ins.name)
        if ins.opcode == "async-start":  # a generic wrapper: the collective inside it
            inner = [(c, i) for c in callees(ins) for i in self.comps.get(c, [])
                     if i.opcode in KINDS]  # fmt: skip
            if not inner:
                return None
            (c, i), kind = inner[0], inner[0][1].opcode
            where = (c, i.name)
        if kind not in KINDS or where not in self.colls:
            return None
        got = self.colls[where]
        return kind, self.coster.transfer(self.comps_instr(where), kind, got.wire_bytes,
                                          got.axes, self.n_parts)  # fmt: skip

    def comps_instr(self, where: tuple[str, str]) -> Instr:
        return self.coster.table(where[0])[where[1]]

    def collective(self, comp: str, ins: Instr, env: dict) -> bool:
        """Handle ``ins`` when it is a collective's start, done or synchronous form."""
        op = ins.opcode
        if (op.endswith("-done") and op.removesuffix("-done") in KINDS) or op == "async-done":
            h = env.get(ins.operands[0]) if ins.operands else None
            if h is _SYNC:
                return True
            if not (isinstance(h, int) and h in self.handles):
                self.unmatched.add(ins.name)  # its start was not found: no wait counted
                return True
            hd = self.handles.pop(h)
            if hd.end > self.t:
                self.path = hd.path  # the wait ends when the collective does
                wait = hd.end - self.t
                self.exposed[_key(hd.axes)] = self.exposed.get(_key(hd.axes), 0.0) + wait
                self.rank_wait += min(wait, hd.peer_wait)
                self.emit(Event("wait " + hd.name, COMPUTE, self.t, wait, "wait", hd.axes,
                                loop="/".join(self.loops)))  # fmt: skip
                self.t = hd.end
            return True
        found = self._transfer(comp, ins)
        if found is None:
            return False
        kind, tr = found
        om = re.search(r'op_name="([^"]*)"', ins.attrs)
        key = _key(tr.axes)
        self.comm[key] = self.comm.get(key, 0.0) + tr.seconds
        self.exposed.setdefault(key, 0.0)  # every axis with collectives is listed
        started = op.endswith("-start") or op == "async-start"
        sync = not started or bool(backend_config(ins).get("is_sync", False))
        stream = COMPUTE if sync else (P2P if kind in P2P_KINDS else COLLECTIVE)
        begin = self.t if sync else max(self.t, self.free[stream])
        # it waited for the compute stream to reach its start, or for its stream to be free
        after = self.path if sync or self.t >= self.free[stream] else self.free_path[stream]
        ready = begin  # when this rank could begin it
        if self.meet is not None and not self.trying and "pp" in tr.axes:
            # the group spans pipeline ranks: it begins when the last of them reaches it
            self.met += 1
            begin, after = self.meet.meet(
                self.rank,
                self.met,
                ins.name,
                begin,
                after,
                self._peers(ins) if kind in P2P_KINDS else None,
            )
        end = begin + tr.seconds
        peer_wait = begin - ready  # waiting for the other ranks (zero without them)
        if sync:
            self.rank_wait += peer_wait
        if sync and begin > self.t:  # the compute stream waits for the other ranks
            self.emit(Event("wait for pp ranks: " + ins.name, COMPUTE, self.t, begin - self.t,
                            "wait", tr.axes, loop="/".join(self.loops)))  # fmt: skip
        self.emit(Event(ins.name, stream, begin, tr.seconds, kind, tr.axes,
                        om.group(1) if om else "", "/".join(self.loops)))  # fmt: skip
        if ins.name not in self.info:
            self.info[ins.name] = (kind, key, om.group(1) if om else "")
        link = (after, ins.name, tr.seconds)
        if sync:
            self.exposed[key] = self.exposed.get(key, 0.0) + end - self.t
            self.t = end
            self.path = link
            env[ins.name] = _SYNC
        else:
            self.free[stream] = end
            self.free_path[stream] = link
            self.next_handle += 1
            h = self.next_handle
            self.handles[h] = _Handle(end, tr.axes, ins.name, link, peer_wait)
            env[ins.name] = h
        return True

    def _peers(self, ins: Instr) -> list[int] | None:
        """The pipeline ranks a send/receive of this rank's exchanges with (its
        ``source_target_pairs``), or None where the pairs are not printed."""
        if "source_target_pairs" not in ins.attrs or self.parts is None:
            return None
        pairs = source_target_pairs(ins.attrs)
        me = self.parts[self.rank]
        out = set()
        for a, b in pairs:
            for x, y in ((a, b), (b, a)):
                if x == me and y != me and y in self.parts:
                    out.add(self.parts.index(y))
        return sorted(out)

    def conditional(self, comp: str, ins: Instr, env: dict) -> Any:
        called = callees(ins)
        pred = re.search(r"true_computation=%?([\w.\-]+).*false_computation=%?([\w.\-]+)",
                         ins.attrs)  # fmt: skip
        if pred:  # branch 0 is false, 1 is true
            called = [pred.group(2), pred.group(1)]
        args = [env.get(o) for o in ins.operands[1:]]
        weights = branch_weights(ins)
        k = env.get(ins.operands[0]) if ins.operands else None
        if isinstance(k, np.ndarray) and k.shape == ():  # the program says which branch
            i = int(bool(k)) if pred else min(max(int(k), 0), len(called) - 1)
        elif weights is not None and len(weights) == len(called) and sum(weights) > 0:
            taken = self.taken.setdefault((comp, ins.name), [0.0] * len(called))
            n = sum(taken)
            i = int(np.argmax([w * (n + 1) - t for w, t in zip(weights, taken, strict=True)]))
            taken[i] += 1
        else:
            note = f"conditional {ins.name}: no branch counts; its slowest branch assumed"
            if note not in self.assumptions:
                self.assumptions.append(note)
            start, ends = self.snapshot(), []
            self.trying += 1
            for j, c in enumerate(called):
                self.run(c, [args[j] if j < len(args) else None])
                ends.append(self.t)
                self.restore(start)
            self.trying -= 1
            i = int(np.argmax(ends))
        return self.run(called[i], [args[i] if i < len(args) else None])

    def trips(self, comp: str, ins: Instr, state: Any) -> int:
        tm = _TRIP.search(ins.attrs)
        if tm:
            return int(tm.group(1))
        got = infer_trips(self.comps, self.comps[comp], ins)
        if got is not None:
            return got
        got = self.values.trips(ins, state)  # the condition, run on the state's values
        if got is not None:
            self.read.append(got)
            return got
        note = f"while {ins.name}: trip count unknown; one trip assumed"
        if note not in self.assumptions:
            self.assumptions.append(note)
        return 1

    def _signature(self, state: Any) -> tuple:
        """Where the streams and the in-flight collectives stand, relative to the clock."""
        handles: list[float] = []

        def walk(v: Any) -> None:
            if isinstance(v, list):
                for x in v:
                    walk(x)
            elif isinstance(v, int) and v in self.handles:
                handles.append(max(0.0, self.handles[v].end - self.t))
            else:
                handles.append(-1.0)

        walk(state)
        free = [max(0.0, self.free[s] - self.t) for s in STREAMS]
        return tuple(free), tuple(handles)

    def loop(self, comp: str, ins: Instr, state: Any) -> Any:
        bm = re.search(r"body=%?([\w.\-]+)", ins.attrs)
        if not bm or bm.group(1) not in self.comps:
            return state
        body, n = bm.group(1), self.trips(comp, ins, state)
        steady = not self.reaches_conditional(body) and not (
            self.meet is not None and self.reaches_pp(body)
        )  # every rank walks it all
        prev = None
        i = 0
        while i < n:
            self.loops.append(f"{ins.name}[{i}]")
            t0, ex0, cm0, c0, f0, e0 = (self.t, dict(self.exposed), dict(self.comm),
                                        self.compute_s, self.flops, len(self.events))  # fmt: skip
            links0 = self._links(state)
            r0 = len(self.read)
            state = self.run(body, [state])
            self.loops.pop()
            i += 1
            cur = (self._signature(state), self.t - t0, tuple(self.read[r0:]))
            if steady and prev is not None and i < n and _same(prev, cur):
                # (no rank waits to add: a loop that reaches a collective over pp is walked
                # whole when the ranks meet, see ``steady``)
                self._repeat(n - i, t0, ex0, cm0, c0, f0, e0, state, (ins.name, i - 1))
                self._repeat_paths(n - i, links0, state)
                # the counters and bounds the iterations not walked leave in the state
                state = _merge(state, self.values.advance(ins, state, n - i))
                break
            prev = cur
        return state

    def _repeat(self, r: int, t0, ex0, cm0, c0, f0, e0, state, it: tuple[str, int]) -> None:
        """Add ``r`` more iterations equal to iteration ``it`` (loop name, index), which started
        at ``t0``."""
        dt = self.t - t0
        ev = self.events[e0:]
        label = f"{it[0]}[{it[1]}]"
        for k in range(1, r + 1):
            now = f"{it[0]}[{it[1] + k}]"
            for e in ev:
                self.emit(Event(e.name, e.stream, e.start + k * dt, e.dur, e.kind, e.axes,
                                e.op_name, e.loop.replace(label, now, 1)))  # fmt: skip
            if len(self.events) >= MAX_EVENTS:
                self.dropped += (r - k) * len(ev)
                break
        for d, before in ((self.exposed, ex0), (self.comm, cm0)):
            for key, v in list(d.items()):
                d[key] = v + r * (v - before.get(key, 0.0))
        self.compute_s += r * (self.compute_s - c0)
        self.flops += r * (self.flops - f0)
        self.t += r * dt
        for s in STREAMS:
            self.free[s] += r * dt

        def shift(v: Any) -> None:
            if isinstance(v, list):
                for x in v:
                    shift(x)
            elif isinstance(v, int) and v in self.handles:
                self.handles[v].end += r * dt

        shift(state)

    def _live(self, state: Any) -> list[_Handle]:
        """The in-flight collectives in ``state``, in :meth:`_signature`'s order."""
        out: list[_Handle] = []

        def walk(v: Any) -> None:
            if isinstance(v, list):
                for x in v:
                    walk(x)
            elif isinstance(v, int) and v in self.handles:
                out.append(self.handles[v])

        walk(state)
        return out

    def _links(self, state: Any) -> list[Link]:
        """Where the critical paths a loop iteration can extend stand: the compute clock's, each
        stream's, each in-flight collective's of the loop state."""
        return [self.path, *(self.free_path[s] for s in STREAMS),
                *(h.path for h in self._live(state))]  # fmt: skip

    def _repeat_paths(self, r: int, before: list[Link], state: Any) -> None:
        """The critical paths after ``r`` more iterations like the last one, which turned the
        links ``before`` into the present ones: each present link is one of ``before`` plus the
        stretch the iteration added, and each further iteration adds that stretch again to the
        link it extends then."""
        now = repeat_links(before, self._links(state), r)
        self.path = now[0]
        for k, s in enumerate(STREAMS):
            self.free_path[s] = now[1 + k]
        for h, link in zip(self._live(state), now[1 + len(STREAMS) :], strict=True):
            h.path = link

    def critical_path(self, end: Link, exposed_keys: list[str]) -> CriticalPath:
        """Walk ``end`` back to the step's start (:func:`jaxpar.gpu.critical.walk_back`)."""
        return walk_back(end, self.info, exposed_keys)


def _merge(state: Any, ints: Any) -> Any:
    """The loop state ``state`` with the integer values ``ints`` (:class:`Values`) in place of
    its own (which are the last walked iteration's): its collectives' handles kept."""
    if isinstance(state, list):
        more = ints if isinstance(ints, list) and len(ints) == len(state) else [None] * len(state)
        return [_merge(s, v) for s, v in zip(state, more, strict=True)]
    if isinstance(ints, np.ndarray) or isinstance(state, np.ndarray):
        return ints if isinstance(ints, np.ndarray) else None
    return state


def _same(a: tuple, b: tuple) -> bool:
    (sa, da, ra), (sb, db, rb) = a, b
    tol = 1e-9 * max(abs(da), abs(db), 1e-12)
    if ra != rb or abs(da - db) > tol or len(sa[1]) != len(sb[1]):
        return False
    pairs = list(zip(sa[0], sb[0], strict=True)) + list(zip(sa[1], sb[1], strict=True))
    return all(abs(x - y) <= tol for x, y in pairs)


def check_hardware(hw: HardwareConfig) -> None:
    """Refuse (ValueError naming the field) a mesh without a figure the model needs."""
    for f in ("peak_flops_bf16", "hbm_bw", "intra_node_bw", "nic_bw", "nics_per_node",
              "devices_per_node", "matmul_efficiency"):  # fmt: skip
        if not getattr(hw, f, None):
            raise ValueError(f"hardware.{f}: the time model needs it (mesh file)")


def simulate(
    compiled_or_text: Any,
    mesh: Any,
    hw: HardwareConfig,
    nodes: list[int] | None = None,
    model_flops: float | None = None,
) -> StepTime:
    """Simulate one step of the scheduled program (module docstring).

    ``compiled_or_text``: a compiled executable, its optimized HLO text or that text parsed
    (:class:`~jaxpar.analysis.hlo_text.Module`); ``mesh``: anything with ``devices`` (its
    shape) and ``axis_names`` in the program's partition order; ``hw`` the mesh file's
    hardware; ``nodes[p]`` the node of partition ``p`` (default ``p // hw.devices_per_node``);
    ``model_flops`` per device per step for TFLOP/s and MFU.
    """
    check_hardware(hw)
    src = compiled_or_text
    module = parse(src if isinstance(src, (str, Module)) else program_text(src))
    comps, entry = module.comps, module.entry
    colls = {(c.computation, c.name): c for c in collective_bytes(module, mesh).collectives}
    parts = pipeline_partitions(mesh)
    notes: list[str] = []

    def one(r: int, meet: Rendezvous) -> tuple[_Sim, Link]:
        sim = _Sim(comps, entry, hw, mesh, nodes, colls, parts[r], r, meet)
        sim.parts = parts
        return _walk(sim)

    if len(parts) > 1:
        try:
            sims = run_ranks(one, parts)
        except Diverged as e:
            notes.append(
                f"pipeline ranks not walked side by side ({e}): one walk, each "
                "conditional's branches by the schedule's counts averaged over ranks"
            )
            sims = [_walk(_Sim(comps, entry, hw, mesh, nodes, colls))]
    else:
        sims = [_walk(_Sim(comps, entry, hw, mesh, nodes, colls))]
    sim, end = max(sims, key=lambda x: x[0].t)  # the rank that ends the step
    for other, _ in sims:
        for name, got in other.info.items():
            sim.info.setdefault(name, got)
        notes += [a for a in other.assumptions if a not in notes]
    exposed = dict(sorted(sim.exposed.items()))
    exposed["total"] = sum(sim.exposed.values())
    comm = dict(sorted(sim.comm.items()))
    comm["total"] = sum(sim.comm.values())
    out = StepTime(sim.t, sim.compute_s, exposed, comm, sim.flops, events=sim.events,
                   events_dropped=sim.dropped, assumptions=notes,
                   critical_path=sim.critical_path(end, list(sim.exposed)),
                   ranks=[_rank_figures(x, parts[i] if len(sims) > 1 else 0)
                          for i, (x, _) in enumerate(sims)] if len(sims) > 1 else [],
                   rank_wait_s=sim.rank_wait, gemms=sim.coster.gemms())  # fmt: skip
    if model_flops is not None and sim.t > 0:
        out.model_flops = model_flops
        out.tflops_per_device = model_flops / sim.t / 1e12
        out.mfu = model_flops / sim.t / hw.peak_flops_bf16
    return out


def _walk(sim: _Sim) -> tuple[_Sim, Link]:
    """Walk the entry computation; the simulation and the critical path to the step's end."""
    sim.run(sim.entry, [])
    if sim.unmatched:
        names = sorted(sim.unmatched)
        sim.assumptions.append(f"{len(names)} collective done(s) whose start was not traced "
                               f"(e.g. {names[0]}): no wait counted for them")  # fmt: skip
    end = sim.path
    for h in sim.handles.values():  # a collective the step never waits for still ends in it
        if h.end > sim.t:
            sim.t, end = h.end, h.path
    return sim, end


def _rank_figures(sim: _Sim, partition: int) -> RankTime:
    exposed = dict(sorted(sim.exposed.items()))
    exposed["total"] = sum(sim.exposed.values())
    return RankTime(partition, sim.t, sim.compute_s, exposed, sim.rank_wait)
