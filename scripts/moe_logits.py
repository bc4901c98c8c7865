"""Largest logit differences of MoE inference, printed as one JSON object.

- ``decode``: KV-cache decoding of a jaxpar-initialised MoE model (dense prefix, a dense block
  in each MoE group, a shared expert, a nonzero routing bias) against the dropless full forward
  of each whole sequence, every generated position, on one device and on tp 2;
- ``mixtral_import``: a random ``MixtralForCausalLM`` read by :func:`jaxpar.model.hf.load`
  against ``transformers``' logits, on one device and on dp 2 x ep 2 x tp 2;
- ``mixtral_export``: that model exported by jaxpar, loaded back by ``transformers``.

Usage: ``python scripts/moe_logits.py`` (CPU, 8 simulated devices, about a minute).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar import config as C  # noqa: E402
from jaxpar.devices import make_mesh  # noqa: E402
from jaxpar.generate import Generator, Sampling, forward  # noqa: E402
from jaxpar.model import Model, hf  # noqa: E402
from jaxpar.sharding import rules_for, use_rules  # noqa: E402
from jaxpar.train.step import Trainer  # noqa: E402

MOE = C.MoeConfig(experts=4, top_k=2, shared_experts=1, expert_ff=32, first_dense=1, every=2)
SHAPE = C.ModelConfig(name="dec-moe", n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96,
                      vocab_size=128, max_seq_len=32, init_std=0.2, moe=MOE)  # fmt: skip
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34]]
NEW = 8


def _hidden(model: Model, params, tokens_BxS):
    positions = jnp.arange(tokens_BxS.shape[1])
    x = model.embed(params, tokens_BxS)
    if "layers" in params:
        x = model.blocks(params["layers"], x, positions)
    return model.logits(params, model.moe_groups(params["moe_layers"], x, positions)[0])


def decode_error(tp: int) -> float:
    """Max |cached decode logits − full forward logits| over every generated position."""
    lay = C.LayoutConfig(dp=1, tp=tp, pp=1, zero=0)
    mesh, rules, model = make_mesh(lay, jax.devices()[:tp]), rules_for(SHAPE, lay), Model(SHAPE)
    b, p = len(PROMPTS), max(map(len, PROMPTS))
    pad = jnp.array([p - len(x) for x in PROMPTS], jnp.int32)
    with jax.set_mesh(mesh), use_rules(rules):
        params = jax.jit(model.init)(jax.random.key(1))
        mlp = params["moe_layers"]["moe"]["mlp"]
        mlp["bias"] = 0.3 * jax.random.normal(jax.random.key(2), mlp["bias"].shape)
        gen = Generator(model, mesh, rules)
        out = gen.generate(params, PROMPTS, NEW, Sampling(0.0)).tokens
        run = jax.jit(lambda prm, tok, cache, i: forward(model, prm, tok, cache, i, pad))
        zeros = jnp.zeros(gen._cache_shape(b, p + NEW), jnp.float32)
        padded = jnp.array([[0] * (p - len(x)) + x for x in PROMPTS], jnp.int32)
        logits, cache = run(params, padded, (zeros, zeros), 0)
        steps = [logits]
        for t in range(NEW - 1):
            logits, cache = run(params, jnp.array(out)[:, t : t + 1], cache, p + t)
            steps.append(logits)
        got = np.stack(steps, axis=1)
        full = jax.jit(lambda prm, t: _hidden(model, prm, t))
        worst = 0.0
        for i, prompt in enumerate(PROMPTS):
            seq = prompt + out[i]
            ref = np.asarray(full(params, jnp.array([seq + [0] * (32 - len(seq))])))[0]
            worst = max(worst, float(np.abs(got[i] - ref[len(prompt) - 1 : len(seq) - 1]).max()))
    return worst


def mixtral(root: Path, torch, transformers):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2, rope_theta=50000.0, initializer_range=0.2,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(cfg).eval()
    model.save_pretrained(root / "mixtral")
    return model


def import_error(path: Path, ref, tokens, **layout) -> tuple[float, object, C.ModelConfig]:
    """Max |jaxpar logits − transformers logits| of the imported checkpoint on ``layout``."""
    cfg = C.load("tiny", "cpu-8")
    cfg.model = hf.model_config(path)
    cfg.mesh.layout = C.LayoutConfig(pp=1, zero=0, microbatches=1, remat="none", **layout)
    mesh = make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices])
    tr = Trainer(cfg, mesh)
    params = hf.load(path, cfg.model, tr.param_shardings)
    model = Model(cfg.model)
    with jax.set_mesh(mesh), use_rules(tr.rules):
        fn = jax.jit(lambda prm, t: _hidden(model, prm, t), in_shardings=(None, tr.batch_sharding))
        got = np.asarray(fn(params, jax.device_put(tokens.astype(np.int32), tr.batch_sharding)))
    return float(np.abs(got - ref).max()), params, cfg.model


def main() -> int:
    import torch
    import transformers

    out = {"decode": {f"tp{tp}": decode_error(tp) for tp in (1, 2)}}
    tokens = np.random.default_rng(0).integers(0, 128, (4, 16))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = mixtral(root, torch, transformers)
        with torch.no_grad():
            ref = model(torch.tensor(tokens)).logits.numpy()
        err1, params, cfg = import_error(root / "mixtral", ref, tokens, dp=1, tp=1)
        err8, _, _ = import_error(root / "mixtral", ref, tokens, dp=2, ep=2, tp=2)
        hf.export(params, cfg, root / "exported")
        again = transformers.AutoModelForCausalLM.from_pretrained(root / "exported").eval()
        with torch.no_grad():
            back = again(torch.tensor(tokens)).logits.numpy()
    out["mixtral_import"] = {"dp1": err1, "dp2_ep2_tp2": err8}
    out["mixtral_export"] = float(np.abs(back - ref).max())
    out["max_abs_logit"] = float(np.abs(ref).max())
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
