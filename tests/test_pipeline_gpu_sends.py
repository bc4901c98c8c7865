"""A pipeline tick's sends come after its compute in the program XLA:GPU compiles, and the time
model walks every rank of it (one compile of pp 4 × dp 2, 1F1B, for an 8-GPU target; the CPU
equivalence of the same executor is tests/test_pipeline.py's schedules).

The executor sends a tick's cotangent and activation after its forward phase
(jaxpar.pipeline.executor): a send holds a rank until its peers reach it, so a send between the
phases would hold each rank's forward until its neighbours' backward phases had ended."""

import re

from test_gpu_compile import _compile, _plugin_or_fail, _report

from jaxpar.analysis.hlo_text import callees, parse_module


def _has(comps, name: str, pred, seen=()) -> bool:
    """Whether computation ``name`` (or one it calls) holds an instruction ``pred`` accepts."""
    for ins in comps.get(name, []):
        if pred(ins):
            return True
        if any(c not in seen and _has(comps, c, pred, (*seen, name)) for c in callees(ins)):
            return True
    return False


def _matmul(ins) -> bool:
    return ins.opcode == "dot" or (ins.opcode == "custom-call" and "gemm" in ins.attrs)


def _send(ins) -> bool:
    return ins.opcode in ("collective-permute", "collective-permute-start")


def test_tick_sends_follow_its_compute_and_every_rank_is_walked(tmp_path):
    _plugin_or_fail()
    hlo = tmp_path / "step.hlo"
    out = _report(_compile(tmp_path, "--mesh", "h100-8", "--global-batch", "16", "--pp", "4",
                           "--dp", "2", "--tp", "1", "--zero", "1", "--microbatches", "8",
                           "--schedule", "1f1b", "--hlo", str(hlo), "--json"))  # fmt: skip
    comps, _ = parse_module(hlo.read_text())
    # The tick loop's body (XLA may double-buffer it: two ticks per trip): its phases are the
    # conditionals that run matmuls, its sends the conditionals over the ticks' pair sets.
    bodies = 0
    for body in comps.values():
        conds = [i for i in body if i.opcode == "conditional"]
        phases = [
            k for k, i in enumerate(conds) if any(_has(comps, c, _matmul) for c in callees(i))
        ]
        sends = [k for k, i in enumerate(conds) if any(_has(comps, c, _send) for c in callees(i))]
        if not phases or not sends:
            continue
        bodies += 1
        assert not any(_send(i) for i in body), "a send outside the ticks' switches"
        assert not set(phases) & set(sends), "a send inside a phase's conditional"
        # each tick's sends after both its phases: blocks of phases, each followed by sends
        order = "".join("p" if k in phases else "s" for k in sorted(phases + sends))
        assert re.fullmatch(r"(pp+s+)+", order), order  # the backward and forward, then sends
    assert bodies >= 1
    # The time model walked each of the 4 pipeline ranks, reading its branches from the table.
    est = out["estimate"]
    assert [r["partition"] for r in est["ranks"]] == [0, 2, 4, 6]
    assert not any("side by side" in a for a in est["assumptions"]), est["assumptions"]
    last = max(est["ranks"], key=lambda r: r["compute_s"])
    assert last["partition"] == 6  # the last stage runs the head and loss
    assert est["step_s"] >= last["compute_s"]
