"""Own text end to end: train-tokenizer → data prepare → train → eval (any layout) → generate."""

import json
import math

from jaxpar import tokenizer as T
from jaxpar.cli import main
from jaxpar.data import stdlib_files

SMALL = ["-o", "model.n_layers=2", "-o", "model.d_model=64", "-o", "model.n_heads=4",
         "-o", "model.n_kv_heads=2", "-o", "model.d_ff=128", "-o", "model.max_seq_len=64",
         "-o", "model.vocab_size=512"]  # fmt: skip


def _json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_train_eval_generate(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, (_, path) in enumerate(stdlib_files()[:30]):
        (corpus / f"{i:02d}.py").write_bytes(path.read_bytes())
    tok_dir, data = tmp_path / "tok", tmp_path / "data" / "tokens.bin"
    data.parent.mkdir()
    assert main(["data", "train-tokenizer", str(corpus), "--vocab-size", "500",
                 "--out", str(tok_dir)]) == 0  # fmt: skip
    assert main(["data", "prepare", str(corpus), "--tokenizer", str(tok_dir), "--out", str(data),
                 "--validation-fraction", "0.1", "--json"]) == 0  # fmt: skip
    prep = _json(capsys)
    assert prep["validation_documents"] == 3

    ck = tmp_path / "ck"
    train = ["train", "--data", str(data), "--steps", "16", "--dp", "4", "--tp", "2", "--pp", "1",
             "--microbatches", "1", "--global-batch", "16", "--seq-len", "32", "--eval-every",
             "8", "-o", "train.warmup_steps=2", "--checkpoint-dir", str(ck), "--no-progress",
             "--json", *SMALL]  # fmt: skip
    assert main(train) == 0
    tr = _json(capsys)
    first, last = tr["losses"][0], tr["eval_loss"]
    assert abs(first - math.log(512)) < 0.5 and last < first - 0.5  # it learned

    evals = []
    val = str(data.with_name("tokens.val.bin"))
    for layout in ([], ["--dp", "2", "--tp", "2"], ["--pp", "2", "--tp", "2"]):
        argv = ["eval", "--checkpoint-dir", str(ck), "--data", val, "--devices", "8", "--json",
                *layout]  # fmt: skip
        assert main(argv) == 0
        evals.append(_json(capsys))
    ref = evals[0]
    assert ref["checkpoint_step"] == 16 and ref["tokens"] == ref["batches"] * 16 * 32
    assert abs(ref["perplexity"] - math.exp(ref["loss"])) < 1e-6 * ref["perplexity"]
    assert ref["loss"] < first - 0.5
    for e in evals[1:]:  # the same weights on another layout: the same loss
        assert abs(e["loss"] / ref["loss"] - 1) < 1e-5, e["layout"]

    assert main(["generate", "--checkpoint-dir", str(ck), "--prompt", "def ", "--prompt",
                 "import os\n", "--max-new-tokens", "12", "--seed", "3", "--temperature", "0.8",
                 "--devices", "8", "--json"]) == 0  # fmt: skip
    gen = _json(capsys)
    tok = T.load(str(tok_dir))
    assert gen["tokenizer"] == tok.identity()  # named by the checkpoint, from the sidecar
    for c in gen["completions"]:
        assert 0 < c["new_tokens"] <= 12 and c["text"] == tok.decode(c["token_ids"])
    assert gen["checkpoint_step"] == 16 and gen["tokens_per_s"] > 0
