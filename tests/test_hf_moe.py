"""Hugging Face Mixtral weights: jaxpar's logits equal ``transformers``' (one device, and
dp 2 x ep 2 x tp 2); export writes the same tensors and ``transformers`` loads them to the same
logits; what Mixtral's format cannot hold is refused in one line."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.errors import ConfigError
from jaxpar.model import hf
from jaxpar.model.hf_moe import check_export

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
from test_hf import _export_same_tensors, _hf_logits, _jax_logits  # noqa: E402  (after the skips: it needs torch)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A tiny random MixtralForCausalLM: 4 experts, top-2, GQA, head_dim != d/h."""
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2, rope_theta=50000.0, rms_norm_eps=1e-6,
        initializer_range=0.2,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():  # norm scales away from 1 so a dropped norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf") / "tiny-mixtral"
    model.save_pretrained(path)
    tokens = np.random.default_rng(0).integers(0, 128, (4, 16))
    return path, model, tokens, _hf_logits(model, tokens)


def test_mixtral_logits_match_transformers_on_ep_and_tp(mixtral, make_cfg):
    path, _, tokens, ref = mixtral
    cfg = make_cfg(dp=2, ep=2, tp=2)
    cfg.model = hf.model_config(path)
    e = cfg.model.moe
    assert (e.experts, e.top_k, cfg.model.expert_ff, cfg.model.moe_layers()) == (4, 2, 48, 2)
    params, got = _jax_logits(path, cfg, tokens)
    assert params["moe_layers"]["moe"]["mlp"]["w_gate"].sharding.spec[1] == "ep"
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_mixtral_export_round_trip(mixtral, make_cfg, tmp_path):
    path, _, tokens, ref = mixtral
    cfg = make_cfg(dp=1)
    cfg.model = hf.model_config(path)
    params, got = _jax_logits(path, cfg, tokens)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    out = _export_same_tensors(params, cfg.model, path, tmp_path / "exported")
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(again).__name__ == "MixtralForCausalLM"
    np.testing.assert_allclose(_hf_logits(again, tokens), ref, atol=1e-6, rtol=0)

    # A learned routing bias has no place in Mixtral's format: refused, naming it.
    params["moe_layers"]["moe"]["mlp"]["bias"] = jnp.full((2, 4), 0.01)
    with pytest.raises(ConfigError, match="moe_layers/moe/mlp/bias: max"):
        hf.export(params, cfg.model, tmp_path / "biased")


@pytest.mark.parametrize(
    "model_type, needle",
    [("qwen3_moe", "Qwen3-MoE import: not supported"),
     ("deepseek_v3", "DeepSeek-V3 import: not supported .multi-head latent attention")],
)  # fmt: skip
def test_unsupported_moe_checkpoints_refused(mixtral, tmp_path, model_type, needle):
    d = tmp_path / model_type
    d.mkdir()
    config = json.loads((mixtral[0] / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    with pytest.raises(ConfigError, match=f"^{d}/config.json: model_type='{model_type}': {needle}"):
        hf.model_config(d)


@pytest.mark.parametrize(
    "field, value, needle",
    [("shared_experts", 1, "Mixtral has no shared experts"),
     ("first_dense", 1, "Mixtral's layers are all MoE"),
     ("bias_rate", 1e-3, "Mixtral has no routing bias")],
)  # fmt: skip
def test_export_of_what_mixtral_cannot_hold_refused(mixtral, field, value, needle):
    cfg = hf.model_config(mixtral[0])
    setattr(cfg.moe, field, value)
    cfg.n_layers += field == "first_dense"
    with pytest.raises(ConfigError, match=f"model.moe.{field}={value!r}: {needle}"):
        check_export(cfg)
