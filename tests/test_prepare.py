"""``jaxpar data train-tokenizer`` and ``jaxpar data prepare``: deterministic, parallel, lossless
(tokens decode back to the documents), held-out split by document, bad input in one line."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxpar import tokenizer as T
from jaxpar.cli import main
from jaxpar.data import open_token_file, stdlib_files
from jaxpar.prepare import held_out, prepare

N_FILES = 40  # about 1 MB of the embedded corpus's files


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A directory of stdlib files (documents), a hidden file and a binary file (both skipped)."""
    root = tmp_path_factory.mktemp("corpus")
    texts = []
    for i, (rel, path) in enumerate(stdlib_files()[:N_FILES]):
        dest = root / f"{i:03d}_{rel.replace('/', '_')}"
        shutil.copyfile(path, dest)
        texts.append(dest.read_text(encoding="utf-8", errors="replace"))
    (root / ".hidden").write_text("not a document")
    (root / "zz.bin").write_bytes(b"\x00\x01binary")
    return root, texts


@pytest.fixture(scope="module")
def bpe(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    assert main(["data", "train-tokenizer", str(corpus[0]), "--vocab-size", "512",
                 "--out", str(out / "a")]) == 0  # fmt: skip
    return out / "a"


def _docs(tokens, eos):
    """Split a token stream after each end-of-text token."""
    cuts = np.flatnonzero(np.asarray(tokens) == eos) + 1
    return [list(d) for d in np.split(np.asarray(tokens), cuts) if len(d)]


def test_train_tokenizer_is_deterministic_and_lossless(corpus, bpe, tmp_path):
    root, texts = corpus
    assert main(["data", "train-tokenizer", str(root), "--vocab-size", "512",
                 "--out", str(tmp_path / "b")]) == 0  # fmt: skip
    assert (bpe / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    tok = T.load(str(bpe))
    assert tok.vocab_size == 512 and tok.eos_id == 0  # <|endoftext|> first
    ids = tok.encode_batch(texts[:3])
    assert [tok.decode(x) for x in ids] == texts[:3]
    assert np.mean([len(x) for x in ids]) < 0.6 * np.mean([len(t.encode()) for t in texts[:3]])


def test_prepare_is_byte_identical_for_any_worker_count(corpus, bpe, tmp_path, capsys):
    root, texts = corpus
    outs = []
    for name, workers in (("a", "2"), ("b", "1"), ("c", "2"), ("d", "fork")):
        out = tmp_path / name / "tokens.bin"
        out.parent.mkdir()
        argv = ["data", "prepare", str(root), "--tokenizer", str(bpe), "--out", str(out),
                "--validation-fraction", "0.1", "--json"]  # fmt: skip
        if workers == "fork":  # the command line, without JAX in the process: forked workers
            cmd = [sys.executable, "-m", "jaxpar.cli", *argv, "--workers", "2"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr
        else:  # here JAX runs (conftest): spawned workers
            assert main([*argv, "--workers", workers]) == 0
            summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        outs.append(out)
    files = ("tokens.bin", "tokens.json", "tokens.val.bin", "tokens.val.json")
    for f in files:
        ref = (outs[0].parent / f).read_bytes()
        assert all((o.parent / f).read_bytes() == ref for o in outs[1:]), f
    assert summary["documents"] + summary["validation_documents"] == N_FILES
    assert summary["validation_documents"] == int(N_FILES * 0.1) and summary["mb_per_s"] > 0

    # Lossless: each split's documents decode back to the held-out / kept input files.
    tok = T.load(str(bpe))
    train, val = open_token_file(outs[0]), open_token_file(outs[0].with_name("tokens.val.bin"))
    assert train.meta["split"] == "train" and val.meta["split"] == "validation"
    assert train.meta["validation_file"] == "tokens.val.bin" and train.meta["eos_id"] == 0
    assert train.meta["tokenizer"] == tok.identity() and train.tokens.dtype == np.uint16
    assert train.meta["tokens"] == len(train.tokens) == summary["tokens"]
    for f, want in ((train, [t for i, t in enumerate(texts) if not held_out(i, 0.1)]),
                    (val, [t for i, t in enumerate(texts) if held_out(i, 0.1)])):  # fmt: skip
        docs = _docs(f.tokens, tok.eos_id)
        assert [tok.decode(d) for d in docs] == want
        assert f.meta["documents"] == len(want)


def test_jsonl_and_byte_tokenizer(tmp_path, capsys):
    lines = [{"text": "first document é"}, {"text": "second"}, {"id": 3, "text": "third\n"}]
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    r = prepare([str(src)], "byte", tmp_path / "b.bin", workers=1, progress=False)
    f = open_token_file(tmp_path / "b.bin")
    assert f.tokens.dtype == np.uint8 and f.vocab_size == 256 and f.meta["eos_id"] == 0
    assert f.meta["text_field"] == "text" and f.meta["split"] == "all"
    want = b"".join(x["text"].encode() + b"\0" for x in lines)
    assert bytes(f.tokens) == want and r["documents"] == 3
    src.write_text('{"body": "x"}\n')
    argv = ["data", "prepare", str(src), "--tokenizer", "byte", "--out", str(tmp_path / "c.bin")]
    assert main([*argv, "--text-field", "body"]) == 0
    capsys.readouterr()
    assert main([*argv, "--force"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "docs.jsonl:1: no string field 'text'" in err[0]
    # the failed run left the previous output as it was, and no temporary file
    assert (tmp_path / "c.bin").read_bytes() == b"x\0" and not list(tmp_path.glob(".*.tmp-*"))


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--tokenizer", "EMPTY"], "no tokenizer.json in the directory"),
        (["--tokenizer", "byte", "--validation-fraction", "1.5"], "--validation-fraction=1.5"),
        (["--tokenizer", "byte", "--validation-fraction", "0.1"], "hold out none"),
        (["--tokenizer", "byte", "--out", "x.txt"], "must end in .bin"),
        (["--tokenizer", "byte", "--out", "EXISTING"], "exists (pass --force"),
    ],
)
def test_bad_input_one_line(tmp_path, capsys, extra, needle):
    doc = tmp_path / "doc.txt"
    doc.write_text("one document only")
    (tmp_path / "empty").mkdir()
    (tmp_path / "old.bin").write_bytes(b"\0")
    subst = {"EMPTY": str(tmp_path / "empty"), "EXISTING": str(tmp_path / "old.bin")}
    extra = [subst.get(x, x) for x in extra]
    out = [] if "--out" in extra else ["--out", str(tmp_path / "t.bin")]
    assert main(["data", "prepare", str(doc), *out, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxpar data: error:") and needle in err[0], err
    assert not (tmp_path / "t.bin").exists() and not list(tmp_path.glob(".*.tmp-*"))
