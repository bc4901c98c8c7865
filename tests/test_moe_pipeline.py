"""Mixture of experts in a pipeline (pp x ep): every schedule family against one device (loss and
every gradient leaf, fp32, rank-coded rows), the expert load and dropped tokens a stage reports,
the balancing loss's gradient through a stage, the bias rule on the stack at rest, bad input."""

from functools import cache

import jax
import numpy as np
import pytest
from conftest import small_config
from test_moe import _assert_close, _batch, _trainer

from jaxpar import config as C
from jaxpar import validation as V
from jaxpar.analysis.hlo import collective_bytes
from jaxpar.errors import ConfigError

SEQ, BATCH, D, E = 16, 8, 32, 8


def moe_config(capacity_factor=0.0, every=1, aux_loss=0.01, **layout) -> C.RunConfig:
    """A tiny MoE whose every layer is MoE (8 experts, top-2, one shared expert), 4 groups of
    ``every`` layers: a pipeline stage holds whole groups."""
    cfg = small_config(**layout)
    moe = C.MoeConfig(experts=E, top_k=2, shared_experts=1, expert_ff=16, first_dense=0,
                      every=every, capacity_factor=capacity_factor, aux_loss=aux_loss)  # fmt: skip
    cfg.model = C.ModelConfig(
        name="tiny-moe-pp-test", n_layers=4 * every, d_model=D, n_heads=4, n_kv_heads=2,
        d_ff=64, vocab_size=64, max_seq_len=32, moe=moe,
    )  # fmt: skip
    cfg.train.global_batch, cfg.train.seq_len = BATCH, SEQ
    V.validate(cfg, cfg.layout.n_devices)
    return cfg


def _grads(cfg):
    """Loss and canonical-order gradients from the layout's own initial params (the same
    values on every layout: partitionable threefry)."""
    tr = _trainer(cfg)
    params = tr.init_state(0)["params"]
    loss, g = tr.grads(params, _batch(tr))
    return tr, float(loss), jax.tree.map(np.asarray, tr.convert(g, "canonical"))


@cache
def _reference(every=1):
    return _grads(moe_config(every=every))[1:]


# dp counts every data-parallel rank; ep of them hold an expert shard each. 1F1B runs in
# test_dense_blocks_inside_the_groups (its groups hold a dense block before the MoE one).
LAYOUTS = {
    "pp2-ep2-dualpipev-remat-full": dict(
        pp=2, dp=2, ep=2, microbatches=4, schedule="dualpipev", virtual=2, remat="full"
    ),  # split backward under recompute: each layer's I re-run from its stashed input
    "pp2-dp4-ep2-zero3-interleaved": dict(
        pp=2, dp=4, ep=2, zero=3, microbatches=2, schedule="interleaved", virtual=2
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_layout_matches_one_device(name):
    """The balancing loss (aux_loss 0.01) reaches each stage's router through the stage."""
    tr, loss, g = _grads(moe_config(**LAYOUTS[name]))
    ref_loss, ref = _reference()
    assert tr.mesh.shape["pp"] == 2 and tr.mesh.shape["ep"] == 2
    # The groups are split over pp at rest, the routed experts over ep.
    w_up = tr.param_shardings["moe_layers"]["moe"]["mlp"]["w_up"].spec
    assert w_up[0] == "pp" and w_up[1] == (("ep", "edp") if tr.cfg.layout.zero == 3 else "ep")
    assert abs(loss / ref_loss - 1) < 1e-4
    _assert_close(g, ref)


def test_dense_blocks_inside_the_groups():
    """pp 2 x ep 2 under 1F1B with every 2: (dense, MoE) x 4 equals one device; the dense
    blocks' own stack inside a group stays unsharded (logical axis ``sublayers``) while the
    groups go over pp, the routed experts over ep."""
    tr, loss, g = _grads(moe_config(every=2, pp=2, dp=2, ep=2, microbatches=2, schedule="1f1b"))
    assert tr.mesh.shape["pp"] == 2 and tr.mesh.shape["ep"] == 2
    spec = tr.param_shardings["moe_layers"]["dense"]["mlp"]["w_up"].spec
    assert spec[0] == "pp" and (len(spec) < 2 or spec[1] is None)
    w_up = tr.param_shardings["moe_layers"]["moe"]["mlp"]["w_up"].spec
    assert w_up[0] == "pp" and w_up[1] == "ep"
    ref_loss, ref = _reference(every=2)
    assert abs(loss / ref_loss - 1) < 1e-4
    _assert_close(g, ref)


@cache
def _capacity_step(**layout):
    """One optimizer step under capacity factor 1: metrics, canonical params, trainer."""
    tr = _trainer(moe_config(capacity_factor=1.0, **layout))
    state, m = tr.step(tr.init_state(0), _batch(tr))
    return jax.tree.map(np.asarray, m), jax.tree.map(np.asarray, tr.convert(state, "canonical")), tr


def test_capacity_drops_and_bias_rule_through_the_pipeline():
    """A step's dropped counts and loads per layer (canonical order), its loss and the updated
    params (the optimizer and the bias rule on the stack at rest) equal one device's, under the
    V placement of DualPipeV (stage order on a rank differs from layer order)."""
    m1, s1, _ = _capacity_step()
    m2, s2, tr = _capacity_step(pp=2, dp=2, ep=2, microbatches=4, schedule="dualpipev", virtual=2)
    assert tr.rest.order is not None and list(tr.rest.order) != sorted(tr.rest.order)
    dropped = m1["moe_dropped"]
    assert dropped.shape == (4,) and dropped.sum() > 0  # the capacity really bites
    np.testing.assert_array_equal(m2["moe_dropped"], dropped)
    np.testing.assert_allclose(m2["moe_load"], m1["moe_load"], rtol=1e-6)
    assert len(set(np.round(m1["moe_load"], 6))) > 1  # per layer, distinguishable
    assert abs(float(m2["loss"]) / float(m1["loss"]) - 1) < 1e-4
    bias = s1["params"]["moe_layers"]["moe"]["mlp"]["bias"]
    assert np.any(bias != 0) and not np.all(bias == bias[:1])  # moved, differently per layer
    _assert_close(s2["params"], s1["params"])


def test_all_to_all_bytes_in_a_stage_equal_the_padded_dispatch():
    """Per MoE layer and micro-batch: dispatch and combine forward, their transposes backward,
    each an [E, B/(dp·m), C, D] fp32 buffer, over ep only (not pp, not edp)."""
    # the compiled step only: nothing here needs it initialised or run
    m = 2
    tr = _trainer(moe_config(capacity_factor=1.0, pp=2, dp=2, ep=2, microbatches=m,
                             schedule="1f1b"))  # fmt: skip
    rep = collective_bytes(tr.compile_step(), tr.mesh)
    a2a = rep.select(kind="all-to-all")
    assert a2a.count == rep.select(kind="all-to-all", axes={"ep"}).count > 0
    c = -(-2 * SEQ // E)  # capacity factor 1: ceil(k·S/E) slots
    rows = BATCH // tr.cfg.layout.dp // m
    per_layer_mb = 4 * E * rows * c * D * 4
    # A rank runs its 2 groups' scans once per micro-batch forward and once per backward; the
    # program holds each collective once (inside the tick's branches), so the analysis weighs
    # each by how often the table takes its branch.
    assert a2a.bytes == pytest.approx(per_layer_mb * m * 2, rel=1e-6)


@pytest.mark.parametrize(
    "moe,layout,needle",
    [
        (dict(first_dense=1), dict(pp=2), "model.moe.first_dense=1: with layout.pp=2"),
        (
            dict(every=2),
            dict(pp=2, schedule="interleaved", virtual=2, microbatches=2),
            "layout.pp=2: the 2 MoE groups",
        ),  # fmt: skip
    ],
)
def test_bad_input_refused(moe, layout, needle):
    cfg = small_config(**layout)
    cfg.model.n_layers = 4
    cfg.model.moe = C.MoeConfig(experts=8, **moe)
    with pytest.raises(ConfigError, match=needle):
        V.validate(cfg, cfg.layout.n_devices)
