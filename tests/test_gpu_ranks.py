"""A pipeline's ranks walked side by side by the time model (jaxpar.gpu.ranks): each rank's
branch read from the schedule table the program indexes by ``partition-id``, the ranks held at
their collectives over ``pp`` until their peers arrive.

Hand-written scheduled HLO whose answer is known: two pipeline ranks, two ticks; a rank's tick
runs a dot or nothing, as its row of a constant table says, then the two ranks exchange a
message. Rank 0 works in tick 0, rank 1 in tick 1, so each rank waits one dot for the other:
the step is two dots and two sends, though each rank computes one dot."""

import types

import numpy as np
import pytest

from jaxpar.config import load_mesh
from jaxpar.gpu.ranks import Diverged, Rendezvous, pipeline_partitions, run_ranks
from jaxpar.gpu.timing import simulate

HW = load_mesh("h100-8").hardware
MESH = types.SimpleNamespace(devices=np.zeros((2, 1)), axis_names=("pp", "dp"))
N = 4096
MAT = f"bf16[{N},{N}]"
STATE = f"(s32[], {MAT}, {MAT}, s32[2])"
ASYNC = 'backend_config={"collective_backend_config":{"is_sync":false}}'
DOT_DIMS = "lhs_contracting_dims={1}, rhs_contracting_dims={0}"


def _module(table: str, send_in_branch: bool = False) -> str:
    """The two-tick program; ``table`` the ranks' rows (``{ {1, 0}, {0, 1} }``: rank 0 works
    in tick 0, rank 1 in tick 1). ``send_in_branch``: the send inside the working branch, so
    the ranks do not reach the same sends."""
    send = (f"  %cps = ({MAT}, {MAT}) collective-permute-start(%c), channel_id=1, "
            f"source_target_pairs={{{{0,1}},{{1,0}}}}, {ASYNC}\n"
            f"  %cpd = {MAT}{{1,0}} collective-permute-done(%cps)\n")  # fmt: skip
    work_send = send.replace("%c)", "%d)") if send_in_branch else ""
    work_root = "%cpd" if send_in_branch else "%d"
    return f"""HloModule t, is_scheduled=true, num_partitions=2

%fused_dot (p0: {MAT}, p1: {MAT}) -> {MAT} {{
  %p0 = {MAT}{{1,0}} parameter(0)
  %p1 = {MAT}{{1,0}} parameter(1)
  ROOT %d = {MAT}{{1,0}} dot(%p0, %p1), {DOT_DIMS}
}}

%idle (x: {STATE}) -> {MAT} {{
  %x = {STATE} parameter(0)
  ROOT %y = {MAT}{{1,0}} get-tuple-element(%x), index=1
}}

%work (x: {STATE}) -> {MAT} {{
  %x = {STATE} parameter(0)
  %a = {MAT}{{1,0}} get-tuple-element(%x), index=1
  %b = {MAT}{{1,0}} get-tuple-element(%x), index=2
  %d = {MAT}{{1,0}} fusion(%a, %b), kind=kCustom, calls=%fused_dot
{work_send}  ROOT %r = {MAT}{{1,0}} copy({work_root})
}}

%body (p: {STATE}) -> {STATE} {{
  %p = {STATE} parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %row = s32[2]{{0}} get-tuple-element(%p), index=3
  %b = {MAT}{{1,0}} get-tuple-element(%p), index=2
  %k1 = s32[1]{{0}} dynamic-slice(%row, %i), dynamic_slice_sizes={{1}}
  %k = s32[] reshape(%k1)
  %c = {MAT}{{1,0}} conditional(%k, %p, %p), branch_computations={{%idle, %work}}
{"" if send_in_branch else send}  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  ROOT %t = {STATE} tuple(%i1, {"%c" if send_in_branch else "%cpd"}, %b, %row)
}}

%cond (q: {STATE}) -> pred[] {{
  %q = {STATE} parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %lim = s32[] constant(2)
  ROOT %lt = pred[] compare(%j, %lim), direction=LT
}}

ENTRY %main (a: {MAT}, b: {MAT}) -> {STATE} {{
  %a = {MAT}{{1,0}} parameter(0)
  %b = {MAT}{{1,0}} parameter(1)
  %pid = u32[] partition-id()
  %rank = s32[] convert(%pid)
  %table = s32[2,2]{{1,0}} constant({table})
  %zero = s32[] constant(0)
  %r = s32[1,2]{{1,0}} dynamic-slice(%table, %rank, %zero), dynamic_slice_sizes={{1,2}}
  %row = s32[2]{{0}} reshape(%r)
  %init = {STATE} tuple(%zero, %a, %b, %row)
  ROOT %loop = {STATE} while(%init), condition=%cond, body=%body
}}
"""


def test_each_rank_takes_its_rows_branch_and_waits_for_its_peer():
    st = simulate(_module("{ {1, 0}, {0, 1} }"), MESH, HW)
    dot = st.compute_s  # the rank that ends the step computed one dot
    send = st.comm_s["pp"] / 2  # two sends a rank
    assert st.assumptions == []
    assert [r.partition for r in st.ranks] == [0, 1]
    for r in st.ranks:  # one dot each, read from its own row of the table
        assert r.compute_s == pytest.approx(dot, rel=1e-6)
    # lock-step: each tick lasts as long as its working rank, so the step is two dots and the
    # two sends; each rank waits out the other's dot as exposed pp time (the tolerance: the
    # index kernels every rank runs every tick, nanoseconds)
    assert st.step_s == pytest.approx(2 * dot + 2 * send, rel=1e-6)
    assert st.exposed_s["pp"] == pytest.approx(dot + 2 * send, rel=1e-6)
    assert st.step_s == pytest.approx(st.compute_s + st.exposed_s["total"], rel=1e-12)
    # of the exposed pp, the wait for the other rank is the dot; the rest is the two sends
    assert st.rank_wait_s == pytest.approx(dot, rel=1e-6)
    for r in st.ranks:
        assert r.rank_wait_s == pytest.approx(dot, rel=1e-6)
    # both ranks working in the same tick: no wait, one dot and two sends
    both = simulate(_module("{ {1, 0}, {1, 0} }"), MESH, HW)
    assert both.step_s == pytest.approx(dot + 2 * send, rel=1e-6)
    assert both.rank_wait_s < 1e-3 * dot


def test_ranks_that_do_not_meet_fall_back_to_one_walk():
    """A send only the working rank runs, rank 0 working twice and rank 1 once: the ranks'
    collectives do not pair up, so the model says so and walks one rank with the branches'
    counts averaged."""
    st = simulate(_module("{ {1, 1}, {0, 1} }", send_in_branch=True), MESH, HW)
    assert st.ranks == []
    assert any("not walked side by side" in a for a in st.assumptions), st.assumptions


def test_pipeline_partitions_vary_the_pp_coordinate_only():
    mesh = types.SimpleNamespace(
        devices=np.zeros((4, 2, 1, 1)), axis_names=("pp", "dp", "sp", "tp")
    )
    assert pipeline_partitions(mesh) == [0, 2, 4, 6]
    assert pipeline_partitions(types.SimpleNamespace(devices=np.zeros(8), axis_names=("dp",))) == [
        0
    ]


def test_rendezvous_waits_for_peers_only_and_refuses_mismatches():
    ready = {0: 1.0, 1: 3.0, 2: 10.0}
    peers = {0: [1], 1: [0], 2: None}  # 0 and 1 exchange; 2's collective spans every rank

    def walk(r: int, meet: Rendezvous):
        return meet.meet(r, 1, "cp", ready[r], f"link{r}", peers[r])

    got = run_ranks(walk, [0, 1, 2])
    assert got[0] == (3.0, "link1") and got[1] == (3.0, "link1")  # not held for rank 2
    assert got[2] == (10.0, "link2")

    with pytest.raises(Diverged, match="differs between ranks"):
        run_ranks(lambda r, m: m.meet(r, 1, f"cp{r}", 0.0, None), [0, 1])
    with pytest.raises(Diverged, match="not reached by every rank"):
        run_ranks(lambda r, m: m.meet(r, 1, "cp", 0.0, None) if r == 0 else None, [0, 1])

    # an error in one walk reaches the caller, and the other walk is not left waiting (the
    # call returns)
    def boom(r: int, m: Rendezvous):
        if r == 1:
            raise KeyError("walk failed")
        return m.meet(r, 1, "cp", 0.0, None)

    with pytest.raises(KeyError):
        run_ranks(boom, [0, 1])


def test_compile_output_lists_each_ranks_work_and_waits():
    """``jaxpar compile``'s human table shows each walked rank's compute and exposed time, and
    of that the wait for the other ranks."""
    from jaxpar.gpu.report import estimate_lines

    st = simulate(_module("{ {1, 0}, {0, 1} }"), MESH, HW)
    est = {**st.to_dict(), "planner_step_s": st.step_s, "step_ratio": 1.0}
    lines = estimate_lines(est)
    at = next(i for i, x in enumerate(lines) if x.startswith("pipeline ranks"))
    for k, r in enumerate(st.ranks):
        want = (f"{r.compute_s * 1e3:.3f} + {r.exposed_s['total'] * 1e3:.3f} "
                f"({r.rank_wait_s * 1e3:.3f})")  # fmt: skip
        assert lines[at + 1 + k].split(":")[1].strip() == want
    assert any(x.strip().startswith("of the exposed, waiting for other pipeline ranks")
               for x in lines)  # fmt: skip
