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
    12. The executor's sends at the tick's end give exactly that. A cotangent sent after the
    backward and waited for before the forward: tick 0 ends at 1 (rank 0's F, its activation
    sent); in tick 1 rank 1's FB ends at 5.5 and its cotangent's send holds rank 0 there, so
    rank 0's F runs 5.5 → 6.5 after it, not beside it; tick 2 ends at 11 (rank 1's FB), tick 3
    at 13 (rank 0's B)."""
    t = StepTables.make("1f1b", 2, 2, 1, 2)
    back, fwd = phase_costs(t, 1.0, 2.0, 1.0, 1.0, HEAD)
    assert back.T.tolist() == [[0, 0, 2, 2], [0, 4.5, 4.5, 0]]
    assert fwd.T.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]
    assert stats(t.schedule, 1.0, 2.0, 1.0, 1.0, HEAD).lockstep_makespan == pytest.approx(12.0)
    assert coupled_makespan(t, 1.0, 2.0, 1.0, 1.0, HEAD) == pytest.approx(12.0)
    first = coupled_makespan(t, 1.0, 2.0, 1.0, 1.0, HEAD, cotangent_first=True)
    assert first == pytest.approx(13.0)


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
    with (at most the slowest rank of the tick); the cotangent waited for before the forward
    never does better."""
    t = StepTables.make(kind, 4, 8, v, 4 * v)
    lockstep = stats(t.schedule, 1.0, 2.0, head=HEAD).lockstep_makespan
    late = coupled_makespan(t, 1.0, 2.0, head=HEAD)
    first = coupled_makespan(t, 1.0, 2.0, head=HEAD, cotangent_first=True)
    assert late <= lockstep + 1e-9
    assert first >= late - 1e-9
