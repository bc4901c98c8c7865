"""Blockwise attention, its parallel forms, the chunked loss and the layer loop against the dense
reference (fp32, relative 1e-5); refusals of implementations a run cannot use. 8 simulated CPU
devices (conftest), small shapes.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TEST_XLA_FLAGS, small_config

from jaxpar import validation as V
from jaxpar.analysis.hlo import compiled_memory
from jaxpar.data import Batches, load_corpus
from jaxpar.devices import make_mesh
from jaxpar.errors import ConfigError
from jaxpar.model import Model, flash
from jaxpar.model.attention import causal_attention, resolve
from jaxpar.model.llama import Hooks
from jaxpar.train.step import Trainer

RTOL = 1e-5


def _qkv(b=2, s=37, h=4, kvh=2, dh=8, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, s, h, dh))
    k = jax.random.normal(ks[1], (b, s, kvh, dh))
    v = jax.random.normal(ks[2], (b, s, kvh, dh))
    w = jax.random.normal(ks[3], (b, s, h, dh))  # a random cotangent direction
    return q, k, v, w


def _value_and_grads(core, q, k, v, w):
    return jax.jit(
        jax.value_and_grad(lambda q, k, v: jnp.sum(core(q, k, v) * w), argnums=(0, 1, 2))
    )(q, k, v)


def _close(got, ref, what=""):
    """Relative agreement at the scale of each leaf."""
    for path, r in jax.tree_util.tree_flatten_with_path(ref)[0]:
        g = got
        for k in path:
            g = g[k.key] if hasattr(k, "key") else g[k.idx]
        r, g = np.asarray(r), np.asarray(g)
        np.testing.assert_allclose(
            g, r, rtol=RTOL, atol=RTOL * np.abs(r).max(), err_msg=f"{what}{path}"
        )


# --------------------------------------------------------------------------------------------
# The kernel


@pytest.mark.parametrize("block", [8, 5, 64, 1])
def test_blockwise_matches_dense_with_gqa(block):
    """Output and dq, dk, dv of the blockwise kernel equal the dense causal GQA reference
    (4 query heads on 2 kv heads); 37 positions: blocks of 8 and 5 need padding."""
    q, k, v, w = _qkv()
    ref = _value_and_grads(causal_attention, q, k, v, w)
    got = _value_and_grads(lambda *a: flash.blockwise_attention(*a, block), q, k, v, w)
    _close(got, ref)


@pytest.mark.parametrize(
    "s, h, kvh, dh",
    [(37, 4, 2, 16), (100, 4, 4, 32), (70, 8, 2, 64), (65, 2, 1, 128), (200, 4, 2, 32)],
)
def test_native_matches_dense(s, h, kvh, dh):
    """The native CPU kernel (jaxpar/native/flash_cpu.cc): output and dq, dk, dv equal the
    dense causal reference, with GQA and without, every head dim it takes, sequences that its
    64-position tiles do not divide (one and two partial tiles), and four tiles (diagonal ones,
    whose products skip the zeros above the causal staircase, and off-diagonal ones)."""
    from jaxpar.model import native

    assert native.unavailable() is None  # a C++ compiler is part of the test machine
    q, k, v, w = _qkv(b=3, s=s, h=h, kvh=kvh, dh=dh)
    _close(_value_and_grads(native.flash_attention, q, k, v, w),
           _value_and_grads(causal_attention, q, k, v, w))  # fmt: skip


def test_native_threaded_and_serial_agree_and_serial_under_several_devices():
    """The kernel splits its tasks over XLA's pool only in a one-device process (this one has
    8 simulated devices); threaded and serial it computes the same bits."""
    from jaxpar.model import native

    assert native.unavailable() is None
    assert jax.device_count() > 1 and not native._threaded()
    q, k, v, _ = _qkv(b=3, s=100, h=4, kvh=2, dh=32)
    do = jnp.cos(q)
    outs = {}
    for threaded in (True, False):
        o, lse = jax.ffi.ffi_call(
            native._FWD,
            (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((3, 4, 100), q.dtype)),
        )(q, k, v, threaded=np.bool_(threaded))
        shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
        grads = jax.ffi.ffi_call(native._BWD, shapes)(
            q, k, v, o, lse, do, threaded=np.bool_(threaded)
        )
        outs[threaded] = [np.asarray(x) for x in (o, lse, *grads)]
    for a, b in zip(outs[True], outs[False], strict=True):
        np.testing.assert_array_equal(a, b)


def test_causal_mask_and_skipped_tiles(monkeypatch):
    """The past never sees the future (changing keys/values at position t leaves every output
    before t unchanged), and forward and backward visit only the n(n+1)/2 lower-triangular
    tiles of n blocks (counted as they run)."""
    q, k, v, w = _qkv(s=32)
    fn = jax.jit(lambda q, k, v: flash.blockwise_attention(q, k, v, 8))
    t = 19
    o1 = fn(q, k, v)
    o2 = fn(q, k.at[:, t:].add(1.0), v.at[:, t:].add(1.0))
    np.testing.assert_array_equal(o1[:, :t], o2[:, :t])
    assert not np.allclose(o1[:, t:], o2[:, t:])

    visits = {"fold": 0, "tile_grads": 0}
    for name in visits:
        inner = getattr(flash, name)

        def counted(*a, _inner=inner, _name=name):
            jax.debug.callback(lambda: visits.__setitem__(_name, visits[_name] + 1))
            return _inner(*a)

        monkeypatch.setattr(flash, name, counted)
    jax.block_until_ready(_value_and_grads(lambda *a: flash.blockwise_attention(*a, 8), q, k, v, w))
    n = 32 // 8
    assert visits == {"fold": n * (n + 1) // 2, "tile_grads": n * (n + 1) // 2}


def test_attention_temporaries_grow_linearly_with_the_sequence():
    """Compiled temporaries of the kernel's forward and backward: linear in the sequence at a
    fixed block size (4x the positions, under 5x the bytes), the dense form's quadratic."""

    def temp(core, s):
        q, k, v, w = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _qkv(b=1, s=s, dh=16))
        f = jax.jit(jax.grad(lambda q, k, v, w: jnp.sum(core(q, k, v) * w), argnums=(0, 1, 2)))
        return compiled_memory(f.lower(q, k, v, w).compile())["temp"]

    blockwise = lambda *a: flash.blockwise_attention(*a, 32)  # noqa: E731
    grow = temp(blockwise, 1024) / temp(blockwise, 256)
    dense = temp(causal_attention, 1024) / temp(causal_attention, 256)
    assert grow < 5, grow
    assert dense > 8, dense


# --------------------------------------------------------------------------------------------
# The model on every layout


def _cfg(attention="blockwise", **layout):
    cfg = small_config(**layout)
    cfg.model.n_layers = 2
    cfg.model.attention = attention
    cfg.model.attention_block = 8  # 4 blocks of the 32 positions, 2 per ring shard
    cfg.model.loss_chunk = 8  # 4 cross-entropy chunks
    cfg.train.global_batch = 8
    return cfg


_REF: dict = {}


def _reference():
    """Loss and gradients of the dense one-device model, unchunked loss, rolled layer scan."""
    if not _REF:
        cfg = _cfg()
        cfg.model.attention, cfg.model.loss_chunk, cfg.model.layer_unroll = "dense", 10**6, 1
        model = Model(cfg.model)
        params = model.init(jax.random.key(0))
        rows = Batches(load_corpus("stdlib", 256), 8, 32, seed=3).rows(0, 0, 8)
        loss, grads = jax.jit(jax.value_and_grad(model.loss))(params, rows[:, :-1], rows[:, 1:])
        _REF.update(params=params, rows=rows, loss=float(loss), grads=grads)
    return _REF


LAYOUTS = {
    "one-device": dict(layer_unroll=0),
    "tp2": dict(tp=2),
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "ulysses2": dict(sp=2, sp_mode="ulysses"),
    "ring2": dict(sp=2, sp_mode="ring"),
    "pp2": dict(pp=2, microbatches=2, layer_unroll=0),
}


@pytest.mark.parametrize(
    "name, attention",
    [(n, "blockwise") for n in LAYOUTS] + [(n, "native") for n in LAYOUTS if n != "ring2"],
)
def test_loss_and_every_gradient_match_dense_reference(name, attention):
    """Every layout, with the blockwise kernel and with the native one (ring attention runs
    the blockwise kernel only), against the dense one-device model (head dim 16)."""
    ref = _reference()
    layout = dict(LAYOUTS[name])
    unroll = layout.pop("layer_unroll", 1)
    cfg = _cfg(attention, **layout)
    cfg.model.layer_unroll = unroll
    V.validate(cfg, cfg.layout.n_devices)
    tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices]))
    # Canonical weights in, converted to the layout's form at rest (pp: stage-owned ends).
    params = tr.convert(jax.device_put(ref["params"], tr.canonical_param_shardings), "rest")
    batch = jax.device_put(np.asarray(ref["rows"]), tr.batch_sharding)
    loss, grads = tr.grads(params, batch)
    grads = tr.convert(grads, "canonical")
    assert float(loss) == pytest.approx(ref["loss"], rel=RTOL)
    _close(jax.tree.map(np.asarray, grads), ref["grads"], f"{name}: ")


def test_chunked_loss_keeps_big_vocabulary_logits_out_of_memory():
    """head_loss in sequence chunks: the same loss and gradients as one chunk, and compiled
    temporaries well under the [B, S, V] fp32 logits the unchunked loss keeps."""
    cfg = _cfg()
    cfg.model.vocab_size, cfg.model.d_model, cfg.model.n_heads, cfg.model.n_kv_heads = (
        4096,
        32,
        2,
        1,
    )
    b, s = 2, 256
    x = jax.random.normal(jax.random.key(1), (b, s, cfg.model.d_model))
    tg = jax.random.randint(jax.random.key(2), (b, s), 0, cfg.model.vocab_size)
    out = {}
    for chunk in (s, 32):
        cfg.model.loss_chunk = chunk
        model = Model(cfg.model)
        params = model.init(jax.random.key(0))
        fn = jax.jit(jax.value_and_grad(partial(model.head_loss, targets_BxS=tg), argnums=(0, 1)))
        out[chunk] = (fn(params, x), compiled_memory(fn.lower(params, x).compile())["temp"])
    (ref, temp_one), (got, temp_chunked) = out[s], out[32]
    _close(got, ref)
    logits_bytes = b * s * cfg.model.vocab_size * 4
    assert temp_one >= logits_bytes
    assert temp_chunked < logits_bytes / 2, (temp_chunked, logits_bytes)


def test_zero3_head_keeps_the_chunked_loss_out_of_memory():
    """Under ZeRO-3 the head runs inside a checkpoint of its own (the gathered head weights
    must not be kept): that checkpoint saves nothing, so the loss's chunks still recompute
    their logits and ZeRO-3's temporaries stay within half the device's [B, S, V] fp32
    logits of ZeRO-0's (a policy saving activations there kept every chunk's softmax and
    one-hot: twice the logits more)."""
    temps = {}
    for zero in (0, 3):
        cfg = small_config(dp=2, zero=zero)
        cfg.model.vocab_size, cfg.model.loss_chunk, cfg.model.max_seq_len = 4096, 32, 256
        cfg.train.global_batch, cfg.train.seq_len = 4, 256
        mesh = make_mesh(cfg.layout, jax.devices()[:2])
        temps[zero] = compiled_memory(Trainer(cfg, mesh).compile_step())["temp"]
    logits_bytes = 4 // 2 * 256 * 4096 * 4  # one device's rows
    # ZeRO-3 adds its gathered weights, not a copy of the logits per chunk
    assert temps[3] - temps[0] < logits_bytes / 2, (temps, logits_bytes)


def test_layer_unroll_leaves_no_loop_unless_the_body_is_wrapped():
    """layer_unroll 0: straight-line layers (no while loop of 3 trips, one per layer, in the
    compiled program; the attention's own loops have other trip counts); with a remat wrap
    the layers stay in a rolled scan."""
    cfg = _cfg()
    cfg.model.layer_unroll, cfg.model.n_layers = 0, 3
    model = Model(cfg.model)
    params = model.init(jax.random.key(0))
    tok = jnp.zeros((2, 32), jnp.int32)

    def hlo(wrap):  # the forward shows the layer loop as well as the backward would
        loss = lambda p: model.loss(p, tok, tok, hooks=Hooks(layer=wrap))  # noqa: E731
        return jax.jit(loss).lower(params).compile().as_text()

    layer_loop = '"known_trip_count":{"n":"3"}'
    assert layer_loop not in hlo(None)
    assert layer_loop in hlo(lambda body: jax.checkpoint(body, prevent_cse=False))


def test_rotary_tables_are_constants_of_the_program():
    """The compiled loss and gradient (static positions) and a decode-style rotation (traced
    per-row positions) evaluate no sin or cos: XLA would fuse them into the rotation, once per
    element of q and k. Both read the same float64-accurate tables."""
    from jaxpar.model.layers import rope

    cfg = _cfg()
    model = Model(cfg.model)
    params = model.init(jax.random.key(0))
    tok = jnp.zeros((2, 32), jnp.int32)
    grad = jax.jit(jax.value_and_grad(lambda p: model.loss(p, tok, tok)))
    assert " sine(" not in grad.lower(params).compile().as_text()

    s, dh, theta = 2048, 64, 10000.0
    x = jax.random.normal(jax.random.key(1), (2, s, 2, dh))
    static = jax.jit(lambda x: rope(x, np.arange(s), theta, s))(x)
    traced_fn = jax.jit(lambda x, p: rope(x, p, theta, s))
    rows = jnp.stack([jnp.arange(s), jnp.arange(s)[::-1]])  # per row, as when decoding
    assert " sine(" not in traced_fn.lower(x, rows).compile().as_text()
    traced = traced_fn(x, rows)
    np.testing.assert_array_equal(traced[0], static[0])
    backwards = jax.jit(lambda x: rope(x, np.arange(s)[::-1].copy(), theta, s))(x[1:])
    np.testing.assert_array_equal(traced[1], backwards[0])
    # float64 rotation of the same float32 angles
    half = dh // 2
    freq = theta ** (-np.arange(half, dtype=np.float32) / half)
    angle = (np.arange(s, dtype=np.float32)[:, None] * freq).astype(np.float64)[None, :, None]
    x1, x2 = np.split(np.asarray(x[:1], np.float64), 2, axis=-1)
    ref = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                          x2 * np.cos(angle) + x1 * np.sin(angle)], axis=-1)  # fmt: skip
    assert np.abs(np.asarray(static[:1]) - ref).max() < 1e-5


# --------------------------------------------------------------------------------------------
# Choosing and refusing implementations


def test_auto_picks_cudnn_only_where_it_applies():
    assert resolve("auto", True, jnp.bfloat16, 128) == "cudnn"
    assert resolve("auto", True, jnp.float32, 128) == "blockwise"
    assert resolve("auto", False, jnp.bfloat16, 128) == "blockwise"
    assert resolve("auto", True, jnp.bfloat16, 160) == "blockwise"  # head dim beyond cuDNN's
    assert resolve("auto", True, jnp.bfloat16, 128, "ring") == "blockwise"
    assert resolve("dense", False, jnp.float32, 64) == "dense"


def test_auto_picks_native_on_cpu_in_float32_only():
    """The native kernel where it applies (CPU, float32, head dims 16/32/64/128, not ring);
    the blockwise one elsewhere, and wherever the platform is not known."""
    assert resolve("auto", False, jnp.float32, 64, platform="cpu") == "native"
    assert resolve("auto", False, jnp.bfloat16, 64, platform="cpu") == "blockwise"
    assert resolve("auto", False, jnp.float32, 48, platform="cpu") == "blockwise"
    assert resolve("auto", False, jnp.float32, 64, "ring", platform="cpu") == "blockwise"
    assert resolve("auto", True, jnp.float32, 64, platform="gpu") == "blockwise"
    assert resolve("auto", False, jnp.float32, 64) == "blockwise"


@pytest.mark.parametrize(
    "dtype, head_dim, mode, platform, match",
    ids=["bf16", "head-dim", "ring", "gpu"],
    argvalues=[
        (jnp.bfloat16, 64, "local", "cpu", "the native kernel computes in float32 only; this "
         "run computes in bfloat16"),
        (jnp.float32, 48, "local", "cpu", "head dim 48: the native kernel takes 16, 32, 64, 128"),
        (jnp.float32, 64, "ring", "cpu", r"ring attention \(layout.sp_mode='ring'\) runs the "
         "blockwise kernel"),
        (jnp.float32, 64, "local", "gpu", "the native kernel runs on CPU only; this run is on gpu"),
    ],
)  # fmt: skip
def test_forced_native_refused_where_it_cannot_run(dtype, head_dim, mode, platform, match):
    with pytest.raises(ConfigError, match=f"model.attention='native': {match}") as e:
        resolve("native", False, dtype, head_dim, mode, platform)
    assert "\n" not in str(e.value)


def test_native_refuses_a_sharded_sequence():
    """Called directly under ring rules (resolve never picks it there) the kernel refuses: a
    device holding part of the sequence would attend to its own keys only."""
    from jaxpar.model import native
    from jaxpar.sharding import rules_for, use_rules

    cfg = _cfg(sp=2, sp_mode="ring")
    q, k, v, _ = _qkv(dh=16)
    with use_rules(rules_for(cfg.model, cfg.layout)):
        with pytest.raises(ConfigError, match="the sequence is sharded"):
            native.flash_attention(q, k, v)


def test_native_without_a_compiler_falls_back_or_refuses(tmp_path):
    """No C++ compiler (``CXX`` names none) and nothing built yet: ``auto`` keeps the blockwise
    kernel, a forced ``native`` is one line saying why."""
    import os
    import subprocess
    import sys

    code = (
        "import jax.numpy as jnp\n"
        "from jaxpar.errors import ConfigError\n"
        "from jaxpar.model.attention import resolve\n"
        "print(resolve('auto', False, jnp.float32, 32, platform='cpu'))\n"
        "try:\n"
        "    resolve('native', False, jnp.float32, 32, platform='cpu')\n"
        "except ConfigError as e:\n"
        "    print(e)\n"
    )
    env = dict(os.environ, CXX="no-such-compiler", JAXPAR_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.splitlines()  # fmt: skip
    assert out == [
        "blockwise",
        "model.attention='native': no C++ compiler found ($CXX, g++, c++ or clang++)",
    ]


@pytest.mark.parametrize(
    "setting, layout, match",
    ids=["cudnn-on-cpu", "native-bf16", "dense-ring", "unknown"],
    argvalues=[
        ("cudnn", {}, r"model.attention='cudnn': needs an NVIDIA GPU.*no NVIDIA GPU, compute "
         r"dtype float32"),
        ("native", dict(compute_dtype="bfloat16"), r"model.attention='native': the native "
         r"kernel computes in float32 only; this run computes in bfloat16"),
        ("dense", dict(sp=2, sp_mode="ring"), r"model.attention='dense': ring attention"),
        ("flash", {}, r"model.attention='flash': must be one of auto, blockwise, dense, cudnn, "
         "native"),
    ],
)  # fmt: skip
def test_refused_in_one_line_before_compiling(setting, layout, match, monkeypatch):
    from jaxpar.train import loop

    cfg = _cfg(**layout)
    cfg.model.attention = setting
    compiled = []
    monkeypatch.setattr(Trainer, "compile_step", lambda self: compiled.append(1))
    with pytest.raises(ConfigError, match=match) as e:
        loop.run(cfg, devices=jax.devices()[: cfg.layout.n_devices], quiet=True)
    assert "\n" not in str(e.value) and not compiled


@pytest.mark.parametrize("field, value", [("attention_block", 0), ("loss_chunk", -1)])
def test_bad_sizes_refused(field, value):
    cfg = _cfg()
    setattr(cfg.model, field, value)
    with pytest.raises(ConfigError, match=rf"model.{field}={value}: must be a positive integer"):
        V.validate(cfg, cfg.layout.n_devices)


def test_gpu_check_dry_mode_runs_on_cpu():
    """scripts/gpu_check.sh --dry: the bench and both loss checks run (CPU, tiny sizes) and
    report what a GPU run would, as one JSON line."""
    import json
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS}  # no device count of this process's
    out = subprocess.run(
        ["bash", str(root / "scripts" / "gpu_check.sh"), "--dry"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0 and got["ok"], (got, out.stderr[-2000:])
    bench = got["bench"]
    assert bench["attention"] == "blockwise" and bench["tokens_per_s"] > 0
    assert 0 < bench["mfu"] < 1 and bench["memory_per_device_bytes"] > 0
    for dtype in ("float32", "bfloat16"):
        check = got["loss_check"][dtype]
        assert len(check["losses"]) == 2 and check["max_rel_diff"] < check["tolerance"]
