"""The pipeline executor reproduces the single-device loss and gradients on every schedule and
composes with every layout; checkpoints stay layout-independent; evaluation runs forward only.

Coverage (each case one compile of the gradient program; the full grid — every schedule at
p ∈ {2, 4}, m ∈ {4, 8}, v ∈ {1, 2}, and every layout below with ZeRO 0-3 — runs in
``scripts/bench_pipeline_grid.py``):

* p = 4: 1F1B m 8 (fused ticks, backward first), lean 1F1B m 8 (stashes capped at p - r,
  one action per tick), interleaved v 2 m 8 (layers at rest in placement order), ZB-V m 8
  (split backward, V placement);
* p = 2 composed with the other axes, one schedule each: dp 2 × tp 2 with ZeRO 2 on ZB-H1 m 4
  (per-micro-batch reduce-scatter of the split backward's pieces) and ZeRO 0 on interleaved
  v 2 m 4; dp 2 × sp 2 with ring attention and ZeRO 3 on 1F1B m 4, and Ulysses on GPipe m 4
  under ``remat full``; dp 2 × tp 2 with ZeRO 3 on 1F1B m 4 under ``remat full`` (each
  layer's backward re-run from its stashed input); hybrid sharding (dp 4, dp_shard 2, ZeRO 3)
  on DualPipeV m 4; optimizer offload on 1F1B m 2 (two steps); tied embeddings on 1F1B.

The reference is one device without micro-batching (equal micro-batches: the mean of their
means is the batch mean); inputs are real text, so a misrouted micro-batch or shard shows.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import validation as V
from jaxpar.analysis.hlo import collective_bytes
from jaxpar.checkpoint import Checkpointer
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


def trainer_of(cfg) -> Trainer:
    V.validate(cfg, cfg.layout.n_devices)
    return Trainer(cfg, make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices]))


def batch_of(tr: Trainer):
    return Batches(load_corpus("stdlib", 256), 16, 16, seed=3).global_array(0, tr.batch_sharding)


def loss_and_grads(cfg, hlo: bool = False):
    """Loss and canonical-order gradients; with ``hlo`` also the compiled program's text."""
    tr = trainer_of(cfg)
    params = tr.init_state(0)["params"]
    batch = batch_of(tr)
    with tr._ctx():
        fn = jax.jit(tr.grads_fn, in_shardings=(tr.device_shardings["params"], tr.batch_sharding))
        compiled = fn.lower(params, batch).compile()
        loss, g = compiled(params, batch)
    out = float(loss), jax.tree.map(np.asarray, tr.convert(g, "canonical"))
    return (*out, compiled.as_text(), tr.mesh) if hlo else out


@functools.cache
def reference(make_cfg):
    return loss_and_grads(tiny(make_cfg))


def assert_matches(got, ref):
    (loss, g), (ref_loss, ref_g) = got[:2], ref
    assert abs(loss / ref_loss - 1) < 1e-4
    for path, a in jax.tree_util.tree_leaves_with_path(g):
        b = ref_g
        for k in path:
            b = b[k.key]
        assert np.abs(b).max() > 0, path  # the comparison is not vacuous
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max(), err_msg=str(path))


SCHEDULES = [
    dict(schedule="1f1b", microbatches=8),
    dict(schedule="1f1b", microbatches=8, pipeline_memory="lean"),
    dict(schedule="interleaved", microbatches=8, virtual=2),
    dict(schedule="zbv", microbatches=8, virtual=2),
]


@pytest.mark.parametrize("layout", SCHEDULES, ids=lambda d: "-".join(map(str, d.values())))
def test_schedule_matches_single_device(make_cfg, layout):
    assert_matches(loss_and_grads(tiny(make_cfg, pp=4, **layout)), reference(make_cfg))


LAYOUTS = {
    "dp2-tp2-z2-zbh1": dict(dp=2, tp=2, zero=2, schedule="zb-h1", microbatches=4),
    "dp2-tp2-z0-interleaved": dict(
        dp=2, tp=2, zero=0, schedule="interleaved", virtual=2, microbatches=4
    ),  # fmt: skip
    # Megatron-SP in the stages: GSPMD's gathers, not the collective matmul's rings (whose
    # permutes inside a stage's branch met other stages' on CPU: a wrong loss)
    "dp2-tp2-sp-z1-interleaved": dict(
        dp=2,
        tp=2,
        sequence_parallel=True,
        zero=1,
        schedule="interleaved",
        virtual=2,
        microbatches=4,
    ),  # fmt: skip
    "dp2-sp2-ring-z3-1f1b": dict(
        dp=2, sp=2, sp_mode="ring", zero=3, schedule="1f1b", microbatches=4
    ),  # fmt: skip
    "dp2-sp2-ulysses-gpipe-full": dict(
        dp=2, sp=2, sp_mode="ulysses", schedule="gpipe", microbatches=4, remat="full"
    ),  # fmt: skip
    "dp2-tp2-z3-1f1b-full": dict(
        dp=2, tp=2, zero=3, schedule="1f1b", microbatches=4, remat="full"
    ),  # fmt: skip
    "dp4-shard2-z3-dualpipev": dict(
        dp=4, dp_shard=2, zero=3, schedule="dualpipev", virtual=2, microbatches=4
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_with_pipeline_matches_single_device(make_cfg, name):
    loss, g, text, mesh = loss_and_grads(tiny(make_cfg, pp=2, **LAYOUTS[name]), hlo=True)
    assert_matches((loss, g), reference(make_cfg))
    # Inside the tick scan only the executor's own sends permute (over pp): a collective-permute
    # in a stage's branch (ring attention's, say) would meet another stage's on CPU.
    rep = collective_bytes(text, mesh)
    in_ticks = {c.axes for c in rep.collectives if c.kind == "collective-permute" and c.trips != 1}
    assert in_ticks == {("pp",)}, in_ticks
    # The embedding and head are stage-owned at rest: no gradient is summed over pp, only the
    # scalar loss.
    assert_no_pp_sum_but_the_loss(rep)


def assert_no_pp_sum_but_the_loss(rep, allowed: float = 0.0):
    """Every pp collective other than the pipeline's permutes moves at most the scalar loss
    (plus ``allowed`` bytes)."""
    other = [c for c in rep.collectives if "pp" in c.axes and c.kind != "collective-permute"]
    assert sum(c.bytes for c in other) <= 8 + allowed, [(c.kind, c.bytes, c.axes) for c in other]


def test_tied_embeddings_with_a_pipeline(make_cfg):
    """Tied embeddings: the table is read by the first stage and the head (1F1B: on different
    ranks); it stays replicated over pp and its gradient, the sum of both uses, is the one pp
    all-reduce of the step."""

    def tied(**kw):
        cfg = tiny(make_cfg, **kw)
        cfg.model.tied_embeddings = True
        return cfg

    loss, g, text, mesh = loss_and_grads(tied(pp=2, schedule="1f1b", microbatches=4), hlo=True)
    assert "w_out" not in g["head"]
    assert_matches((loss, g), loss_and_grads(tied()))
    table = g["embed"]["table"]
    assert_no_pp_sum_but_the_loss(collective_bytes(text, mesh), allowed=table.nbytes)


def test_recompute_holds_one_layers_residuals(make_cfg):
    """remat full in a pipeline: the stash holds each layer's input and the backward re-runs
    one layer at a time, so a chunk of 4 layers compiles to about the temporaries of a chunk
    of 1 plus 3 layer inputs per stash slot — not 3 more layers' residuals at once (as one
    VJP of the whole chunk from the stage input held)."""
    from jaxpar.planner.activations import block_residuals

    def temps(n_layers):
        cfg = tiny(make_cfg, pp=2, schedule="1f1b", microbatches=2, remat="full")
        cfg.model.n_layers = n_layers
        tr = trainer_of(cfg)
        batch = jax.ShapeDtypeStruct((16, 17), jnp.int32, sharding=tr.batch_sharding)
        with tr._ctx():
            c = jax.jit(tr.grads_fn).lower(tr.abstract_params, batch).compile()
        return c.memory_analysis().temp_size_in_bytes, cfg

    small, _ = temps(2)
    big, cfg = temps(8)
    tokens = 16 // 2 * cfg.train.seq_len  # one micro-batch on one rank (no dp)
    full_layer = block_residuals(cfg.model, cfg.layout, cfg.train.seq_len, "blockwise",
                                 "none").bytes(tokens, 4)  # fmt: skip
    # 3 more layers per chunk: their inputs in the stash slots, a small share of a layer's
    # residuals each (measured 0.14 of a layer; the whole chunk under one VJP, as before: 3.3)
    assert big - small < 1.0 * full_layer, (big - small, full_layer)


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


def test_interleaved_checkpoint_restores_on_other_layouts(make_cfg, tmp_path):
    """Written under interleaved (layers at rest in placement order), a checkpoint holds
    canonical order: it restores under 1F1B, ZeRO-3 dp 8 and one device, and one written on
    one device restores under interleaved, to the same values."""
    inter = trainer_of(tiny(make_cfg, pp=2, schedule="interleaved", virtual=2, microbatches=4))
    assert inter.rest.order is not None  # the stack at rest is not in canonical order
    # A distinct value per layer, so a misplaced layer shows; checkpoints hold canonical order
    # (what the training loop writes: Trainer.convert(state, "canonical")).
    canon = inter.convert(inter.init_state(0), "canonical")
    canon["params"]["layers"] = jax.tree.map(
        lambda a: a + jnp.arange(8.0).reshape((8,) + (1,) * (a.ndim - 1)), canon["params"]["layers"]
    )
    # Adam's first moment is zero at init: give it values, so its owner slots are checked too.
    adam = canon["opt"][1][0]
    canon["opt"] = (canon["opt"][0], (adam._replace(mu=jax.tree.map(lambda a: a + 1.0, adam.mu)),
                                      *canon["opt"][1][1:]))  # fmt: skip
    want = jax.tree.map(np.asarray, canon)
    ckpt = Checkpointer(tmp_path / "ck", every=1)
    ckpt.save(1, canon, {"model": {}}, force=True)
    for layout in (dict(pp=2, schedule="1f1b", microbatches=4), dict(dp=8, zero=3), dict()):
        tr = trainer_of(tiny(make_cfg, **layout))
        got, _ = ckpt.restore(1, tr.canonical_abstract_state())
        got = tr.convert(tr.convert(got, "rest"), "canonical")
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, got), want)
    # The reverse: written on one device, read under interleaved: its stack at rest is the
    # placement permutation of the canonical one.
    back, _ = ckpt.restore(1, inter.canonical_abstract_state())
    back = inter.convert(back, "rest")
    wq = np.asarray(back["params"]["layers"]["attn"]["wq"])
    np.testing.assert_array_equal(wq, want["params"]["layers"]["attn"]["wq"][inter.rest.order])
    # Stage-owned leaves, params and Adam moments alike: the owner's slot holds the canonical
    # value, the other slots zeros (embedding: rank 0; head: the last stage's rank, 1 here).
    mu = lambda state: state["opt"][1][0].mu  # noqa: E731  (clip, then AdamW's moments)
    assert all(np.all(np.asarray(a) != 0) for a in jax.tree.leaves(mu(want)))
    for rest, canon in ((back["params"], want["params"]), (mu(back), mu(want))):
        for key, owner in (("embed", 0), ("head", 1)):
            for a, b in zip(jax.tree.leaves(rest[key]), jax.tree.leaves(canon[key]), strict=True):
                a = np.asarray(a)
                assert a.shape == (2, *b.shape)
                np.testing.assert_array_equal(a[owner], b)
                assert not np.any(a[1 - owner])
    ckpt.close()


def test_pipeline_evaluation_runs_forward_only(make_cfg):
    """At pp > 1 the held-out loss comes from the schedule's forwards (no weight gathered
    over pp) and equals one device's."""
    ref = trainer_of(tiny(make_cfg))
    cfg = tiny(make_cfg, pp=2, dp=2, schedule="interleaved", virtual=2, microbatches=4)
    tr = trainer_of(cfg)
    canonical = ref.init_state(0)["params"]
    params = tr.convert(tr.init_state(0)["params"], "canonical")
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params),
                 jax.tree.map(np.asarray, canonical))  # fmt: skip
    want = float(ref.eval_loss(canonical, batch_of(ref)))
    got = float(tr.eval_loss(tr.init_state(0)["params"], batch_of(tr)))
    assert abs(got / want - 1) < 1e-5
    batch = jax.ShapeDtypeStruct((16, 17), jnp.int32, sharding=tr.batch_sharding)
    with tr._ctx():
        text = tr._eval.lower(tr.abstract_params, batch).compile().as_text()
    rep = collective_bytes(text, tr.mesh)
    assert rep.select("all-gather", ("pp",)).bytes == 0  # no stage's weights leave their rank
    assert rep.select("collective-permute", ("pp",)).count > 0  # activations do


def test_optimizer_offload_with_a_pipeline(make_cfg):
    """``offload=optimizer`` under pp 2: Adam's state at rest in ``pinned_host``, the same
    losses and gradient norms as on the device, step after step."""

    def trajectory(**layout):
        tr = trainer_of(tiny(make_cfg, pp=2, microbatches=2, **layout))
        state, out = tr.init_state(0), []
        for _ in range(2):
            state, m = tr.step(state, batch_of(tr))
            out.append((float(m["loss"]), float(m["grad_norm"])))
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state["opt"])}
        return np.array(out), kinds

    ref, on_device = trajectory()
    got, on_host = trajectory(offload="optimizer")
    assert on_device == {"device"} and on_host == {"pinned_host"}
    np.testing.assert_allclose(got, ref, rtol=1e-6)


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
        (dict(pp=2, remat="offload", microbatches=2), "remat='offload': not supported with pp"),
    ],
)
def test_bad_pipeline_layouts(make_cfg, layout, needle):
    cfg = tiny(make_cfg, **layout)
    with pytest.raises(ConfigError) as e:
        V.validate(cfg, cfg.layout.n_devices)
    assert needle in str(e.value) and "\n" not in str(e.value)
