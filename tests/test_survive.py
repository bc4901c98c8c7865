"""Training that survives: other layouts, preemption, SIGKILL (also mid-write), bad numbers,
bad checkpoint directories.

The signal tests run ``jaxpar train`` in subprocesses (4 simulated devices, dp 2 × tp 2,
ZeRO-1) sharing one persistent compilation cache, so only the first child compiles.
"""

import errno
import importlib.util
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import MODEL_YAML, TEST_XLA_FLAGS

from jaxpar import checkpoint as ck
from jaxpar.checkpoint import Checkpointer, CheckpointWarning
from jaxpar.data import Batches
from jaxpar.devices import make_mesh
from jaxpar.errors import CheckpointError
from jaxpar.train import load_data
from jaxpar.train.loop import run
from jaxpar.train.step import Trainer

REPO = Path(__file__).resolve().parent.parent
STEPS = 10


def _ckpt_cfg(make_cfg, path, steps, every, **layout):
    cfg = make_cfg(**layout)
    cfg.train.steps = steps
    cfg.train.checkpoint_dir = str(path)
    cfg.train.checkpoint_every = every
    return cfg


# ---- in-process --------------------------------------------------------------------------------


def test_restore_onto_another_layout_continues_like_one_device(make_cfg, tmp_path):
    """Saved under dp 8 ZeRO-3, restored under dp 2 × sp 2 (Ulysses) × tp 2 with Megatron SP,
    ZeRO-1 (the widest layout on main; no pipeline yet): losses of the whole run equal an
    uninterrupted single-device run."""
    ref_cfg = make_cfg(dp=1)
    ref_cfg.train.steps = 6
    ref = run(ref_cfg, devices=jax.devices()[:1])["losses"]

    first = _ckpt_cfg(make_cfg, tmp_path, 3, 3, dp=8, zero=3)
    a = run(first, devices=jax.devices())["losses"]
    second = _ckpt_cfg(make_cfg, tmp_path, 6, 3, dp=2, sp=2, tp=2, zero=1, sequence_parallel=True)
    second.train.resume = True
    out = run(second, devices=jax.devices())
    assert out["start_step"] == 3
    np.testing.assert_allclose(np.array(a + out["losses"]), np.array(ref), rtol=1e-5)
    assert ref[-1] < ref[0]


def test_nonfinite_skip_and_stop(make_cfg, tmp_path):
    """An injected NaN gradient at step 2: ``skip`` keeps the old state and goes on (step 3's
    loss is that of the step-1 params; the diverged step gets no periodic checkpoint, one
    warning line); ``stop`` writes a diagnostic naming the leaf and never checkpoints past the
    last finite state. (Also: TensorBoard scalars.)"""
    cfg = _ckpt_cfg(make_cfg, tmp_path / "skip", 3, 1, dp=2)
    cfg.train.inject_nonfinite_step = 2
    cfg.train.on_nonfinite = "skip"
    tensorboard = importlib.util.find_spec("tensorboardX") is not None  # optional dependency
    if tensorboard:
        cfg.train.tensorboard_dir = str(tmp_path / "tb")
    out = run(cfg, devices=jax.devices()[:2])
    assert out["skipped_steps"] == 1 and out["stopped"] is None and out["diverged_steps"] == 1
    assert np.isfinite(out["losses"][0]) and np.isfinite(out["losses"][2])
    recs = [json.loads(x) for x in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    bad = [r for r in recs if r.get("nonfinite")]
    assert [r["step"] for r in bad] == [2] and bad[0]["nonfinite_leaves"] == ["embed/table"]
    assert Checkpointer(tmp_path / "skip").steps() == [1, 3]
    p1, p3 = (_params(tmp_path / "skip" / str(s)) for s in (1, 3))
    # the NaN update was not applied: step 3 started from the step-1 params
    tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[:2]))
    batches = Batches(load_data(cfg), 16, 32, cfg.train.seed)
    loss3 = float(tr.eval_loss(p1, batches.global_array(2, tr.batch_sharding)))
    np.testing.assert_allclose(loss3, out["losses"][2], rtol=1e-5)
    assert not np.array_equal(p1["head"]["w_out"], p3["head"]["w_out"])
    if tensorboard:
        (event,) = (tmp_path / "tb").glob("events.out.tfevents.*")
        assert b"train/loss" in event.read_bytes() and b"train/grad_norm" in event.read_bytes()

    # ``stop``, resumed from the skip run's step 1 (no init to compile)
    shutil.copytree(tmp_path / "skip" / "1", tmp_path / "stop" / "1")
    cfg = _ckpt_cfg(make_cfg, tmp_path / "stop", 3, 1, dp=2)
    cfg.train.inject_nonfinite_step = 2
    cfg.train.on_nonfinite = "stop"
    cfg.train.resume = True
    out = run(cfg, devices=jax.devices()[:2])
    assert out["stopped"] and len(out["losses"]) == 1
    report = json.loads(Path(out["nonfinite_report"]).read_text())
    assert report["step"] == 2 and report["nonfinite_leaves"] == ["embed/table"]
    assert report["grad_norm_finite"] is False and report["last_checkpoint_step"] == 1
    assert Checkpointer(tmp_path / "stop").steps() == [1]


@pytest.mark.parametrize("layout", [dict(dp=1), dict(dp=2, zero=1)])
def test_guarded_update_writes_the_donated_state_in_place(make_cfg, layout):
    """The non-finite guard costs no copy of the state: the compiled step copies none of its
    entry arrays (the step counter, a scalar, may be). With a ``where`` over the new state,
    XLA copied every AdamW moment before the update overwrote it."""
    cfg = make_cfg(**layout)
    tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices]))
    hlo = tr.compile_step().as_text()
    entry = hlo[hlo.index("\nENTRY") :]
    args = set(re.findall(r"%([\w.\-]+) = \S+ parameter\(", entry))
    assert len(args) > 10  # the state's leaves and the batch
    # Non-scalar copies only: ``= f32[4,32]{1,0} copy(%param.3)``.
    copied = [a for a in re.findall(r"\[[\d,]+\]\S* copy\(%([\w.\-]+)\)", entry) if a in args]
    assert not copied, copied


def test_corrupted_and_partial_checkpoints_are_skipped(make_cfg, tmp_path):
    """A step without its integrity record, one with a damaged file and an orbax tmp dir are
    never loaded: the newest complete step is used; broken ones are warned about and set
    aside; a non-finite state is refused."""
    cfg = make_cfg(dp=2)
    tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[:2]))
    state = tr.init_state(0)
    c = Checkpointer(tmp_path, keep=5, every=1)
    for s in (1, 2, 3):
        c.save(s, state, {"step": s})
    c.close()
    (tmp_path / "2" / ck.MANIFEST).unlink()  # killed between orbax's rename and the manifest
    victim = max((tmp_path / "3").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else 0)
    victim.write_bytes(victim.read_bytes()[::-1])  # same size, other bytes: only the CRC sees it
    (tmp_path / "4.orbax-checkpoint-tmp-123").mkdir()  # an interrupted orbax write
    c = Checkpointer(tmp_path, keep=5, every=1)
    assert not list(tmp_path.glob("*.orbax-checkpoint-tmp*"))
    assert c.steps() == [1, 3]  # sizes only; the CRC check is made before loading
    with pytest.warns(CheckpointWarning) as w:
        assert c.latest_valid_step() == 1
    text = " ".join(str(x.message) for x in w)
    assert "step 3" in text and "CRC" in text and "step 2" in text and "no integrity" in text
    assert sorted(p.name.split("-")[0] for p in (tmp_path / ck.QUARANTINE).iterdir()) == ["2", "3"]
    restored, _ = c.restore(1, tr.abstract_state())
    jax.tree.map(np.testing.assert_array_equal, restored["params"], state["params"])
    bad = jax.tree.map(lambda x: x * np.nan, state)
    with pytest.raises(CheckpointError, match="non-finite"):
        c.save(5, bad, {})
    assert c.all_steps() == [1]


def test_bad_checkpoint_directories(make_cfg, tmp_path, monkeypatch):
    """Another model shape, no checkpoint, an unwritable path and a full disk: one-line errors
    before compiling (or at the failing save), earlier checkpoints intact."""
    d = tmp_path / "ck"
    cfg = _ckpt_cfg(make_cfg, d, 4, 2, dp=2)
    real = ck.write_manifest

    def full_at_4(step_dir):
        if step_dir.name == "4":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(step_dir)

    monkeypatch.setattr(ck, "write_manifest", full_at_4)
    with pytest.raises(CheckpointError, match="saving step 4 failed: No space left") as e:
        run(cfg, devices=jax.devices()[:2])
    assert "\n" not in str(e.value)
    monkeypatch.undo()
    assert Checkpointer(d).all_steps() == [2] and ck.verify_step(d / "2") is None

    other = _ckpt_cfg(make_cfg, d, 4, 2, dp=2)
    other.model.d_ff = 192
    other.train.resume = True
    with pytest.raises(CheckpointError, match=r"layers/mlp/w_down has shape \(4, 128, 64\) in "):
        run(other, devices=jax.devices()[:2])

    empty = _ckpt_cfg(make_cfg, tmp_path / "empty", 4, 2, dp=2)
    empty.train.resume = True
    with pytest.raises(CheckpointError, match="no complete checkpoint.*--resume-or-start"):
        run(empty, devices=jax.devices()[:2])
    from jaxpar.train.loop import _open_checkpoints

    empty.train.resume, empty.train.resume_or_start = False, True
    assert _open_checkpoints(empty)[1] is None  # starts fresh, as asked

    (tmp_path / "file").write_text("")
    ro = _ckpt_cfg(make_cfg, tmp_path / "file" / "ck", 4, 2, dp=2)
    with pytest.raises(CheckpointError, match="not writable") as e:
        run(ro, devices=jax.devices()[:2])
    assert "\n" not in str(e.value)


def test_stop_request_turns_the_first_signal_into_a_request():
    from jaxpar.train.guard import StopRequest, resume_command

    before = signal.getsignal(signal.SIGINT)
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs between bytecodes
        assert stop.signal_name == "SIGINT"
        assert signal.getsignal(signal.SIGINT) is before  # a second Ctrl-C aborts as usual
    assert resume_command(["train", "--dp", "2"]) == "jaxpar train --dp 2 --resume"


def _params(step_dir: Path):
    """A checkpoint's parameters as numpy arrays (no target shardings, no compile)."""
    c = ocp.PyTreeCheckpointer()
    tree = c.metadata(step_dir / "state").item_metadata.tree["params"]
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    item = {"params": tree}
    out = c.restore(
        step_dir / "state",
        args=ocp.args.PyTreeRestore(item=item, restore_args={"params": args}, partial_restore=True),
    )
    return out["params"]


# ---- subprocesses --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """Run ``jaxpar train`` children with a shared compilation cache; the first run is the
    uninterrupted reference (its losses and final parameters)."""
    root = tmp_path_factory.mktemp("survive")
    (root / "m.yaml").write_text(MODEL_YAML)
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(REPO),
        JAX_COMPILATION_CACHE_DIR=str(root / "jax-cache"),
        JAX_ENABLE_COMPILATION_CACHE="true",  # conftest turns it off for the test processes
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
    )
    env["XLA_FLAGS"] = TEST_XLA_FLAGS

    def args(ckdir, every, *extra):
        return [
            *("train", "--model", str(root / "m.yaml"), "--devices", "4", "--dp", "2"),
            *("--tp", "2", "--pp", "1", "--microbatches", "1", "--zero", "1"),
            *("--steps", str(STEPS), "--global-batch", "16"),
            *("--seq-len", "32", "--eval-every", "0", "--no-progress", "--data", "synthetic"),
            "-o",
            *("train.warmup_steps=2", "--checkpoint-dir", str(ckdir)),
            *("--checkpoint-every", str(every), *extra),
        ]

    def start(argv, extra_env=None, name="child"):
        out = open(root / f"{name}.out", "w")
        err = open(root / f"{name}.err", "w")
        cmd = [sys.executable, "-m", "jaxpar.cli", *argv]
        p = subprocess.Popen(cmd, env={**env, **(extra_env or {})}, stdout=out, stderr=err)
        p.err_path = root / f"{name}.err"
        return p

    ref = start(args(root / "ref", STEPS), name="ref")
    assert ref.wait(timeout=300) == 0, ref.err_path.read_text()
    ns = type("Cli", (), {})()
    ns.root, ns.args, ns.start = root, args, start
    ns.ref_losses = _losses(root / "ref" / "metrics.jsonl")
    ns.ref_params = _params(root / "ref" / str(STEPS))
    return ns


def _records(metrics: Path) -> list[dict]:
    out = []
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut by SIGKILL
    return out


def _losses(metrics: Path) -> list[float]:
    """Loss per step, the last record of each step winning (resumed runs repeat steps)."""
    by_step = {r["step"]: r["loss"] for r in _records(metrics) if "loss" in r}
    return [by_step[s] for s in sorted(by_step)]


def _wait_for(cond, proc, timeout=240.0, poll=0.001):
    t0 = time.monotonic()
    while not cond():
        if proc.poll() is not None:
            return False
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("child made no progress")
        time.sleep(poll)
    return True


def _steps_done(metrics: Path) -> int:
    return sum("loss" in r for r in _records(metrics))


def test_sigkill_anywhere_then_resume_is_bitwise_identical(cli):
    """Three SIGKILLs — at a random moment of training, while orbax writes a step (its tmp dir
    exists), and after orbax finalised but before jaxpar's integrity record — each followed by a
    resume; the final parameters and every step's loss equal the uninterrupted run's bits."""
    rng = random.Random()
    d = cli.root / "killed"
    metrics = d / "metrics.jsonl"
    argv = cli.args(d, 1, "--resume-or-start")

    def tmp_dirs():
        return set(d.glob("*.orbax-checkpoint-tmp*")) if d.exists() else set()

    def unsealed():
        steps = [p for p in d.iterdir() if p.name.isdigit()] if d.exists() else []
        return [p for p in steps if not (p / ck.MANIFEST).exists()]

    # 1. a random moment, a few steps into training
    p = cli.start(argv, name="kill1")
    assert _wait_for(lambda: _steps_done(metrics) >= rng.randint(2, 4), p), p.err_path.read_text()
    time.sleep(rng.uniform(0.0, 0.2))
    p.kill()
    p.wait()
    # 2. inside orbax's write of a step after the resumed one: its tmp dir exists and stays
    # (retried if the write finished between seeing the dir and the kill landing)
    for attempt in range(3):
        base, old = _steps_done(metrics), tmp_dirs()
        p = cli.start(argv, name=f"kill2-{attempt}")
        hit = _wait_for(lambda b=base, o=old: _steps_done(metrics) > b and tmp_dirs() - o, p)
        p.kill()
        p.wait()
        assert hit, p.err_path.read_text()
        if tmp_dirs() - old:
            break
    assert tmp_dirs() - old, "never killed inside orbax's write"
    # 3. between orbax's rename and the manifest (the test hook widens that window)
    p = cli.start(argv, {ck.SAVE_DELAY_ENV: "2"}, name="kill3")
    hit = _wait_for(lambda: unsealed(), p)
    p.kill()
    p.wait()
    assert hit and unsealed(), p.err_path.read_text()
    unsealed_step = unsealed()[0].name
    # finish
    p = cli.start(argv, name="finish")
    assert p.wait(timeout=300) == 0, p.err_path.read_text()
    err = p.err_path.read_text()
    assert f"checkpoint step {unsealed_step}" in err and "no integrity record" in err
    assert not tmp_dirs()
    starts = [r["step"] for r in _records(metrics) if r.get("event") == "start"]
    assert len(starts) >= 4 and starts[0] == 0 and 0 < starts[-1] < STEPS, starts
    jax.tree.map(np.testing.assert_array_equal, _params(d / str(STEPS)), cli.ref_params)
    assert _losses(metrics) == cli.ref_losses
    # each resume cut the records written after its checkpoint: every step once, in order
    assert [r["step"] for r in _records(metrics) if "loss" in r] == list(range(1, STEPS + 1))
    assert sum(r.get("dropped_records", 0) for r in _records(metrics)) > 0


def test_sigterm_checkpoints_exits_0_and_resumes(cli):
    d = cli.root / "term"
    metrics = d / "metrics.jsonl"
    p = cli.start(cli.args(d, 100), name="term")
    assert _wait_for(lambda: _steps_done(metrics) >= 2, p), p.err_path.read_text()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 0
    err = p.err_path.read_text()
    assert "stopped by SIGTERM" in err, err
    saved = Checkpointer(d, writable=False).steps()
    assert len(saved) == 1 and 2 <= saved[0] < STEPS
    command = err.split("resume with:")[1].strip().splitlines()[0]
    argv = shlex.split(command)
    assert argv[0] == "jaxpar" and argv[-1] == "--resume"
    p = cli.start(argv[1:], name="term-resume")
    assert p.wait(timeout=300) == 0, p.err_path.read_text()
    jax.tree.map(np.testing.assert_array_equal, _params(d / str(STEPS)), cli.ref_params)
    assert _losses(metrics) == cli.ref_losses
    assert [r["step"] for r in _records(metrics) if "loss" in r] == list(range(1, STEPS + 1))
