"""One gradient path for every layout (jaxpar.train.grads): equivalence, the stage's dp bytes
from the compiled HLO, the reduction it names, remat meanings, refusals.

Each case compiles twice (gradients for equivalence, the step for its collectives). The cases
cover every ZeRO stage and every layout of the issue's grid at least once; the whole grid runs
in ``scripts/bench_grad_path.py`` (its table is in BENCHMARKS.md). Other files cover more of the
same mechanism: test_zero (dp-only stages, hybrid, offload), test_tpsp (tp/sp modes),
test_pipeline (every schedule).
"""

from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config

from jaxpar import config as C
from jaxpar import validation as V
from jaxpar.analysis.memory import dp_comm_theory, measure
from jaxpar.data import Batches, load_corpus
from jaxpar.devices import make_mesh
from jaxpar.errors import ConfigError
from jaxpar.model.names import weight
from jaxpar.train.remat import remat_of
from jaxpar.train.step import Trainer

# (layout, ZeRO stage, micro-batches): every stage, every layout of the grid, k = 1 and k > 1.
CASES = {
    "dp4_tp2_z3": (dict(dp=4, tp=2), 3, 1),
    "dp2_tp4_z2_k4": (dict(dp=2, tp=4), 2, 4),
    "dp2_sp2_tp2_ulysses_z3": (dict(dp=2, sp=2, tp=2), 3, 1),
    "dp2_sp2_tp2_ring_z3_k2": (dict(dp=2, sp=2, tp=2, sp_mode="ring"), 3, 2),
    "dp2_tp2_pp2_z1_m4": (dict(dp=2, tp=2, pp=2), 1, 4),
    "dp2_tp2_pp2_z3_m2": (dict(dp=2, tp=2, pp=2), 3, 2),
}


def cfg_of(layout: dict, zero: int, k: int) -> C.RunConfig:
    cfg = small_config(zero=zero, microbatches=k, **layout)
    cfg.train.global_batch = 16
    V.validate(cfg, cfg.layout.n_devices)
    return cfg


def grads(cfg: C.RunConfig):
    tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices]))
    t = cfg.train
    batches = Batches(load_corpus("stdlib", 256), t.global_batch, t.seq_len, seed=3)
    loss, g = tr.grads(tr.init_state(0)["params"], batches.global_array(0, tr.batch_sharding))
    return tr, float(loss), jax.tree.map(np.asarray, tr.convert(g, "canonical"))


@cache
def reference():
    return grads(small_config(dp=1))[1:]


@pytest.mark.parametrize("name", list(CASES))
def test_layout_reproduces_one_device_and_reduces_as_its_stage(name):
    layout, zero, k = CASES[name]
    cfg = cfg_of(layout, zero, k)
    tr, loss, g = grads(cfg)
    ref_loss, ref = reference()
    assert abs(loss / ref_loss - 1) < 1e-4
    for path, leaf in jax.tree_util.tree_flatten_with_path(g)[0]:
        r = ref
        for key in path:
            r = r[key.key]
        tol = 1e-4 * np.abs(r).max()
        np.testing.assert_allclose(leaf, r, rtol=1e-4, atol=tol, err_msg=str(path))
    names = ("all_reduce_once", "reduce_scatter_once", "reduce_scatter_per_microbatch",
             "reduce_scatter_per_layer")  # fmt: skip
    assert tr.dp_reduction == names[zero]

    m = measure(cfg)
    comm = m["comm"]
    dp_kinds = {e["kind"] for e in comm["entries"] if set(e["axes"]) == {"dp"} and e["bytes"] > 1e3}
    assert dp_kinds == ({"all-reduce"} if zero == 0 else {"reduce-scatter", "all-gather"})
    # Inside a pipeline the collectives of a tick's branches count as often as the table runs
    # them (jaxpar.pipeline.branches.branch_scope), so the stage's theory holds there too.
    theory = dp_comm_theory(cfg)["total_bytes"]
    assert comm["dp_wire_bytes"] == pytest.approx(theory, rel=0.10)

    # Many leaves, one collective: per micro-batch, ZeRO-3 gathers each layer's weights with one
    # all-gather (forward, again in the backward; plus embedding and head) and reduces their
    # gradients with one reduce-scatter; ZeRO-2 one reduce-scatter of the whole gradient.
    count = lambda kind: sum(e["count"] for e in comm["entries"]  # noqa: E731
                             if e["kind"] == kind and set(e["axes"]) == {"dp"})  # fmt: skip
    passes = k * (cfg.model.n_layers + 2)  # the layers, the embedding, the head
    if zero == 3 and cfg.layout.pp == 1:
        assert count("all-gather") <= 2 * passes and count("reduce-scatter") <= passes
    if zero == 2 and cfg.layout.pp == 1:
        assert count("reduce-scatter") == k
    if cfg.layout.sp > 1 and cfg.layout.sp_mode == "ulysses" and cfg.layout.remat == "none":
        # Four all-to-alls per layer forward (q, k, v in, o out) and four in the backward (their
        # transposes); ZeRO-3's remat policy keeps their outputs rather than re-running them.
        a2a = sum(e["count"] for e in comm["entries"] if e["kind"] == "all-to-all")
        assert a2a == 8 * k * cfg.model.n_layers, a2a


def test_remat_none_under_zero3_keeps_no_weight():
    """``none`` keeps every activation and, under ZeRO-3, no weight (nor anything computed from
    one): the backward gathers again. ``selective`` keeps matmul outputs, ``full`` nothing."""

    def layer(x_BxD, w_DxF):
        w = weight(jnp.concatenate([w_DxF, w_DxF], axis=1).reshape(w_DxF.shape[0], -1))
        h = jnp.tanh(x_BxD @ w)
        return jnp.sin(h) @ w.T

    x, w = jnp.ones((4, 8)), jnp.ones((8, 16))

    def saved(setting):
        """Shapes of what the backward keeps (the VJP's leaves, less the inputs)."""
        fn = jax.checkpoint(layer, policy=remat_of(setting).policy(regather=True))
        leaves = jax.tree_util.tree_leaves(jax.vjp(fn, x, w)[1])
        return [tuple(a.shape) for a in leaves if a is not x and a is not w]

    kept = saved("none")
    assert not {(8, 32), (32, 8)} & set(kept), kept  # no weight, nor its concat or transpose
    assert (4, 32) in kept  # the activations (tanh and its input's derivative) are kept
    assert {(8, 32), (32, 8)} & set(saved("selective")) == set()
    assert (4, 32) not in saved("full")
    assert remat_of("none").policy(regather=False) is None  # no checkpoint at all without ZeRO-3
    assert remat_of("full").recompute_forward and not remat_of("selective").recompute_forward


def test_project_gradients_equal_autodiff_of_the_matmul():
    """``layers.project`` (the up projections' custom VJP): value, dx and dW equal JAX's own
    derivative of the same contraction, with the fused QKV weight's extra output axes."""
    from jaxpar.model.layers import project

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 5, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 2, 3, 4)), jnp.float32)  # [D, tp, N, Dh]
    ct = jnp.asarray(rng.standard_normal((2, 5, 2, 3, 4)), jnp.float32)

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w) * ct)

    want = jax.value_and_grad(loss(lambda x, w: jnp.einsum("bsd,dtnk->bstnk", x, w)), (0, 1))
    got = jax.value_and_grad(loss(project), (0, 1))
    (v0, g0), (v1, g1) = want(x, w), got(x, w)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    for a, b in zip(g1, g0, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("setting", ["selective", "offload"])
def test_policies_keep_projected_outputs(setting):
    """The projection's matmul is inside a custom VJP, invisible to a dot policy: its tagged
    output is kept (``selective``) or offloaded (``offload``), so the backward runs no second
    forward matmul: as many dots as without any checkpoint."""
    from jaxpar.model.layers import project
    from jaxpar.model.names import projected

    def layer(x, w, w2):
        return jnp.tanh(projected(project(x, w))) @ w2

    x, w, w2 = jnp.ones((2, 4, 8)), jnp.ones((8, 16)), jnp.ones((16, 8))

    def dots(fn):
        g = jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1, 2))
        return str(jax.make_jaxpr(g)(x, w, w2)).count("dot_general")

    policy = remat_of(setting).policy(regather=False)
    assert dots(jax.checkpoint(layer, policy=policy)) == dots(layer)
    assert dots(jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)) > dots(
        layer
    )  # the count sees a recomputed projection


@pytest.mark.parametrize(
    "layout,match",
    [
        (dict(pp=2, remat="offload", microbatches=2), "remat='offload': not supported with pp"),
    ],
)
def test_unsupported_combinations_refused_in_one_line(layout, match):
    with pytest.raises(ConfigError, match=match) as e:
        V.validate(small_config(**layout), None)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("setting", ["none", "selective", "full"])
def test_zero3_packed_gather_keeps_no_gathered_weight(setting):
    """A layer's weights gathered in one packed all-gather (dp 4 × tp 2): under every remat
    setting the backward keeps the shards it was given and activations, never a gathered
    weight (it gathers again)."""
    from jax._src.ad_checkpoint import saved_residuals
    from jax.sharding import PartitionSpec as P

    from jaxpar.train.reduce import DPReduction

    mesh = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    dims, specs = {"w1": 0, "w2": 1, "s": -1}, {"w1": P(None, "tp"), "w2": P("tp"), "s": P()}
    red = DPReduction(3, ("dp",), "dp", {"dp": 4}, dims, specs, jnp.float32, jnp.float32)

    def layer(x_BxD, lp):
        w = red.gather(lp, red.dims, red.auto_specs)
        return jnp.sin(jnp.tanh(x_BxD @ w["w1"]) * w["s"]) @ w["w2"]

    fn = jax.shard_map(
        jax.checkpoint(layer, prevent_cse=False, policy=remat_of(setting).policy(regather=True)),
        in_specs=(P("dp"), {"w1": P("dp"), "w2": P(None, "dp"), "s": P()}),
        out_specs=P("dp"),
        axis_names={"dp"},
        check_vma=False,
    )
    lp = {"w1": jnp.ones((8, 32)), "w2": jnp.ones((32, 8)), "s": jnp.ones(())}
    with jax.set_mesh(mesh):
        kept = saved_residuals(fn, jnp.ones((16, 8)), lp)
    computed = [tuple(a.shape) for a, why in kept if "argument" not in str(why)]
    # Per dp rank a gathered weight holds 8 * 32 values, an activation [4, 32] half of that.
    assert all(np.prod(shape) // 4 < 8 * 32 for shape in computed), computed
    assert bool(computed) == (setting != "full")  # activations kept unless recomputed
