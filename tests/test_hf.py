"""Hugging Face Llama weights: logits match ``transformers`` on any layout; export round-trips."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import config as C
from jaxpar.cli import main
from jaxpar.data import Batches, load_corpus
from jaxpar.devices import make_mesh
from jaxpar.errors import ConfigError
from jaxpar.model import Model, hf
from jaxpar.sharding import use_rules
from jaxpar.train.step import Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")


def _write_llama(path, tied=False, seed=0):
    """A tiny random LlamaForCausalLM: GQA, head_dim != d/h, non-default theta and eps."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        initializer_range=0.2,  # large weights: logits far from uniform, errors visible
        tie_word_embeddings=tied,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norm scales away from 1 so a dropped norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    model = _write_llama(path)
    tokens = np.random.default_rng(0).integers(0, 256, (8, 24))
    return path, model, tokens, _hf_logits(model, tokens)


def _jax_logits(path, cfg: C.RunConfig, tokens):
    mesh = make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices])
    tr = Trainer(cfg, mesh)
    params = hf.load(path, cfg.model, tr.param_shardings)
    model = Model(cfg.model)

    def logits(params, tokens_BxS):
        # The training forward's stacks: the dense ``layers``, then a MoE model's groups.
        positions = jnp.arange(tokens_BxS.shape[1])
        x = model.embed(params, tokens_BxS)
        if "layers" in params:
            x = model.blocks(params["layers"], x, positions)
        if "moe_layers" in params:
            x, _ = model.moe_groups(params["moe_layers"], x, positions)
        return model.logits(params, x)

    with jax.set_mesh(mesh), use_rules(tr.rules):
        fn = jax.jit(logits, in_shardings=(tr.param_shardings, tr.batch_sharding))
        batch = jax.device_put(np.asarray(tokens, np.int32), tr.batch_sharding)
        return params, np.asarray(fn(params, batch))


def _export_same_tensors(params, model_cfg, source, out_dir):
    """Export ``params`` to ``out_dir``; its tensors are bit-identical to ``source``'s."""
    out = hf.export(params, model_cfg, out_dir)
    a = safetensors_numpy.load_file(str(source / "model.safetensors"))
    b = safetensors_numpy.load_file(str(out / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    return out


@pytest.mark.parametrize("layout", [dict(dp=8), dict(dp=4, tp=2)])
def test_logits_match_transformers(llama, make_cfg, layout):
    path, _, tokens, ref = llama
    cfg = make_cfg(**layout)
    cfg.model = hf.model_config(path)
    assert (cfg.model.hd, cfg.model.rope_theta, cfg.model.norm_eps) == (32, 50000.0, 1e-6)
    params, got = _jax_logits(path, cfg, tokens)
    if layout.get("tp"):  # the heads really are split over tp
        assert params["layers"]["attn"]["wq"].sharding.spec[2] == "tp"
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_tied_embeddings_and_export_round_trip(llama, make_cfg, tmp_path):
    path, model, tokens, ref = llama
    cfg = make_cfg(dp=1)
    cfg.model = hf.model_config(path)
    params, _ = _jax_logits(path, cfg, tokens[:1])
    out = _export_same_tensors(params, cfg.model, path, tmp_path / "exported")
    again = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    np.testing.assert_allclose(_hf_logits(again, tokens), ref, atol=1e-6)

    tied_path = tmp_path / "tied"
    tied = _write_llama(tied_path, tied=True, seed=1)
    cfg.model = hf.model_config(tied_path)
    assert cfg.model.tied_embeddings
    params, got = _jax_logits(tied_path, cfg, tokens[:2])
    assert "w_out" not in params["head"]
    np.testing.assert_allclose(got, _hf_logits(tied, tokens[:2]), atol=1e-4, rtol=0)


def test_train_init_from_hf_starts_from_those_weights(llama, tmp_path, capsys):
    """`jaxpar train --init-from-hf`: step 1's loss is the HF model's loss on batch 0."""
    path, model, _, _ = llama
    out = tmp_path / "after"
    argv = ["train", "--init-from-hf", str(path), "--global-batch", "8", "--seq-len", "16"]
    argv += ["--steps", "2", "-o", "train.warmup_steps=1", "--eval-every", "0", "--no-progress"]
    argv += ["--json"]
    argv += ["--export-hf", str(out)]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    batch = Batches(load_corpus("stdlib", 256), 8, 16, seed=0).rows(0, 0, 8)
    with torch.no_grad():
        loss = model(torch.tensor(batch[:, :-1].astype(np.int64)), labels=None).logits
        loss = torch.nn.functional.cross_entropy(
            loss.reshape(-1, 256), torch.tensor(batch[:, 1:].astype(np.int64)).reshape(-1)
        )
    assert abs(result["losses"][0] / float(loss) - 1) < 1e-5
    assert json.loads((out / "config.json").read_text())["head_dim"] == 32
    exported = safetensors_numpy.load_file(str(out / "model.safetensors"))
    original = safetensors_numpy.load_file(str(path / "model.safetensors"))
    assert not np.array_equal(exported["lm_head.weight"], original["lm_head.weight"])  # trained


def test_mismatching_shapes_name_the_tensor(llama, tmp_path, capsys):
    path, _, _, _ = llama
    cfg = hf.model_config(path)
    cfg.d_ff = 128
    with pytest.raises(ConfigError) as e:
        hf.load(path, cfg)
    assert str(e.value) == (
        "model.layers.0.mlp.gate_proj.weight: shape [96, 64] does not match the model config "
        "(expected [128, 64])"
    )
    # A file whose config.json is right but one tensor is not.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((path / "config.json").read_text())
    tensors = safetensors_numpy.load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((32, 64), np.float32)
    safetensors_numpy.save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"^model\.layers\.1\.self_attn\.k_proj\.weight: shape"):
        hf.load(bad, hf.model_config(path))
    # Through the CLI: one line, exit 2, before anything is compiled.
    argv = ["train", "--init-from-hf", str(bad), "--steps", "1", "--seq-len", "16"]
    assert main([*argv, "--global-batch", "8", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "jaxpar train: error: model.layers.1.self_attn.k_proj.weight: shape [32, 64]"
    )
    assert main([*argv, "--global-batch", "8", "--resume", "--checkpoint-dir", "x"]) == 2
    assert "conflicts with train.resume=True" in capsys.readouterr().err
    cfg = hf.model_config(path)
    cfg.rope_theta = 10000.0
    with pytest.raises(ConfigError, match=r"^model\.rope_theta=10000\.0: .* has 50000\.0$"):
        hf.load(path, cfg)
