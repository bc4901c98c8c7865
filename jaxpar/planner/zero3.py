"""ZeRO-3's per-layer calls walked on one collective stream, as XLA:GPU schedules them.

What the compiled program does (jaxpar's step on a GPU, the time model's walk of it:
BENCHMARKS.md, "ZeRO-3 exposure walked per weight group"):

* XLA:GPU gathers a layer's weights one **weight group** at a time (attention's fused QKV,
  its output, the MLP's gate, up and down: one all-gather each) and starts each gather one
  kernel ahead of its consumer: the window is the previous group's last kernel — the whole
  matmul, or one chunk of it where Megatron-SP's collective matmul runs it as ``tp`` ring
  chunks (:mod:`jaxpar.model.collective_matmul`).
* The backward regathers the groups in reverse order, each one kernel ahead, and reduce-
  scatters the layer's gradients in one call, started as soon as they are complete — at the
  start of the next layer's backward, ahead of the regathers started there.
* Every all-gather and reduce-scatter runs on the one async collective stream, in the order
  they start: a reduce-scatter that outlasts the compute beside it holds back the next
  regathers, and the backward waits for them.
* With more than one collective in flight (the GPU meshes' overlap limit, which
  :func:`jaxpar.distributed.run_xla_flags` starts ZeRO-3 across nodes and Megatron-SP's rings
  with), XLA:GPU starts the layer's first regather before the scatter of the layer above,
  which then runs behind it beside the layer's backward (llama2-70b dp 32 × tp 2 + SP, limit
  4: a 2.4 ms regather ahead of the 16.7 ms scatter).

:func:`exposed` walks that: the compute stream runs the groups in order, each waiting for its
gather; the collective stream runs the calls first in, first out. No share of the layer is
assumed: on NVLink a group's transfer is shorter than the kernel beside it and nearly all of
it hides (llama3-8b dp 8), across nodes a call outlasts its window and the rest is exposed
(llama2-70b dp 32 × tp 2 + SP on a100-64), at each link's bandwidth
(:func:`jaxpar.planner.collectives.call_time`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    """One weight group of a layer: forward and backward seconds of its compute (the
    backward's recompute included) and its all-gather's seconds."""

    fwd_s: float
    bwd_s: float
    gather_s: float


def _walk(segments: list[tuple[float, list[tuple[object, float]], object]]) -> float:
    """Seconds the compute stream waits. Each segment: (compute seconds, calls started at its
    start as (key, seconds), the key of the call it waits for or None)."""
    t = free = exposed = 0.0
    done: dict[object, float] = {}
    for secs, starts, need in segments:
        for key, dur in starts:
            free = max(t, free) + dur
            done[key] = free
        if need is not None and done.get(need, 0.0) > t:
            exposed += done[need] - t
            t = done[need]
        t += secs
    return exposed


def _split(secs: float, chunks: int, starts: list, need: object) -> list:
    """A group's compute as the program runs it: the calls it starts begin at its last chunk."""
    if chunks <= 1:
        return [(secs, starts, need)]
    return [(secs * (1 - 1 / chunks), [], need), (secs / chunks, starts, None)]


def _forward(groups: Sequence[Group], layers: int, chunks: int) -> float:
    n, segs = len(groups), []
    for j in range(layers):
        for k, g in enumerate(groups):
            nj, nk = (j, k + 1) if k + 1 < n else (j + 1, 0)
            starts = [(("f", nj, nk), groups[nk].gather_s)] if nj < layers else []
            if j == 0 and k == 0:  # the first gather has nothing before it
                starts.insert(0, (("f", 0, 0), g.gather_s))
            segs += _split(g.fwd_s, chunks, starts, ("f", j, k))
    return _walk(segs)


def _backward(groups: Sequence[Group], layers: int, chunks: int, rs_s: float,
              regathers_first: bool = False) -> float:  # fmt: skip
    n, segs = len(groups), []
    order = list(range(n))[::-1]
    for jj in range(layers):
        j = layers - 1 - jj
        for i, k in enumerate(order):
            starts = []
            if jj == 0 and i == 0:
                starts.append((("b", j, k), groups[k].gather_s))
            # the layer above's gradients, ahead of this layer's calls (one in flight) or
            # behind the regather started beside them (more than one)
            scatter = [(("rs", j + 1), rs_s)] if i == 0 and jj > 0 else []
            if not regathers_first:
                starts += scatter
            if i + 1 < n:
                starts.append((("b", j, order[i + 1]), groups[order[i + 1]].gather_s))
            elif j > 0:
                starts.append((("b", j - 1, order[0]), groups[order[0]].gather_s))
            if regathers_first:
                starts += scatter
            segs += _split(groups[k].bwd_s, chunks, starts, ("b", j, k))
    segs.append((0.0, [(("rs", 0), rs_s)], ("rs", 0)))  # the last reduce-scatter: nothing after
    return _walk(segs)


def exposed(groups: Sequence[Group], layers: int, rs_s: float, chunks: int = 1,
            regathers_first: bool = False) -> tuple[float, float]:  # fmt: skip
    """(forward, backward) seconds the compute stream waits on ZeRO-3's calls in one
    micro-batch of ``layers`` layers (module docstring). ``rs_s``: one layer's reduce-scatter;
    ``chunks``: kernels each group's matmul runs as (``tp`` under Megatron-SP's rings, else
    1); ``regathers_first``: the run keeps more than one collective in flight, and the
    backward's first regather of a layer goes ahead of the scatter of the layer above.
    Past four layers the walk is steady, and the rest are extrapolated from the fourth."""
    if layers <= 0 or not groups:
        return 0.0, 0.0
    n, rf = min(layers, 4), regathers_first
    f, b = _forward(groups, n, chunks), _backward(groups, n, chunks, rs_s, rf)
    if layers > n:
        f1, b1 = _forward(groups, n - 1, chunks), _backward(groups, n - 1, chunks, rs_s, rf)
        f, b = f + (layers - n) * (f - f1), b + (layers - n) * (b - b1)
    return f, b
