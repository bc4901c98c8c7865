"""Issue 48: what the user had is kept, and what jaxpar says is true. One test per class (each
failed before its fix): a foreign line in a metrics file, Hugging Face weights that are not the
model's (an integer dtype, an extra tensor) and a prompt's NUL byte, and the message of a
second signal during training.
"""

import json
import os
import signal
import time

import jax
import numpy as np
import pytest

from jaxpar import config as C
from jaxpar.cli import main
from jaxpar.errors import ConfigError
from jaxpar.lock import Interrupted, abort_on_signal
from jaxpar.metrics import MetricsLog
from jaxpar.train.core import Hook

DRY = ["train", "--devices", "1", "--dp", "1", "--tp", "1", "--pp", "1", "--microbatches", "1",
       "--global-batch", "2", "--seq-len", "16", "--data", "synthetic", "--dry-run"]  # fmt: skip


def _one_line(capsys, argv, code=2) -> str:
    rc = main(argv)
    err = [x for x in capsys.readouterr().err.strip().splitlines() if x]
    assert rc == code and len(err) == 1, (argv, rc, err)
    return err[0]


def test_a_foreign_json_line_in_metrics_is_refused_like_a_comment_and_kept(tmp_path, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    m = ck / "metrics.jsonl"
    ours = '{"event": "start", "step": 0, "layout": {"dp": 1}, "params": 10, "compile_s": 0.5}\n'
    ours += '{"step": 1, "loss": 5.5, "grad_norm": 1.0, "lr": 0.001}\n'
    for foreign in ('# my notes', '{"note": "keep me"}', '{"step": 9, "loss": 1.0, "by": "me"}',
                    '{"step": 7, "eval_loss": 2.0, "tag": 1}', '[1, 2]'):  # fmt: skip
        text = ours + foreign + '\n{"step": 2, "loss": 5.0}\n{"step": 3, "lo'
        m.write_text(text)
        # the resume of the directory's run (its own metrics file is cut back to the step)
        line = _one_line(capsys, [*DRY, "--checkpoint-dir", str(ck), "--resume-or-start"])
        # named by the flag the user gave: the checkpoint directory, whose own file it is
        want = f"jaxpar train: error: train.checkpoint_dir={str(ck)!r}: metrics.jsonl: line 3 ("
        assert line.startswith(want) and "is not a jaxpar record" in line, line
        with pytest.raises(ConfigError, match="line 3 .*is not a jaxpar record"):
            MetricsLog(str(m), keep_until=1)  # the cut itself refuses too
        assert m.read_text() == text, foreign
    # jaxpar's own lines (a record cut by a crash included) are cut back as before
    m.write_text(ours + '{"step": 2, "loss": 5.0}\n{"step": 2, "eval_loss": 4.0}\n{"step": 3, "lo')
    log = MetricsLog(str(m), keep_until=1)
    log.close()
    assert log.dropped == 3 and m.read_text() == ours


def _llama_dir(path, **tensors) -> C.ModelConfig:
    """A tiny Llama directory written without torch: config.json and random F32 weights."""
    from safetensors.numpy import save_file

    from jaxpar.model import hf

    cfg = C.ModelConfig(name="t", n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32,
                        vocab_size=256, max_seq_len=32)  # fmt: skip
    rng = np.random.default_rng(0)
    out = {}
    for e in hf._entries(cfg):
        for i in range(cfg.n_layers) if e.stacked else [None]:
            for name in e.names(i, cfg):
                out[name] = rng.normal(0, 0.2, e.hf_shape(cfg)).astype(np.float32)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf.hf_config(cfg)))
    save_file({**out, **tensors}, str(path / "model.safetensors"))
    return cfg


def test_hf_weights_not_of_the_model_are_refused_and_a_prompt_keeps_its_nul(tmp_path, capsys):
    from jaxpar.model import hf
    from jaxpar.tokenizer import ByteTokenizer

    good = tmp_path / "good"
    cfg = _llama_dir(good)
    hf.check(good, cfg)  # the model's own tensors pass
    q = "model.layers.0.self_attn.q_proj.weight"
    cases = {
        "int32": ({q: np.ones((16, 16), np.int32)}, rf"^{q}: dtype I32 in model.safetensors: "
                  "weights must be stored as a float type"),
        "extra": ({"model.layers.0.self_attn.q_proj.bias": np.zeros(16, np.float32)},
                  r"^model\.layers\.0\.self_attn\.q_proj\.bias: shape \[16\] in "
                  "model.safetensors: not a tensor of this model"),
        "layer": ({"model.layers.1.input_layernorm.weight": np.ones(16, np.float32)},
                  r"^model\.layers\.1\.input_layernorm\.weight: .*not a tensor of this model"),
    }  # fmt: skip
    for kind, (tensors, rule) in cases.items():
        _llama_dir(tmp_path / kind, **tensors)
        with pytest.raises(ConfigError, match=rule):
            hf.check(tmp_path / kind, cfg)
    # the CLI that loads them refuses in one line, before JAX starts
    line = _one_line(capsys, ["generate", "--init-from-hf", str(tmp_path / "int32"),
                              "--tokenizer", "byte", "--prompt", "x"])  # fmt: skip
    assert line.startswith(f"jaxpar generate: error: {q}: dtype I32"), line

    # NUL: byte 0 is a byte of the prompt (it was dropped); the round trip is exact
    text = "a\0b\u00e9\0"
    tok = ByteTokenizer()
    assert tok.encode_batch([text]) == [[97, 0, 98, 195, 169, 0]]
    assert tok.decode(tok.encode_batch([text])[0]) == text
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b"x\x00y\x0cz\n")  # NUL and a form feed inside one prompt
    argv = ["generate", "--init-from-hf", str(good), "--tokenizer", "byte", "--prompts-file",
            str(prompts), "--max-new-tokens", "2", "--temperature", "0", "--devices", "8",
            "--json"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    (c,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["completions"]
    assert c["prompt"] == "x\0y\x0cz" and c["prompt_tokens"] == 5, c


class _TwoSignals(Hook):
    """Sends SIGINT twice after step ``at``: the first asks to stop, the second aborts."""

    needs_state = True

    def __init__(self, at: int) -> None:
        self.at = at

    def due(self, ctx, step: int) -> bool:
        return step == self.at

    def on_step(self, ctx, m) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the request's handler runs, and hands SIGINT back
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # interrupted by the second


def test_a_second_sigint_after_saved_steps_names_the_step_saved(tmp_path, make_cfg):
    from jaxpar.train.loop import run

    cfg = make_cfg()
    cfg.train.data, cfg.train.steps = "synthetic", 4
    cfg.train.checkpoint_dir, cfg.train.checkpoint_every = str(tmp_path / "ck"), 2
    with pytest.raises(Interrupted) as e, abort_on_signal():
        run(cfg, devices=jax.devices()[:1], hooks=[_TwoSignals(3)])
    msg = str(e.value)
    assert e.value.exit_code == 128 + signal.SIGINT and "\n" not in msg
    assert msg.startswith("stopped by a second SIGINT after step 3; ") and "no step" not in msg
    assert f"the newest complete checkpoint is step 2 in {tmp_path / 'ck'}" in msg, msg
    # without a checkpoint directory it says so, not that nothing ran
    cfg.train.checkpoint_dir = None
    with (
        pytest.raises(Interrupted, match="after step 3; no checkpoint was saved"),
        abort_on_signal(),
    ):
        run(cfg, devices=jax.devices()[:1], hooks=[_TwoSignals(3)])


def test_messages_name_the_flag_given_and_promise_only_what_happens(make_cfg, capsys):
    from jaxpar.preflight import check_checkpoints
    from jaxpar.train.checkpointing import open_checkpoints
    from jaxpar.train.preempt import StopRequest

    cfg = make_cfg()
    cfg.train.resume_or_start = True  # not --resume: the refusal names what was given
    for check in (check_checkpoints, open_checkpoints):
        with pytest.raises(ConfigError, match=r"^train\.resume_or_start=True: needs train\.check"):
            check(cfg)
    before = signal.getsignal(signal.SIGINT)
    with StopRequest(saves=False) as stop:  # no --checkpoint-dir: no checkpoint is promised
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
    assert stop.signal_name == "SIGINT" and signal.getsignal(signal.SIGINT) is before
    err = capsys.readouterr().err
    assert (
        "then exiting (no --checkpoint-dir: nothing is saved)" in err and "checkpointing" not in err
    )
