"""KV-cache decoding: equals recomputing the whole sequence, compiles once (not per token),
samples from the intended distribution; bad sampling input refused in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import config as C
from jaxpar.cli import main
from jaxpar.devices import make_mesh
from jaxpar.generate import Generator, Sampling, count_compilations, next_token
from jaxpar.model import Model, hf
from jaxpar.sharding import rules_for, use_rules

SHAPE = C.ModelConfig(name="dec", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128,
                      vocab_size=256, max_seq_len=64, init_std=0.2)  # fmt: skip
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34]]


@pytest.fixture(scope="module")
def setup():
    lay = C.LayoutConfig(dp=1, tp=1, pp=1, zero=0)
    mesh = make_mesh(lay, jax.devices()[:1])
    model = Model(SHAPE)
    params = jax.jit(model.init)(jax.random.key(1))
    return model, mesh, rules_for(SHAPE, lay), params


def _full_logits(model, params, tokens):
    x = model.embed(params, tokens)
    x = model.blocks(params["layers"], x, jnp.arange(tokens.shape[1]))
    return model.logits(params, x)


def test_cached_decode_equals_recomputing_the_sequence(setup):
    """Greedy tokens with the cache equal those of the training forward on the whole growing
    sequence, row by row (each row alone: no padding)."""
    model, mesh, rules, params = setup
    with jax.set_mesh(mesh), use_rules(rules):
        out = Generator(model, mesh, rules).generate(params, PROMPTS, 12, Sampling(0.0))
    # Causal: right padding to a fixed length changes nothing before it (one compile).
    full = jax.jit(lambda p, t: _full_logits(model, p, t))
    for prompt, got in zip(PROMPTS, out.tokens, strict=True):
        seq = list(prompt)
        for _ in range(12):
            padded = jnp.array([seq + [0] * (SHAPE.max_seq_len - len(seq))])
            seq.append(int(jnp.argmax(full(params, padded)[0, len(seq) - 1])))
        assert got == seq[len(prompt) :]
    assert out.steps == 12 and out.tokens_per_s > 0


def _count_compiles(fn):
    with count_compilations() as seen:
        fn()
    return len(seen)


def test_no_recompilation_per_token(setup):
    model, mesh, rules, params = setup
    s = Sampling(0.7, top_k=20, top_p=0.9)

    def run(gen, n, prompts=PROMPTS, seed=0):
        return lambda: gen.generate(params, prompts, n, s, seed=seed, eos_id=None)

    gen = Generator(model, mesh, rules)
    few = _count_compiles(run(Generator(model, mesh, rules), 2))
    many = _count_compiles(run(gen, 40))
    assert few == many and 2 <= few <= 4  # prefill + decode loop (+ a key), whatever the length
    other = [[p + 1 for p in q] for q in PROMPTS]
    assert _count_compiles(run(gen, 40, other, seed=5)) == 0  # same shape: nothing compiles


def test_sampling_distribution():
    logits = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1] + [1e-9] * 4]))
    keys = jax.random.split(jax.random.key(0), 20000)
    draw = jax.jit(jax.vmap(lambda k, s: next_token(logits, k, s)[0], in_axes=(0, None)),
                   static_argnums=1)  # fmt: skip

    def freq(s):
        return np.bincount(np.asarray(draw(keys, s)), minlength=8) / len(keys)

    np.testing.assert_allclose(freq(Sampling(1.0)), [0.5, 0.25, 0.15, 0.1, 0, 0, 0, 0], atol=0.015)
    t2 = np.array([0.5, 0.25, 0.15, 0.1]) ** 0.5
    np.testing.assert_allclose(freq(Sampling(2.0))[:4], t2 / t2.sum(), atol=0.015)
    np.testing.assert_allclose(freq(Sampling(1.0, top_k=2))[:3], [2 / 3, 1 / 3, 0], atol=0.015)
    # nucleus 0.7: {0.5, 0.25} reach it; 0.15 is outside
    np.testing.assert_allclose(freq(Sampling(1.0, top_p=0.7))[:3], [2 / 3, 1 / 3, 0], atol=0.015)
    assert freq(Sampling(1.0, top_p=0.4))[0] == 1.0 and freq(Sampling(0.0))[0] == 1.0


@pytest.fixture(scope="module")
def hf_dir(setup, tmp_path_factory):
    _, _, _, params = setup
    return str(hf.export(params, SHAPE, tmp_path_factory.mktemp("w") / "dec"))


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--temperature", "-0.5"], "--temperature=-0.5: must be a finite number >= 0"),
        (["--top-p", "0"], "--top-p=0.0: must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p=1.5: must be in (0, 1]"),
        (["--top-k", "999"], "--top-k=999: larger than the vocabulary"),
        (["--prompt", "x" * 60], "prompt 2: 60 tokens + --max-new-tokens=8 exceed the context"),
        (["--tokenizer", "NOTOK"], "no tokenizer.json in the directory"),
        (["--tp", "3"], "layout.tp=3"),
        (["--step", "3"], "--step: only with --checkpoint-dir"),
        (["--dp", "2"], "--dp=2: 1 prompt(s) do not split into 2 equal shards"),
        (["--dp", "2", "--ep", "2", "--prompt", "a"], "layout.ep=2"),
    ],
)
def test_bad_input_one_line(hf_dir, tmp_path, capsys, extra, needle):
    (tmp_path / "notok").mkdir()
    extra = [str(tmp_path / "notok") if x == "NOTOK" else x for x in extra]
    tok = [] if "--tokenizer" in extra else ["--tokenizer", "byte"]
    argv = ["generate", "--init-from-hf", hf_dir, "--prompt", "hi", "--max-new-tokens", "8",
            "--devices", "8", *tok, *extra]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxpar generate: error:") and needle in err[0], err


def test_generate_cli_json(hf_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import\n\nclass A:\n")
    argv = ["generate", "--init-from-hf", hf_dir, "--tokenizer", "byte", "--prompt", "def f(",
            "--prompts-file", str(prompts), "--max-new-tokens", "6", "--temperature", "0",
            "--tp", "2", "--devices", "8", "--json"]  # fmt: skip
    assert main(argv) == 0
    import json

    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [c["prompt"] for c in r["completions"]] == ["def f(", "import", "class A:"]
    assert [c["prompt_tokens"] for c in r["completions"]] == [6, 6, 8]
    assert all(c["text"] == bytes(c["token_ids"]).decode() for c in r["completions"]
               if all(0 < t < 128 for t in c["token_ids"]))  # fmt: skip
    assert r["tp"] == 2 and r["batch"] == 3 and r["sampling"]["temperature"] == 0
    assert r["tokens_per_s"] > 0 and r["tokenizer"] == {"kind": "byte"}


def test_eval_of_hf_weights_is_the_mean_window_loss(setup, hf_dir, tmp_path, capsys):
    """``jaxpar eval`` = the mean of Model.loss over consecutive windows, on any layout."""
    import json

    model, _, _, params = setup
    ids = np.random.default_rng(0).integers(0, 256, 16 * 9 + 1 + 7)  # 2 batches, a remainder
    path = tmp_path / "e.bin"
    ids.astype(np.uint16).tofile(path)
    windows = np.stack([ids[w * 16 : w * 16 + 17] for w in range(8)])
    want = np.mean([float(model.loss(params, jnp.array(b[:, :-1]), jnp.array(b[:, 1:])))
                    for b in (windows[:4], windows[4:])])  # fmt: skip
    for layout in ([], ["--tp", "2"]):
        argv = ["eval", "--init-from-hf", hf_dir, "--data", str(path), "--seq-len", "16",
                "--global-batch", "4", "--devices", "8", "--json", *layout]  # fmt: skip
        assert main(argv) == 0
        r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert r["batches"] == 2 and r["tokens"] == 128 and r["init_from_hf"] == hf_dir
        assert abs(r["loss"] / want - 1) < 1e-5, layout
