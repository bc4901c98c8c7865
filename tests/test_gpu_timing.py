"""The time model of a compiled XLA:GPU step (jaxpar.gpu.timing, jaxpar.gpu.costs).

Hand-written scheduled HLO whose answer is known: a dot of 2·n³ FLOPs costs
2n³ / (peak · matmul_efficiency(n)) (an n×n×n matmul has the FLOPs per byte of size n), a
collective what the planner's NCCL model says for its wire bytes, and the simulation must place
them as XLA:GPU's streams would; the critical path is the chain of intervals that set the step's
end (its compute plus its collective seconds are the step). One real compile for an 8-GPU target
checks ``jaxpar compile --json``'s ``estimate`` and the ``--trace`` file; bad ``--trace`` paths
are refused before compiling.
"""

import dataclasses
import json
import types

import numpy as np
import pytest
from conftest import MODEL_YAML
from test_gpu_compile import _compile, _plugin_or_fail, _report

from jaxpar import config as C
from jaxpar.gpu import timing as TM
from jaxpar.gpu.timing import simulate
from jaxpar.gpu.trace import chrome_trace
from jaxpar.planner.collectives import call_time
from jaxpar.planner.hardware import GENERATIONS, matmul_efficiency

HW = C.load_mesh("h100-8").hardware
MESH = types.SimpleNamespace(devices=np.arange(8), axis_names=("dp",))
GROUP = "replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true"
ASYNC = 'backend_config={"collective_backend_config":{"is_sync":false}}'
SYNC = 'backend_config={"collective_backend_config":{"is_sync":true}}'
DOT_DIMS = "lhs_contracting_dims={1}, rhs_contracting_dims={0}"


def _trips(n: int) -> str:
    return 'backend_config={"known_trip_count":{"n":"' + str(n) + '"}}'


def _dot_comp(n: int) -> str:
    return f"""%fused_dot (p0: bf16[{n},{n}], p1: bf16[{n},{n}]) -> bf16[{n},{n}] {{
  %p0 = bf16[{n},{n}]{{1,0}} parameter(0)
  %p1 = bf16[{n},{n}]{{1,0}} parameter(1)
  ROOT %d = bf16[{n},{n}]{{1,0}} dot(%p0, %p1), {DOT_DIMS}
}}
"""


def _t_dot(n: int) -> float:
    """By hand: 2n³ FLOPs at the published H100 SXM ceiling (794.5 of 989 TFLOP/s) or, for a
    small n, at the bytes' pace: n/3 FLOPs per byte at HBM bandwidth (3·2n² bytes)."""
    flops = 2.0 * n**3
    share = min(794.5 / 989, n / 3 * HW.hbm_bw / HW.peak_flops_bf16)
    return max(flops / (HW.peak_flops_bf16 * share), 6.0 * n * n / HW.hbm_bw)


def _t_gather(rows: int, hw=HW, stride: int = 1) -> float:
    """An all-gather of 8 × [rows, 1024] bf16: each device sends 7/8 of the output."""
    return call_time(hw, "all-gather", 7 / 8 * 8 * rows * 1024 * 2, 8, stride).seconds


def _module(n: int, rows: int, config: str, op: str = "all-gather-start") -> str:
    if op == "all-gather-start":
        coll = (f"  %ags = (bf16[{rows},1024]{{1,0}}, bf16[{8 * rows},1024]{{1,0}}) "
                f"all-gather-start(%w), channel_id=1, {GROUP}, {config}\n")  # fmt: skip
        done = f"  %agd = bf16[{8 * rows},1024]{{1,0}} all-gather-done(%ags)\n"
    else:  # a collective without a start/done pair
        coll = (f"  %agd = bf16[{8 * rows},1024]{{1,0}} all-gather(%w), channel_id=1, "
                f"{GROUP}\n")  # fmt: skip
        done = ""
    out = f"(bf16[{n},{n}]{{1,0}}, bf16[{8 * rows},1024]{{1,0}})"
    return f"""HloModule t, is_scheduled=true, num_partitions=8

{_dot_comp(n)}
ENTRY %main (a: bf16[{n},{n}], b: bf16[{n},{n}], w: bf16[{rows},1024]) -> {out} {{
  %a = bf16[{n},{n}]{{1,0}} parameter(0)
  %b = bf16[{n},{n}]{{1,0}} parameter(1)
  %w = bf16[{rows},1024]{{1,0}} parameter(2)
{coll}  %dot = bf16[{n},{n}]{{1,0}} fusion(%a, %b), kind=kCustom, calls=%fused_dot
{done}  ROOT %t = {out} tuple(%dot, %agd)
}}
"""


def _path(st) -> tuple[float, float, dict[str, int]]:
    """The critical path's compute and dp seconds and its instructions' executions, after
    checking that it tiles the step."""
    cp = st.critical_path
    assert cp.compute_s + cp.comm_s["total"] == pytest.approx(st.step_s, rel=1e-12)
    assert set(cp.comm_s) == set(st.exposed_s)  # the same axis keys, "total" included
    assert cp.comm_s["total"] == pytest.approx(sum(v for k, v in cp.comm_s.items()
                                                   if k != "total"), rel=1e-12)  # fmt: skip
    return cp.compute_s, cp.comm_s.get("dp", 0.0), {o.name: o.count for o in cp.top}


@pytest.mark.parametrize("n,rows", [(1024, 128), (8192, 128), (2048, 4096)])
def test_all_gather_window_holds_a_dot(n, rows):
    """Start, dot, done: the dot runs while the gather is in flight; the step waits
    max(0, t_comm − t_dot), booked to the group's axis."""
    st = simulate(_module(n, rows, ASYNC), MESH, HW)
    t_dot, t_comm = _t_dot(n), _t_gather(rows)
    assert st.compute_s == pytest.approx(t_dot, rel=1e-9)
    assert st.exposed_s["dp"] == pytest.approx(max(0.0, t_comm - t_dot), rel=1e-9, abs=1e-15)
    assert st.exposed_s["total"] == st.exposed_s["dp"]
    assert st.step_s == pytest.approx(max(t_dot, t_comm), rel=1e-9)
    assert st.comm_s["dp"] == pytest.approx(t_comm, rel=1e-9)
    assert st.hardware_flops == 2.0 * n**3
    streams = {(e.stream, e.kind) for e in st.events}
    assert ("collective", "all-gather") in streams and ("compute", "matmul") in streams


@pytest.mark.parametrize("n,rows", [(1024, 128), (8192, 128), (2048, 4096)])
def test_critical_path_of_a_window(n, rows):
    """The gather starts with the step and the dot runs under it: when the gather is longer
    it is the critical path, whole (the dot under it is not on it), though only
    t_comm − t_dot of it is exposed; when it is shorter the path is the dot alone — a fully
    hidden collective is not on it."""
    st = simulate(_module(n, rows, ASYNC), MESH, HW)
    t_dot, t_comm = _t_dot(n), _t_gather(rows)
    compute, dp, ops = _path(st)
    if t_comm > t_dot:
        assert (compute, ops) == (0.0, {"ags": 1})
        assert dp == pytest.approx(t_comm, rel=1e-12)
        assert st.exposed_s["dp"] < dp
        top = st.critical_path.top[0]
        assert (top.kind, top.axes, top.seconds) == ("all-gather", "dp", dp)
    else:
        assert (dp, ops) == (0.0, {"dot": 1})
        assert compute == pytest.approx(t_dot, rel=1e-12)
        assert st.critical_path.top[0].kind == "matmul" and st.critical_path.top[0].axes == ""


@pytest.mark.parametrize("op", ["all-gather-start", "all-gather"])
def test_synchronous_collective_is_on_the_critical_path(op):
    """A synchronous gather runs on the compute stream before the dot: both are on the path,
    the gather with its seconds, all of them exposed."""
    st = simulate(_module(8192, 128, SYNC, op), MESH, HW)
    compute, dp, ops = _path(st)
    assert compute == pytest.approx(_t_dot(8192), rel=1e-12)
    assert dp == pytest.approx(_t_gather(128), rel=1e-12)
    assert dp == pytest.approx(st.exposed_s["dp"], rel=1e-12)
    assert ops == {"dot": 1, "ags" if op == "all-gather-start" else "agd": 1}


def test_critical_path_follows_the_collective_stream():
    """Two gathers started back to back share the collective stream: the second starts when
    the first ends. Each is shorter than the dot under them, together they are longer: the
    step is t_a + t_b and its path both gathers end to end (the second's predecessor is the
    first, not the compute stream, which reached its start at once), the dot not on it."""
    n, ra, rb = 4096, 4096, 2048
    text = f"""HloModule t, is_scheduled=true, num_partitions=8

{_dot_comp(n)}
ENTRY %main (a: bf16[{n},{n}], b: bf16[{n},{n}], x: bf16[{ra},1024], y: bf16[{rb},1024]) -> bf16[{n},{n}] {{
  %a = bf16[{n},{n}]{{1,0}} parameter(0)
  %b = bf16[{n},{n}]{{1,0}} parameter(1)
  %x = bf16[{ra},1024]{{1,0}} parameter(2)
  %y = bf16[{rb},1024]{{1,0}} parameter(3)
  %sa = (bf16[{ra},1024]{{1,0}}, bf16[{8 * ra},1024]{{1,0}}) all-gather-start(%x), channel_id=1, {GROUP}, {ASYNC}
  %sb = (bf16[{rb},1024]{{1,0}}, bf16[{8 * rb},1024]{{1,0}}) all-gather-start(%y), channel_id=2, {GROUP}, {ASYNC}
  %dot = bf16[{n},{n}]{{1,0}} fusion(%a, %b), kind=kCustom, calls=%fused_dot
  %da = bf16[{8 * ra},1024]{{1,0}} all-gather-done(%sa)
  %db = bf16[{8 * rb},1024]{{1,0}} all-gather-done(%sb)
  ROOT %t = (bf16[{n},{n}]{{1,0}}, bf16[{8 * ra},1024]{{1,0}}, bf16[{8 * rb},1024]{{1,0}}) tuple(%dot, %da, %db)
}}
"""  # noqa: E501
    st = simulate(text, MESH, HW)
    t_a, t_b = _t_gather(ra), _t_gather(rb)
    assert max(t_a, t_b) < _t_dot(n) < t_a + t_b
    assert st.step_s == pytest.approx(t_a + t_b, rel=1e-12)
    compute, dp, ops = _path(st)
    assert (compute, ops) == (0.0, {"sa": 1, "sb": 1})
    assert dp == pytest.approx(t_a + t_b, rel=1e-12)


@pytest.mark.parametrize("op", ["all-gather-start", "all-gather"])
def test_synchronous_collective_is_fully_exposed(op):
    """A start marked is_sync (or a collective with no start/done pair) runs on the compute
    stream: the dot after it cannot hide any of it."""
    st = simulate(_module(8192, 128, SYNC, op), MESH, HW)
    t_dot, t_comm = _t_dot(8192), _t_gather(128)
    assert st.exposed_s["dp"] == pytest.approx(t_comm, rel=1e-9)
    assert st.step_s == pytest.approx(t_dot + t_comm, rel=1e-9)
    assert {e.stream for e in st.events} == {"compute"}


def test_group_across_nodes_takes_the_nics():
    """The same gather on nodes of 4 GPUs spans 2 nodes: the planner's crossing bandwidth
    (all the node's NICs for a group with 4 members per node) and network hops."""
    hw = dataclasses.replace(HW, devices_per_node=4)
    st = simulate(_module(1024, 4096, ASYNC), MESH, hw)
    assert st.comm_s["dp"] == pytest.approx(_t_gather(4096, hw), rel=1e-9)
    assert st.comm_s["dp"] > 1.1 * _t_gather(4096)  # 4 × 50 GB/s NICs, not 450 GB/s NVLink
    one_nic = dataclasses.replace(hw, nics_per_node=1)
    slow = simulate(_module(1024, 4096, ASYNC), MESH, one_nic)
    assert slow.comm_s["dp"] == pytest.approx(_t_gather(4096, one_nic), rel=1e-9)
    assert slow.comm_s["dp"] > 3 * st.comm_s["dp"]


def _loop_module(n: int, rows: int, trips: int) -> str:
    """A collective the pipeliner split across iterations: started at the end of the body,
    done in the next iteration after its dot (the handle travels in the loop state)."""
    w, ag = f"bf16[{rows},1024]", f"bf16[{8 * rows},1024]"
    mat = f"bf16[{n},{n}]"
    state = f"(s32[], {w}, ({w}, {ag}), {mat}, {mat})"
    start = f"all-gather-start(%w), channel_id=1, {GROUP}, {ASYNC}"
    return f"""HloModule t, is_scheduled=true, num_partitions=8

{_dot_comp(n)}
%body (p: {state}) -> {state} {{
  %p = {state} parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = {w}{{1,0}} get-tuple-element(%p), index=1
  %h = ({w}, {ag}) get-tuple-element(%p), index=2
  %a = {mat}{{1,0}} get-tuple-element(%p), index=3
  %b = {mat}{{1,0}} get-tuple-element(%p), index=4
  %dot = {mat}{{1,0}} fusion(%a, %b), kind=kCustom, calls=%fused_dot
  %agd = {ag}{{1,0}} all-gather-done(%h)
  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  %ags = ({w}, {ag}) {start}
  ROOT %t = {state} tuple(%i1, %w, %ags, %dot, %b)
}}

%cond (q: {state}) -> pred[] {{
  %q = {state} parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %lim = s32[] constant({trips})
  ROOT %lt = pred[] compare(%j, %lim), direction=LT
}}

ENTRY %main (a: {mat}, b: {mat}, w: {w}) -> {ag} {{
  %a = {mat}{{1,0}} parameter(0)
  %b = {mat}{{1,0}} parameter(1)
  %w = {w}{{1,0}} parameter(2)
  %zero = s32[] constant(0)
  %ags0 = ({w}, {ag}) {start}
  %init = {state} tuple(%zero, %w, %ags0, %a, %b)
  %loop = {state} while(%init), condition=%cond, body=%body, {_trips(trips)}
  %last = ({w}, {ag}) get-tuple-element(%loop), index=2
  ROOT %agd = {ag}{{1,0}} all-gather-done(%last)
}}
"""


@pytest.mark.parametrize("n,rows", [(1024, 128), (8192, 128), (2048, 2048)])
def test_pipelined_collective_window_wraps_around_the_loop(n, rows, monkeypatch):
    """Start before the loop and at the end of each iteration, done in the next one after its
    dot: each done in the loop waits max(0, t_comm − t_dot) (the window wraps around the
    body's end and holds the next iteration's dot), the done after the loop the whole
    transfer: exposed = trips·max(0, t_comm − t_dot) + t_comm. Iterations after the steady
    state is reached are added, not walked: the same figures as walking all of them."""
    trips = 10
    st = simulate(_loop_module(n, rows, trips), MESH, HW)
    t_dot, t_comm = _t_dot(n), _t_gather(rows)
    want = trips * max(0.0, t_comm - t_dot) + t_comm
    assert st.exposed_s["dp"] == pytest.approx(want, rel=1e-6)
    assert st.compute_s == pytest.approx(trips * t_dot, rel=1e-6, abs=1e-10)  # adds ~4e-12 s
    assert st.step_s == pytest.approx(st.compute_s + st.exposed_s["total"], rel=1e-12)
    assert st.comm_s["dp"] == pytest.approx((trips + 1) * t_comm, rel=1e-9)
    assert sum(e.kind == "all-gather" for e in st.events) == trips + 1
    assert [e.loop for e in st.events if e.name == "dot"] == [f"loop[{i}]" for i in range(trips)]
    monkeypatch.setattr(TM._Sim, "reaches_conditional", lambda self, c: True)  # walk all
    walked = simulate(_loop_module(n, rows, trips), MESH, HW)
    assert walked.step_s == pytest.approx(st.step_s, rel=1e-9)
    assert walked.exposed_s["dp"] == pytest.approx(st.exposed_s["dp"], rel=1e-9)


@pytest.mark.parametrize("n,rows", [(1024, 128), (8192, 128), (2048, 2048)])
def test_critical_path_through_a_pipelined_loop(n, rows, monkeypatch):
    """The loop above, 10 trips. A gather longer than the dot: each done waits for the gather
    the previous iteration started, and the next starts after the counter's add (~4e-12 s):
    the path is the 11 gathers end to end and the adds, the dots not on it. A shorter one: the
    10 dots and adds, then the last gather, which the done after the loop waits for. The
    iterations added without walking add their stretch of the path: the same path as walking
    all of them."""
    trips = 10
    st = simulate(_loop_module(n, rows, trips), MESH, HW)
    t_dot, t_comm = _t_dot(n), _t_gather(rows)
    compute, dp, ops = _path(st)
    if t_comm > t_dot:
        assert ops == {"ags0": 1, "i1": trips, "ags": trips}
        assert compute == pytest.approx(0.0, abs=1e-10)
        assert dp == pytest.approx((trips + 1) * t_comm, rel=1e-9)
    else:
        assert ops == {"dot": trips, "i1": trips, "ags": 1}
        assert compute == pytest.approx(trips * t_dot, rel=1e-9, abs=1e-10)  # the adds
        assert dp == pytest.approx(t_comm, rel=1e-12)
    monkeypatch.setattr(TM._Sim, "reaches_conditional", lambda self, c: True)  # walk all
    walked = simulate(_loop_module(n, rows, trips), MESH, HW)
    assert _path(walked)[2] == ops
    assert walked.critical_path.compute_s == pytest.approx(compute, rel=1e-9, abs=1e-15)
    assert walked.critical_path.comm_s["dp"] == pytest.approx(dp, rel=1e-9)


def test_pipeline_branches_run_as_often_as_the_table_says():
    """A conditional annotated with branch shares [0.25, 0.75] inside a 4-trip loop, its
    predicate not known to the walk (a float compare): the dot branch runs 3 times, the empty
    one once."""
    n, mat = 2048, "bf16[2048,2048]"
    state = f"(s32[], {mat}, {mat})"
    scope = 'metadata={op_name="jit(f)/while/body/jaxpar_branches[0.25,0.75]/cond"}'
    branches = "true_computation=%work, false_computation=%idle"
    text = f"""HloModule t, is_scheduled=true, num_partitions=8

{_dot_comp(n)}
%idle (x: {state}) -> {mat} {{
  %x = {state} parameter(0)
  ROOT %y = {mat}{{1,0}} get-tuple-element(%x), index=1
}}

%work (x: {state}) -> {mat} {{
  %x = {state} parameter(0)
  %a = {mat}{{1,0}} get-tuple-element(%x), index=1
  %b = {mat}{{1,0}} get-tuple-element(%x), index=2
  ROOT %d = {mat}{{1,0}} fusion(%a, %b), kind=kCustom, calls=%fused_dot
}}

%body (p: {state}) -> {state} {{
  %p = {state} parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %b = {mat}{{1,0}} get-tuple-element(%p), index=2
  %f = f32[] constant(1)
  %pred = pred[] compare(%f, %f), direction=EQ
  %c = {mat}{{1,0}} conditional(%pred, %p, %p), {branches}, {scope}
  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  ROOT %t = {state} tuple(%i1, %c, %b)
}}

%cond (q: {state}) -> pred[] {{
  %q = {state} parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %lim = s32[] constant(4)
  ROOT %lt = pred[] compare(%j, %lim), direction=LT
}}

ENTRY %main (a: {mat}, b: {mat}) -> {state} {{
  %a = {mat}{{1,0}} parameter(0)
  %b = {mat}{{1,0}} parameter(1)
  %zero = s32[] constant(0)
  %init = {state} tuple(%zero, %a, %b)
  ROOT %loop = {state} while(%init), condition=%cond, body=%body, {_trips(4)}
}}
"""
    st = simulate(text, MESH, HW)
    assert st.hardware_flops == 3 * 2.0 * n**3
    assert st.compute_s == pytest.approx(3 * _t_dot(n), rel=1e-6)
    assert st.assumptions == []
    # the dot branch three times, the counter and the predicate four
    assert _path(st)[2] == {"d": 3, "i1": 4, "pred": 4}
    unannotated = simulate(text.replace(scope, ""), MESH, HW)  # the slowest branch, each time
    assert unannotated.hardware_flops == 4 * 2.0 * n**3
    assert "no branch counts" in unannotated.assumptions[0]


def test_done_without_a_traced_start_is_said():
    """A done whose start the walk cannot trace (here: a parameter) adds no wait, and the
    estimate says so instead of passing it over."""
    text = _module(1024, 128, ASYNC).replace("all-gather-done(%ags)", "all-gather-done(%w)")
    st = simulate(text, MESH, HW)
    assert st.assumptions == [
        "1 collective done(s) whose start was not traced (e.g. agd): no wait counted for them"
    ]
    assert st.step_s == pytest.approx(_t_gather(128), rel=1e-9)  # the gather still ends in it
    assert _path(st) == (0.0, pytest.approx(_t_gather(128), rel=1e-12), {"ags": 1})  # it ends it


def test_missing_hardware_field_is_named():
    hw = dataclasses.replace(HW, hbm_bw=0.0)
    with pytest.raises(ValueError, match=r"hardware.hbm_bw: the time model needs it"):
        simulate(_module(1024, 128, ASYNC), MESH, hw)


def test_chrome_trace_tracks():
    st = simulate(_module(1024, 128, ASYNC), MESH, HW)
    tr = chrome_trace(st)
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"]: e["tid"] for e in tr["traceEvents"] if e["name"] == "thread_name"}
    assert {e["tid"] for e in xs} == {names["compute"], names["collective"]}
    wait = next(e for e in xs if e["args"]["kind"] == "wait")
    assert wait["dur"] == pytest.approx(st.exposed_s["dp"] * 1e6)


# ------------------------------------------------------------------------------------------------
# jaxpar compile --trace / --json estimate


@pytest.mark.parametrize("name,why", [
    ("exists.json", "file exists"),
    ("nodir/step.json", "directory .* does not exist"),
    ("step.txt", "must end in .json"),
    ("afile/step.json", "directory .* does not exist"),
])  # fmt: skip
def test_bad_trace_path_refused_before_compiling(tmp_path, name, why, capsys, monkeypatch):
    """In process, the step's build failing the test: refused in one line, exit 2, before
    anything is built (a real process's stderr: test_gpu_compile's refusal tests)."""
    (tmp_path / "exists.json").write_text("{}")
    (tmp_path / "afile").write_text("")
    _refused(tmp_path, "--trace", name, why, capsys, monkeypatch)


def _refused(tmp_path, flag, name, why, capsys, monkeypatch):
    from jaxpar.cli import main
    from jaxpar.commands import compile as compile_cmd

    monkeypatch.setattr(compile_cmd, "build_config", lambda args: pytest.fail("it compiled"))
    model = tmp_path / "model.yaml"
    model.write_text(MODEL_YAML)
    argv = ["compile", "--model", str(model), "--global-batch", "8", "--seq-len", "64",
            "--mesh", "h100-8", flag, str(tmp_path / name)]  # fmt: skip
    assert main(argv) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert out.out == "" and len(lines) == 1 and flag in lines[0], lines
    assert __import__("re").search(why, lines[0]), lines[0]


def test_compile_estimate_and_trace(tmp_path):
    """dp 2 × tp 2 × pp 2 on an 8-GPU H100 target: the estimate's keys, its identities, and a
    Chrome trace with events on the compute and a communication track."""
    _plugin_or_fail()
    trace, png = tmp_path / "step.json", tmp_path / "step.png"
    out = _report(_compile(tmp_path, "--mesh", "h100-8", "--pp", "2", "--dp", "2", "--tp", "2",
                           "--zero", "1", "--microbatches", "4", "--trace", str(trace),
                           "--timeline", str(png), "--json"))  # fmt: skip
    est = out["estimate"]
    for key in ("step_s", "compute_s", "exposed_s", "tflops_per_device", "mfu",
                "planner_step_s", "step_ratio"):  # fmt: skip
        assert key in est, key
    assert est["step_s"] > 0 and est["compute_s"] > 0 and est["planner_step_s"] > 0
    assert set(est["exposed_s"]) >= {"tp", "total"}
    assert est["step_s"] == pytest.approx(est["compute_s"] + est["exposed_s"]["total"], rel=1e-9)
    cp = est["critical_path"]
    assert cp["compute_s"] + cp["comm_s"]["total"] == pytest.approx(est["step_s"], rel=1e-9)
    assert set(cp["comm_s"]) == set(est["exposed_s"]) and 0 < len(cp["top"]) <= TM.TOP_PATH
    # (no bound on the path's pp seconds here: a rank's waits for the others are exposed on it,
    # while the path runs through the rank that arrived last, critical.py)
    assert est["step_ratio"] == pytest.approx(est["planner_step_s"] / est["step_s"])
    assert 0 < est["mfu"] < 1
    assert est["tflops_per_device"] == pytest.approx(est["mfu"] * HW.peak_flops_bf16 / 1e12)
    tr = json.loads(trace.read_text())
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert all(isinstance(e["ts"], float | int) and e["dur"] >= 0 for e in xs)
    tids = {e["args"]["name"]: e["tid"] for e in tr["traceEvents"] if e["name"] == "thread_name"}
    used = {e["tid"] for e in xs}
    assert tids["compute"] in used and (tids["collective"] in used or tids["p2p"] in used)
    assert any(e["args"].get("phase") == "backward" for e in xs)
    assert out["trace"] == {"file": str(trace), "events": len(xs)}
    kernels = ("matmul", "attention", "memory")  # the rest of the compute stream is exposed
    exposed = sum(e["tid"] == tids["compute"] and e["args"]["kind"] not in kernels for e in xs)
    assert out["timeline"] == {"file": str(png), "intervals": len(xs) + exposed}
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("mesh,ceiling", [("a100-8", 271.2 / 312), ("h100-8", 794.5 / 989),
                                          ("h200-8", 794.5 / 989)])  # fmt: skip
def test_matmul_ceiling_is_the_published_measurement(mesh, ceiling):
    """Large matmuls run at the measured ceiling (not the planner's fitted one), small ones at
    their bytes' pace; attention at flash attention's published share; a GPU without a
    measurement keeps the mesh file's curve."""
    from jaxpar.gpu.costs import attention_share, matmul_share

    hw = C.load_mesh(mesh).hardware
    assert matmul_share(hw, 16384) == pytest.approx(ceiling)
    fitted = {g.name: g.matmul_share_max for g in GENERATIONS}[mesh[:4].replace("h200", "h100")]
    assert matmul_share(hw, 16384) != pytest.approx(fitted, abs=0.01)
    assert matmul_share(hw, 64) == pytest.approx(64 / 3 * hw.hbm_bw / hw.peak_flops_bf16)
    assert attention_share(hw, 8192) == pytest.approx(0.73 if mesh == "a100-8" else 0.75)
    other = dataclasses.replace(hw, gpu="mi300x")
    assert matmul_share(other, 4096) == matmul_efficiency(other, 4096)


# ------------------------------------------------------------------------------------------------
# jaxpar compile --timeline


def test_timeline_marks_the_exposed_wait(tmp_path):
    """The Gantt chart of a step whose all-gather outlasts its dot: a PNG, every simulated
    interval drawn, the exposed row exactly the compute stream's wait, under its axis."""
    from jaxpar.gpu.timeline import draw_timeline, spans

    st = simulate(_module(1024, 4096, ASYNC), MESH, HW)
    assert st.exposed_s["dp"] > 0
    rows = spans(st)
    assert list(rows["exposed"]) == ["dp"]
    waits = rows["exposed"]["dp"]
    assert len(waits) == 1
    assert waits[0][1] == pytest.approx(st.exposed_s["dp"] * 1e3)
    assert rows["compute"]["wait"] == waits and "dp" not in rows["compute"]
    assert list(rows["collective"]) == ["dp"] and rows["phase"] == {}  # no op names here
    path = tmp_path / "step.png"
    drawn = draw_timeline(path, st, "t")
    assert drawn == len(st.events) + 1  # the wait twice: on the compute row and its own
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_marks_synchronous_collectives_exposed(tmp_path):
    """A synchronous gather runs on the compute stream: drawn there and on the exposed row,
    whose bars per axis add up to the step's exposed seconds."""
    from jaxpar.gpu.timeline import draw_timeline, spans

    st = simulate(_module(8192, 128, SYNC), MESH, HW)
    rows = spans(st)
    assert rows["exposed"]["dp"] == rows["compute"]["dp"]
    assert sum(d for _, d in rows["exposed"]["dp"]) == pytest.approx(st.exposed_s["dp"] * 1e3)
    assert rows["collective"] == {} and "wait" not in rows["compute"]
    assert draw_timeline(tmp_path / "step.png", st) == len(st.events) + 1


def test_timeline_phase_row():
    """The phase row: forward/backward from the op names, a wait in the phase of the kernel
    before it, adjacent stretches of one phase merged."""
    from jaxpar.gpu.timeline import spans

    def ev(start, kind, op="", axes=()):
        return TM.Event("e", "compute", start * 1e-3, 1e-3, kind, axes, op_name=op)

    fwd, bwd = "jit(f)/jvp(g)/dot_general", "jit(f)/transpose(jvp(g))/dot_general"
    st = TM.StepTime(5e-3, 3e-3, {"dp": 2e-3, "total": 2e-3}, {}, 0.0, events=[
        ev(0, "matmul", fwd), ev(1, "wait", axes=("dp",)), ev(2, "matmul", fwd),
        ev(3, "matmul", bwd), ev(4, "all-gather", bwd, ("dp",))])  # fmt: skip
    rows = spans(st)
    assert rows["phase"] == {"forward": [(0.0, 3.0)], "backward": [(3.0, 2.0)]}
    assert rows["exposed"] == {"dp": [(1.0, 1.0), (4.0, 1.0)]}


@pytest.mark.parametrize("name,why", [
    ("exists.png", "file exists"),
    ("nodir/step.png", "directory .* does not exist"),
    ("step.json", "must end in .png"),
])  # fmt: skip
def test_bad_timeline_path_refused_before_compiling(tmp_path, name, why, capsys, monkeypatch):
    (tmp_path / "exists.png").write_bytes(b"")
    _refused(tmp_path, "--timeline", name, why, capsys, monkeypatch)


# ------------------------------------------------------------------------------------------------
# XLA's latency-hiding-scheduler statistics beside the model (jaxpar.gpu.lhs)

_P = "I1206 11:36:45.048147    5137 "
LHS_LOG = "\n".join(_P + line for line in [
    "latency_hiding_scheduler.cc:4268] [latency-hiding-scheduler] Statistics before scheduling:",
    "latency_hiding_scheduler.cc:4271] For computation: main.1, module jit_f",
    "latency_hiding_scheduler.cc:4271] Total wasted cycles: 10",
    "latency_hiding_scheduler.cc:4271] Total cycles: 20",
    "latency_hiding_scheduler.cc:4337] [latency-hiding-scheduler] Statistics after scheduling:",
    "latency_hiding_scheduler.cc:4341] For computation: main.1, module jit_f",
    "latency_hiding_scheduler.cc:4341] Total wasted cycles: 4",
    "latency_hiding_scheduler.cc:4341] Wasted cycles for all-reduce: 0",
    "latency_hiding_scheduler.cc:4341] Wasted cycles for all-gather: 4",
    "latency_hiding_scheduler.cc:4341] Total cycles: 15.5",
    "latency_hiding_scheduler.cc:4341] Memory pressure peak (bytes): 123",
    "latency_hiding_scheduler.cc:4341] For computation: body.2, module jit_f",
    "latency_hiding_scheduler.cc:4341] Total wasted cycles: 0",
    "latency_hiding_scheduler.cc:4341] Total cycles: 7",
    "sol_latency_estimator.cc:488] NodeCost: Matmul cost from matmul_interpolator for dot: 12.5 us",
    "sol_latency_estimator.cc:467] GetLatencyBetween: Computed collective time for ags: 40 us",
    "sol_latency_estimator.cc:467] GetLatencyBetween: Computed collective time for ags: 41 us",
])  # fmt: skip


def test_lhs_statistics_and_costs_beside_the_model():
    """The scheduler's blocks are read per computation and phase; the estimator's per
    instruction costs (first figure kept) are set beside jaxpar's cost of the same
    instructions of a hand-written module; the estimator's options come from the mesh."""
    from jaxpar.gpu import lhs

    stats = lhs.parse_stats(LHS_LOG)
    assert [(s.computation, s.phase) for s in stats] == [
        ("main.1", "before"), ("main.1", "after"), ("body.2", "after")]  # fmt: skip
    main = stats[1]
    assert (main.total, main.wasted, main.memory_peak) == (15.5, 4.0, 123)
    assert main.wasted_by_kind == {"all-gather": 4.0} and stats[2].total == 7.0
    xla = lhs.parse_costs(LHS_LOG)
    assert xla == {"matmul": {"dot": 12.5}, "fusion": {}, "collective": {"ags": 40.0}}
    got = lhs.instruction_costs(_module(1024, 128, ASYNC), MESH, HW, xla)
    assert got["matmul"]["count"] == 1 and got["collective"]["count"] == 1
    assert got["matmul"]["jaxpar_us"] == pytest.approx(_t_dot(1024) * 1e6)
    assert got["collective"]["jaxpar_us"] == pytest.approx(_t_gather(128) * 1e6)
    assert got["collective"]["ratio_xla_over_jaxpar"] == pytest.approx(40 / (_t_gather(128) * 1e6))
    flags = " ".join(lhs.sol_flags(HW))
    assert "nic_speed_gbps=50," in flags and "gpus_per_node=8," in flags


def test_lhs_computations_walked_once_loops_apart():
    """A loop body is walked once (its handle from the previous iteration unknown: no wait);
    the entry's figures without its loop are what is left outside it: here the done after the
    loop, which waits the whole last all-gather."""
    from jaxpar.gpu import lhs

    text = _loop_module(1024, 128, 10)
    got = lhs.computation_times(text, MESH, HW, ["body", "main", "absent"])
    assert set(got) == {"body", "main"}
    body, main = got["body"], got["main"]
    assert body["step_s"] == pytest.approx(_t_dot(1024), rel=1e-6, abs=1e-10)
    assert body["exposed_s"] == 0.0 and body["loops_s"] == 0.0
    assert main["loops_s"] == pytest.approx(simulate(text, MESH, HW).step_s - _t_gather(128))
    assert main["flat_exposed_s"] == pytest.approx(_t_gather(128), rel=1e-9)
    assert main["flat_compute_s"] == pytest.approx(0.0, abs=1e-10)


# ------------------------------------------------------------------------------------------------
# In-place updates, trip counts read from the loop state


def _update_module(read_at: str) -> str:
    """One loop fusion adding a [1,8,64,128] f32 block into row p2 of a [64,8,64,128] buffer
    (``buf.at[i].add(x)``, XLA's scatter-add in a blockwise attention's backward), reading the
    row at ``read_at``."""
    big, row = "f32[64,8,64,128]", "f32[1,8,64,128]"
    ds = f"dynamic-slice(%p0, {read_at}, %zero, %zero, %zero), dynamic_slice_sizes={{1,8,64,128}}"
    return f"""HloModule t, is_scheduled=true, num_partitions=8

%fused_add (p0: {big}, p1: {row}, p2: s32[]) -> {big} {{
  %p0 = {big}{{3,2,1,0}} parameter(0)
  %p1 = {row}{{3,2,1,0}} parameter(1)
  %p2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %one = s32[] constant(1)
  %next = s32[] add(%p2, %one)
  %ds = {row}{{3,2,1,0}} {ds}
  %sum = {row}{{3,2,1,0}} add(%ds, %p1)
  ROOT %dus = {big}{{3,2,1,0}} dynamic-update-slice(%p0, %sum, %p2, %zero, %zero, %zero)
}}

ENTRY %main (b: {big}, x: {row}, i: s32[]) -> {big} {{
  %b = {big}{{3,2,1,0}} parameter(0)
  %x = {row}{{3,2,1,0}} parameter(1)
  %i = s32[] parameter(2)
  ROOT %f = {big}{{3,2,1,0}} fusion(%b, %x, %i), kind=kLoop, calls=%fused_add
}}
"""


def test_update_in_place_moves_the_block_not_the_buffer():
    """XLA:GPU updates the buffer in place when the fusion reads it only at the slice it writes
    (``CanEmitFusedDynamicUpdateSliceInPlaceForGpu``): the row read, the addend read, the row
    written, 3 × 256 KiB, not the 16 MiB buffer. Read at another row, the update cannot be in
    place: the whole buffer is read and written. (Plus the 4-byte index.)"""
    row, big = 8 * 64 * 128 * 4, 64 * 8 * 64 * 128 * 4
    st = simulate(_update_module("%p2"), MESH, HW)
    assert st.compute_s == pytest.approx((3 * row + 4) / HW.hbm_bw, rel=1e-12)
    other = simulate(_update_module("%next"), MESH, HW)
    assert other.compute_s == pytest.approx((2 * big + row + 4) / HW.hbm_bw, rel=1e-12)


def _table_loops_module(n: int, rows: int) -> str:
    """A loop fills a table of bounds (``table[i] = i + 1``, a residual JAX keeps for a loop
    whose bound depends on an outer counter); a second loop runs, at its ``i``-th trip, an inner
    loop of ``table[i]`` dot trips, with the bound carried in the inner loop's state (no
    constant for the trip count to be read from)."""
    mat, tab = f"bf16[{n},{n}]", f"s32[{rows}]"
    fill = f"(s32[], {tab})"
    inner = f"(s32[], s32[], {mat}, {mat})"
    outer = f"(s32[], {tab}, {mat}, {mat})"
    return f"""HloModule t, is_scheduled=true, num_partitions=8

{_dot_comp(n)}
%fill_body (p: {fill}) -> {fill} {{
  %p = {fill} parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %t = {tab}{{0}} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  %v = s32[1]{{0}} bitcast(%i1)
  %t1 = {tab}{{0}} dynamic-update-slice(%t, %v, %i)
  ROOT %r = {fill} tuple(%i1, %t1)
}}

%fill_cond (p: {fill}) -> pred[] {{
  %p = {fill} parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %lim = s32[] constant({rows})
  ROOT %lt = pred[] compare(%i, %lim), direction=LT
}}

%inner_body (q: {inner}) -> {inner} {{
  %q = {inner} parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %lim = s32[] get-tuple-element(%q), index=1
  %a = {mat}{{1,0}} get-tuple-element(%q), index=2
  %b = {mat}{{1,0}} get-tuple-element(%q), index=3
  %dot = {mat}{{1,0}} fusion(%a, %b), kind=kCustom, calls=%fused_dot
  %one = s32[] constant(1)
  %j1 = s32[] add(%j, %one)
  ROOT %r = {inner} tuple(%j1, %lim, %dot, %b)
}}

%inner_cond (q: {inner}) -> pred[] {{
  %q = {inner} parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %lim = s32[] get-tuple-element(%q), index=1
  ROOT %lt = pred[] compare(%j, %lim), direction=LT
}}

%outer_body (p: {outer}) -> {outer} {{
  %p = {outer} parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %t = {tab}{{0}} get-tuple-element(%p), index=1
  %a = {mat}{{1,0}} get-tuple-element(%p), index=2
  %b = {mat}{{1,0}} get-tuple-element(%p), index=3
  %at = s32[1]{{0}} dynamic-slice(%t, %i), dynamic_slice_sizes={{1}}
  %lim = s32[] bitcast(%at)
  %zero = s32[] constant(0)
  %init = {inner} tuple(%zero, %lim, %a, %b)
  %w = {inner} while(%init), condition=%inner_cond, body=%inner_body
  %d = {mat}{{1,0}} get-tuple-element(%w), index=2
  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  ROOT %r = {outer} tuple(%i1, %t, %d, %b)
}}

%outer_cond (p: {outer}) -> pred[] {{
  %p = {outer} parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %lim = s32[] constant({rows})
  ROOT %lt = pred[] compare(%i, %lim), direction=LT
}}

ENTRY %main (a: {mat}, b: {mat}) -> {outer} {{
  %a = {mat}{{1,0}} parameter(0)
  %b = {mat}{{1,0}} parameter(1)
  %zero = s32[] constant(0)
  %empty = {tab}{{0}} broadcast(%zero), dimensions={{}}
  %f0 = {fill} tuple(%zero, %empty)
  %filled = {fill} while(%f0), condition=%fill_cond, body=%fill_body, {_trips(rows)}
  %t = {tab}{{0}} get-tuple-element(%filled), index=1
  %o0 = {outer} tuple(%zero, %t, %a, %b)
  ROOT %loop = {outer} while(%o0), condition=%outer_cond, body=%outer_body, {_trips(rows)}
}}
"""


@pytest.mark.parametrize("rows", [4, 9])
def test_trip_count_read_from_a_table_in_the_loop_state(rows, monkeypatch):
    """The inner loop's trips are read by running its condition on the values its state
    starts with: 1 + 2 + … + rows dots, nothing assumed. The table is filled by a loop whose
    iterations after the second are added without walking them: what they write is computed
    all the same (otherwise the later bounds would read 0). Walking every iteration gives the
    same step."""
    n = 1024
    st = simulate(_table_loops_module(n, rows), MESH, HW)
    dots = rows * (rows + 1) // 2
    assert st.assumptions == []
    assert st.hardware_flops == dots * 2.0 * n**3
    assert st.compute_s == pytest.approx(dots * _t_dot(n), abs=1e-9)  # and the counters
    assert _path(st)[2]["dot"] == dots
    monkeypatch.setattr(TM._Sim, "reaches_conditional", lambda self, c: True)  # walk all
    walked = simulate(_table_loops_module(n, rows), MESH, HW)
    assert walked.step_s == pytest.approx(st.step_s, rel=1e-12)
    assert walked.hardware_flops == st.hardware_flops
