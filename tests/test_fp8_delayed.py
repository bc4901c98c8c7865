"""Delayed FP8 scaling (``layout.fp8='delayed'``): scales from an amax history carried in the
parameter tree, every layout keeping one device's history, checkpoints carrying it onto other
layouts, overflow counted, mismatched resumes refused."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MODEL_YAML, small_config
from test_fp8 import moe_rows, moe_trainer

from jaxpar import validation as V
from jaxpar.checkpoint import Checkpointer
from jaxpar.data import Batches, load_corpus
from jaxpar.devices import make_mesh
from jaxpar.errors import ConfigError
from jaxpar.model import fp8
from jaxpar.planner.fp8 import amax_calls
from jaxpar.train.checkpointing import check_fp8_history
from jaxpar.train.step import Trainer

SITES = (("attn", "fp8_qkv"), ("attn", "fp8_out"), ("mlp", "fp8_up"), ("mlp", "fp8_down"))


def _ages(buckets: dict[int, float]) -> np.ndarray:
    a = np.full(fp8.BUCKETS, fp8.NEVER, np.float32)
    for b, age in buckets.items():
        a[b] = age
    return a


def test_history_gives_the_largest_scale_within_reach():
    age = np.stack([_ages({150: 3, 152: 20}), _ages({}), _ages({10: 0, 11: 15})])
    # within 16 steps: bucket 150 (152 is 20 steps old); none; 11
    np.testing.assert_array_equal(fp8.hist_bucket(age, 16), [150, -1, 11])
    np.testing.assert_array_equal(fp8.hist_bucket(age, 25), [152, -1, 11])
    np.testing.assert_array_equal(fp8.hist_bucket(age, 4), [150, -1, 10])
    s = fp8._hist_scale(jnp.asarray(age), 16)
    np.testing.assert_array_equal(s, [2.0 ** (150 + fp8.K_LO), 1.0, 2.0 ** (11 + fp8.K_LO)])
    # a step that needed bucket 151 of the first operand and 10 of the third
    counts = np.zeros_like(age)
    counts[0, 151], counts[2, 10] = 2.0, 1.0
    new = np.asarray(fp8.advance(jnp.asarray(age), jnp.asarray(counts)))
    assert new[0, 151] == 0 and new[0, 150] == 4 and new[0, 152] == 21
    assert new[2, 10] == 0 and new[2, 11] == 16
    assert np.all(new[1] == fp8.NEVER)  # capped, never past NEVER
    # 151 > 150: the first operand was clipped; the third needed less than its history gave;
    # the empty second one quantized at scale 1 and needed nothing
    assert int(fp8.overflows(jnp.asarray(age), jnp.asarray(counts), 16)) == 1


def test_delayed_gemm_uses_the_history_and_reports_the_needed_scales():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 8, 16)) * 3.0, jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 24)) * 0.05, jnp.float32)
    # the histories say scales 2**-6 (x), 2**-12 (w), 2**-20 (dy)
    hist = jnp.stack([jnp.asarray(_ages({k - fp8.K_LO: 1})) for k in (-6, -12, -20)])
    recipe = fp8.Recipe("delayed", fp8.E5M2, rowwise=False, history=16)

    def q(t, s, dtype):
        return np.asarray(jnp.clip(t / s, -448.0, 448.0).astype(dtype).astype(jnp.float32)) * s

    y, vjp = jax.vjp(lambda x, w, h: fp8.tensordot(x, w, 1, recipe, "", h), x, w, hist)
    want = np.tensordot(q(x, 2.0**-6, fp8.E4M3), q(w, 2.0**-12, fp8.E4M3), 1)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-6, atol=1e-6)
    dy = jnp.asarray(rng.normal(size=y.shape) * 1e-3, jnp.float32)
    dx, dw, dh = vjp(dy)
    qdy = np.clip(np.asarray(dy) / 2.0**-20, -57344, 57344)
    qdy = np.asarray(jnp.asarray(qdy).astype(fp8.E5M2).astype(jnp.float32)) * 2.0**-20
    np.testing.assert_allclose(np.asarray(dx), np.tensordot(qdy, q(w, 2.0**-12, fp8.E4M3).T, 1),
                               rtol=1e-5, atol=1e-9)  # fmt: skip
    # the history's cotangent: one-hot of the scale current (tensorwise) scaling gives each
    for row, (t, dtype) in enumerate(((x, fp8.E4M3), (w, fp8.E4M3), (dy, fp8.E5M2))):
        k = int(np.log2(float(fp8._scale(t, dtype, tuple(range(t.ndim)), batch=False).ravel()[0])))
        assert np.argmax(np.asarray(dh[row])) == k - fp8.K_LO and float(dh[row].sum()) == 1.0


_RUNS: dict = {}


def _run(steps: int, **layout):
    """``steps`` steps of the test model with delayed FP8 on ``layout`` (kept per process: the
    checkpoint test restores the tp run's state)."""
    key = (steps, tuple(sorted(layout.items())))
    if key not in _RUNS:
        _RUNS[key] = _train(steps, **layout)
    return _RUNS[key]


def _train(steps: int, devices_per_node: int = 8, **layout):
    cfg = small_config(fp8="delayed", **layout)
    cfg.mesh.hardware.devices_per_node = devices_per_node  # 2: ZeRO-3 across "nodes"
    tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices]))
    t = cfg.train
    batches = Batches(load_corpus("stdlib", 256), t.global_batch, t.seq_len, seed=3)
    state, out = tr.init_state(0), []
    for i in range(steps):
        state, m = tr.step(state, batches.global_array(i, tr.batch_sharding))
        out.append((float(m["loss"]), int(m["fp8_overflow"])))
    return tr, state, out


_REF: dict = {}


def _reference():
    if not _REF:
        tr, state, out = _run(3)
        _REF["out"] = out
        _REF["params"] = jax.tree.map(np.asarray, tr.convert(state["params"], "canonical"))
    return _REF["out"], _REF["params"]


# (layout, tolerance on the trained params): pipeline and ZeRO-3 keep one device's numbers up
# to fp32 rounding; tp splits the GEMMs' sums (FP8 products regrouped: the loss to 1e-4, the
# Adam-normalised params not compared).
LAYOUTS = {
    "dp2_pp2_1f1b_m2": (dict(dp=2, pp=2, microbatches=2, schedule="1f1b"), 1e-5),
    # (ZeRO-3 in zero-bubble stages: the weights gathered as FP8 with the histories' scales,
    # each history's weight record written back by the gather, then split into I and W. The
    # W pass sums the fp32 gradients in another order; after three Adam steps the params are
    # 8.5e-5 of their largest apart, the same with the weights gathered in bf16)
    "dp2_pp2_zbh1_m2_zero3": (dict(dp=2, pp=2, microbatches=2, schedule="zb-h1", zero=3), 2e-4),
    "dp4_zero3": (dict(dp=4, zero=3), 1e-5),
    "dp2_tp2_sp": (dict(dp=2, tp=2, sequence_parallel=True), None),
    # ZeRO-3 across nodes of two devices: Megatron-SP's FP8 collectives as the rings
    # (sharding.fp8_rings), quantized with the same history scales
    "dp2_tp2_sp_zero3_rings": (
        dict(dp=2, tp=2, sequence_parallel=True, zero=3, devices_per_node=2),
        None,
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_keeps_one_devices_history(name):
    layout, tol = LAYOUTS[name]
    ref_out, ref = _reference()
    tr, state, out = _run(3, **layout)
    assert tr.rules.fp8_rings == name.endswith("_rings")
    got = jax.tree.map(np.asarray, tr.convert(state["params"], "canonical"))
    for (loss, over), (ref_loss, ref_over) in zip(out, ref_out, strict=True):
        assert abs(loss / ref_loss - 1) < (1e-5 if tol else 1e-4)
        assert over == ref_over
    for mod, leaf in SITES:  # the same scales for any history length
        for h in (1, 2, 16):
            np.testing.assert_array_equal(fp8.hist_bucket(got["layers"][mod][leaf], h),
                                          fp8.hist_bucket(ref["layers"][mod][leaf], h))  # fmt: skip
    # the history is live: three steps recorded scales, some within one step
    assert np.all(fp8.hist_bucket(ref["layers"]["mlp"]["fp8_down"], 1) >= 0)
    if tol is not None:
        for path, leaf in jax.tree_util.tree_flatten_with_path(got)[0]:
            if "fp8_" in jax.tree_util.keystr(path):
                continue
            r = ref
            for k in path:
                r = r[k.key]
            assert np.abs(leaf - r).max() <= tol * np.abs(r).max(), jax.tree_util.keystr(path)


def _moe_run(steps: int, **layout):
    """tests/test_fp8.py's tiny MoE trained ``steps`` steps with delayed FP8 on rank-coded
    rows."""
    tr = moe_trainer("delayed", **layout)
    state, out = tr.init_state(0), []
    for i in range(steps):
        state, m = tr.step(state, jax.device_put(moe_rows(i), tr.batch_sharding))
        out.append((float(m["loss"]), int(m["fp8_overflow"])))
    return out, jax.tree.map(np.asarray, tr.convert(state["params"], "canonical"))


def test_moe_experts_keep_one_devices_history():
    """Each routed expert's amax history (``[E, 3, BUCKETS]`` per MoE layer, split over ep like
    the experts): dp 2 × ep 2 keeps one device's histories, losses, overflow counts and trained
    parameters over two steps (the second quantizing with the first's history)."""
    ref_out, ref = _moe_run(2)
    out, got = _moe_run(2, dp=2, ep=2)
    for (loss, over), (ref_loss, ref_over) in zip(out, ref_out, strict=True):
        assert abs(loss / ref_loss - 1) < 1e-5 and over == ref_over
    hists = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(got)[0]:
        r = ref
        for k in path:
            r = r[k.key]
        if "fp8_" in jax.tree_util.keystr(path):
            hists += 1
            for h in (1, 16):
                np.testing.assert_array_equal(fp8.hist_bucket(leaf, h), fp8.hist_bucket(r, h))
        else:
            assert np.abs(leaf - r).max() <= 1e-5 * np.abs(r).max(), jax.tree_util.keystr(path)
    routed = ref["moe_layers"]["moe"]["mlp"]["fp8_down"]
    assert routed.shape[1:] == (8, 3, fp8.BUCKETS)  # [groups, experts, operands, buckets]
    assert np.any(fp8.hist_bucket(routed, 1) >= 0)  # recorded by the steps
    # leaves (each stacked over its layers): the dense block's 4 GEMMs; the MoE blocks'
    # attention (2), shared expert (2) and routed experts (3)
    assert hists == 4 + 2 + 2 + 3


def test_overflow_is_counted_and_the_history_catches_up():
    cfg = small_config(fp8="delayed")
    tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[:1]))
    t = cfg.train
    batches = Batches(load_corpus("stdlib", 256), t.global_batch, t.seq_len, seed=3)
    state = tr.init_state(0)
    # Every weight's history says "scale 2**-100 was needed last step": far too small; the
    # activations' and gradients' stay empty (scale 1: e4m3 and e5m2 hold them).
    tiny = jnp.asarray(np.stack([_ages({}), _ages({-100 - fp8.K_LO: 0}), _ages({})]))
    layers = state["params"]["layers"]
    for mod, leaf in SITES:
        layers[mod][leaf] = jnp.broadcast_to(tiny, layers[mod][leaf].shape)
    state, m = tr.step(state, batches.global_array(0, tr.batch_sharding))
    n_weights = cfg.model.n_layers * len(SITES)
    assert int(m["fp8_overflow"]) == n_weights
    # the scales the weights needed are recorded (their ages 0): each history now gives one
    # of them, far above the tiny one, and the next step clips fewer operands
    for mod, leaf in SITES:
        w_bucket = fp8.hist_bucket(state["params"]["layers"][mod][leaf][:, 1], 1)
        assert np.all(np.asarray(w_bucket) > -100 - fp8.K_LO)
    state, m2 = tr.step(state, batches.global_array(1, tr.batch_sharding))
    assert int(m2["fp8_overflow"]) < n_weights


def test_checkpoint_carries_the_history_onto_another_layout(tmp_path):
    tr, state, _ = _run(3, **LAYOUTS["dp2_tp2_sp"][0])  # the layout test's run, when it ran
    canon = jax.tree.map(np.asarray, tr.convert(state, "canonical"))
    ckpt = Checkpointer(tmp_path / "ck", every=1)
    ckpt.save(3, tr.convert(state, "canonical"), {"model": {}}, force=True)
    ckpt.wait()
    cfg = small_config(fp8="delayed", pp=2, dp=2, microbatches=2, schedule="1f1b")
    other = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[:4]))
    got, _ = ckpt.restore(3, other.canonical_abstract_state())
    got = other.convert(other.convert(got, "rest"), "canonical")
    for mod, leaf in SITES:
        a = np.asarray(got["params"]["layers"][mod][leaf])
        np.testing.assert_array_equal(a, canon["params"]["layers"][mod][leaf])
        assert np.any(a == 0)  # written by the steps, not the empty history
    ckpt.close()


def test_mismatched_history_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"has no FP8 amax history \(written with "
                       r"layout.fp8='tensorwise'\); continue with --fp8 tensorwise"):  # fmt: skip
        check_fp8_history({"layout": {"fp8": "tensorwise"}}, "delayed", "checkpoint step 2")
    with pytest.raises(ConfigError, match="was written with layout.fp8='delayed'"):
        check_fp8_history({"layout": {"fp8": "delayed"}}, "none", "checkpoint step 2")
    check_fp8_history({"layout": {"fp8": "delayed"}}, "delayed", "here")  # matching: accepted
    check_fp8_history({"layout": {"fp8": "none"}}, "rowwise", "here")
    # the layout's own rules: a history length the ages can hold, no MoE
    cfg = small_config(fp8="delayed", compute_dtype="bfloat16", fp8_history=255)
    with pytest.raises(ConfigError, match=r"layout.fp8_history=255: must be an integer in 1..254"):
        V.check_fp8(cfg.model, cfg.layout)


def test_resume_with_delayed_from_a_current_scaling_checkpoint_exits_2(tmp_path):
    (tmp_path / "test.yaml").write_text(MODEL_YAML)
    ck = tmp_path / "ck"
    base = [sys.executable, "-m", "jaxpar.cli", "train", "--model", str(tmp_path / "test.yaml"),
            "--mesh", "cpu-8", "--devices", "1", "--dp", "1", "--tp", "1", "--pp", "1",
            "--microbatches", "1", "--compute-dtype", "bfloat16", "--global-batch", "4",
            "--seq-len", "16", "--checkpoint-dir", str(ck), "--no-progress"]  # fmt: skip
    first = subprocess.run([*base, "--fp8", "tensorwise", "--steps", "2"], capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    again = subprocess.run([*base, "--fp8", "delayed", "--steps", "4", "--resume"],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert again.returncode == 2
    lines = [ln for ln in again.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "has no FP8 amax history" in lines[0], again.stderr
    assert sorted(p.name for p in ck.iterdir() if p.name.isdigit()) == ["2"]  # nothing lost


def test_planner_counts_delayed_amaxes_on_tp_only():
    cfg = small_config(fp8="delayed", dp=2, tp=2, sequence_parallel=True)
    calls = amax_calls(cfg.model, cfg.layout, tokens=1024)
    assert set(calls) == {"tp"} and calls["tp"].fwd == 0 and calls["tp"].bwd == 12
    cfg.layout.fp8 = "tensorwise"
    assert set(amax_calls(cfg.model, cfg.layout, tokens=1024)) == {"dp", "tp"}
