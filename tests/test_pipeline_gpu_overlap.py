"""A pipeline tick's cotangent send is in flight during that tick's forward in the program
XLA:GPU compiles (issue 47, item 3): the send starts after the tick's backward and completes
after its forward, outside every conditional (one compile of pp 4 × dp 2, 1F1B, for an 8-GPU
target; the CPU equivalence of the same executor is tests/test_pipeline.py's schedules)."""

from test_gpu_compile import _compile, _plugin_or_fail, _report

from jaxpar.analysis.hlo_text import callees, parse_module


def _computes(comps, name: str, seen=()) -> bool:
    """Whether computation ``name`` (or one it calls) runs a matmul: a dot, or a cuBLAS gemm."""
    for ins in comps.get(name, []):
        if ins.opcode == "dot" or (ins.opcode == "custom-call" and "gemm" in ins.attrs):
            return True
        if any(c not in seen and _computes(comps, c, (*seen, name)) for c in callees(ins)):
            return True
    return False


def test_cotangent_send_window_holds_the_ticks_forward(tmp_path):
    _plugin_or_fail()
    hlo = tmp_path / "step.hlo"
    out = _report(_compile(tmp_path, "--mesh", "h100-8", "--global-batch", "16", "--pp", "4",
                           "--dp", "2", "--tp", "1", "--zero", "1", "--microbatches", "8",
                           "--schedule", "1f1b", "--hlo", str(hlo), "--json"))  # fmt: skip
    comps, _ = parse_module(hlo.read_text())
    # The tick loop's body holds the cotangent's collective-permutes at its top level (XLA may
    # double-buffer the loop: two ticks per trip, one send each); the activation's sit in the
    # switch over the tick's pair sets.
    windows = []
    for body in comps.values():
        for i, ins in enumerate(body):
            if ins.opcode != "collective-permute-start":
                continue
            done = next(j for j in range(i + 1, len(body)) if ins.name in body[j].operands)
            windows.append(body[i + 1 : done])
    top = [w for w in windows if any(x.opcode == "conditional" for x in w)]
    assert top, "no pipeline send has a conditional (a phase of the tick) in flight beside it"
    for w in top:
        # the tick's forward: a conditional whose branches run the stage's matmuls
        assert any(x.opcode == "conditional" and any(_computes(comps, c) for c in callees(x))
                   for x in w), [x.name for x in w]  # fmt: skip
    # The report reads the same: those sends are asynchronous, with FLOPs in their window.
    sends = [c for c in out["overlap"]["async_collectives"]
             if c["axes"] == ["pp"] and not c["sync"]]  # fmt: skip
    assert sends and all(c["flops_between"] > 0 and not c["exposed"] for c in sends), sends
    assert sum(c["count"] for c in sends) == 14  # one per tick: m + 2(p - 1) fused ticks
    assert 0 < out["collectives"]["pp"]["exposed_share"] < 1
