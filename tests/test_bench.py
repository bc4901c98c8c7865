"""``jaxpar bench`` on the small config: figures are consistent with each other."""

import jax

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
