"""``jaxpar plan --verify N``: the planner's ranked layouts compiled by XLA:GPU for the pod.

The compile runs in a subprocess (XLA reads ``XLA_FLAGS`` once per process). It needs the jax
CUDA plugin, which the ``test`` extra installs: without it the test fails saying so.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from conftest import MODEL_YAML

from jaxpar.errors import ConfigError
from jaxpar.gpu import targets as T
from jaxpar.gpu.verify import Verified, render, verified_pick

LAYOUT = {"dp": 8, "tp": 1, "pp": 1, "sp": 1, "zero": 3, "microbatches": 1, "schedule": "1f1b",
          "virtual": 1, "microbatch_size": 1, "remat": "none", "offload": "none"}  # fmt: skip


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    return env


def _model(tmp_path) -> str:
    path = tmp_path / "model.yaml"
    path.write_text(MODEL_YAML)
    return str(path)


def _plan(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jaxpar.cli", "plan", "--model", _model(tmp_path), "--mesh",
           "h100-8", "--global-batch", "8", "--seq", "64", *flags]  # fmt: skip
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)


def test_verify_compiles_the_recommendation_for_the_pod(tmp_path):
    if T.plugin() is None:
        pytest.fail("the jax CUDA plugin is missing: pip install -e '.[test]' installs it")
    proc = _plan(tmp_path, "--top", "1", "--verify", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (row,) = out["verified"]
    assert row["rank"] == 1 and row["refused"] is None
    assert row["layout"] == out["layout"]  # the recommendation itself was compiled
    assert row["predicted_bytes"] == out["memory_per_device_bytes"]
    # XLA:GPU's per-device total of a real program: above the batch, far under the device
    assert 1e5 < row["compiled_bytes"] < row["usable_bytes"]
    assert row["ratio"] == pytest.approx(row["compiled_bytes"] / row["predicted_bytes"])
    assert row["fits"] is True and out["verified_pick"] == 1
    assert 0.0 <= row["exposed_share"] <= 1.0 and row["compile_s"] > 0
    # the program's simulated step beside the planner's (jaxpar.gpu.timing)
    assert row["step_s"] > 0 and row["planner_step_s"] > 0
    assert row["step_ratio"] == pytest.approx(row["planner_step_s"] / row["step_s"])
    assert row["exposed_s"]["total"] <= row["step_s"]
    # compiled with the flags a run of its layout starts with (as `jaxpar compile` and
    # `jaxpar train`), in a process of its own: ZeRO-3 inside one node runs one collective in
    # flight, so the mesh's overlap-limit flag is withheld
    from jaxpar import config as C
    from jaxpar.distributed import run_xla_flags

    hw = C.load_mesh("h100-8").hardware
    limit = "--xla_gpu_experimental_parallel_collective_overlap_limit=4"
    assert limit in hw.xla_flags and limit not in row["xla_flags"]
    lay = C.LayoutConfig(**{k: v for k, v in row["layout"].items() if k != "microbatch_size"})
    assert row["xla_flags"] == run_xla_flags(hw, lay)


def test_verified_pick_skips_what_the_gpu_program_does_not_fit():
    gib = 2.0**30
    rows = [
        Verified(1, LAYOUT, 70 * gib, 76.6 * gib, 73.6 * gib, False, 100.0, 1.0),
        Verified(2, LAYOUT, 50 * gib, refused="layout.tp=3: must divide ..."),
        Verified(3, LAYOUT, 50 * gib, 51 * gib, 73.6 * gib, True, 90.0, 0.3),
    ]
    assert verified_pick(rows).rank == 3
    text = render(rows)
    assert "does NOT fit" in text and "not compiled: layout.tp=3" in text
    assert "verified pick (shortest simulated step that fits): rank 3" in text
    assert verified_pick(rows[:2]) is None
    assert "none of the 2 compiled layouts fits" in render(rows[:2])


def test_verified_pick_is_the_shortest_simulated_step_not_the_planners_first():
    """The planner ranks 1 above 2 by an overlap the compiled program does not have; the
    simulated steps of the compiled programs decide, and the text says by how much."""
    gib = 2.0**30
    exp1, exp2 = {"dp": 3.8, "total": 3.8}, {"dp": 0.2, "tp": 0.1, "total": 0.3}
    rows = [
        Verified(1, LAYOUT, 50 * gib, 52 * gib, 73.6 * gib, True, 12.0, 0.68, step_s=12.3,
                 planner_step_s=8.7, exposed_s=exp1, tflops_per_device=150.0),
        Verified(2, LAYOUT, 55 * gib, 57 * gib, 73.6 * gib, True, 12.0, 0.30, step_s=9.9,
                 planner_step_s=9.1, exposed_s=exp2, tflops_per_device=186.0),
        Verified(3, LAYOUT, 75 * gib, 80 * gib, 73.6 * gib, False, 12.0, 0.1, step_s=8.0,
                 planner_step_s=8.0, exposed_s={"total": 0.0}),
    ]  # fmt: skip
    assert verified_pick(rows).rank == 2  # 3 is faster but does not fit
    assert rows[0].step_ratio == pytest.approx(8.7 / 12.3)
    assert rows[0].to_dict()["step_ratio"] == pytest.approx(8.7 / 12.3)
    text = render(rows)
    assert (
        "simulated step 12.3 s (planner 8.7 s, ratio 0.71), 150 TFLOP/s; exposed: dp 3.8 s" in text
    )
    assert "exposed: dp 0.2 s, tp 0.1 s" in text
    assert "verified pick (shortest simulated step that fits): rank 2" in text
    # equal simulated steps: the planner's rank breaks the tie
    tie = [dataclasses.replace(rows[1], rank=4), dataclasses.replace(rows[1], rank=2)]
    assert verified_pick(tie).rank == 2


def test_verify_refuses_a_cpu_mesh_and_a_given_layout(tmp_path):
    from jaxpar import config as C
    from jaxpar.gpu.verify import verify_ranked

    with pytest.raises(ConfigError, match="--verify: mesh 'cpu-8' is not a GPU pod"):
        verify_ranked(C.load("tiny", "cpu-8"), 1)
    proc = _plan(tmp_path, "--dp", "8", "--verify", "1")
    assert proc.returncode == 2 and "--verify: verifies the searched ranking" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_compile_layout_auto_compiles_the_planners_pick(tmp_path):
    if T.plugin() is None:
        pytest.fail("the jax CUDA plugin is missing: pip install -e '.[test]' installs it")
    env = _env()
    cmd = [sys.executable, "-m", "jaxpar.cli", "compile", "--model", _model(tmp_path), "--mesh",
           "h100-8", "--global-batch", "8", "--seq-len", "64", "--layout", "auto",
           "--json"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    assert any(x.startswith("layout auto: ") and "(rank 1)" in x for x in lines[:-1]), lines
    auto = out["auto_layout"]
    assert auto["rank"] == 1
    for k in ("dp", "tp", "pp", "sp", "zero", "microbatches"):
        assert out["layout"][k] == auto["layout"][k], k  # the compiled step is the pick's
    proc = subprocess.run([*cmd[:-1], "--dp", "8"], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 2 and "--layout=auto: conflicts with --dp" in proc.stderr


def test_verify_compiles_the_best_of_each_family_first():
    """--verify N takes the planner's best layout of each family (pipelined or not, ZeRO
    stage) in rank order, then the next ranked ones."""
    from types import SimpleNamespace as NS

    from jaxpar.gpu.verify import candidates

    fams = [(8, 3), (8, 3), (8, 3), (4, 2), (1, 3), (8, 3), (1, 1)]  # (pp, zero) by rank
    ranked = [NS(layout=NS(pp=pp, zero=z)) for pp, z in fams]
    assert candidates(ranked, 3) == [0, 3, 4]  # pp 8 ZeRO-3, pp 4 ZeRO-2, no pipeline ZeRO-3
    assert candidates(ranked, 1) == [0]  # the recommendation itself
    assert candidates(ranked, 5) == [0, 1, 3, 4, 6]  # four families, then rank 2
    assert candidates(ranked, 10) == list(range(7))
