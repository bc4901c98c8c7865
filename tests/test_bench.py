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


def test_bench_torch_attribute_runs_four_sides_and_splits_off_the_core(monkeypatch):
    """``--attribute``: the stand-in steps of both sides join the rounds (ABCDDCBA order); a
    side's core cost is its step minus its stand-in step, the rest ratio the stand-ins'."""
    bt = _bench_torch()
    order = []
    speeds = {("jax", "real"): 1.0, ("torch", "real"): 0.8, ("jax", "standin"): 0.6,
              ("torch", "standin"): 0.7}  # fmt: skip

    class Fake:
        def __init__(self, args):
            self.side = (args[1], args[-1])
            self.info = {"first_loss": 5.5, "compile_s": 1.0}

        def run(self, steps):
            order.append(self.side)
            return [speeds[self.side]] * steps

        def close(self):
            pass

    monkeypatch.setattr(bt, "Worker", Fake)
    row = bt.compare("issue", "single", steps=2, repeats=2, model_overrides={}, attribute=True)
    sides = [("jax", "real"), ("torch", "real"), ("jax", "standin"), ("torch", "standin")]
    assert order == sides + sides[::-1]
    assert row["jaxpar_core_s"] == pytest.approx(0.4) and row["torch_core_s"] == pytest.approx(0.1)
    assert row["rest_ratio"] == pytest.approx(0.6 / 0.7) and row["ratio"] == pytest.approx(1.25)


def test_bench_torch_standins_compute_the_same_function():
    """The attribution is fair only if both stand-ins do the same work: same outputs and
    gradients on the same grouped-query inputs (each side in its own layout)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    bt = _bench_torch()
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 5, h, 4)).astype(np.float32) for h in (6, 3, 3))
    w = rng.standard_normal((2, 5, 6, 4)).astype(np.float32)  # weights of the scalar loss
    o_j, g_j = jax.value_and_grad(
        lambda q, k, v: jnp.sum(bt.standin_jax(q, k, v) * w), argnums=(0, 1, 2)
    )(q, k, v)
    tq, tk, tv = (torch.tensor(x.transpose(0, 2, 1, 3), requires_grad=True) for x in (q, k, v))
    o_t = (bt.standin_torch(tq, tk, tv) * torch.tensor(w.transpose(0, 2, 1, 3))).sum()
    o_t.backward()
    assert float(o_j) == pytest.approx(float(o_t.detach()), rel=1e-5)
    for gj, t in zip(g_j, (tq, tk, tv), strict=True):
        np.testing.assert_allclose(np.asarray(gj), t.grad.numpy().transpose(0, 2, 1, 3), rtol=1e-5)


def test_bench_torch_matmul_rates_run_both_sides(monkeypatch):
    """The calibration runs a real matmul of the shape's MLP up projection in a fresh process
    of each side (checked against the product of ones) and reports a rate for each."""
    bt = _bench_torch()
    monkeypatch.setitem(bt.SHAPES, "small", dict(batch=2, seq=32, d_model=32, d_ff=48))
    rates = bt.matmul_rates("small")
    assert set(rates) == {"jaxpar", "torch"}
    assert all(0 < r < 1e5 for r in rates.values()), rates


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
