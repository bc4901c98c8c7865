"""Per-rank steps of each pipeline schedule, and the rules on their arguments.

Each generator ``(p, m, v) -> steps`` returns, per rank, its work in execution order as a list
of *steps*; a step is a tuple of one action, or of two that share a lock-step tick: a forward
and a backward (``B`` or ``I``) of the same rank — a *fused tick*. Actions are
:class:`~jaxpar.pipeline.types.Action` values. :func:`jaxpar.pipeline.schedules.make_schedule` turns
the steps into a validated :class:`~jaxpar.pipeline.schedules.Schedule`. Facts about each
schedule (warm-up counts, phase structure) come from its paper or reference implementation,
cited at the generator; the code is jaxpar's own.

Why fused ticks: the SPMD executor runs the table in lock step, so a tick lasts as long as the
slowest rank's work. A steady-state tick in which one rank runs ``F`` and another ``B`` (2F)
wastes the difference; a tick in which every rank runs one ``F`` and one ``B`` does not. On
the last stage the forward goes first, so it can run the backward of the micro-batch it has
just finished in the same tick (it needs no received cotangent). Everywhere else the backward
goes first (:func:`fused`): its micro-batch is not the forward's, and the stash slot it frees
holds the forward's new stash, so the tick never holds both — one stash fewer per rank.

Memory modes (``memory``, the layout's ``pipeline_memory``): ``"fast"`` is the fused table
above, at the asynchronous makespan; in lock step each hop costs a tick, so rank ``r`` holds
``2(p-1-r)`` stashes (1F1B). ``"lean"`` (1F1B only, :data:`LEAN`) caps rank ``r`` at the
classic ``p - r`` in flight and pays for it in lock-step makespan (p 4, m 16: 72 units
against 57, F = 1, B = 2).
"""

from __future__ import annotations

from collections.abc import Callable

from jaxpar.config import PIPELINE_MEMORY
from jaxpar.errors import ConfigError
from jaxpar.pipeline.types import Action, Kind, Step

KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")


def _gpipe(p: int, m: int, v: int) -> list[list[Step]]:
    # All forwards, then all backwards in the same micro-batch order: m stashes live per rank.
    return [
        [(Action(Kind.F, r, j),) for j in range(m)] + [(Action(Kind.B, r, j),) for j in range(m)]
        for r in range(p)
    ]


def fused(f: Action, b: Action) -> Step:
    """A forward and a backward in one tick, in the order the executor runs them: the
    backward first (it frees its stash slot before the forward fills one) unless it is the
    backward of the forward's own (stage, micro-batch) — the last stage's ``FB``."""
    return (f, b) if (f.stage, f.mb) == (b.stage, b.mb) else (b, f)


def _1f1b(p: int, m: int, v: int) -> list[list[Step]]:
    # 1F1B (PipeDream-flush) in fused ticks: the interleaved form with one chunk per rank.
    return _interleaved(p, m, 1)


def _interleaved(p: int, m: int, v: int) -> list[list[Step]]:
    # Megatron-LM's interleaved 1F1B: virtual micro-batch k runs chunk (k // p) % v on
    # micro-batch (k // (p*v)) * p + k % p; backwards visit the chunks in reverse. Warm-up is
    # 2(p-1-r) + (v-1)p virtual micro-batches, as in Megatron's forward_backward function, then
    # every step fuses F of virtual index k + warm with B of index k into one tick: in the lock
    # step rank r runs F of index t - r and B of index t - warm_r - r at tick t, so the
    # lock-step makespan equals the asynchronous one. The backward runs first (fused), so
    # rank r holds warm_r stashes (1F1B: 2(p-1-r), where PipeDream-flush's unfused order holds
    # p - r; the last stage runs each micro-batch's FB in one tick and stashes nothing).
    total = m * v
    steps = []
    for r in range(p):

        def item(k: int, kind: Kind, r: int = r) -> Action:
            chunk = (k // p) % v
            chunk = chunk if kind == Kind.F else v - 1 - chunk
            return Action(kind, chunk * p + r, (k // (p * v)) * p + k % p)

        warm = min(2 * (p - 1 - r) + (v - 1) * p, total)
        row: list[Step] = [(item(k, Kind.F),) for k in range(warm)]
        row += [fused(item(warm + k, Kind.F), item(k, Kind.B)) for k in range(total - warm)]
        row += [(item(k, Kind.B),) for k in range(total - warm, total)]
        steps.append(row)
    return steps


def _1f1b_lean(p: int, m: int, v: int) -> list[list[Step]]:
    # PipeDream-flush's order (Narayanan et al. 2021, 1F1B with flush): rank r runs p - r
    # forwards, then alternates a backward and a forward, then drains its backwards, one action
    # per tick, so it never holds more than p - r stashes. Fused pairs at this cap lengthen the
    # lock step instead: a hop costs a tick, so a micro-batch's round trip from rank 0 takes
    # 2(p-1) ticks whatever the tick holds, and p stashes over that round trip admit a new
    # micro-batch every 2(p-1)/p ticks, not every tick — ticks of one F and one B (3 units)
    # then alternate with ticks of one action and the step grows past the unfused 2-unit ticks
    # (p 4, m 16: 96 units fused, 72 unfused, 57 async).
    if p <= 2:  # 2(p-1-r) <= p - r: the fused table is within the cap
        return _1f1b(p, m, v)
    steps = []
    for r in range(p):
        warm = min(p - r, m)
        row: list[Step] = [(Action(Kind.F, r, j),) for j in range(warm)]
        for k in range(m - warm):
            row += [(Action(Kind.B, r, k),), (Action(Kind.F, r, k + warm),)]
        row += [(Action(Kind.B, r, k),) for k in range(m - warm, m)]
        steps.append(row)
    return steps


def _zb_h1(p: int, m: int, v: int) -> list[list[Step]]:
    # ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): steady step x on rank r is
    # (F_x, I_{x-(p-1-r)}, W_{x-(p-1)}). Every rank lags its W by p-1 micro-batches, so it
    # holds p stashes: PipeDream-flush's peak (rank 0's p), reached on every rank. The deferred
    # W fill the cool-down bubbles: idle (p-1)(F+I-W) per rank instead of 1F1B's (p-1)(F+B).
    # Every action costs one unit, so ticks of one action each already run in lock step.
    steps = []
    for r in range(p):
        row: list[Step] = []
        for x in range(m + p - 1):
            if x < m:
                row.append((Action(Kind.F, r, x),))
            if 0 <= x - (p - 1 - r) < m:
                row.append((Action(Kind.I, r, x - (p - 1 - r)),))
            if 0 <= x - (p - 1) < m:
                row.append((Action(Kind.W, r, x - (p - 1)),))
        steps.append(row)
    return steps


class _VRow:
    """One rank's order under V placement: chunk 0 is stage ``r``, chunk 1 is ``2p-1-r``.

    Counters give each chunk's next micro-batch per action family (``I`` and ``B`` share one,
    both being "the backward"); ``I`` queues its ``W`` for a FIFO :meth:`weight`. Every action
    is a step of its own (V-shaped schedules run one action per tick).
    """

    def __init__(self, p: int, r: int) -> None:
        self.stages = (r, 2 * p - 1 - r)
        self.row: list[Step] = []
        self.count = {(k, c): 0 for k in "FBW" for c in (0, 1)}
        self.queue: list[Action] = []

    def add(self, kind: str, chunk: int) -> None:
        family = "B" if kind == "I" else kind
        stage, mb = self.stages[chunk], self.count[(family, chunk)]
        self.count[(family, chunk)] += 1
        self.row.append((Action(Kind(kind), stage, mb),))
        if kind == "I":
            self.queue.append(Action(Kind.W, stage, mb))

    def weight(self) -> None:
        self.row.append((self.queue.pop(0),))

    def n(self, family: str, chunk: int) -> int:
        return self.count[(family, chunk)]


def _zbv(p: int, m: int, v: int) -> list[list[Step]]:
    # ZB-V (Qi et al. 2024), phases as in the paper's figure and PyTorch's ZBV schedule.
    # Warm-up fills the V with forwards (2(p-r)-1 of chunk 0, then r F1/F0 pairs, then p-r
    # F1 I1 W1), the steady phase alternates F/I/W of chunk 0 and chunk 1, the cool-down runs
    # input gradients first (they are on the critical path) and drains the weights last.
    orders = []
    for r in range(p):
        b = _VRow(p, r)
        for _ in range(2 * (p - r) - 1):
            b.add("F", 0)
        for _ in range(r):
            b.add("F", 1)
            b.add("F", 0)
        for _ in range(p - r):
            for kind in "FIW":
                b.add(kind, 1)
        while b.n("F", 1) < b.n("F", 0) or b.n("F", 0) < m:
            if b.n("F", 0) < m:
                b.add("F", 0)
            for kind, c in (("I", 0), ("W", 0), ("F", 1), ("I", 1), ("W", 1)):
                b.add(kind, c)
        for _ in range(r):
            b.add("I", 0)
            b.add("I", 1)
        for _ in range(p - r):
            b.add("I", 0)
            b.add("W", 0)
        for c in (1, 0):
            while b.n("W", c) < b.n("B", c):
                b.add("W", c)
        orders.append(b.row)
    return orders


def _dualpipev(p: int, m: int, v: int) -> list[list[Step]]:
    # DeepSeek DualPipeV (deepseek-ai/DualPipe, dualpipev.py), its eight steps per rank; see
    # the schedules module docstring for what is modelled. Full backwards are "B"; zero-bubble
    # backwards are "I" with their "W" queued FIFO, as DualPipe's weight-gradient store does.
    # Its overlapped pairs (a forward of one chunk with the full backward of the other) stay
    # two ticks: fused, they lengthen the lock step (p 4, m 8: 31.5 against 27 units, async
    # 25.5), because the ranks are in different phases when they run them, so a fused tick on
    # one rank waits against single actions on the others.
    orders = []
    for r in range(p):
        b = _VRow(p, r)
        for _ in range(2 * (p - r - 1)):  # 1: forwards of chunk 0
            b.add("F", 0)
        for _ in range(r + 1):  # 2: F0 F1 pairs
            b.add("F", 0)
            b.add("F", 1)
        for _ in range(p - r - 1):  # 3: zero-bubble I1, W1, F1
            b.add("I", 1)
            b.weight()
            b.add("F", 1)
        for _ in range(m - 2 * p + r + 1):  # 4: main step, overlapped F0&B1 then F1&B0
            for kind, c in (("F", 0), ("B", 1), ("F", 1), ("B", 0)):
                b.add(kind, c)
        for _ in range(p - r - 1):  # 5: B1, then overlapped F1&B0
            for kind, c in (("B", 1), ("F", 1), ("B", 0)):
                b.add(kind, c)
        zb = False
        for i in range(r + 1):  # 6: B1 B0, the second half zero-bubble
            zb = zb or (i == (r + 1) // 2 and r % 2 == 1)
            b.add("I" if zb else "B", 1)
            zb = zb or (i == (r + 1) // 2 and r % 2 == 0)
            b.add("I" if zb else "B", 0)
        for _ in range(p - r - 1):  # 7: W, then zero-bubble I0
            b.weight()
            b.add("I", 0)
        while b.queue:  # 8: drain the weight queue
            b.weight()
        orders.append(b.row)
    return orders


GENERATORS: dict[str, Callable[[int, int, int], list[list[Step]]]] = {
    "gpipe": _gpipe,
    "1f1b": _1f1b,
    "interleaved": _interleaved,
    "zb-h1": _zb_h1,
    "zbv": _zbv,
    "dualpipev": _dualpipev,
}
# Tables that cap the stashes below the fused table's, at the cost of lock-step makespan.
LEAN: dict[str, Callable[[int, int, int], list[list[Step]]]] = {"1f1b": _1f1b_lean}
DEFAULT_VIRTUAL = {"interleaved": 2, "zbv": 2, "dualpipev": 2}


def generator(kind: str, memory: str = "fast") -> Callable[[int, int, int], list[list[Step]]]:
    """The generator of ``kind`` in memory mode ``memory`` (arguments already checked)."""
    return LEAN[kind] if memory == "lean" else GENERATORS[kind]


def check_arguments(kind: str, p: int, m: int, v: int | None = None, memory: str = "fast") -> int:
    """Refuse a bad (kind, p, m, v, memory) with a one-line :class:`ConfigError`; return the
    resolved v."""
    if kind not in GENERATORS:
        raise ConfigError(f"schedule={kind!r}: unknown schedule, choose one of {', '.join(KINDS)}")
    if memory not in PIPELINE_MEMORY:
        raise ConfigError(
            f"pipeline_memory={memory!r}: must be one of {', '.join(PIPELINE_MEMORY)}"
        )
    if memory == "lean" and kind not in LEAN:
        raise ConfigError(
            f"pipeline_memory='lean': schedule {kind!r} has no lean table, only "
            f"{', '.join(LEAN)} (GPipe holds every micro-batch by design; interleaved's fused "
            "table holds Megatron's peak less one; ZB-H1 and the V schedules are unfused)"
        )
    v = DEFAULT_VIRTUAL.get(kind, 1) if v is None else v
    for name, value in (("stages", p), ("microbatches", m), ("virtual", v)):
        if value < 1:
            raise ConfigError(f"{name}={value}: must be >= 1")
    if kind in V_SHAPED and v != 2:
        raise ConfigError(f"virtual={v}: schedule {kind!r} is V-shaped and needs virtual=2")
    if kind not in V_SHAPED and kind != "interleaved" and v != 1:
        raise ConfigError(f"virtual={v}: schedule {kind!r} has one stage per rank, needs virtual=1")
    if kind in ("1f1b", "zb-h1") or (kind == "interleaved" and v == 1):
        if m < p:
            raise ConfigError(
                f"microbatches={m}: schedule {kind!r} needs microbatches >= stages={p}"
            )
    if kind == "interleaved" and v > 1 and m % p:
        raise ConfigError(
            f"microbatches={m}: schedule 'interleaved' needs a multiple of stages={p} (Megatron)"
        )
    if kind in V_SHAPED and m < 2 * p:
        raise ConfigError(
            f"microbatches={m}: schedule {kind!r} needs microbatches >= 2*stages={2 * p}"
        )
    return v


def placement_for(kind: str, p: int, v: int) -> tuple[int, ...]:
    """Stage -> rank map: V-shaped, interleaved (round robin), or one stage per rank."""
    if kind in V_SHAPED:
        return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
    return tuple(s % p for s in range(p * v))
