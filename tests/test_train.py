"""The foundation: layouts reproduce the single-device run; resume equals an uninterrupted run."""

import jax
import numpy as np
import pytest

from jaxpar.data import Batches, load_corpus
from jaxpar.devices import make_mesh
from jaxpar.errors import CheckpointError
from jaxpar.train.loop import run


def _run(cfg):
    return run(cfg, devices=jax.devices()[: cfg.layout.n_devices])


def _losses(cfg):
    return np.array(_run(cfg)["losses"])


def test_dp8_matches_single_device(make_cfg):
    ref = _run(make_cfg(dp=1))
    got = _run(make_cfg(dp=8))  # ZeRO-1 (the mesh default)
    assert len(ref["losses"]) == 5 and ref["losses"][-1] < ref["losses"][0]
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    # The summary names what the compiled step does over dp (one dp rank: nothing).
    assert got["layout"]["dp_reduction"] == "reduce_scatter_once"
    assert ref["layout"]["dp_reduction"] == "none"


def test_data_is_layout_independent_and_sharded():
    corpus = load_corpus("stdlib", 256)
    b = Batches(corpus, 8, 16, seed=0)
    whole = b.rows(3, 0, 8)
    assert np.array_equal(np.concatenate([b.rows(3, 0, 4), b.rows(3, 4, 8)]), whole)
    assert not np.array_equal(b.rows(4, 0, 8), whole)
    mesh = make_mesh(make_layout(dp=8), jax.devices())
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    arr = b.global_array(3, NamedSharding(mesh, P("dp", None)))
    assert np.array_equal(np.asarray(arr), whole)
    assert len({str(s.index) for s in arr.addressable_shards}) == 8  # each device a different row


def make_layout(**kw):
    from jaxpar.config import LayoutConfig

    lay = LayoutConfig(dp=1, tp=1)
    for k, v in kw.items():
        setattr(lay, k, v)
    return lay


def test_resume_equals_uninterrupted(make_cfg, tmp_path):
    """Resumed from step 3, the run's losses equal an uninterrupted run's. Before that, the same
    run again without ``--resume`` is refused and leaves the checkpoints as they were (existing
    checkpoints are never overwritten)."""
    full = make_cfg(dp=4, tp=2)
    full.train.steps = 6
    ref = _losses(full)

    first = make_cfg(dp=4, tp=2)
    first.train.steps = 3
    first.train.checkpoint_dir = str(tmp_path / "ck")
    first.train.checkpoint_every = 3
    a = _losses(first)
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert "3" in before
    with pytest.raises(CheckpointError, match="--resume"):
        _run(first)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before
    second = make_cfg(dp=4, tp=2)
    second.train.steps = 6
    second.train.checkpoint_dir = str(tmp_path / "ck")
    second.train.resume = True
    out = run(second, devices=jax.devices())
    assert out["start_step"] == 3
    np.testing.assert_array_equal(np.concatenate([a, out["losses"]]), ref)
    lines = (tmp_path / "ck" / "metrics.jsonl").read_text().splitlines()
    assert sum('"loss"' in line for line in lines) == 6  # appended, not rewritten


def test_a_program_compiles_once_per_process(make_cfg):
    """Trainers of the same run share the compiled step (jaxpar.train.programs: a run resumed
    in the same process compiles it once); a run whose step differs (the learning rate
    schedule's length) compiles its own."""
    from jaxpar.train.step import Trainer

    def trainer(steps):
        cfg = make_cfg(dp=4, tp=2)
        cfg.train.steps = steps
        return Trainer(cfg, make_mesh(cfg.layout, jax.devices()))

    a, b = trainer(6), trainer(6)
    assert a.compile_step() is b.compile_step() and a.memory_limit == b.memory_limit
    assert trainer(3).compile_step() is not a.compile_step()
