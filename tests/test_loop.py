"""The loop of hooks: metrics read one step late, state hooks exact, and the newcomer's edges
(the compile line, one held-out measure, the vocabulary refusal, a closed pipe, log_every)."""

import ast
import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import config as C
from jaxpar.cli import main
from jaxpar.data import load_corpus, write_sidecar
from jaxpar.errors import ConfigError
from jaxpar.metrics import MetricsLog, Progress
from jaxpar.train.checkpointing import Saver
from jaxpar.train.core import Hook, LoopContext, Sinks, Stop, train_loop
from jaxpar.train.hooks import PreemptionHook
from jaxpar.train.loop import run

REPO = Path(__file__).resolve().parent.parent


# ---- the core, with a stand-in trainer (nothing compiles) -----------------------------------


class FakeTrainer:
    """A step that adds one to the state and logs its dispatch; loss = 10 - step."""

    batch_sharding = None

    def __init__(self, events):
        self.events = events

    def step(self, state, batch):
        n = int(state) + 1
        self.events.append(("dispatch", n))
        loss = jnp.float32(10 - n)
        metrics = {"loss": loss, "grad_norm": loss, "lr": loss, "finite": jnp.bool_(True),
                   "leaf_finite": {}}  # fmt: skip
        return jnp.int32(n), metrics


class FakeBatches:
    def global_array(self, i, sharding):
        return i


class Recorder(Hook):
    """Logs what it sees: metrics hooks the step read, state hooks the state after it."""

    def __init__(self, events, every=1, needs_state=False, stop_at=None):
        self.events, self.every, self.needs_state, self.stop_at = (
            events,
            every,
            needs_state,
            stop_at,
        )

    def on_step(self, ctx, m):
        if self.needs_state:
            self.events.append(("state", m.step, int(ctx.state)))
        else:
            self.events.append(("read", m.step))
        if m.step == self.stop_at:
            ctx.stop = Stop("diverged", "test")


def _ctx(events, steps):
    cfg = C.RunConfig()
    cfg.train.steps = steps
    sinks = Sinks(MetricsLog(None), Progress(steps, 0, enabled=False))
    return LoopContext(cfg, FakeTrainer(events), FakeBatches(), jnp.int32(0), 0, sinks)


def test_metrics_are_read_after_the_next_step_is_dispatched():
    """Steps run one ahead of their metrics; a state hook's step is read at once and sees the
    state after that step (never the next one's), the last step too."""
    events = []
    ctx = _ctx(events, 5)
    train_loop(ctx, [Recorder(events), Recorder(events, every=3, needs_state=True)])
    assert events == [
        ("dispatch", 1), ("dispatch", 2), ("read", 1), ("dispatch", 3), ("read", 2),
        ("read", 3), ("state", 3, 3),  # due at 3: read at once, before step 4 is dispatched
        ("dispatch", 4), ("dispatch", 5), ("read", 4), ("read", 5), ("state", 5, 5),
    ]  # fmt: skip
    assert ctx.losses == [9.0, 8.0, 7.0, 6.0, 5.0] and ctx.done == 5
    assert all(t > 0 for t in ctx.step_times)


def test_a_stop_drops_the_step_run_ahead():
    """A metrics hook stopping at step 2 (read after step 3 was dispatched): step 3 is neither
    read, recorded nor seen by a state hook."""
    events = []
    ctx = _ctx(events, 6)
    train_loop(ctx, [Recorder(events, stop_at=2), Recorder(events, every=3, needs_state=True)])
    assert events == [("dispatch", 1), ("dispatch", 2), ("read", 1), ("dispatch", 3),
                      ("read", 2)]  # fmt: skip
    assert ctx.losses == [9.0, 8.0] and ctx.done == 2


class FakeStop:
    signal_name = None

    def should_stop(self, step):
        self.asked = [*getattr(self, "asked", []), step]
        if step == 3:
            self.signal_name = "SIGTERM"
        return self.signal_name is not None


def test_preemption_is_asked_every_step_and_the_save_sees_its_step():
    events = []
    ctx = _ctx(events, 8)
    stop = FakeStop()
    saver = Recorder(events, every=100, needs_state=True)
    saver.due = lambda ctx, step: ctx.preempted is not None  # as CheckpointHook's rule
    train_loop(ctx, [Recorder(events), PreemptionHook(stop), saver])
    assert stop.asked == [1, 2, 3] and ctx.preempted == "SIGTERM" and ctx.stop.kind == "preempted"
    assert events[-2:] == [("read", 3), ("state", 3, 3)] and ("dispatch", 4) not in events


class SyncCheckpointer:
    def __init__(self, log):
        self.log = log

    def due(self, step):
        return step % 2 == 0

    def save(self, step, state, meta, force=False):
        self.log.append(("save", step))
        return True

    def close(self):
        self.log.append("close")


class AsyncCheckpointer(SyncCheckpointer):
    def wait(self):
        self.log.append("wait")


def test_saver_waits_only_where_the_checkpointer_can():
    log = []
    for cls in (SyncCheckpointer, AsyncCheckpointer):
        s = Saver(cls(log))
        assert s.save(2, None, {}) and s.due(2) and not s.due(3)
        s.wait()
        s.close()
    assert log == [("save", 2), "close", ("save", 2), "wait", "wait", "close"]


def test_train_functions_are_short():
    """The loop's core stays a core; no function in jaxpar/train/ over 80 lines (reduce.py is
    another module's business)."""
    for path in sorted((REPO / "jaxpar" / "train").glob("*.py")):
        if path.name == "reduce.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                assert n <= (60 if node.name == "train_loop" else 80), (path.name, node.name, n)


# ---- a real run: the compile line, one held-out measure --------------------------------------


def test_compile_line_and_one_heldout_measure(make_cfg, tmp_path, capsys):
    """A run with its bar says what the first seconds are (compiling, then the time); its
    held-out loss is what ``jaxpar eval --max-batches 4`` gives on the checkpoint, named so."""
    cfg = make_cfg(dp=1)
    cfg.train.steps, cfg.train.eval_every, cfg.train.progress = 2, 2, True
    cfg.train.checkpoint_dir, cfg.train.checkpoint_every = str(tmp_path / "ck"), 2
    out = run(cfg, devices=jax.devices()[:1])
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "compiling the train step" in x)
    assert line.startswith("jaxpar: compiling the train step (test, 1 cpu devices: pp=1 dp=1")
    assert float(line.rsplit(" ", 2)[-2]) > 0 and line.endswith(" s")
    assert out["eval_batches"] == 4 and "held-out loss" in err and "(4 batches)" in err
    argv = ["eval", "--checkpoint-dir", str(tmp_path / "ck"), "--data", "stdlib", "--json",
            "--devices", "8"]  # fmt: skip
    assert main([*argv, "--max-batches", "4"]) == 0
    ev = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ev["batches"] == 4 and ev["batches_available"] > 4
    assert math.isclose(ev["loss"], out["eval_loss"], rel_tol=1e-5), (ev["loss"], out["eval_loss"])


# ---- refusals and warnings --------------------------------------------------------------------


def test_vocabulary_refusal_names_the_file_that_needs_it(tmp_path):
    """Both files need 512 ids: the refusal names the training file's sidecar, not the
    held-out partner's (which a tuple comparison of the notes picked)."""
    ids = (np.arange(4000) % 512).astype(np.uint16)
    tp, vp = tmp_path / "tokens.bin", tmp_path / "tokens.val.bin"
    for path, split, extra in ((tp, "train", {"validation_file": vp.name}),
                               (vp, "validation", {})):  # fmt: skip
        ids.tofile(path)
        write_sidecar(path, {"dtype": "uint16", "vocab_size": 512, "tokens": len(ids),
                             "split": split, **extra})  # fmt: skip
    with pytest.raises(ConfigError, match=r"\(sidecar tokens\.json\)"):
        load_corpus(str(tp), 256)
    write_sidecar(vp, {"dtype": "uint16", "vocab_size": 600, "tokens": len(ids)})
    with pytest.raises(ConfigError, match=r"600 \(sidecar tokens\.val\.json\)"):
        load_corpus(str(tp), 256)  # the held-out file needs more: it is named


def test_closed_pipe_ends_quietly():
    """``jaxpar VERB | head``: the reader leaves, jaxpar exits 141 without an error line."""
    cmd = [sys.executable, "-m", "jaxpar.cli", "schedule", "--kind", "1f1b", "--stages", "4"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    p.stdout.close()  # before the child has written anything
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == "", err


def test_log_every_is_ignored_with_one_warning(tmp_path, capsys):
    cfg = C.load("tiny", "cpu-8")
    with pytest.warns(C.ConfigWarning, match="train.log_every: no longer a field, ignored"):
        C.override(cfg, "train.log_every", "5")
    mesh = tmp_path / "m.yaml"
    mesh.write_text("devices: 8\ntrain:\n  log_every: 10\n")
    with pytest.warns(C.ConfigWarning, match="mesh.train.log_every"):
        C.load("tiny", str(mesh))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a misspelt field is still refused
        with pytest.raises(ConfigError, match="log_evry: unknown field"):
            C.override(cfg, "train.log_evry", "5")
    assert main(["train", "--dry-run", "--json", "-o", "train.log_every=5"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    want = (
        "jaxpar train: warning: train.log_every: no longer a field, ignored: every step "
        "writes one metrics record (the field was never read); remove it"
    )
    assert err == [want]
