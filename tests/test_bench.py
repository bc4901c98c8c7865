"""``jaxpar bench`` on the small config: figures are consistent with each other; and
``scripts/bench_torch.py``'s protocol (round pairing, ``--cpus`` refusal) without compiling."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxpar import hostmem
from jaxpar.commands.bench import bench


def test_bench_reports_consistent_figures(make_cfg, tmp_path):
    cfg = make_cfg(dp=2)
    cfg.train.steps = 2
    # The suite runs with JAXPAR_HOST_ALLOCATOR=system (conftest): what the run set up is what
    # bench reports.
    assert hostmem.keep_host_buffers() == "system"
    out = bench(cfg, devices=jax.devices()[:2], warmup=1, profile=str(tmp_path / "trace"))
    assert out["steps"] == 2 and out["compile_s"] > 0
    tokens = cfg.train.global_batch * cfg.train.seq_len
    assert abs(out["tokens_per_s"] * out["step_time_s"] - tokens) < 1e-6 * tokens
    assert 0 < out["mfu"] and out["memory_per_device_bytes"] > 0
    assert out["host_allocator"] == "system"
    assert out["collective_bytes"] > 0  # dp=2 reduces gradients
    assert any((tmp_path / "trace").rglob("*"))


# ---- scripts/bench_torch.py: the protocol, without compiling either side --------------------

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _bench_torch():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import bench_torch
    finally:
        sys.path.remove(str(SCRIPTS))
    return bench_torch


def test_bench_torch_pairs_each_rounds_bursts(monkeypatch):
    """Per round, the ratio of the two bursts that ran back to back (ABBA order), and their
    median; the pooled medians stay as before."""
    bt = _bench_torch()
    order = []
    # jaxpar gets slower each round, PyTorch faster (a drifting machine): 4 rounds, 2 steps.
    speeds = {"jax": iter([1.0, 1.2, 1.4, 1.6]), "torch": iter([2.0, 1.5, 1.0, 0.5])}

    class Fake:
        def __init__(self, args):
            self.kind = args[1]
            self.info = {"first_loss": 5.5, "compile_s": 1.0}

        def run(self, steps):
            order.append(self.kind)
            return [next(speeds[self.kind])] * steps

        def close(self):
            pass

    monkeypatch.setattr(bt, "Worker", Fake)
    row = bt.compare("issue", "single", steps=2, repeats=4, model_overrides={})
    assert order == ["jax", "torch", "torch", "jax", "jax", "torch", "torch", "jax"]
    assert row["ratio_rounds"] == pytest.approx([0.5, 1.2 / 1.5, 1.4, 3.2])
    assert row["ratio_round_median"] == pytest.approx((1.2 / 1.5 + 1.4) / 2)
    assert row["ratio"] == pytest.approx(1.3 / 1.25) and row["steps"] == 8


def test_bench_torch_refuses_cpus_out_of_range():
    """``--cpus`` beyond this process's CPUs is one line naming the flag and the rule."""
    have = len(os.sched_getaffinity(0))
    p = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_torch.py"), "--cpus", str(have + 1)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (
        f"bench_torch.py: error: --cpus={have + 1}: must be between 1 and the {have} CPUs available"
    )
