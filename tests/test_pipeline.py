"""The pipeline executor reproduces the single-device loss and gradients for every schedule.

Coverage (each case one compile; budget): every schedule at p = 4 (GPipe m = 4, 1F1B m = 8,
ZB-H1 m = 4, interleaved v = 2 m = 8, ZB-V and DualPipeV v = 2 m = 8, DualPipeV with stage
recompute), and dp 2 × tp 2 × pp 2 with 1F1B m = 4 on 8 devices — so p ∈ {2, 4}, m ∈ {4, 8} and
v ∈ {1, 2} each appear. The reference is one device without micro-batching (equal micro-batches:
the mean of their means is the batch mean). Memory and compile-time figures are measured by
``scripts/bench_schedules.py``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import config as C
from jaxpar.data import Batches, load_corpus
from jaxpar.devices import make_mesh
from jaxpar.errors import ConfigError
from jaxpar.train.step import Trainer


def tiny(make_cfg, **layout):
    """8 layers of d 32 (1 or 2 per chunk), seq 16, batch 16."""
    cfg = make_cfg(**layout)
    cfg.model.n_layers, cfg.model.d_model, cfg.model.d_ff = 8, 32, 64
    cfg.model.n_heads, cfg.model.n_kv_heads = 2, 1
    cfg.train.seq_len = 16
    return cfg


def loss_and_grads(cfg):
    C.validate(cfg, cfg.layout.n_devices)
    mesh = make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices])
    tr = Trainer(cfg, mesh)
    params = tr.init_state(0)["params"]
    batch = Batches(load_corpus("stdlib", 256), 16, 16, seed=3).global_array(0, tr.batch_sharding)
    loss, g = tr.grads(params, batch)
    return float(loss), jax.tree.map(np.asarray, tr.reorder_layers(g, "canonical"))


@functools.cache
def reference(make_cfg):
    return loss_and_grads(tiny(make_cfg))


def assert_matches(got, ref):
    (loss, g), (ref_loss, ref_g) = got, ref
    assert abs(loss / ref_loss - 1) < 1e-4
    for path, a in jax.tree_util.tree_leaves_with_path(g):
        b = ref_g
        for k in path:
            b = b[k.key]
        assert np.abs(b).max() > 0, path  # the comparison is not vacuous
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max(), err_msg=str(path))


CASES = [
    dict(schedule="gpipe", microbatches=4),
    dict(schedule="1f1b", microbatches=8),
    dict(schedule="zb-h1", microbatches=4),
    dict(schedule="interleaved", microbatches=8, virtual=2),
    dict(schedule="zbv", microbatches=8, virtual=2),
    dict(schedule="dualpipev", microbatches=8, virtual=2, remat="full"),
]


@pytest.mark.parametrize("layout", CASES, ids=lambda d: "-".join(map(str, d.values())))
def test_schedule_matches_single_device(make_cfg, layout):
    assert_matches(loss_and_grads(tiny(make_cfg, pp=4, **layout)), reference(make_cfg))


def test_dp_tp_pp_matches_single_device(make_cfg):
    cfg = tiny(make_cfg, dp=2, tp=2, pp=2, schedule="1f1b", microbatches=4)
    assert_matches(loss_and_grads(cfg), reference(make_cfg))


def test_tick_scan_does_not_unroll(make_cfg):
    """The lowered program has the same size at m = 8 and m = 32: one scan over ticks."""

    def lowered_lines(m):
        cfg = tiny(make_cfg, pp=4, schedule="1f1b", microbatches=m)
        cfg.train.global_batch = 32
        tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[:4]))
        batch = jax.ShapeDtypeStruct((32, 17), jnp.int32, sharding=tr.batch_sharding)
        with tr._ctx():
            text = jax.jit(tr.grads_fn).lower(tr.abstract_params, batch).as_text()
        return len(text.splitlines())

    assert lowered_lines(32) <= 1.02 * lowered_lines(8)  # unrolled ticks would be ~4x


@pytest.mark.parametrize(
    ("layout", "needle"),
    [
        (dict(pp=4, virtual=3), "model.n_layers=8: must be divisible by pp*virtual=4*3"),
        (dict(pp=4, microbatches=2), "layout.microbatches=2: schedule '1f1b' needs"),
        (
            dict(pp=2, schedule="zbv", microbatches=8),
            "layout.virtual=1: schedule 'zbv' is V-shaped",
        ),
        (dict(pp=2, schedule="dualpipev", virtual=2, microbatches=2), "needs microbatches >= 2*"),
        (dict(pp=2, schedule="pipedream"), "layout.schedule='pipedream': must be one of"),
    ],
)
def test_bad_pipeline_layouts(make_cfg, layout, needle):
    cfg = tiny(make_cfg, **layout)
    with pytest.raises(ConfigError) as e:
        C.validate(cfg, cfg.layout.n_devices)
    assert needle in str(e.value) and "\n" not in str(e.value)
