"""Pipeline schedule tables: validity, slot bookkeeping, bubble theory, errors, CLI, rendering.

Pure Python (no JAX). Costs are F=1, B=2, I=W=1 per full stage, a chunk costs 1/v. The tick
table's slots are checked by :func:`replay_slots`, which runs the table as the executor would.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.errors import ConfigError
from jaxpar.pipeline.render import ascii_table, legend_entries, plot_schedules, schedule_figure
from jaxpar.pipeline.schedules import (
    KINDS,
    Action,
    ScheduleError,
    lockstep,
    make_schedule,
    validate,
)
from jaxpar.pipeline.tables import (
    B_CODE,
    B_FULL,
    B_INPUT,
    B_WEIGHT,
    BUFFERS,
    CHANNEL_OF_SEND,
    F_FB,
    F_RUN,
    SEND_LOCAL,
    SEND_NONE,
    TickTable,
    build_table,
    destination,
    fused_fb,
    send_code,
)
from jaxpar.pipeline.timing import stats
from jaxpar.pipeline.types import Schedule
from jaxpar.planner.search import pipe_choices

PS = (1, 2, 4, 8)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def allowed(kind: str, p: int, v: int) -> list[int]:
    """Micro-batch counts from the required grid that ``kind`` accepts."""
    ms = sorted({p, 2 * p, 4 * p, 8, 16, 32})
    if kind in ("1f1b", "zb-h1"):
        return [m for m in ms if m >= p]
    if kind == "interleaved":
        return [m for m in ms if m % p == 0 and m >= p]
    if kind in ("zbv", "dualpipev"):
        return [m for m in ms if m >= 2 * p]
    return ms


def grid():
    for kind in KINDS:
        vs = (2,) if kind in ("zbv", "dualpipev") else (1, 2) if kind == "interleaved" else (1,)
        for p in PS:
            for v in vs:
                for m in allowed(kind, p, v):
                    yield kind, p, m, v


GRID = list(grid())
LEAN_GRID = [(p, m) for p in PS for m in allowed("1f1b", p, 1)]


def idle_per_rank(kind: str, p: int, m: int) -> float:
    st = stats(make_schedule(kind, p, m))
    return st.makespan - st.busy_per_rank


def stored_peak(sched) -> int:
    """Most stashes any rank keeps between ticks, walking its actions in tick order (the last
    stage's FB keeps none)."""
    fb, peak = fused_fb(sched), 0
    for row in sched.ticks:
        live = 0
        for a in (a for cell in row for a in cell if (a.stage, a.mb) not in fb):
            live += a.kind == "F"
            peak = max(peak, live)
            live -= a.kind == "B" or a.kind == "W"
    return peak


@pytest.mark.parametrize("kind", [*KINDS, "1f1b-lean"])
def test_every_generator_validates_and_its_slots_replay(kind):
    if kind == "1f1b-lean":
        cases = [("1f1b", p, m, 1, "lean") for p, m in LEAN_GRID]
    else:
        cases = [(*c, "fast") for c in GRID if c[0] == kind]
    assert cases
    for kind_, p, m, v, memory in cases:
        sched = make_schedule(kind_, p, m, v, memory)
        validate(sched)  # make_schedule validates too; this documents the check
        table = build_table(sched)
        replay_slots(sched, table)
        st = stats(sched)
        # The stash buffer is the lock-step peak of the ranks that stash (a fused tick's
        # backward runs first and its slot takes the forward's stash; an FB stashes nothing).
        assert table.slots.stash == stored_peak(sched) <= max(st.peak_stashes)
        peak = max(st.peak_stashes)
        assert table.slots.act <= peak and table.slots.grad <= peak
        assert_table_is_the_ticks(sched, table)


def assert_table_is_the_ticks(sched: Schedule, table: TickTable) -> None:
    """The integer table is the tick table: same actions in the same cells."""
    for r, row in enumerate(sched.ticks):
        for t, cell in enumerate(row):
            f_code, b_code = int(table.f_kind[t, r]), int(table.b_kind[t, r])
            forward = [a for a in cell if a.kind == "F"]
            backward = [a for a in cell if a.kind != "F"]
            fb = forward and backward and (forward[0].stage, forward[0].mb) == (
                backward[0].stage, backward[0].mb)  # fmt: skip
            assert f_code == (F_FB if fb else F_RUN if forward else 0)
            assert b_code == (B_CODE[backward[0].kind] if backward and not fb else 0)
            for ph, acts in (("f_", forward), ("b_", [] if fb else backward)):
                for a in acts:
                    stage, mb = getattr(table, ph + "stage"), getattr(table, ph + "mb")
                    assert (stage[t, r], mb[t, r]) == (a.stage, a.mb)
                    assert sched.stages_of(r)[getattr(table, ph + "chunk")[t, r]] == a.stage


class _Replay:
    """The executor's use of a table's slots, tick by tick (see :func:`replay_slots`)."""

    def __init__(self, sched: Schedule, table: TickTable):
        self.sched, self.table, self.p = sched, table, sched.p
        self.size = {b: getattr(table.slots, b) for b in BUFFERS}
        self.bufs = {b: [[None] * self.size[b] for _ in range(sched.p)] for b in BUFFERS}
        self.split = any(a.kind == "I" for row in sched.orders for a in row)

    def at(self, field: str, t: int, r: int) -> int:
        return int(getattr(self.table, field)[t, r])

    def take(self, buf: str, r: int, k: int, want: tuple[int, int], t: int) -> None:
        if not 0 <= k < self.size[buf] or self.bufs[buf][r][k] != want:
            raise ScheduleError(f"tick {t} rank {r}: {buf} slot {k} lacks {want}")
        self.bufs[buf][r][k] = None

    def put(self, buf: str, r: int, k: int, item: tuple[int, int], t: int) -> None:
        if not 0 <= k < self.size[buf] or self.bufs[buf][r][k] is not None:
            raise ScheduleError(f"tick {t} rank {r}: {buf} slot {k} is live or out of range")
        self.bufs[buf][r][k] = item

    def unset(self, t: int, r: int, *fields: str) -> None:
        for f in fields:
            if self.at(f, t, r) != -1:
                raise ScheduleError(f"tick {t} rank {r}: {f} is set for an action without one")

    def send(self, t: int, buf: str, r: int, s_to: int, j: int, field: str, tick: dict) -> None:
        code, dst = self.at(field, t, r), self.sched.placement[s_to]
        if code != send_code(r, dst, self.p) or destination(r, code, self.p) != dst:
            raise ScheduleError(f"tick {t} rank {r}: wrong {field} {code}")
        ch = CHANNEL_OF_SEND[code]
        tick["writes"].append((buf, dst, int(getattr(self.table, "recv_" + buf)[t, dst, ch]),
                               (s_to, j)))  # fmt: skip
        tick["expected"][buf][dst, ch] = 0
        tick["sent"].add((r, field))

    def forward(self, t: int, r: int, tick: dict) -> None:
        fk, last = self.at("f_kind", t, r), self.sched.num_stages - 1
        s, j = self.at("f_stage", t, r), self.at("f_mb", t, r)
        if s > 0:
            self.take("act", r, self.at("f_in", t, r), (s, j), t)
        else:
            self.unset(t, r, "f_in")
        if fk == F_FB:
            self.unset(t, r, "f_stash", "f_taps", "f_cot")
        else:
            bufs = ["stash"] + (["taps"] if self.split else []) + (["cot"] if s == last else [])
            tick["writes"] += [(b, r, self.at("f_" + b, t, r), (s, j)) for b in bufs]
        if s < last:
            self.send(t, "act", r, s + 1, j, "f_send", tick)
        if fk == F_FB and s > 0:
            self.send(t, "grad", r, s - 1, j, "b_send", tick)

    def backward(self, t: int, r: int, tick: dict) -> None:
        bk, last = self.at("b_kind", t, r), self.sched.num_stages - 1
        s, j = self.at("b_stage", t, r), self.at("b_mb", t, r)
        if bk in (B_FULL, B_INPUT):
            if s < last:
                self.take("grad", r, self.at("b_in", t, r), (s, j), t)
            else:
                self.take("cot", r, self.at("b_cot", t, r), (s, j), t)
            self.take("stash", r, self.at("b_stash", t, r), (s, j), t)
            if s > 0:
                self.send(t, "grad", r, s - 1, j, "b_send", tick)
        if bk == B_INPUT:
            tick["writes"].append(("dys", r, self.at("b_dys", t, r), (s, j)))
        if bk == B_WEIGHT:
            self.take("dys", r, self.at("b_dys", t, r), (s, j), t)
        if self.split and bk in (B_FULL, B_WEIGHT):
            self.take("taps", r, self.at("b_taps", t, r), (s, j), t)

    def run(self) -> None:
        for t in range(self.table.num_ticks):
            tick = {"writes": [], "sent": set(),
                    "expected": {b: np.full((self.p, 3), -1) for b in ("act", "grad")}}  # fmt: skip
            for r in range(self.p):
                if self.at("f_kind", t, r):
                    self.forward(t, r, tick)
                if self.at("b_kind", t, r):
                    self.backward(t, r, tick)
                for field in ("f_send", "b_send"):
                    if (r, field) not in tick["sent"] and self.at(field, t, r) != SEND_NONE:
                        raise ScheduleError(f"tick {t} rank {r}: {field} without a message")
            # Messages and stashes are filed after every rank has read: a slot read this tick
            # may be reused at its end.
            for buf, r, k, item in tick["writes"]:
                self.put(buf, r, k, item, t)
            for buf in ("act", "grad"):
                stray = (getattr(self.table, "recv_" + buf)[t] >= 0) & (tick["expected"][buf] < 0)
                if stray.any():
                    raise ScheduleError(f"tick {t}: {buf} receive slot without a message")
        for buf, per_rank in self.bufs.items():
            if any(x is not None for row in per_rank for x in row):
                raise ScheduleError(f"{buf} buffer not empty at the end of the step")


def replay_slots(sched: Schedule, table: TickTable) -> None:
    """Replay ``table`` tick by tick as the executor would; raise on any misuse of a slot:
    a read that does not find the (stage, micro-batch) it expects, a write onto a live slot or
    outside the buffer, a message without a receiving slot or a receive without a message, a
    buffer not empty at the end."""
    _Replay(sched, table).run()


def _steps(orders):
    """One action per step (no fused ticks)."""
    return tuple(tuple((a,) for a in row) for row in orders)


def test_validator_rejects_broken_tables():
    good = make_schedule("1f1b", 4, 8)
    row0 = list(good.orders[0])
    # Backward before its forward on rank 0: the order itself is not causal.
    i_f, i_b = row0.index(Action("F", 0, 5)), row0.index(Action("B", 0, 5))
    swapped = row0[:]
    swapped[i_f], swapped[i_b] = swapped[i_b], swapped[i_f]
    with pytest.raises(ScheduleError):
        lockstep(_steps((tuple(swapped),) + good.orders[1:]), 4)
    # A tick table that runs F1.0 in the same tick as F0.0 (data arrives one tick later).
    ticks = [list(r) for r in good.ticks]
    ticks[1][0], ticks[1][1] = ticks[1][1], ()
    with pytest.raises(ScheduleError, match="needs F0.0"):
        validate(dataclasses.replace(good, ticks=tuple(map(tuple, ticks))))
    # Missing a backward, duplicate action, action on the wrong rank.
    for bad in (
        (good.orders[0][:-1],) + good.orders[1:],
        (good.orders[0] + (Action("F", 0, 0),),) + good.orders[1:],
        (good.orders[0] + (Action("W", 1, 0),),) + good.orders[1:],
    ):
        with pytest.raises(ScheduleError):
            validate(dataclasses.replace(good, steps=_steps(bad)))
    # Mixing B with I/W for one (stage, micro-batch) is refused.
    zb = make_schedule("zb-h1", 2, 2)
    extra = (zb.orders[0] + (Action("B", 0, 0),),) + zb.orders[1:]
    with pytest.raises(ScheduleError, match="stage 0 micro-batch 0"):
        validate(dataclasses.replace(zb, steps=_steps(extra)))


def _reorder_cell(sched, r: int, t: int):
    """``sched`` with rank ``r``'s cell at tick ``t`` run in the other order (steps and
    ticks both)."""
    ticks = [list(row) for row in sched.ticks]
    ticks[r][t] = ticks[r][t][::-1]
    steps = list(sched.steps)
    steps[r] = tuple(c for c in ticks[r] if c)
    return dataclasses.replace(sched, steps=tuple(steps), ticks=tuple(map(tuple, ticks)))


def test_fused_ticks_are_validated_inside_the_tick():
    good = make_schedule("1f1b", 4, 8)
    # Rank 2's fused ticks run B first (a micro-batch other than the forward's) and rank 3's
    # run F first (its own micro-batch: FB).
    t2 = next(t for t, c in enumerate(good.ticks[2]) if len(c) == 2)
    assert [a.kind for a in good.ticks[2][t2]] == ["B", "F"]
    t3 = next(t for t, c in enumerate(good.ticks[3]) if len(c) == 2)
    assert good.ticks[3][t3] == (Action("F", 3, 0), Action("B", 3, 0))
    # The last stage's B3.0 before its own F3.0 in one tick breaks the dependency.
    with pytest.raises(ScheduleError, match="B3.0 at tick 3 needs F3.0 earlier"):
        validate(_reorder_cell(good, 3, t3))
    # F before an unrelated B is causal (the validator accepts both orders) but the executor
    # runs the backward first, so its tables refuse it rather than misstate the stashes.
    forward_first = _reorder_cell(good, 2, t2)
    validate(forward_first)
    assert stats(forward_first).peak_stashes[2] == stats(good).peak_stashes[2] + 1
    with pytest.raises(ScheduleError, match="runs a tick's backward first"):
        build_table(forward_first)
    # Fusing rank 2's B2.0 with the forward before it, in the tick where rank 3 runs B3.0:
    # the cotangent is sent at the end of that tick, so B2.0 cannot use it in the same tick.
    ticks = [list(row) for row in good.ticks]
    t = good.tick_of()[Action("B", 3, 0)]
    b20 = Action("B", 2, 0)
    ticks[2] = [tuple(a for a in c if a != b20) for c in ticks[2]]
    ticks[2][t] = (*ticks[2][t], b20)
    steps = list(good.steps)
    steps[2] = tuple(c for c in ticks[2] if c)
    with pytest.raises(ScheduleError, match="needs B3.0 earlier"):
        validate(dataclasses.replace(good, steps=tuple(steps), ticks=tuple(map(tuple, ticks))))


@pytest.mark.parametrize("kind", ["1f1b", "interleaved"])
def test_fused_lockstep_makespan_is_the_async_one(kind):
    """The issue's figure: within 3% at p = 4, m in {8, 16, 32}, v in {1, 2} (exact here)."""
    for m in (8, 16, 32):
        for v in (1, 2) if kind == "interleaved" else (1,):
            st = stats(make_schedule(kind, 4, m, v))
            assert st.lockstep_makespan == pytest.approx(st.makespan, rel=0.03)
            assert st.lockstep_makespan == pytest.approx(st.makespan, abs=1e-9)
    # Full recompute (B = 3F): interleaved v 2, m 32 at the async 134, not the unfused 193.
    rec = stats(make_schedule("interleaved", 4, 32, 2), b=3.0)
    assert rec.lockstep_makespan == pytest.approx(rec.makespan) == pytest.approx(134.0)


def test_slot_checker_catches_a_corrupted_table():
    for sched in (make_schedule("zbv", 4, 8), make_schedule("interleaved", 4, 8, 2)):
        good = build_table(sched)
        replay_slots(sched, good)
        keys = [k for k in good.arrays() if k.endswith(("_in", "_stash", "_taps", "_dys", "_cot",
                "_send", "recv_act", "recv_grad"))]  # fmt: skip
        for key in keys:
            field = getattr(good, key)
            if not np.any(field > 0):
                continue
            corrupt = field.copy()
            where = tuple(np.argwhere(corrupt > 0)[3])
            corrupt[where] += 1
            with pytest.raises(ScheduleError):
                replay_slots(sched, good.replace(**{key: corrupt}))


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_exact(kind):
    for p in PS:
        for m in allowed(kind, p, 1):
            st = stats(make_schedule(kind, p, m))
            assert st.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


def test_interleaved_bubble_is_exact():
    for p in PS:
        for v in (2, 4):
            for m in allowed("interleaved", p, v):
                st = stats(make_schedule("interleaved", p, m, v))
                assert st.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


def test_zb_h1_idles_one_third_of_1f1b():
    for p in (2, 4, 8):
        for m in allowed("zb-h1", p, 1):
            # ZB-H1 idles (p-1)(F+I-W) = p-1 per rank, 1F1B (p-1)(F+B) = 3(p-1): exactly 1/3.
            assert idle_per_rank("zb-h1", p, m) == pytest.approx(p - 1, abs=1e-12)
            ratio = idle_per_rank("zb-h1", p, m) / idle_per_rank("1f1b", p, m)
            assert ratio == pytest.approx(1 / 3, abs=1e-12)


def test_zbv_has_no_bubble_within_each_rank_span():
    for p in PS:
        for m in allowed("zbv", p, 2):
            st = stats(make_schedule("zbv", p, m))
            assert max(st.span_bubble) == pytest.approx(0.0, abs=1e-12)
            assert st.start_skew == pytest.approx((p - 1) * 0.5)  # (p-1) chunk forwards
            assert st.makespan == pytest.approx(3 * m + (p - 1) * 0.5)
            # 2p half-size chunk stashes: the activation memory of 1F1B's p full stages.
            assert st.peak_inflight == [2 * p] * p


def test_dualpipev_beats_1f1b_and_uses_both_backward_forms():
    for p in (2, 4, 8):
        for m in allowed("dualpipev", p, 2):
            sched = make_schedule("dualpipev", p, m)
            kinds = {a.kind for row in sched.orders for a in row}
            assert kinds == {"F", "B", "I", "W"}
            st = stats(sched)
            assert st.bubble_fraction < stats(make_schedule("1f1b", p, m)).bubble_fraction
            assert max(st.peak_inflight) <= 2 * p + 1


def test_peak_stashes():
    for p in PS:
        for m in allowed("1f1b", p, 1):
            assert stats(make_schedule("gpipe", p, m)).peak_stashes == [m] * p
            # Fused 1F1B: rank r runs F of micro-batch t - r and B of t - 2(p-1) + r at tick t,
            # the B first, so 2(p-1-r) stashes (the last stage's FB holds one within its tick).
            want = [max(min(2 * (p - 1 - r), m), 1) for r in range(p)]
            st = stats(make_schedule("1f1b", p, m))
            assert st.peak_stashes == want and st.peak_inflight == want
            # Lean 1F1B: the classic in-flight cap p - r.
            lean = stats(make_schedule("1f1b", p, m, memory="lean"))
            assert all(k <= p - r for r, k in enumerate(lean.peak_stashes))
            assert lean.peak_stashes[0] == min(p, m) and lean.lockstep_makespan >= st.makespan
            if p <= 2:  # the same table (the planner's search skips lean there)
                assert (
                    make_schedule("1f1b", p, m, memory="lean").ticks
                    == make_schedule("1f1b", p, m).ticks
                )
                assert all(c[2] == "fast" for c in pipe_choices(p))
            # ZB-H1 keeps PipeDream-flush's peak (p, on rank 0); deferring W holds p everywhere.
            assert stats(make_schedule("zb-h1", p, m)).peak_stashes == [p] * p


def test_lockstep_of_unfused_and_split_schedules():
    # DualPipeV's ticks mix single actions of different costs across ranks (its overlapped
    # pairs are not fused: fused they are longer still, see the generator).
    dpv = stats(make_schedule("dualpipev", 4, 16))
    assert dpv.lockstep_makespan > dpv.makespan
    for kind in ("gpipe", "zb-h1", "zbv"):
        st = stats(make_schedule(kind, 4, 16))
        assert st.lockstep_makespan == pytest.approx(st.makespan)


def test_v_placement_and_local_hops():
    sched = make_schedule("zbv", 4, 8)
    assert sched.placement == (0, 1, 2, 3, 3, 2, 1, 0)
    table = build_table(sched)
    tick = sched.tick_of()
    # The turn of the V (stage 3 -> 4 on rank 3) is local; stage 4 -> 5 goes up a rank.
    assert table.f_send[tick[Action("F", 3, 0)], 3] == SEND_LOCAL
    assert table.f_send[tick[Action("F", 4, 0)], 3] == 2
    one = build_table(make_schedule("interleaved", 1, 4, 2))
    sends = np.concatenate([one.f_send.ravel(), one.b_send.ravel()])
    assert set(sends[sends > 0].tolist()) == {SEND_LOCAL}


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("pipedream", 4, 8, None), "schedule='pipedream'"),
        (("1f1b", 4, 3, None), "microbatches=3"),
        (("zb-h1", 4, 3, None), "microbatches=3"),
        (("zbv", 4, 7, None), "microbatches=7"),
        (("dualpipev", 4, 6, None), "microbatches=6"),
        (("interleaved", 4, 6, 2), "microbatches=6"),
        (("zbv", 4, 8, 1), "virtual=1"),
        (("gpipe", 4, 8, 2), "virtual=2"),
        (("gpipe", 0, 8, None), "stages=0"),
        (("gpipe", 2, 0, None), "microbatches=0"),
    ],
)
def test_bad_inputs_raise_one_line_config_errors(args, field):
    with pytest.raises(ConfigError) as err:
        make_schedule(*args)
    msg = str(err.value)
    assert field in msg and "\n" not in msg
    assert any(w in msg for w in ("needs", "must", "unknown"))


def test_action_text_round_trips():
    for a in (Action("F", 3, 5), Action("W", 12, 31)):
        assert Action.parse(str(a)) == a


def test_ascii_table_wraps_to_120_columns_and_keeps_every_cell():
    sched = make_schedule("interleaved", 4, 8, 2)
    text = ascii_table(sched)
    blocks = [b.splitlines() for b in text.split("\n\n")]
    assert len(blocks) > 1  # 26 ticks of 9-character cells do not fit on one line
    for lines in blocks:
        assert len(lines) == 1 + sched.p
        assert len({len(line) for line in lines}) == 1  # aligned within a block
        assert max(len(line) for line in lines) <= 120
    # Every tick appears once, in order, and each rank's cells read back as its tick row.
    ticks = [int(t) for lines in blocks for t in lines[0].split()]
    assert ticks == list(range(sched.num_ticks))
    for r in range(sched.p):
        cells = [c for lines in blocks for c in lines[1 + r].split()[2:]]
        assert cells == ["+".join(map(str, c)) if c else "." for c in sched.ticks[r]]
    assert "F7.7+B7.7" in text  # the last stage's fused tick
    narrow = ascii_table(sched, width=60)
    assert max(len(line) for line in narrow.splitlines()) <= 60


def test_plot_labels_micro_batches_and_chunks_and_only_present_actions():
    import matplotlib.pyplot as plt

    inter = make_schedule("interleaved", 4, 8, 2)
    assert [e[0] for e in legend_entries([inter])] == ["F", "B", "chunk 0", "chunk 1"]
    assert [e[0] for e in legend_entries([make_schedule("zb-h1", 4, 8)])] == ["F", "I", "W"]
    fig = schedule_figure([inter])
    try:
        (legend,) = fig.legends
        assert [t.get_text() for t in legend.get_texts()] == ["F", "B", "chunk 0", "chunk 1"]
        for ax in fig.axes:
            labels = [t.get_text() for t in ax.texts]
            # Every box of this schedule is wide enough for its micro-batch label.
            assert sorted(labels) == sorted(str(a.mb) for row in inter.orders for a in row)
            hatches = {p.get_hatch() for p in ax.patches}
            assert hatches == {"", "///"}  # chunk 0 plain, chunk 1 hatched
    finally:
        plt.close(fig)


def test_cli_json_and_plot(capsys, tmp_path):
    png = tmp_path / "zbv.png"
    argv = ["schedule", "--kind", "zbv", "--stages", "4", "--microbatches", "8"]
    assert main(argv + ["--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["kind"], out["stages"], out["microbatches"], out["virtual"]) == ("zbv", 4, 8, 2)
    assert len(out["ranks"]) == 4 and out["ranks"][3][0] == "F3.0"
    assert sum(len(r) for r in out["ranks"]) == 3 * 2 * 4 * 8  # F, I, W per stage and mb
    assert len(out["peak_inflight"]) == 4 and len(out["peak_stashes"]) == 4
    assert out["fused_ticks"] == 0  # V-shaped: one action per tick
    assert 0 < out["bubble_fraction"] < out["lockstep_bubble_fraction"] + 1e-9
    for key in ("makespan", "lockstep_ticks"):
        assert out[key] > 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert main(["schedule", "--kind", "gpipe", "--stages", "2", "--microbatches", "2"]) == 0
    human = capsys.readouterr().out
    assert "rank 1" in human and "bubble" in human


def test_lean_1f1b_json_and_its_bad_input(capsys, make_cfg):
    from jaxpar import validation as V

    argv = ["schedule", "--kind", "1f1b", "--stages", "4", "--microbatches", "16", "--json"]
    assert main(argv + ["--pipeline-memory", "lean"]) == 0
    lean = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(argv) == 0
    fast = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (lean["pipeline_memory"], fast["pipeline_memory"]) == ("lean", "fast")
    assert lean["peak_stashes"] == [4, 3, 2, 1] and fast["peak_stashes"] == [6, 4, 2, 1]
    # The trade: the same asynchronous makespan, a longer lock step for fewer stashes.
    assert lean["makespan"] == fast["makespan"] == fast["lockstep_makespan"]
    assert lean["lockstep_makespan"] > fast["lockstep_makespan"]
    assert main(argv[:2] + ["gpipe"] + argv[3:] + ["--pipeline-memory", "lean"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pipeline_memory='lean': schedule 'gpipe' has no lean" in err[0]
    for value, schedule, rule in (
        ("slow", "1f1b", "layout.pipeline_memory='slow': must be one of"),
        ("lean", "interleaved", "layout.pipeline_memory='lean': schedule 'interleaved' has no"),
    ):
        cfg = make_cfg(pp=2, dp=4, tp=1, schedule=schedule, microbatches=4,
                       virtual=2 if schedule == "interleaved" else 1)  # fmt: skip
        cfg.layout.pipeline_memory = value
        with pytest.raises(ConfigError, match=rule) as e:
            V.validate(cfg, cfg.layout.n_devices)
        assert "\n" not in str(e.value)


def test_cli_error_exits_2_with_one_line(capsys):
    assert main(["schedule", "--kind", "1f1b", "--stages", "4", "--microbatches", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "microbatches=2" in err[0]


def test_plot_several_schedules(tmp_path):
    out = plot_schedules(
        [make_schedule(k, 4, 8) for k in ("1f1b", "zb-h1", "zbv")], tmp_path / "cmp.png"
    )
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_tick_table_is_frozen_and_typed():
    table = build_table(make_schedule("zb-h1", 4, 8))
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.f_kind = table.b_kind  # type: ignore[misc]
    with pytest.raises(ValueError, match="read-only"):
        table.f_kind[0, 0] = 0
    assert {a.dtype for a in table.arrays().values()} == {np.dtype(np.int32)}
    assert table.recv_act.shape == (table.num_ticks, 4, 3)
    assert (table.slots.taps, table.slots.dys) != (0, 0)  # split backward: I files for W


@pytest.mark.parametrize(("kind", "v"), [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
def test_branch_weights_count_what_the_table_runs(kind, v):
    from jaxpar.pipeline.branches import BranchWeights, branch_scope, parse_branch_scope
    from jaxpar.pipeline.step_tables import StepTables

    tables = StepTables.make(kind, 4, 8, v, n_layers=8 * v)
    w, sched, cells = tables.weights, tables.schedule, tables.table.num_ticks * 4
    fb = fused_fb(sched)
    plain_f = sum(a.kind == "F" and (a.stage, a.mb) not in fb for row in sched.orders for a in row)
    assert w.forward[1] == pytest.approx(plain_f / cells)
    assert sum(w.backward) == pytest.approx(1.0)
    assert w.backward[4] == pytest.approx(len(fb) / cells)  # the FB branch
    assert (w.backward[2] > 0) == (kind == "zb-h1")  # I only where backwards are split
    for route, weights in zip(tables.sends, w.sends, strict=True):
        assert sum(weights) == pytest.approx(1.0) and len(weights) == len(route.pair_sets) + 1
    assert w == BranchWeights.of(tables.table, tables.last_stage, [r.index for r in tables.sends])
    scope = f"jit(step)/shard_map/{branch_scope(w.backward)}/switch"
    assert parse_branch_scope(scope) == pytest.approx(list(w.backward), abs=1e-6)
