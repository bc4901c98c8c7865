"""Mixture of experts: every expert-parallel layout against one device (loss and every gradient
leaf, fp32, rank-coded rows), the same tokens dropped under a capacity, the balancing bias,
the all-to-all bytes of the compiled step against the padded dispatch's theory, bad input."""

from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config

from jaxpar import config as C
from jaxpar import validation as V
from jaxpar.analysis.hlo import collective_bytes
from jaxpar.cli import main
from jaxpar.devices import make_mesh
from jaxpar.errors import ConfigError
from jaxpar.model import Model
from jaxpar.model.moe import capacity
from jaxpar.train.step import Trainer

SEQ, BATCH, D, E = 16, 8, 32, 8


def moe_config(capacity_factor=0.0, router="softmax", aux_loss=0.01, **layout) -> C.RunConfig:
    """A tiny MoE (8 experts, top-2, one shared expert; layer 0 dense, layers 1-2 MoE)."""
    cfg = small_config(**layout)
    moe = C.MoeConfig(
        experts=E, top_k=2, shared_experts=1, expert_ff=16, first_dense=1, router=router,
        capacity_factor=capacity_factor, aux_loss=aux_loss,
    )  # fmt: skip
    cfg.model = C.ModelConfig(
        name="tiny-moe-test", n_layers=3, d_model=D, n_heads=4, n_kv_heads=2, d_ff=64,
        vocab_size=64, max_seq_len=32, moe=moe,
    )  # fmt: skip
    cfg.train.global_batch, cfg.train.seq_len = BATCH, SEQ
    V.validate(cfg, cfg.layout.n_devices)
    return cfg


def _trainer(cfg) -> Trainer:
    return Trainer(cfg, make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices]))


def _batch(tr: Trainer) -> jax.Array:
    """Rank-coded rows: row r starts with token r, so a row routed to the wrong rank shows."""
    rows = np.random.default_rng(0).integers(0, 64, (BATCH, SEQ + 1)).astype(np.int32)
    rows[:, 0] = np.arange(BATCH)
    return jax.device_put(rows, tr.batch_sharding)


@cache
def _init_params():
    """The initial params, once, on one device (the same values on every layout)."""
    cfg = moe_config()
    return jax.jit(Model(cfg.model).init)(jax.random.key(0))


def _grads(cfg):
    tr = _trainer(cfg)
    params = jax.device_put(_init_params(), tr.param_shardings)
    loss, g = tr.grads(params, _batch(tr))
    return tr, float(loss), jax.tree.map(np.asarray, g)


@cache
def _reference():
    return _grads(moe_config())[1:]


def _assert_close(got, ref):
    """Every leaf within 1e-4 of the reference, relative to the leaf's largest entry."""

    def one(path, a, b):
        scale = float(np.max(np.abs(b))) or 1.0
        err = float(np.max(np.abs(a - b))) / scale
        assert err < 1e-4, (jax.tree_util.keystr(path), err)

    jax.tree_util.tree_map_with_path(one, got, ref)


# ep = dp is ep4 here (and ep2-tp2 beside tp); a plain ep 2 = dp 2 case compiled the same
# dispatch at half the width (ep 2 alone: test_planner_moe, test_moe_decode).
LAYOUTS = {
    "ep4": dict(dp=4, ep=4),
    "ep2-tp2": dict(dp=2, ep=2, tp=2),
    "ep2-dp2-zero1": dict(dp=4, ep=2, zero=1),
    "ep2-dp2-zero3-mb2": dict(dp=4, ep=2, zero=3, microbatches=2),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_device(name):
    tr, loss, g = _grads(moe_config(**LAYOUTS[name]))
    ref_loss, ref = _reference()
    assert tr.mesh.shape["ep"] == LAYOUTS[name]["ep"]
    # Routed experts are sharded over ep at rest; the rest of the block is not.
    mlp = tr.param_shardings["moe_layers"]["moe"]["mlp"]
    # ZeRO-3 shards the experts dim over edp beside ep (ep-major); below it, ep alone.
    want = ("ep", "edp") if LAYOUTS[name].get("zero", 0) == 3 else "ep"
    assert mlp["w_up"].spec[1] == want and "ep" not in str(mlp["router"].spec)
    assert np.abs(ref["moe_layers"]["moe"]["mlp"]["w_up"]).max() > 0
    assert not np.any(ref["moe_layers"]["moe"]["mlp"]["bias"])  # selection only: no gradient
    assert abs(loss / ref_loss - 1) < 1e-4
    _assert_close(g, ref)


def test_layers_reduced_in_backward_match_one_device(monkeypatch):
    """The GPU targets' reduction of each layer's gradient inside the backward's scans
    (reduce.DPReduction.reduces_in_backward), run on CPU devices: the dense and the MoE
    stacks, routed experts reduced over edp alone (their ep owners hold the whole gradient),
    at dp 4 = edp 2 x ep 2, ZeRO-2: loss and gradients equal one device's."""
    from jaxpar.train import reduce

    monkeypatch.setattr(reduce, "packed_collectives", lambda: False)
    stacks, in_backward = [], reduce.DPReduction.reduced_in_backward
    monkeypatch.setattr(reduce.DPReduction, "reduced_in_backward",
                        lambda self, *a: stacks.append(a[0]) or in_backward(self, *a))  # fmt: skip
    _, loss, g = _grads(moe_config(dp=4, ep=2, zero=2))
    ref_loss, ref = _reference()
    assert set(stacks) == {"layers", "moe_layers"}, stacks
    assert abs(loss / ref_loss - 1) < 1e-4
    _assert_close(g, ref)


CAPACITY_LAYOUT = dict(dp=4, ep=2, zero=1)


@cache
def _capacity_step(**layout):
    """One optimizer step under capacity factor 1 with the sigmoid router: the metrics, the
    new params, the trainer."""
    cfg = moe_config(capacity_factor=1.0, router="sigmoid", **layout)
    tr = _trainer(cfg)
    fresh = jax.tree.map(jnp.copy, _init_params())  # the step donates its state
    params = jax.device_put(fresh, tr.param_shardings)
    opt = jax.jit(tr.tx.init, out_shardings=tr.state_shardings["opt"])(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), tr.state_shardings["step"])
    state, m = tr.step({"params": params, "opt": opt, "step": step}, _batch(tr))
    return jax.tree.map(np.asarray, m), jax.tree.map(np.asarray, state["params"]), tr


def test_capacity_drops_the_same_tokens_on_every_layout():
    """A step's dropped counts, loads, loss and updated params (the optimizer and the bias
    rule included) equal one device's; the bias moved by rate * sign(mean load - load)."""
    m1, p1, tr = _capacity_step()
    m2, p2, _ = _capacity_step(**CAPACITY_LAYOUT)
    dropped = m1["moe_dropped"]
    assert dropped.shape == (2,) and dropped.sum() > 0  # the capacity really bites
    np.testing.assert_array_equal(m2["moe_dropped"], dropped)
    np.testing.assert_allclose(m2["moe_load"], m1["moe_load"], rtol=1e-6)
    assert abs(float(m2["loss"]) / float(m1["loss"]) - 1) < 1e-4
    _assert_close(p2, p1)
    # The bias rule, from the load the forward of the initial params reports.
    batch = np.asarray(_batch(tr))
    fwd = jax.jit(lambda p, b: tr.model.loss_and_stats(p, b[:, :-1], b[:, 1:]))
    _, stats = fwd(_init_params(), batch)
    load = np.asarray(stats.load)
    want = tr.cfg.model.moe.bias_rate * np.sign(load.mean(-1, keepdims=True) - load)
    np.testing.assert_allclose(p1["moe_layers"]["moe"]["mlp"]["bias"], want)
    np.testing.assert_allclose(m1["moe_load"], load.max(-1) / load.mean(-1), rtol=1e-6)


def test_all_to_all_bytes_equal_the_padded_dispatch():
    """Per MoE layer and step: dispatch and combine forward, their transposes backward, each
    an [E, B/dp, C, D] fp32 buffer (C = the capacity), over ep only."""
    tr = _capacity_step(**CAPACITY_LAYOUT)[2]
    rep = collective_bytes(tr.compile_step(), tr.mesh)
    a2a = rep.select(kind="all-to-all")
    assert a2a.count == rep.select(kind="all-to-all", axes={"ep"}).count > 0
    c = capacity(tr.cfg.model, SEQ)
    assert c == 4  # ceil(1 * 2 * 16 / 8)
    per_layer = 4 * E * (BATCH // tr.cfg.layout.dp) * c * D * 4
    assert a2a.count == 4 * tr.cfg.model.moe_layers()
    assert a2a.bytes == per_layer * tr.cfg.model.moe_layers()


def test_groups_every_second_layer_bias_and_aux_loss():
    """first_dense 1, every 2: layer 0 dense, then (dense, MoE) x 2; a bias changes the
    selection; the loss includes the balancing loss times its coefficient."""
    moe = C.MoeConfig(experts=4, top_k=1, expert_ff=16, first_dense=1, every=2, aux_loss=0.5)
    cfg = C.ModelConfig(n_layers=5, d_model=D, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64,
                        max_seq_len=32, moe=moe)  # fmt: skip
    model = Model(cfg)
    plain = Model(C.ModelConfig(**{**cfg.__dict__, "moe": {**moe.__dict__, "aux_loss": 0.0}}))
    params = jax.jit(model.init)(jax.random.key(0))
    assert params["layers"]["attn"]["wq"].shape[0] == 1
    assert params["moe_layers"]["dense"]["mlp"]["w_up"].shape[:2] == (2, 1)
    assert params["moe_layers"]["moe"]["mlp"]["w_up"].shape[:2] == (2, 4)
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.param_count()
    tok = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, SEQ + 1)), jnp.int32)
    biased = jax.tree.map(lambda x: x, params)
    biased["moe_layers"]["moe"]["mlp"]["bias"] = jnp.asarray(np.eye(2, 4) * 10.0, jnp.float32)

    @jax.jit
    def run(params, biased):
        loss, stats = model.loss_and_stats(params, tok[:, :-1], tok[:, 1:])
        base = plain.loss(params, tok[:, :-1], tok[:, 1:])
        return loss, stats, base, model.loss_and_stats(biased, tok[:, :-1], tok[:, 1:])

    loss, stats, base, (_, biased_stats) = run(params, biased)
    assert stats.load.shape == (2, 4) and float(stats.load.sum()) == 2 * 2 * SEQ
    np.testing.assert_allclose(float(loss - base), 0.5 * float(stats.aux.mean()), rtol=1e-5)
    # A bias of 10 on expert g of group g wins every selection there.
    np.testing.assert_array_equal(np.asarray(biased_stats.load), np.eye(2, 4) * 2 * SEQ)


@pytest.mark.parametrize(
    "moe,layout,needle",
    [
        (dict(experts=8, top_k=9), {}, "model.moe.top_k=9: must be at most model.moe.experts=8"),
        (dict(experts=6, top_k=2), dict(dp=4, ep=4), "layout.ep=4: model.moe.experts=6 must be"),
        (None, dict(dp=2, ep=2), "layout.ep=2: expert parallelism needs a MoE model"),
        (dict(experts=8, capacity_factor=0.5), {}, "model.moe.capacity_factor=0.5: must be 0"),
        (dict(experts=8, first_dense=1), dict(pp=2), "model.moe.first_dense=1: with layout.pp=2"),
        (dict(experts=8), dict(dp=4, ep=3), "layout.ep=3: must divide layout.dp=4"),
    ],
)
def test_bad_input_refused(moe, layout, needle):
    cfg = small_config(**layout)
    if moe is not None:
        cfg.model.moe = C.MoeConfig(**moe)
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        V.validate(cfg, cfg.layout.n_devices)


def test_cli_refuses_in_one_line(capsys):
    code = main(["train", "--model", "tiny-moe", "--dry-run"])  # the default mesh pipelines
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0] == (
        "jaxpar train: error: model.moe.first_dense=1: with layout.pp=2 the pipeline stages hold "
        "MoE groups only; dense blocks before the first group are not supported with pp>1 (set "
        "model.moe.first_dense=0)"
    )
    code = main(["train", "--model", "tiny-moe", "--pp", "1", "--dp", "4", "--ep", "4",
                 "-o", "model.moe.top_k=9", "--dry-run"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        "jaxpar train: error: model.moe.top_k=9: must be at most model.moe.experts=8"
    ]


def test_int32_products_refused_in_one_line(capsys):
    """The dispatch counts and indexes with int32: tokens x top_k (queue positions, the ragged
    sort, the dropped count) and experts x capacity (slot indices; x a rank's rows when the
    exchange is ragged). Past int32: one line, exit 2, before anything compiles, and the
    planner says so before its search (not "no valid layout")."""
    flags = ["--model", "tiny-moe", "--pp", "1", "--tp", "1", "--dp", "8", "--microbatches", "1"]
    cases = [
        (["train", "--dry-run", *flags, "--global-batch", str(2**23), "--seq-len", "128"],
         "jaxpar train: error: model.moe.top_k=2: global_batch*seq_len*top_k=8388608*128*2="
         "2147483648 routed assignments per step: must be at most 2147483647 (int32 in the "
         "compiled step)"),
        (["plan", "--model", "tiny-moe", "--mesh", "h100-8", "--global-batch", str(2**22),
          "--seq", "256"],
         "jaxpar plan: error: model.moe.top_k=2: global_batch*seq_len*top_k=4194304*256*2="
         "2147483648 routed assignments per step: must be at most 2147483647 (int32 in the "
         "compiled step)"),
        (["train", "--dry-run", *flags, "--seq-len", "256", "-o", "model.moe.experts=16777216"],
         "jaxpar train: error: model.moe.experts=16777216: experts*capacity=16777216*256="
         "4294967296 dispatch slots per sequence: must be at most 2147483647 (int32 slot "
         "indices in the compiled step)"),
    ]  # fmt: skip
    for argv, line in cases:
        assert main(argv) == 2, argv
        assert capsys.readouterr().err.strip().splitlines() == [line]
    moe = C.load_model("tiny-moe")
    V.check_sizes(moe, 2**22 - 1, 256)  # one assignment below int32: accepted
    moe.moe.experts = 2**20
    lay = C.LayoutConfig(dp=8, ep=8, tp=1, pp=1, microbatches=1)
    with pytest.raises(ConfigError, match=r"^layout.ep=8: with model.moe.dispatch='auto' the "
                       r"exchange can be ragged, which indexes experts\*rows\*capacity="
                       r"1048576\*8\*256=2147483648 slots"):  # fmt: skip
        V.check_layout(moe, lay, 64, 256, 8)
    moe.moe.dispatch = "padded"  # one sequence's slots: 2**28
    V.check_layout(moe, lay, 64, 256, 8)
