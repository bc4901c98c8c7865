"""Tensor and sequence parallelism: equivalence with one device, per-layer HLO collectives,
activation memory, config refusals. 8 simulated CPU devices (conftest), small config.

Each layout is compiled once (the loss-and-gradient function); the same executable gives the
gradients for equivalence and the HLO for the collective checks. Expected bytes come from the
formulas in :mod:`jaxpar.analysis.theory` for the run's shapes, never from output.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import small_config
from jax.sharding import PartitionSpec as P

from jaxpar import config as C
from jaxpar import sharding as shd
from jaxpar import validation as V
from jaxpar.analysis import tpsp
from jaxpar.data import Batches, load_corpus
from jaxpar.model import Model
from jaxpar.train.loop import run

LAYOUTS = {
    "tp2": dict(tp=2),
    "tp4": dict(tp=4),  # 2 kv heads < tp: kv weights repeated
    "tp2_sp": dict(tp=2, sequence_parallel=True),
    "ulysses2": dict(sp=2, sp_mode="ulysses"),
    "ulysses4": dict(sp=4, sp_mode="ulysses"),
    "ring2": dict(sp=2, sp_mode="ring"),
    "ring4": dict(sp=4, sp_mode="ring"),
    "dp2_tp2_ulysses2": dict(dp=2, tp=2, sp=2, sp_mode="ulysses"),
    "dp2_tp2_ring2": dict(dp=2, tp=2, sp=2, sp_mode="ring"),
}
F32 = 4


def _batch(tr):
    corpus = load_corpus("stdlib", 256)
    return Batches(corpus, 16, 32, seed=3).global_array(0, tr.batch_sharding)


_CACHE: dict[str, dict] = {}


def measured(name: str) -> dict:
    """Compile the layout's loss-and-gradients once; run it on real data (rows differ), from the
    reference's initial parameters placed in the layout's shardings (init is layout-independent,
    tests/test_train.py; this saves a compile per layout)."""
    if name not in _CACHE:
        cfg = small_config(**LAYOUTS[name]) if name != "ref" else small_config()
        V.validate(cfg, cfg.layout.n_devices)
        got = tpsp.measure(cfg, jax.devices()[: cfg.layout.n_devices])
        tr = got["trainer"]
        if name == "ref":
            got["params0"] = jax.tree.map(np.asarray, tr.init_state(0)["params"])
        params = jax.device_put(
            measured("ref")["params0"] if name != "ref" else got["params0"], tr.param_shardings
        )
        loss, grads = got["compiled"](params, _batch(tr))
        got.update(cfg=cfg, loss=float(loss), grads=jax.tree.map(np.asarray, grads))
        _CACHE[name] = got
    return _CACHE[name]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loss_and_gradients_match_single_device(name):
    ref, got = measured("ref"), measured(name)
    assert abs(got["loss"] / ref["loss"] - 1) < 1e-4
    for path, g in jax.tree_util.tree_flatten_with_path(got["grads"])[0]:
        r = ref["grads"]
        for k in path:
            r = r[k.key]
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 * np.abs(r).max(), err_msg=str(path))
    _check_collectives(name, got)


def _check_collectives(name: str, got: dict) -> None:
    cfg, layer = got["cfg"], got["layer"]
    lay = cfg.layout
    expected = tpsp.expected_per_layer(cfg)
    b, s, h = cfg.train.global_batch // lay.dp, cfg.train.seq_len // lay.sp, cfg.model.d_model
    act = b * s * h * F32  # one [b, s, h] activation per device
    if lay.tp > 1:
        wire = tpsp.tp_wire_bytes(layer, lay.tp)
        assert wire == pytest.approx(expected["tp_wire_bytes"], rel=0.1), layer.to_dict()
        big = tpsp.per_layer(got["report"], cfg.model.n_layers, min_bytes=act)
        if lay.sequence_parallel:
            # Collective matmul (jaxpar.model.collective_matmul): the all-gathers into the 2
            # column-parallel matmuls and the reduce-scatters out of the 2 row-parallel ones
            # are rings of t - 1 sends of one sequence chunk (act / t) each. Forward: 4 rings;
            # backward: the column-parallel ones pass x again (for dW, the sequence shard is
            # kept, not the gathered copy) beside their dx reduce-scatter, the row-parallel
            # ones pass dy: 6 rings. No activation all-gather or all-reduce over tp is left.
            t, chunk = lay.tp, act / lay.tp
            for phase, rings in (("fwd", 4), ("bwd", 6)):
                sends = rings * (t - 1)
                assert layer.get("collective-permute", ("tp",), phase) == (sends, sends * chunk)
            small = tpsp.per_layer(got["report"], cfg.model.n_layers, min_bytes=chunk)
            assert small.get("all-gather", ("tp",)) == small.get("all-reduce", ("tp",)) == (0, 0.0)
        else:
            for phase in ("fwd", "bwd"):
                assert big.get("all-reduce", ("tp",), phase) == (2, 2 * act), layer.to_dict()
            assert layer.get("all-gather", ("tp",)) == (0, 0.0)
    if lay.sp > 1 and lay.sp_mode == "ulysses":
        for phase in ("fwd", "bwd"):  # q, k, v in and the output back; their transposes
            assert layer.get("all-to-all", ("sp",), phase)[0] == 4
        assert layer.get("all-to-all", ("sp",))[1] == pytest.approx(
            expected["all_to_all_bytes"], rel=0.1
        )
        _sequence_gathered_only_by_embedding_backward(got, lay, act)
    if lay.sp > 1 and lay.sp_mode == "ring":
        for phase in ("fwd", "bwd"):  # K and V (dK and dV back) at each of P-1 ring steps
            assert layer.get("collective-permute", ("sp",), phase)[0] == 2 * (lay.sp - 1)
        assert layer.get("collective-permute", ("sp",))[1] == pytest.approx(
            expected["permute_bytes"], rel=0.1
        )
        assert layer.get("all-to-all", ("sp",)) == (0, 0.0)
        _sequence_gathered_only_by_embedding_backward(got, lay, act)


def _sequence_gathered_only_by_embedding_backward(got: dict, lay, act: float) -> None:
    """No layer gathers the sequence over sp. Outside the layers, the embedding's backward may
    gather its input cotangent (and token ids) over sp once per micro-batch, to scatter-add
    them into the table gradient: cheaper than all-reducing a [V, D] table gradient."""
    assert got["layer"].get("all-gather", ("sp",)) == (0, 0.0)
    gathered = got["report"].select("all-gather", {"sp"})
    assert gathered.bytes <= 1.1 * act * lay.sp * lay.microbatches


def test_logits_and_embedding_stay_vocab_sharded():
    """Vocabulary-parallel embedding and cross-entropy: no all-gather over tp at all (not of
    the [B, S, V] logits, not of the table: the lookup is a masked local gather + all-reduce
    of [B, S, D]), and no tp collective as large as the local logits."""
    got = measured("tp2")
    cfg = got["cfg"]
    logits_local = cfg.train.global_batch * cfg.train.seq_len * cfg.model.vocab_size * F32 / 2
    assert got["report"].select("all-gather", {"tp"}).count == 0
    for c in got["report"].collectives:
        assert c.bytes < logits_local, (c.kind, c.bytes, c.op_name)
    # Under Megatron-SP the only all-gathers over tp are [b, s, h] activations (not the table).
    sp = measured("tp2_sp")
    act = cfg.train.global_batch * cfg.train.seq_len * cfg.model.d_model * F32
    gathers = [c.bytes for c in sp["report"].collectives if c.kind == "all-gather"]
    assert gathers and set(gathers) == {act}


def test_activation_memory_shrinks_as_theory_says(capsys):
    """Compiled temporaries per device; theory = Korthikanti et al. per-layer formula."""
    from jaxpar.analysis.theory import activation_bytes_per_layer as theory

    cfg = small_config()
    s, b, h, a = cfg.train.seq_len, cfg.train.global_batch, cfg.model.d_model, cfg.model.n_heads
    temp = {n: measured(n)["temp_bytes"] for n in ("ref", "tp2", "tp2_sp", "ulysses2", "ulysses4")}
    pairs = {
        "sp_vs_tp2": (
            temp["tp2_sp"] / temp["tp2"],
            theory(s, b, h, a, 2, True) / theory(s, b, h, a, 2),
        ),
        "ulysses2": (temp["ulysses2"] / temp["ref"], 1 / 2),
        "ulysses4": (temp["ulysses4"] / temp["ref"], 1 / 4),
    }
    with capsys.disabled():
        print("\nactivation temp ratios (measured, theory):", pairs, "bytes:", temp)
    for measured_ratio, theory_ratio in pairs.values():
        assert measured_ratio < 1
        assert measured_ratio < theory_ratio * 1.4


def test_five_steps_match_single_device():
    ref = np.array(run(small_config(), devices=jax.devices()[:1])["losses"])
    # dp × tp × sp with Megatron-SP and ring attention together.
    for layout in (dict(dp=2, tp=2, sp=2, sp_mode="ring", sequence_parallel=True),):
        cfg = small_config(**layout)
        got = np.array(run(cfg, devices=jax.devices()[: cfg.layout.n_devices])["losses"])
        assert ref.shape == (5,) and ref[-1] < ref[0]
        np.testing.assert_allclose(got, ref, rtol=1e-4, err_msg=str(layout))


def test_ring_attention_inside_pipeline_shard_map():
    """The pipeline executor runs stages in a shard_map manual over 'pp'; the ring's nested
    shard_map over 'sp' must work there: loss and gradients per pp rank equal the one-device
    ones."""
    cfg = small_config(pp=2, sp=2, tp=2, sp_mode="ring")
    cfg.model.n_layers = 2
    from jaxpar.devices import make_mesh

    mesh = make_mesh(cfg.layout, jax.devices())
    model = Model(cfg.model)
    params = model.init(jax.random.key(0))
    rows = Batches(load_corpus("stdlib", 256), 16, 32, seed=3).rows(0, 0, 16)
    tok, tgt = rows[:, :-1], rows[:, 1:]
    ref_loss, ref = jax.value_and_grad(model.loss)(params, tok, tgt)

    def stage(p, t, y):
        loss, g = jax.value_and_grad(model.loss)(p, t, y)
        return loss[None], jax.tree.map(lambda x: x[None], g)

    with jax.set_mesh(mesh), shd.use_rules(shd.rules_for(cfg.model, cfg.layout)):
        fn = jax.shard_map(
            stage, in_specs=(P(), P(), P()), out_specs=(P("pp"), P("pp")), axis_names={"pp"}
        )
        loss, grads = jax.jit(fn)(params, tok, tgt)
    np.testing.assert_allclose(np.asarray(loss), float(ref_loss), rtol=1e-5)
    jax.tree.map(
        lambda g, r: np.testing.assert_allclose(g[1], r, rtol=1e-4, atol=1e-4 * abs(r).max()),
        grads,
        ref,
    )


@pytest.mark.parametrize(
    "layout, seq, match",
    [
        (dict(sp=8, sp_mode="ulysses"), 32, r"layout.sp=8: Ulysses splits model.n_heads=4"),
        (dict(sp=2, tp=4, sp_mode="ulysses"), 32, r"tp\*sp=4\*2=8"),
        (dict(tp=8), 32, r"layout.tp=8: model.n_heads=4 must be divisible by tp"),
        (dict(sp=4, sp_mode="ring"), 30, r"train.seq_len=30: .*sequence shards \(4\)"),
        (
            dict(sp=2, tp=4, sp_mode="ring", sequence_parallel=True),
            36,
            r"train.seq_len=36: .*\(8\)",
        ),
    ],
)
def test_bad_layouts_are_refused_in_one_line(layout, seq, match):
    cfg = small_config(**layout)
    cfg.train.seq_len = seq
    with pytest.raises(C.ConfigError, match=match) as e:
        V.validate(cfg, cfg.layout.n_devices)
    assert "\n" not in str(e.value)


def test_ring_with_sp8_and_few_heads_is_accepted():
    """Ring attention needs no head divisibility: the answer where Ulysses refuses."""
    cfg = small_config(sp=8, sp_mode="ring")
    V.validate(cfg, 8)
