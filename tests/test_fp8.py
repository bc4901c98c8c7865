"""FP8 GEMMs (``layout.fp8``, jaxpar.model.fp8): the quantized products against a reference
written from the recipe's definition, scales that are the whole tensor's on every layout (each
layout equals one device), the FP8 dots in the compiled H100 program, and refusals.

Layout equivalence runs with fp32 compute, which the command line refuses with FP8 (a user's
FP8 run computes in bf16): in bf16 the layouts of this model already differ from one device by
0.5-2.4% in their gradients (reduction order, then bf16 rounding), which would hide a wrong
scale. In fp32 only the order of fp32 sums differs, and FP8 rounding amplifies that only where
a value lies on a rounding boundary: a dp or pipeline layout reproduces one device to 1e-6, a tp
layout (whose partial sums are added in another order) to a few 1e-3.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import validation as V
from jaxpar.data import Batches, load_corpus
from jaxpar.devices import make_mesh
from jaxpar.errors import ConfigError
from jaxpar.model import fp8
from jaxpar.train.step import Trainer

# ---- the product against its definition ------------------------------------------------------


def _q(t, axes, dtype):
    """The recipe's quantization in numpy terms: scale = the power of two at or above the
    amax over ``axes`` / format max."""
    t = np.asarray(t, np.float32)
    amax = np.max(np.abs(t), axis=axes, keepdims=True)
    ratio = np.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)
    s = (2.0 ** np.ceil(np.log2(ratio))).astype(np.float32)  # the power of two at or above
    q = np.asarray(jnp.asarray(np.clip(t / s, -jnp.finfo(dtype).max, jnp.finfo(dtype).max))
                   .astype(dtype).astype(jnp.float32))  # fmt: skip
    return q * s  # the dequantized operand: its product equals the scaled FP8 product


@pytest.mark.parametrize("recipe", [r for r, v in fp8.RECIPES.items() if not v.delayed])
def test_product_and_gradients_follow_the_recipe(recipe):
    """``y``, ``dx`` and ``dW`` of :func:`fp8.tensordot` equal fp32 products of operands
    quantized as the recipe says: e4m3 forward, the recipe's format for ``dy``, scales per
    tensor or per row of each GEMM's non-contracted axes."""
    r = fp8.RECIPES[recipe]
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (2, 8, 16)) * jnp.linspace(0.1, 10.0, 16)  # uneven columns
    w = jax.random.normal(kw, (16, 12)) * jnp.linspace(5.0, 0.2, 12)
    dy = jax.random.normal(kd, (2, 8, 12)) * 100.0
    y, vjp = jax.vjp(lambda a, b: fp8.tensordot(a, b, 1, r), x, w)
    dx, dw = vjp(dy)
    e4, g = jnp.float8_e4m3fn, r.grad_dtype
    if r.rowwise:
        want_y = _q(x, (2,), e4) @ _q(w, (0,), e4)
        want_dx = _q(dy, (2,), g) @ _q(w, (1,), e4).T
        xq, dq = _q(x, (0, 1), e4), _q(dy, (0, 1), g)
    else:
        want_y = _q(x, None, e4) @ _q(w, None, e4)
        want_dx = _q(dy, None, g) @ _q(w, None, e4).T
        xq, dq = _q(x, None, e4), _q(dy, None, g)
    want_dw = np.einsum("bsk,bsn->kn", xq, dq)
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
    # and they are FP8 products, not the fp32 ones
    assert np.abs(np.asarray(y) - np.asarray(x) @ np.asarray(w)).max() > 1e-3 * np.abs(want_y).max()


def test_tensorwise_scale_spans_the_dp_rows():
    """Inside the manual dp region each rank holds some rows; the tensorwise scale is the max
    over all of them (a pmax over dp), so the product equals the unsharded one. Taken per rank
    it would not: the rows here differ in magnitude by 1e5, so with the whole tensor's scale the
    small rows fall among e4m3's subnormals (a power-of-two scale alone changes no mantissa)."""
    r = fp8.RECIPES["tensorwise"]
    mesh = jax.make_mesh((2,), ("dp",), devices=jax.devices()[:2])
    rows = jnp.array([1.0, 1, 1e5, 1e5])[:, None, None]
    x = jax.random.normal(jax.random.key(1), (4, 8, 16)) * rows
    w = jax.random.normal(jax.random.key(2), (16, 8))
    whole = fp8.tensordot(x, w, 1, r)

    def sharded():
        fn = jax.shard_map(lambda a, b: fp8.tensordot(a, b, 1, r), mesh=mesh,
                           in_specs=(P("dp"), P()), out_specs=P("dp"), check_vma=False)  # fmt: skip
        return fn(jax.device_put(x, NamedSharding(mesh, P("dp"))), w)

    np.testing.assert_allclose(np.asarray(sharded()), np.asarray(whole), rtol=1e-6, atol=1e-6)
    real = fp8._batch_axes
    try:
        fp8._batch_axes = lambda: ()  # the scale of each rank's own rows
        local = np.asarray(sharded())
    finally:
        fp8._batch_axes = real
    small = np.asarray(whole)[:2]
    assert np.abs(local[:2] - small).max() > 0.05 * np.abs(small).max()


# ---- every layout equals one device --------------------------------------------------------

# (recipe, layout, tolerance on max|g - ref| / max|ref| per leaf): ZeRO-3 with the selective
# policy (the scales kept, operands re-quantized), Megatron TP + SP, a zero-bubble pipeline with
# dp (its W pieces take the FP8 GEMMs' weight gradients apart), and a 3-D pipeline with ZeRO-3;
# the reference is one device with the same micro-batches (a scale is per micro-batch).
CASES = {
    # (with the first and last blocks in bf16: three layer loops, each gathering its weights)
    "tensorwise_dp2_zero3_selective_bf16_ends": ("tensorwise", dict(dp=2, zero=3,
        remat="selective", fp8_bf16_first=1, fp8_bf16_last=1), 1e-5),
    "tensorwise_tp2_sp": ("tensorwise", dict(tp=2, sequence_parallel=True), 2e-2),
    # (ZeRO-3 in the stages: the GEMM weights gathered as FP8, then split into I and W)
    "tensorwise_dp2_pp2_zbh1_m2_zero3": ("tensorwise", dict(dp=2, pp=2, microbatches=2, zero=3,
                                                        schedule="zb-h1"), 1e-5),
    "rowwise_dp2_tp2_pp2_zero3_m2": ("rowwise", dict(dp=2, tp=2, pp=2, zero=3, microbatches=2),
                                     2e-2),
    # sequence parallelism: Ulysses' all-to-alls move no sum; the ring's online softmax adds
    # the attention in another order (FP8 rounding amplifies it, as tp's partial sums)
    "tensorwise_dp2_sp2_ulysses": ("tensorwise", dict(dp=2, sp=2, sp_mode="ulysses"), 1e-5),
    "tensorwise_dp2_sp2_ring": ("tensorwise", dict(dp=2, sp=2, sp_mode="ring"), 2e-2),
}  # fmt: skip

_GRADS: dict = {}


def _grads(recipe: str, **layout):
    key = (recipe, tuple(sorted(layout.items())))
    if key not in _GRADS:
        cfg = small_config(fp8=recipe, **layout)
        tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices]))
        t = cfg.train
        batches = Batches(load_corpus("stdlib", 256), t.global_batch, t.seq_len, seed=3)
        loss, g = tr.grads(tr.init_state(0)["params"], batches.global_array(0, tr.batch_sharding))
        _GRADS[key] = float(loss), jax.tree.map(np.asarray, tr.convert(g, "canonical"))
    return _GRADS[key]


@pytest.mark.parametrize("name", list(CASES))
def test_layout_equals_one_device(name):
    recipe, layout, tol = CASES[name]
    loss, g = _grads(recipe, **layout)
    same = {k: v for k, v in layout.items() if k == "microbatches" or k.startswith("fp8_")}
    ref_loss, ref = _grads(recipe, **{"microbatches": 1, **same})
    assert abs(loss / ref_loss - 1) < 1e-5
    for path, leaf in jax.tree_util.tree_flatten_with_path(g)[0]:
        r = ref
        for k in path:
            r = r[k.key]
        err = np.abs(leaf - r).max() / np.abs(r).max()
        assert err < tol, (name, jax.tree_util.keystr(path), err)
    # and the recipe is on: its gradients are not the fp32 GEMMs' (their gap is far above tol)
    if name == "tensorwise_dp2_zero3_selective_bf16_ends":
        _, plain = _grads("none")
        pairs = zip(jax.tree.leaves(ref), jax.tree.leaves(plain), strict=True)
        gap = max(np.abs(a - b).max() / np.abs(b).max() for a, b in pairs)
        assert gap > 100 * tol


# a delayed history whose weight scale is too small for the MLP's up GEMM: its weights clip
CLIPPED = fp8.K_LO + 106  # the scale 2**-20 (the weights need about 2**-12)


def _clip_up_history(params):
    """``params`` with every layer's up-GEMM history saying its weight needed 2**-20 a step
    ago: the weights quantize with that scale and clip at 448 · 2**-20."""

    def one(path, leaf):
        if "fp8_up" not in jax.tree_util.keystr(path):
            return leaf
        return jax.device_put(leaf.at[..., 1, CLIPPED - fp8.K_LO].set(0.0), leaf.sharding)

    return jax.tree_util.tree_map_with_path(one, params)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_zero3_gathers_gemm_weights_as_fp8_with_the_same_numbers(recipe):
    """ZeRO-3 gathers each GEMM weight as e4m3 bytes, quantized before the gather with its
    GEMM's scale (tensorwise: from the shards' amax, Q, K and V sharing one and the gate and
    up projections another; delayed: from the GEMM's history) and scaled back after it: the
    GEMMs quantize the same values, so dp 2 × tp 2 + SP gives the bf16 gather's loss and
    gradients bit for bit, with half the gathered bytes of those weights (the norm scales are
    gathered as they were). Delayed, with a history that makes the up GEMM's weights clip:
    its history's gradient still records the scale the weight needed, not the clipped values'."""
    import re
    from unittest import mock

    def run(fp8_gather: bool):
        cfg = small_config(dp=2, tp=2, zero=3, fp8=recipe, compute_dtype="bfloat16",
                           sequence_parallel=True)  # fmt: skip
        groups = fp8.gather_groups if fp8_gather else (lambda paths: None)
        with mock.patch.object(fp8, "gather_groups", groups):
            tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[:4]))
            t = cfg.train
            rows = Batches(load_corpus("stdlib", 256), t.global_batch, t.seq_len, seed=3)
            params = tr.init_state(0)["params"]
            if recipe == "delayed":
                params = _clip_up_history(params)
            loss, g = tr.grads(params, rows.global_array(0, tr.batch_sharding))
            text = tr.compile_step().as_text()
        gathers = re.findall(r"= (\w+)\[([\d,]*)\]\S* all-gather(?:-start)?\(", text)
        elems = {}
        for dtype, dims in gathers:
            elems[dtype] = elems.get(dtype, 0) + int(np.prod([int(d) for d in dims.split(",")]))
        return float(loss), tr.convert(g, "canonical"), elems

    loss, g, fp8_elems = run(True)
    ref_loss, ref, bf16_elems = run(False)
    assert loss == ref_loss
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if recipe == "delayed":  # the weight's own scale recorded, above the one that clipped it
        seen = np.asarray(g["layers"]["mlp"]["fp8_up"])[:, 1]  # [L, BUCKETS]
        assert (seen > 0).sum(axis=-1).tolist() == [1] * seen.shape[0]
        assert np.all(np.argmax(seen, axis=-1) > CLIPPED - fp8.K_LO)
    # a layer's GEMM weights on one tp rank: D·(H + 2·K)·Dh + H·Dh·D + 3·D·F, over tp
    m = small_config().model
    dh = m.d_model // m.n_heads
    gemm = (m.d_model * (m.n_heads + 2 * m.n_kv_heads) * dh + m.n_heads * dh * m.d_model
            + 3 * m.d_model * m.d_ff) // 2  # fmt: skip
    assert fp8_elems.get("u8", 0) > 0 and "u8" not in bf16_elems
    assert fp8_elems["u8"] % gemm == 0  # whole layers' GEMM weights, one byte an element
    # each of them a byte or more lighter than in the bf16 program (whose gathers XLA:CPU
    # widens to fp32 on this CPU target: three bytes lighter here)
    size = {"u8": 1, "f16": 2, "bf16": 2, "f32": 4}
    wire = [sum(size[t] * n for t, n in e.items()) for e in (fp8_elems, bf16_elems)]
    assert wire[1] - wire[0] >= fp8_elems["u8"]


def test_tp_rings_across_nodes_equal_one_device():
    """Where ZeRO-3's calls cross nodes (here nodes of two devices), Megatron-SP's FP8 gathers
    and reduce-scatters run as the collective matmul's rings (``sharding.fp8_rings``): FP8
    collective-permutes in the program and no FP8 activation all-gather, gradients equal to one
    device's at the GSPMD path's FP8 tolerance. Inside one node the same layout keeps GSPMD's
    FP8 all-gathers and no permute."""
    import re

    def run(per_node: int):
        cfg = small_config(fp8="tensorwise", dp=2, tp=2, sequence_parallel=True, zero=3)
        cfg.mesh.hardware.devices_per_node = per_node
        tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[:4]))
        t = cfg.train
        rows = Batches(load_corpus("stdlib", 256), t.global_batch, t.seq_len, seed=3)
        loss, g = tr.grads(tr.init_state(0)["params"], rows.global_array(0, tr.batch_sharding))
        text = tr.compile_step().as_text()
        kinds = {op: {d for d, o in re.findall(r"= (\w+)\[[\d,]*\]\S* ([\w-]+?)(?:-start)?\(",
                                                text) if o == op}
                 for op in ("collective-permute", "all-gather")}  # fmt: skip
        return tr.rules.fp8_rings, float(loss), tr.convert(g, "canonical"), kinds

    rings, loss, g, kinds = run(2)
    ref_loss, ref = _grads("tensorwise", microbatches=1)
    assert rings and abs(loss / ref_loss - 1) < 1e-5
    # FP8 values travel as bytes on XLA:CPU (u8); the ZeRO-3 weight gathers stay all-gathers
    # FP8 activations on the wire: XLA:CPU widens their collectives to f16 (the compute dtype
    # here is fp32; the ZeRO-3 weight gathers move FP8 bytes as u8)
    fp8_wire = {"f16", "f8e4m3fn", "f8e5m2"}
    assert fp8_wire & kinds["collective-permute"] and not fp8_wire & kinds["all-gather"]
    for path, leaf in jax.tree_util.tree_flatten_with_path(g)[0]:
        r = ref
        for k in path:
            r = r[k.key]
        err = np.abs(np.asarray(leaf) - r).max() / np.abs(r).max()
        assert err < 2e-2, (jax.tree_util.keystr(path), err)
    rings, _, _, gspmd = run(8)
    assert not rings and not gspmd["collective-permute"] and fp8_wire & gspmd["all-gather"]
    # not inside a pipeline's ticks (jaxpar.sharding.fp8_rings says why)
    from jaxpar import sharding as shd

    cfg = small_config(fp8="tensorwise", dp=2, tp=2, pp=2, sequence_parallel=True, zero=3)
    cfg.mesh.hardware.devices_per_node = 2
    assert not shd.fp8_rings(cfg.layout, cfg.mesh.hardware)
    cfg.layout.pp = 1
    assert shd.fp8_rings(cfg.layout, cfg.mesh.hardware)


def test_bf16_ends_run_their_blocks_without_fp8():
    """``layout.fp8_bf16_first/last``: the loss is embed → the first blocks with bf16 GEMMs →
    the middle ones in FP8 → the last ones in bf16 → head, composed here by hand; and it
    differs from both the all-FP8 and the all-bf16 model's."""
    import dataclasses

    from jaxpar import sharding as shd
    from jaxpar.model import Model

    cfg = small_config(fp8="tensorwise", fp8_bf16_first=1, fp8_bf16_last=2)
    model = Model(cfg.model)
    params = model.init(jax.random.key(0))
    mesh = make_mesh(cfg.layout, jax.devices()[:1])
    batches = Batches(load_corpus("stdlib", 256), 4, cfg.train.seq_len, seed=3)
    batch = batches.global_array(0, NamedSharding(mesh, P()))
    tokens, targets = batch[:, :-1], batch[:, 1:]
    rules = shd.rules_for(cfg.model, cfg.layout)
    bf16 = dataclasses.replace(rules, fp8="none")
    all_fp8 = dataclasses.replace(rules, fp8_bf16_ends=(0, 0))
    pos = np.arange(tokens.shape[1])
    layer = lambda i, j: jax.tree.map(lambda a: a[i:j], params["layers"])  # noqa: E731

    def by_hand():
        x = model.embed(params, tokens)
        for lo, hi, r in ((0, 1, bf16), (1, 2, all_fp8), (2, 4, bf16)):
            with shd.use_rules(r):
                x = model.blocks(layer(lo, hi), x, pos)
        return model.head_loss(params, x, targets)

    def loss(r):
        with shd.use_rules(r):
            return model.loss(params, tokens, targets)

    with jax.set_mesh(mesh):
        got, want = float(jax.jit(lambda: loss(rules))()), float(jax.jit(by_hand)())
        fp8_loss, none = (
            float(jax.jit(lambda: loss(all_fp8))()),
            float(jax.jit(lambda: loss(bf16))()),
        )
    # the composition to fp32 rounding; each gap (FP8 blocks more or fewer) five times that
    assert abs(got - want) <= 2e-7 * abs(want)
    assert min(abs(got - fp8_loss), abs(got - none)) > 1e-6 * abs(got)


def test_moe_bf16_ends_fall_on_groups():
    """A MoE model's bf16 ends count blocks: the dense prefix block and the last MoE group in
    bf16, the first group in FP8 (:meth:`ModelConfig.bf16_spans`), composed here by hand from
    the prefix and group loops; it differs from the all-FP8 and the all-bf16 model's."""
    import dataclasses

    from jaxpar import sharding as shd

    tr = moe_trainer("tensorwise", fp8_bf16_first=1, fp8_bf16_last=1)
    cfg, model = tr.cfg, tr.model
    assert cfg.model.bf16_spans(1, 1) == {"moe_layers": (0, 1), "layers": (1, 0)}
    params = model.init(jax.random.key(0))
    rows = moe_rows(0)
    tokens, targets = rows[:, :-1], rows[:, 1:]
    rules = shd.rules_for(cfg.model, cfg.layout)
    bf16 = dataclasses.replace(rules, fp8="none")
    all_fp8 = dataclasses.replace(rules, fp8_bf16_ends=(0, 0))
    pos = np.arange(tokens.shape[1])
    group = lambda g: jax.tree.map(lambda a: a[g : g + 1], params["moe_layers"])  # noqa: E731

    def by_hand():
        with shd.use_rules(bf16):
            x = model.blocks(params["layers"], model.embed(params, tokens), pos)
        for g, r in ((0, all_fp8), (1, bf16)):
            with shd.use_rules(r):
                x, _ = model.moe_groups(group(g), x, pos)
        return model.head_loss(params, x, targets)

    def loss(r):
        with shd.use_rules(r):
            return model.loss(params, tokens, targets)

    mesh = make_mesh(cfg.layout, jax.devices()[:1])
    with jax.set_mesh(mesh):
        got, want = float(jax.jit(lambda: loss(rules))()), float(jax.jit(by_hand)())
        fp8_loss = float(jax.jit(lambda: loss(all_fp8))())
        none = float(jax.jit(lambda: loss(bf16))())
    assert abs(got - want) <= 2e-7 * abs(want)
    assert min(abs(got - fp8_loss), abs(got - none)) > 1e-6 * abs(got)


def moe_trainer(recipe: str, **layout) -> Trainer:
    """test_moe's tiny MoE (8 experts, top-2, a shared expert; layer 0 dense), 8 × 16 tokens,
    with the FP8 ``recipe`` on ``layout`` (also tests/test_fp8_delayed.py's)."""
    from jaxpar import config as C

    cfg = small_config(fp8=recipe, **layout)
    moe = C.MoeConfig(experts=8, top_k=2, shared_experts=1, expert_ff=16, first_dense=1)
    cfg.model = C.ModelConfig(name="tiny-moe-test", n_layers=3, d_model=32, n_heads=4,
                              n_kv_heads=2, d_ff=64, vocab_size=64, max_seq_len=32,
                              moe=moe)  # fmt: skip
    cfg.train.global_batch, cfg.train.seq_len = 8, 16
    return Trainer(cfg, make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices]))


def moe_rows(seed: int) -> np.ndarray:
    """A batch for :func:`moe_trainer`, rank-coded: a row routed to the wrong rank shows."""
    rows = np.random.default_rng(seed).integers(0, 64, (8, 17)).astype(np.int32)
    rows[:, 0] = np.arange(8)
    return rows


def _moe_grads(recipe: str, **layout):
    """:func:`moe_trainer`'s MoE with FP8, fp32 compute (built without the CLI's bf16 rule, as
    the layouts above): loss and canonical gradients of one rank-coded batch."""
    tr = moe_trainer(recipe, **layout)
    loss, g = tr.grads(tr.init_state(0)["params"], jax.device_put(moe_rows(0), tr.batch_sharding))
    return float(loss), jax.tree.map(np.asarray, tr.convert(g, "canonical"))


@pytest.mark.parametrize(
    "recipe, layout",
    [
        # with the dense block and the last MoE group in bf16: the first group's in FP8
        ("tensorwise", dict(dp=4, ep=2, zero=3, fp8_bf16_first=1, fp8_bf16_last=1)),
        ("rowwise", dict(dp=2, ep=2)),
    ],
)
def test_moe_experts_fp8_equal_one_device(recipe, layout):
    """Each routed expert's GEMMs in FP8 (a tensorwise scale per expert over its tokens on
    every edp rank, not over ep, whose ranks hold other experts; rowwise scales per token row
    and per column over the expert's tokens): dp × ep (with ZeRO-3) reproduces one device's
    gradients, the experts' included; with bf16 ends, one device with the same ends."""
    ref_loss, ref = _moe_grads(recipe, **{k: v for k, v in layout.items() if "fp8" in k})
    loss, g = _moe_grads(recipe, **layout)
    assert abs(loss / ref_loss - 1) < 1e-6
    for path, leaf in jax.tree_util.tree_flatten_with_path(g)[0]:
        r = ref
        for k in path:
            r = r[k.key]
        assert np.abs(leaf - r).max() <= 1e-5 * np.abs(r).max(), jax.tree_util.keystr(path)


# ---- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(fp8="blockwise"), "layout.fp8='blockwise'"),
        (dict(fp8="tensorwise", compute_dtype="float32"), "needs layout.compute_dtype='bfloat16'"),
        (dict(fp8_bf16_first=1), "layout.fp8_bf16_first=1: keeps blocks in bf16 under an FP8"),
        (  # two MoE groups of two blocks each: an end inside a group
            dict(fp8="tensorwise", compute_dtype="bfloat16", fp8_bf16_first=1, moe=True),
            "layout.fp8_bf16_first=1: must end on a MoE group boundary: at most "
            "model.moe.first_dense=0 blocks, or 0 plus a multiple of model.moe.every=2",
        ),
        (
            dict(fp8="tensorwise", compute_dtype="bfloat16", fp8_bf16_last=1, pp=2, microbatches=2),
            "layout.fp8_bf16_last=1: not supported with a pipeline yet",
        ),
        (
            dict(fp8="tensorwise", compute_dtype="bfloat16", fp8_bf16_first=2, fp8_bf16_last=2),
            "layout.fp8_bf16_last = 4: must leave at least one of the 4 blocks in FP8",
        ),
    ],
)
def test_bad_recipe_refused_in_one_line(change, words):
    from jaxpar import config as C

    moe = change.pop("moe", False)
    cfg = small_config(**change)
    if moe:
        cfg.model.moe = C.MoeConfig(experts=8, top_k=2, expert_ff=16, every=2)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")) as e:
        V.validate(cfg, cfg.layout.n_devices)
    assert "\n" not in str(e.value)


def test_gpu_without_fp8_tensor_cores_refused():
    V.check_fp8_device("tensorwise", "gpu", "h100-sxm5-80gb")  # Hopper: accepted
    V.check_fp8_device("tensorwise", "cpu")  # emulated on the CPU
    V.check_fp8_device("none", "gpu", "a100-sxm4-80gb")
    with pytest.raises(ConfigError, match=r"hardware.gpu='a100-sxm4-80gb' \(compute capability "
                                          r"8.0\) has no FP8 tensor cores"):  # fmt: skip
        V.check_fp8_device("rowwise", "gpu", "a100-sxm4-80gb")
    with pytest.raises(ConfigError, match="this GPU"):
        V.check_fp8_device("rowwise", "cuda", capability=(8, 6))


# ---- the time model prices FP8 GEMMs on FP8 tensor cores ----------------------------------


DIMS = "lhs_contracting_dims={1}, rhs_contracting_dims={0}"


def _gemm_module(n: int, dtype: str) -> str:
    """One gemm fusion of two ``dtype`` [n, n] operands with an fp32 result, XLA:GPU's form."""
    return f"""HloModule t, is_scheduled=true, num_partitions=1

%gemm_fusion (p0: {dtype}[{n},{n}], p1: {dtype}[{n},{n}]) -> f32[{n},{n}] {{
  %p0 = {dtype}[{n},{n}]{{1,0}} parameter(0)
  %p1 = {dtype}[{n},{n}]{{1,0}} parameter(1)
  ROOT %d = f32[{n},{n}]{{1,0}} dot(%p0, %p1), {DIMS}
}}

ENTRY %main (a: {dtype}[{n},{n}], b: {dtype}[{n},{n}]) -> f32[{n},{n}] {{
  %a = {dtype}[{n},{n}]{{1,0}} parameter(0)
  %b = {dtype}[{n},{n}]{{1,0}} parameter(1)
  ROOT %g = f32[{n},{n}]{{1,0}} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion
}}
"""


@pytest.mark.parametrize("mesh", ["h100-8", "a100-8"])
def test_time_model_runs_fp8_gemms_at_the_fp8_ceiling(mesh):
    """A large FP8 GEMM costs its FLOPs at the published FP8 ceiling (DeepGEMM: 1550 TFLOP/s
    on Hopper), a bf16 one at the bf16 ceiling (794.5): about half the time. A GPU without FP8
    tensor cores (A100: no ``peak_flops_fp8``) prices it as bf16. Both count as GEMMs of
    their precision in the program."""
    import types

    from jaxpar import config as C
    from jaxpar.analysis.hlo_text import parse_module
    from jaxpar.gpu.costs import Coster
    from jaxpar.gpu.timing import simulate

    hw = C.load_mesh(mesh).hardware
    one = types.SimpleNamespace(devices=np.arange(1), axis_names=("dp",))
    n = 16384
    t8 = simulate(_gemm_module(n, "f8e4m3fn"), one, hw).compute_s
    t16 = simulate(_gemm_module(n, "bf16"), one, hw).compute_s
    if mesh == "h100-8":
        assert hw.peak_flops_fp8 == 1979e12
        assert t8 == pytest.approx(2.0 * n**3 / 1550e12, rel=1e-9)
        assert t16 == pytest.approx(2.0 * n**3 / 794.5e12, rel=1e-9)
    else:
        assert hw.peak_flops_fp8 == 0 and t8 == pytest.approx(t16, rel=1e-9)
    counts = Coster(parse_module(_gemm_module(64, "f8e4m3fn"))[0], hw).gemms()
    assert counts == {"fp8": 1}
    assert Coster(parse_module(_gemm_module(64, "bf16"))[0], hw).gemms() == {"bf16": 1}


# ---- the planner prices the recipe -------------------------------------------------------


def _plan(mesh: str, fp8: str, **layout):
    from jaxpar import config as C
    from jaxpar.planner.search import evaluate
    from jaxpar.planner.workload import Shape

    cfg = C.load("llama3-8b", mesh)
    for k, v in {"fp8": fp8, "compute_dtype": "bfloat16", **layout}.items():
        setattr(cfg.layout, k, v)
    return evaluate(cfg.model, cfg.mesh.hardware, cfg.layout, Shape(8, 4096)).cost


def test_planner_prices_fp8_gemms_gathers_and_scales():
    """On an H100 pod the weight matmuls run at the FP8 peak (the compute term, attention and
    memory-bound work included, falls by more than 15%), Megatron-SP's six gathers a layer
    move one byte per element (14/20 of the bf16 bytes: the four reduce-scatters stay bf16),
    and each FP8 operand's scale is a max over dp: 8 calls a layer and micro-batch, exposed.
    An A100 has no FP8 peak: no faster."""
    z3 = dict(dp=8, tp=1, zero=3)
    bf, f8 = _plan("h100-8", "none", **z3), _plan("h100-8", "tensorwise", **z3)
    assert f8.terms["compute"] < 0.85 * bf.terms["compute"]
    scale = [c for c in f8.comm if c.label == "FP8 scale all-reduce (max)"]
    assert len(scale) == 1 and scale[0].calls == 32 * 8 and scale[0].exposed_s == scale[0].seconds
    assert not [c for c in bf.comm if c.label.startswith("FP8")]
    sp = dict(dp=1, tp=8, sequence_parallel=True)
    tp_bytes = {f: sum(c.bytes for c in _plan("h100-8", f, **sp).comm if c.name == "tp_comm")
                for f in ("none", "tensorwise", "rowwise")}  # fmt: skip
    assert tp_bytes["tensorwise"] / tp_bytes["none"] == pytest.approx(14 / 20, rel=0.01)
    # rowwise gathers each row-parallel output's gradient twice (per row, then per column)
    assert tp_bytes["rowwise"] / tp_bytes["none"] == pytest.approx(16 / 20, rel=0.01)
    a100 = _plan("a100-8", "tensorwise", **z3).terms["compute"]
    assert a100 >= _plan("a100-8", "none", **z3).terms["compute"]


def test_plan_searches_with_the_recipe(capsys):
    """``jaxpar plan --fp8`` ranks every layout with the recipe and prints it; on a GPU without
    FP8 tensor cores it is refused in one line, exit 2."""
    from jaxpar.cli import main

    assert main(["plan", "--model", "llama3-8b", "--mesh", "h100-8", "--fp8", "tensorwise",
                 "--top", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "recommended:" in out and "fp8=tensorwise" in out.split("recommended:")[2]
    assert main(["plan", "--model", "llama3-8b", "--mesh", "a100-8", "--fp8", "rowwise"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no FP8 tensor cores" in err[0]


def test_compile_for_h100_runs_fp8_gemms(tmp_path):
    """``jaxpar compile`` for an H100 node: every weight GEMM of the layers, forward and
    backward, has FP8 operands in the XLA:GPU program (the LM head's stay bf16), the estimate
    counts them, and the simulated GEMMs take less time than bf16's. (The step does not: at
    width 64 the quantization's memory-bound work and the scale all-reduces outweigh them.)"""
    import json

    from test_gpu_compile import _compile, _plugin_or_fail, _report

    _plugin_or_fail()
    base = ("--mesh", "h100-8", "--dp", "8", "--tp", "1", "--pp", "1", "--zero", "3", "--json")

    def run(*extra):
        trace = tmp_path / f"trace{len(extra)}.json"
        out = _report(_compile(tmp_path, *base, *extra, "--trace", str(trace)))["estimate"]
        events = json.loads(trace.read_text())["traceEvents"]
        return out, sum(e["dur"] for e in events if e.get("cat") == "matmul")

    (bf16, bf16_matmul), (got, got_matmul) = run(), run("--fp8", "tensorwise")
    assert got["gemms"].get("fp8", 0) >= 12  # 4 GEMMs a layer forward, 8 backward
    assert "fp8" not in bf16["gemms"] and bf16["gemms"]["bf16"] >= 15
    assert got["gemms"]["bf16"] < bf16["gemms"]["bf16"]
    assert 0 < got_matmul < 0.95 * bf16_matmul


def test_layout_auto_searches_with_the_recipe(capsys):
    """``jaxpar train --layout auto --fp8 R``: the planner ranks the layouts with the recipe
    (on the CPU mesh too: bf16 compute, emulated) and the run takes it; other layout flags
    still conflict with auto."""
    import json

    from jaxpar.cli import main

    args = ["train", "--model", "tiny", "--global-batch", "8", "--seq-len", "32", "--layout",
            "auto", "--dry-run", "--json"]  # fmt: skip
    assert main([*args, "--fp8", "rowwise"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["layout"]["fp8"] == "rowwise" and out["layout"]["compute_dtype"] == "bfloat16"
    assert out["auto_layout"]["layout"]["fp8"] == "rowwise"
    assert main([*args, "--fp8", "rowwise", "--compute-dtype", "bfloat16"]) == 2
    assert "conflicts with --compute-dtype" in capsys.readouterr().err
