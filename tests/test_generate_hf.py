"""Greedy generation from a tiny random Hugging Face Llama equals ``transformers``' ``generate``
token for token (3 prompts of different lengths, 32 new tokens), on one device and on tp 2; a
Hugging Face directory's own tokenizer drives ``data prepare`` and ``generate``."""

import json

import jax
import pytest

from jaxpar import config as C
from jaxpar import tokenizer as T
from jaxpar.cli import main
from jaxpar.devices import make_mesh
from jaxpar.generate import Generator, Sampling
from jaxpar.model import Model, hf
from jaxpar.train.step import Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34, 35]]
NEW = 32
EOS = 0


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A random LlamaForCausalLM (GQA, head_dim != d/h, theta 50000) saved with a tokenizer, as a
    Hugging Face checkpoint directory holds them."""
    root = tmp_path_factory.mktemp("hf")
    bpe = T.train_bpe(
        ["def generate(prompt):\n    return prompt + 'x'\n" * 50, "import jax, numpy\n" * 40],
        300,
        root / "bpe",
    )
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        rope_theta=50000.0, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=None,
        eos_token_id=EOS, pad_token_id=EOS,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = root / "llama"
    model.save_pretrained(path)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(bpe / "tokenizer.json"), eos_token=T.EOT
    )
    fast.save_pretrained(path)
    return path, model, T.load(str(bpe)).vocab_size


@pytest.fixture(scope="module")
def hf_greedy(llama):
    """``transformers``' greedy continuations, left-padded batch with an attention mask."""
    model = llama[1]
    p = max(map(len, PROMPTS))
    ids = torch.tensor([[EOS] * (p - len(x)) + x for x in PROMPTS])
    mask = torch.tensor([[0] * (p - len(x)) + [1] * len(x) for x in PROMPTS])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW,
                             do_sample=False, pad_token_id=EOS, eos_token_id=EOS)  # fmt: skip
    rows = [list(map(int, r)) for r in out[:, p:].numpy()]
    return [r[: r.index(EOS)] if EOS in r else r for r in rows]


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_equals_transformers_generate(llama, hf_greedy, tp):
    path, ref = llama[0], hf_greedy
    assert max(map(len, ref)) == NEW  # at least one row runs the whole 32 tokens
    cfg = C.load("tiny", "cpu-8")
    cfg.model = hf.model_config(path)
    cfg.layout.dp, cfg.layout.tp, cfg.layout.pp, cfg.layout.zero = 1, tp, 1, 0
    mesh = make_mesh(cfg.layout, jax.devices()[:tp])
    tr = Trainer(cfg, mesh)
    params = hf.load(path, cfg.model, tr.param_shardings)
    if tp > 1:  # the weights really are split over tp
        assert params["layers"]["attn"]["wq"].sharding.spec[2] == "tp"
    out = Generator(Model(cfg.model), mesh, tr.rules).generate(
        params, PROMPTS, NEW, Sampling(temperature=0.0), eos_id=EOS
    )
    assert out.tokens == ref


def test_hf_directory_tokenizer_prepare_and_generate(llama, tmp_path, capsys):
    path, _, vocab = llama
    tok = T.load(str(path))
    assert tok.eos_id == 0 and tok.vocab_size == vocab  # from the directory's tokenizer files
    doc = tmp_path / "doc.txt"
    doc.write_text("def generate(prompt):\n    return prompt\n")
    out = tmp_path / "t.bin"
    assert main(["data", "prepare", str(doc), "--tokenizer", str(path), "--out", str(out)]) == 0
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["tokenizer"]["path"] == str(path.resolve()) and side["vocab_size"] == vocab
    capsys.readouterr()
    argv = ["generate", "--init-from-hf", str(path), "--prompt", "def generate(", "--json",
            "--max-new-tokens", "5", "--temperature", "0", "--devices", "8"]  # fmt: skip
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    c = r["completions"][0]
    assert r["tokenizer"]["path"] == str(path.resolve())
    assert c["prompt_tokens"] == len(tok.encode_batch(["def generate("])[0])
    assert isinstance(c["text"], str) and c["new_tokens"] <= 5
