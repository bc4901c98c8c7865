"""Token files: sidecar (dtype, vocabulary, held-out partner) or --data-dtype and the largest id;
bad files refused in one line before compiling; gpt2-124m trains on a uint16 file."""

import json
import math

import jax
import numpy as np
import pytest

from jaxpar import config as C
from jaxpar.cli import main
from jaxpar.data import load_corpus, open_token_file, sidecar_path, write_sidecar
from jaxpar.errors import ConfigError
from jaxpar.train.loop import run


def _bin(path, ids, dtype="uint16"):
    np.asarray(ids, dtype=dtype).tofile(path)
    return str(path)


def _sidecar(path, ids, dtype, vocab, **extra):
    write_sidecar(path, {"dtype": dtype, "vocab_size": vocab, "tokens": len(ids), **extra})


def _one_line_error(capsys, argv, *needles):
    """The CLI exits 2 with exactly one line on stderr containing every needle."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


def _train_argv(data, *extra):
    return ["train", "--data", data, "--steps", "1", "--dp", "8", "--tp", "1", "--pp", "1",
            "--microbatches", "1", "--global-batch", "8", "--seq-len", "16", "--no-progress",
            *extra]  # fmt: skip


def test_vocabulary_without_sidecar_is_the_largest_id(tmp_path):
    ids = np.random.default_rng(0).integers(0, 300, 5000)
    ids[1234] = 300
    path = _bin(tmp_path / "t.bin", ids)
    f = open_token_file(path, "uint16")
    assert f.meta is None and f.vocab_size == 301 and f.tokens.dtype == np.uint16
    corpus = load_corpus(path, 512, "uint16")  # a 512-token model fits a uint16 file
    assert corpus.vocab_size == 301
    assert len(corpus.train) + len(corpus.heldout) == 5000 and len(corpus.heldout) == 250
    with pytest.raises(ConfigError, match="largest token id 300 in t.bin"):
        load_corpus(path, 256, "uint16")
    # the same bytes read as uint32 are other tokens: --data-dtype decides
    assert open_token_file(path, "uint32").tokens.shape == (2500,)


def test_sidecar_gives_dtype_vocabulary_and_heldout_partner(tmp_path):
    train = np.arange(4000) % 200
    val = (np.arange(1000) * 7) % 200
    tp, vp = _bin(tmp_path / "d.bin", train, "uint8"), _bin(tmp_path / "d.val.bin", val, "uint8")
    tok = {"kind": "byte"}
    _sidecar(tp, train, "uint8", 256, tokenizer=tok, split="train", validation_file="d.val.bin")
    _sidecar(vp, val, "uint8", 256, tokenizer=tok, split="validation")
    side = json.loads(sidecar_path(tp).read_text())
    assert side["format"] == "jaxpar-tokens/1" and side["dtype"] == "uint8"
    # --data-dtype is ignored when a sidecar names the dtype
    corpus = load_corpus(tp, 256, "uint32")
    assert corpus.train.dtype == np.uint8 and np.array_equal(corpus.train, train)
    assert np.array_equal(corpus.heldout, val)  # the partner, not the last 5%
    assert corpus.vocab_size == 256 and corpus.tokenizer == tok
    other = _bin(tmp_path / "o.bin", val[:600], "uint8")
    assert np.array_equal(load_corpus(tp, 256, eval_data=other).heldout, val[:600])


def _empty(d):
    (d / "empty.bin").write_bytes(b"")
    return [str(d / "empty.bin")]


def _odd(d):
    (d / "odd.bin").write_bytes(b"\x01\x00\x02")
    return [str(d / "odd.bin")]


def _out_of_vocab(d):
    return [_bin(d / "big.bin", [1, 2, 70000, 3] * 100, "uint32"), "--data-dtype", "uint32"]


IDS = list(range(200)) * 10


def _sidecar_vocab_above_model(d):
    path = _bin(d / "wide.bin", IDS)
    _sidecar(path, IDS, "uint16", 4096)
    return [path]


def _sidecar_count_mismatch(d):
    path = _bin(d / "lying.bin", IDS)
    _sidecar(path, IDS[:-5], "uint16", 256)
    return [path]


def _sidecar_vocab_above_dtype(d):
    path = _bin(d / "tiny.bin", IDS, "uint8")
    _sidecar(path, IDS, "uint8", 300)
    return [path]


def _missing_eval_data(d):
    return [_bin(d / "ok.bin", IDS), "--eval-data", str(d / "nope.bin")]


def _bad_dtype(d):
    return [_bin(d / "ok.bin", IDS), "--data-dtype", "int8"]


@pytest.mark.parametrize(
    "make, needles",
    [
        (_empty, ["train.data=", "empty token file (0 bytes)"]),
        (_odd, ["3 bytes is not a whole number of uint16 tokens", "another --data-dtype?"]),
        (_out_of_vocab, ["model.vocab_size=256", "largest token id 70000 in big.bin"]),
        (_sidecar_vocab_above_model, ["model.vocab_size=256", "vocabulary 4096", "wide.json"]),
        (_sidecar_count_mismatch, ["lying.json: tokens=1995", "holds 2000 uint16 tokens"]),
        (_sidecar_vocab_above_dtype, ["tiny.json: vocab_size=300", "dtype=uint8 holds (256)"]),
        (_missing_eval_data, ["train.eval_data=", "does not exist"]),
        (_bad_dtype, ["train.data_dtype='int8'", "uint8, uint16, uint32"]),
    ],
    ids=lambda x: x.__name__.strip("_") if callable(x) else "",
)
def test_bad_token_file_refused_in_one_line(tmp_path, capsys, make, needles):
    _one_line_error(capsys, _train_argv(*make(tmp_path)), *needles)


def test_gpt2_vocabulary_trains_on_a_uint16_file(tmp_path):
    """GPT-2's vocabulary (50257, from the gpt2-124m model file) on a uint16 file without
    sidecar: the vocabulary check uses the largest id, not the dtype's 65536. One narrow layer
    stands in for the 12-layer stack: neither the check nor the loss at the start depends on it."""
    rng = np.random.default_rng(0)
    ids = (np.arange(40000) * 31 + rng.integers(0, 3, 40000)) % 50257
    ids[7] = 50256
    path = _bin(tmp_path / "gpt2.bin", ids)
    cfg = C.load("gpt2-124m", "cpu-8")
    assert cfg.model.vocab_size == 50257
    m = cfg.model
    m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.d_ff = 1, 64, 4, 4, 128
    cfg.layout.dp, cfg.layout.tp, cfg.layout.pp, cfg.layout.microbatches = 1, 1, 1, 1
    cfg.layout.remat = "none"
    cfg.mesh.devices = 1
    t = cfg.train
    t.data, t.data_dtype, t.seq_len, t.global_batch, t.steps = path, "uint16", 16, 2, 2
    t.warmup_steps, t.eval_every, t.progress = 1, 0, False
    r = run(cfg, devices=jax.devices()[:1])
    assert r["params"] > 50257 * 64 and len(r["losses"]) == 2
    assert all(math.isfinite(x) for x in r["losses"])
    # starts near the uniform loss over 50257 tokens
    assert abs(r["losses"][0] - math.log(50257)) < 1.0
