"""The lock-step makespan with the ranks coupled at each tick's sends (jaxpar.pipeline.coupled),
and the last stage's head in the schedule's timing (jaxpar.pipeline.timing.stats)."""

import pytest

from jaxpar.pipeline.coupled import coupled_makespan, phase_costs
from jaxpar.pipeline.step_tables import StepTables
from jaxpar.pipeline.timing import stats

HEAD = (0.5, 1.0)  # the head's forward and backward, in units of a stage's forward


def test_one_f_one_b_on_two_ranks_by_hand():
    """1F1B, p = 2, m = 2, F = 1, B = 2, head (0.5, 1): rank 1 runs FB ticks of
    1 + 2 + 0.5 + 1 = 4.5; each tick lasting as long as its slowest rank, 1 + 4.5 + 4.5 + 2 =
    12. The executor's sends at the tick's end give exactly that: every tick both ranks
    exchange, so each waits for the other."""
    t = StepTables.make("1f1b", 2, 2, 1, 2)
    back, fwd = phase_costs(t, 1.0, 2.0, 1.0, 1.0, HEAD)
    assert back.T.tolist() == [[0, 0, 2, 2], [0, 4.5, 4.5, 0]]
    assert fwd.T.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]
    assert stats(t.schedule, 1.0, 2.0, 1.0, 1.0, HEAD).lockstep_makespan == pytest.approx(12.0)
    assert coupled_makespan(t, 1.0, 2.0, 1.0, 1.0, HEAD) == pytest.approx(12.0)


def test_head_lengthens_the_last_stage_only():
    """The head adds to the last stage's actions: its busy time by m·(head), the others' not."""
    t = StepTables.make("1f1b", 4, 8, 1, 4)
    plain = stats(t.schedule, 1.0, 2.0)
    head = stats(t.schedule, 1.0, 2.0, head=HEAD)
    assert head.busy_per_rank == pytest.approx(plain.busy_per_rank + 8 * sum(HEAD))
    assert head.makespan > plain.makespan and head.lockstep_makespan > plain.lockstep_makespan


@pytest.mark.parametrize(
    "kind,v",
    [
        ("gpipe", 1),
        ("1f1b", 1),
        ("interleaved", 2),
        ("zb-h1", 1),
        ("zbv", 2),
        ("dualpipev", 2),
    ],  # fmt: skip
)
def test_sends_at_the_ticks_end_never_lengthen_a_tick(kind, v):
    """p = 4, m = 8: the sends at the tick's end hold each rank only for the ranks it exchanges
    with, so never longer than the slowest rank of each tick; DualPipeV has ticks where a rank
    exchanges with no one, and there it is shorter."""
    t = StepTables.make(kind, 4, 8, v, 4 * v)
    lockstep = stats(t.schedule, 1.0, 2.0, head=HEAD).lockstep_makespan
    late = coupled_makespan(t, 1.0, 2.0, head=HEAD)
    assert late <= lockstep + 1e-9
    if kind == "dualpipev":
        assert late < lockstep - 0.1
