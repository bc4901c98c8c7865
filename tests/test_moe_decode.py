"""KV-cache decoding of a MoE model: every position's logits equal the dropless full forward's
(dense prefix, MoE groups with a dense block each, shared expert, a learned routing bias that
changes the selection), left-padded prompts of different lengths, on tp 2 (the heads and their
cache sharded; one device's generation is the reference of the expert-parallel test)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import config as C
from jaxpar.devices import make_mesh
from jaxpar.generate import Generator, Sampling, forward
from jaxpar.model import Model
from jaxpar.sharding import rules_for, use_rules

MOE = C.MoeConfig(experts=4, top_k=2, shared_experts=1, expert_ff=32, first_dense=1, every=2,
                  capacity_factor=1.0)  # fmt: skip
SHAPE = C.ModelConfig(name="dec-moe", n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96,
                      vocab_size=128, max_seq_len=32, init_std=0.2, moe=MOE)  # fmt: skip
DROPLESS = dataclasses.replace(SHAPE, moe=dataclasses.replace(MOE, capacity_factor=0.0))
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34]]
NEW = 8


def _params(model):
    params = jax.jit(model.init)(jax.random.key(1))
    mlp = params["moe_layers"]["moe"]["mlp"]
    # A bias of the scores' size: selection differs from the scores' own top-k.
    mlp["bias"] = 0.3 * jax.random.normal(jax.random.key(2), mlp["bias"].shape)
    return params


def _full_logits(model, params, tokens_BxS):
    positions = jnp.arange(tokens_BxS.shape[1])
    x = model.embed(params, tokens_BxS)
    x = model.blocks(params["layers"], x, positions)
    x, _ = model.moe_groups(params["moe_layers"], x, positions)
    return model.logits(params, x)


def _decode_logits(gen, params, fed_BxN):
    """Logits of the prefill, then of each fed token, through :func:`forward` and the cache."""
    model, b, p = gen.model, len(PROMPTS), max(map(len, PROMPTS))
    pad = jnp.array([p - len(x) for x in PROMPTS], jnp.int32)
    padded = jnp.array([[0] * (p - len(x)) + x for x in PROMPTS], jnp.int32)
    zeros = jnp.zeros(gen._cache_shape(b, p + NEW), jnp.float32)
    run = jax.jit(lambda prm, tok, cache, i: forward(model, prm, tok, cache, i, pad))
    logits, cache = run(params, padded, (zeros, zeros), 0)
    out = [logits]
    for t in range(NEW - 1):
        logits, cache = run(params, fed_BxN[:, t : t + 1], cache, p + t)
        out.append(logits)
    return np.stack(out, axis=1)


def test_moe_decode_logits_equal_the_full_forward():
    """tp 2: the decoding code has no one-device branch, so a sharded run checks it whole."""
    tp = 2
    lay = C.LayoutConfig(dp=1, tp=tp, pp=1, zero=0)
    mesh = make_mesh(lay, jax.devices()[:tp])
    rules = rules_for(SHAPE, lay)
    model = Model(SHAPE)
    with jax.set_mesh(mesh), use_rules(rules):
        params = _params(model)
        gen = Generator(model, mesh, rules)
        assert gen.model.cfg.moe.capacity_factor == 0  # sampling is dropless
        out = gen.generate(params, PROMPTS, NEW, Sampling(0.0))
        fed = jnp.array(out.tokens, jnp.int32)
        got_BxNxV = _decode_logits(gen, params, fed)
        full = jax.jit(lambda prm, t: _full_logits(Model(DROPLESS), prm, t))
        for b, prompt in enumerate(PROMPTS):
            seq = prompt + out.tokens[b]
            ref_SxV = np.asarray(full(params, jnp.array([seq + [0] * (32 - len(seq))])))[0]
            want = ref_SxV[len(prompt) - 1 : len(seq) - 1]
            np.testing.assert_allclose(got_BxNxV[b], want, atol=2e-5, rtol=0)
            # greedy: each new token is the argmax of the full forward at the position before
            assert out.tokens[b] == [int(i) for i in np.argmax(want, axis=-1)]
    assert np.abs(want).max() > 1.0  # logits far from uniform: an error would show


def test_generate_with_expert_parallelism_samples_what_one_device_does():
    """`jaxpar generate --dp 2 --ep 2`: the routed experts sharded over ep (each rank holds
    half), the batch over dp; greedy tokens equal one device's."""
    from conftest import small_config

    from jaxpar.train.step import Trainer

    prompts = [*PROMPTS, [40, 41]]  # four: two per dp rank
    got = {}
    for dp, ep in ((1, 1), (2, 2)):
        cfg = small_config(dp=dp, ep=ep, zero=0)
        cfg.model = SHAPE
        mesh = make_mesh(cfg.layout, jax.devices()[:dp])
        tr = Trainer(cfg, mesh)
        shardings = tr.canonical_param_shardings
        params = jax.device_put(jax.jit(Model(SHAPE).init)(jax.random.key(1)), shardings)
        up = params["moe_layers"]["moe"]["mlp"]["w_up"]
        assert up.addressable_shards[0].data.shape[1] == MOE.experts // ep  # [G, E, D, F]
        gen = Generator(Model(SHAPE), mesh, tr.rules)
        got[ep] = gen.generate(params, prompts, NEW, Sampling(0.0)).tokens
    assert got[2] == got[1] and len(got[1]) == 4
