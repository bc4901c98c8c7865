"""Nothing lost, nothing trusted: one test per class of bad input or fault that jaxpar once let
through (each failed before the fix). In-process where nothing needs to train; subprocesses
for signals and a two-process launch.
"""

import json
import os
import resource
import signal
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MODEL_YAML, TEST_MODEL, TEST_XLA_FLAGS

from jaxpar import config as C
from jaxpar.checkpoint import MANIFEST, Checkpointer, verify_step
from jaxpar.cli import main
from jaxpar.data import open_token_file, write_sidecar
from jaxpar.errors import ConfigError, JaxparError
from jaxpar.lock import LOCK_NAME, RunLock

ROOT = Path(__file__).resolve().parent.parent
DRY = ["train", "--devices", "1", "--dp", "1", "--tp", "1", "--pp", "1", "--microbatches", "1",
       "--global-batch", "2", "--seq-len", "16", "--data", "synthetic", "--dry-run"]  # fmt: skip


def _one_line(capsys, argv, code=2) -> str:
    rc = main(argv)
    err = [x for x in capsys.readouterr().err.strip().splitlines() if x]
    assert rc == code, (argv, err)
    assert len(err) == 1, (argv, err)
    return err[0]


def _tokens(tmp_path, ids, dtype="uint16", **sidecar) -> Path:
    path = tmp_path / "t.bin"
    np.asarray(ids, dtype=dtype).tofile(path)
    record = {"dtype": dtype, "vocab_size": 256, "tokens": len(ids), **sidecar}
    if sidecar.pop("_raw", None) is None:
        write_sidecar(path, record)
    return path


def _sidecar(path: Path, **fields) -> None:
    side = path.with_suffix(".json")
    record = json.loads(side.read_text())
    record.update(fields)
    side.write_text(json.dumps(record))


# ---- data lost or corrupted silently --------------------------------------------------------


def test_second_prepare_into_one_out_is_refused_naming_the_first(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello world\n")
    out = tmp_path / "t.bin"
    argv = ["data", "prepare", str(tmp_path / "a.txt"), "--tokenizer", "byte", "--out", str(out),
            "--workers", "1", "--no-progress"]  # fmt: skip
    holder = RunLock(out.with_name(out.name + ".lock"), "the first prepare").acquire()
    try:
        line = _one_line(capsys, argv)
        assert "in use by another run" in line and f"pid {os.getpid()}" in line, line
        assert not out.exists()
    finally:
        holder.release()
    assert main(argv) == 0 and out.exists() and not list(tmp_path.glob(".*tmp*"))


def test_metrics_file_in_another_runs_checkpoint_dir_is_refused(tmp_path, make_cfg):
    from jaxpar.train.loop import run

    other = tmp_path / "other"
    other.mkdir()
    holder = RunLock(other / LOCK_NAME, "the other run").acquire()
    try:
        cfg = make_cfg()
        cfg.train.data, cfg.train.metrics_file = "synthetic", str(other / "metrics.jsonl")
        with pytest.raises(ConfigError, match="inside another run's checkpoint directory"):
            run(cfg, devices=None)
        assert not (other / "metrics.jsonl").exists()
    finally:
        holder.release()


def test_foreign_metrics_file_needs_force_and_is_then_replaced_whole(tmp_path, capsys, make_cfg):
    from jaxpar.outputs import lock_outputs

    m = tmp_path / "notes.jsonl"
    m.write_text('{"step": 1, "loss": 2.0}\nmy own notes, keep them\n')
    line = _one_line(capsys, [*DRY, "--metrics-file", str(m)])
    assert "line 2" in line and "not a jaxpar record" in line and "--force" in line, line
    cut = tmp_path / "cut.jsonl"  # a record cut short by a crash is jaxpar's own
    cut.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n')
    assert main([*DRY, "--metrics-file", str(cut)]) == 0
    capsys.readouterr()
    cfg = make_cfg()
    cfg.train.metrics_file, cfg.train.force = str(m), True
    for lock in lock_outputs(cfg):
        lock.release()
    assert m.read_text() == ""


def _hf_params(cfg):
    from jaxpar.model.hf import _entries, _set

    params = {}
    for e in _entries(cfg):
        shape = e.to_jax(np.zeros(e.hf_shape(cfg), np.float32), cfg).shape
        _set(params, e.path, np.ones((cfg.n_layers, *shape) if e.stacked else shape, np.float32))
    return params


def test_export_into_a_foreign_hf_dir_needs_force_and_replaces_it_whole(tmp_path, capsys):
    from jaxpar.model import hf

    d = tmp_path / "hf"
    d.mkdir()
    for name in ("config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        (d / name).write_text("{}")
    line = _one_line(capsys, [*DRY, "--export-hf", str(d)])
    assert "did not write" in line and "--force" in line, line
    assert main([*DRY, "--export-hf", str(d), "--force"]) == 0
    capsys.readouterr()
    cfg = C.ModelConfig(name="test", **TEST_MODEL)
    hf.export(_hf_params(cfg), cfg, d)
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors"]
    hf.check_export_target(d)  # jaxpar's own export: replaced again without --force


def _small_checkpoint(tmp_path) -> Path:
    ck = Checkpointer(tmp_path / "ck", every=1)
    ck.save(1, {"params": {"w": jnp.arange(64.0)}, "step": jnp.array(1)}, {"step": 1})
    ck.close()
    return tmp_path / "ck" / "1"


def test_a_manifest_listing_no_files_does_not_vouch_for_a_corrupted_step(tmp_path):
    step = _small_checkpoint(tmp_path)
    (step / MANIFEST).write_text(json.dumps({"version": 1, "files": {}}))
    data = max((p for p in step.rglob("*") if p.is_file() and p.name != MANIFEST),
               key=lambda p: p.stat().st_size)  # fmt: skip
    data.write_bytes(b"\0" * data.stat().st_size)
    assert verify_step(step) is not None
    (step / MANIFEST).write_text(json.dumps({"version": 1, "files": {"state/x": [1, 2]}}))
    assert "not in the integrity record" in verify_step(step) or "missing" in verify_step(step)


# ---- files trusted instead of checked --------------------------------------------------------


def test_a_sidecar_vocabulary_is_checked_against_the_tokens(tmp_path):
    path = _tokens(tmp_path, [1, 2, 999, 3])
    with pytest.raises(ConfigError, match="holds token id 999"):
        open_token_file(path)


@pytest.mark.parametrize(
    "field, value, rule",
    [
        ("validation_file", "../../etc/passwd", "must be a file name in the sidecar's directory"),
        ("validation_file", "/etc/passwd", "must be a file name"),
        ("validation_file", 5, "expected null or a string"),
        ("validation_file", {"a": 1}, "expected"),
        ("vocab_size", True, "vocab_size=True: expected an integer"),
        ("tokens", True, "expected an integer"),
        ("tokenizer", "byte", "tokenizer='byte': expected a mapping or null"),
        ("tokenizer", {"kind": "huggingface"}, "must be {'kind': 'byte'}"),
    ],
)
def test_sidecar_fields_are_held_to_their_schema(tmp_path, field, value, rule):
    path = _tokens(tmp_path, [1, 2, 3, 4])
    _sidecar(path, **{field: value})
    with pytest.raises(ConfigError) as e:
        open_token_file(path)
    assert rule in str(e.value) and "t.json" in str(e.value) and "\n" not in str(e.value)


def test_duplicate_yaml_keys_are_refused(tmp_path, capsys):
    m = tmp_path / "m.yaml"
    m.write_text(MODEL_YAML + "n_layers: 2\n")
    line = _one_line(capsys, [*DRY, "--model", str(m)])
    assert "duplicate key 'n_layers' (first at line 2)" in line and "m.yaml:9:1" in line, line


def _bad_hf_dir(tmp_path, weights: bytes) -> Path:
    from jaxpar.model.hf import hf_config

    d = tmp_path / "hfbad"
    d.mkdir(exist_ok=True)
    cfg = C.ModelConfig(name="test", **TEST_MODEL)
    (d / "config.json").write_text(json.dumps(hf_config(cfg)))
    (d / "model.safetensors").write_bytes(weights)
    return d


def _truncated_safetensors(tmp_path) -> bytes:
    from safetensors.numpy import save_file

    cfg = C.ModelConfig(name="test", **TEST_MODEL)
    from jaxpar.model.hf import _entries

    tensors = {}
    for e in _entries(cfg):
        for i in range(cfg.n_layers) if e.stacked else [None]:
            tensors[e.hf.format(i=i)] = np.zeros(e.hf_shape(cfg), np.float32)
    save_file(tensors, str(tmp_path / "full.safetensors"))
    raw = (tmp_path / "full.safetensors").read_bytes()
    return raw[: len(raw) - 1000]


def test_dry_run_runs_every_check_of_the_real_run(tmp_path, capsys, monkeypatch):
    d = _bad_hf_dir(tmp_path, _truncated_safetensors(tmp_path))
    m = tmp_path / "m.yaml"
    m.write_text(MODEL_YAML)
    line = _one_line(capsys, [*DRY, "--model", str(m), "--init-from-hf", str(d)])
    assert "truncated" in line and "model.safetensors" in line, line
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text((ROOT / "meshes" / "cpu-8.yaml").read_text() + "\n" * 0 + "")
    data = C.typed.read_yaml(mesh)
    data.setdefault("hardware", {})["xla_flags"] = ["--xla_jaxpar_no_such_flag=1"]
    import yaml

    mesh.write_text(yaml.safe_dump(data))
    line = _one_line(capsys, [*DRY, "--mesh", str(mesh)])
    assert "hardware.xla_flags" in line and "xla_jaxpar_no_such_flag" in line, line
    monkeypatch.setenv("JAXPAR_HOST_ALLOCATOR", "fast")
    line = _one_line(capsys, DRY)
    assert line.endswith("JAXPAR_HOST_ALLOCATOR='fast': must be one of keep, system"), line


# ---- tracebacks from file contents ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["empty", "garbage", "truncated", "header"])
def test_bad_safetensors_are_one_line(tmp_path, capsys, kind):
    weights = {
        "empty": b"",
        "garbage": os.urandom(4096),
        "truncated": _truncated_safetensors(tmp_path),
        "header": struct.pack("<Q", 12) + b'{"a": [1, 2]',
    }[kind]
    d = _bad_hf_dir(tmp_path, weights)
    for argv in (
        [*DRY[:-1], "--init-from-hf", str(d), "--steps", "1"],  # the real run: refused pre-compile
        ["eval", "--init-from-hf", str(d), "--data", "stdlib", "--devices", "8",
         "--global-batch", "8", "--seq-len", "16"],
        ["generate", "--init-from-hf", str(d), "--prompt", "hi", "--tokenizer", "byte",
         "--devices", "8", "--max-new-tokens", "2"],
    ):  # fmt: skip
        line = _one_line(capsys, argv)
        assert "model.safetensors" in line, line


def test_non_utf8_prompts_file_is_one_line(tmp_path, capsys):
    ck = _small_checkpoint(tmp_path).parent
    p = tmp_path / "prompts.txt"
    p.write_bytes(b"hello\n\xff\xfe bad\n")
    line = _one_line(capsys, ["generate", "--checkpoint-dir", str(ck), "--prompts-file", str(p)])
    assert "line 2: not UTF-8" in line or "unreadable record" in line, line
    line = _one_line(capsys, ["generate", "--checkpoint-dir", str(ck), "--prompts-file",
                              str(tmp_path)])  # fmt: skip
    assert "is a directory" in line or "unreadable record" in line, line


def test_non_ascii_digit_step_directory_is_ignored(tmp_path, capsys):
    ck = tmp_path / "ck"
    (ck / "²").mkdir(parents=True)
    line = _one_line(capsys, ["eval", "--checkpoint-dir", str(ck), "--data", "stdlib"])
    assert "no complete checkpoint" in line, line


def test_deep_or_huge_yaml_is_one_line(tmp_path, capsys):
    m = tmp_path / "deep.yaml"
    m.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    line = _one_line(capsys, [*DRY, "--model", str(m)])
    assert "nested deeper than" in line, line
    m.write_text("# " + "x" * (2 << 20) + "\n")
    line = _one_line(capsys, [*DRY, "--model", str(m)])
    assert "larger than" in line, line


def test_vocab_size_beyond_memory_is_refused(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello hello world\n")
    argv = ["data", "train-tokenizer", str(tmp_path / "a.txt"), "--vocab-size", str(10**12)]
    line = _one_line(capsys, [*argv, "--out", str(tmp_path / "tok")])
    assert "--vocab-size=1000000000000: must be at most" in line, line
    assert not (tmp_path / "tok").exists()


@pytest.mark.parametrize(
    "record",
    [{"version": 1, "files": {"a": 5}}, {"version": 1, "files": []}, [1, 2],
     {"version": "1", "files": {}}, {"version": 1, "files": {"../x": [1, 2]}}, "x"],
)  # fmt: skip
def test_manifest_of_wrong_types_is_a_reason_not_a_traceback(tmp_path, record):
    step = _small_checkpoint(tmp_path)
    (step / MANIFEST).write_text(json.dumps(record))
    why = verify_step(step)
    assert why and why.startswith("unreadable integrity record"), why


def test_full_disk_during_export_is_one_line_and_keeps_the_old_export(tmp_path):
    from jaxpar.model import hf

    cfg = C.ModelConfig(name="test", **TEST_MODEL)
    d = tmp_path / "hf"
    hf.export(_hf_params(cfg), cfg, d)
    before = (d / "model.safetensors").read_bytes()
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    try:
        with pytest.raises(JaxparError) as e:
            hf.export(_hf_params(cfg), cfg, d)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, old)
    assert "writing the export failed" in str(e.value) and "untouched" in str(e.value)
    assert "\n" not in str(e.value)
    assert (d / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf.lock"] or sorted(
        p.name for p in tmp_path.iterdir()
    ) == ["hf"]


# ---- wrong words ----------------------------------------------------------------------------


def test_a_directory_or_fifo_given_as_a_file_is_named_so(tmp_path, capsys):
    line = _one_line(capsys, [*DRY, "--data", str(tmp_path)])
    assert "is a directory" in line, line
    fifo = tmp_path / "fifo.bin"
    os.mkfifo(fifo)
    path = _tokens(tmp_path, list(range(100)))
    line = _one_line(capsys, [*DRY, "--data", str(path), "--eval-data", str(fifo)])
    assert "is a FIFO" in line, line


def test_a_step_never_written_is_not_called_interrupted(tmp_path, capsys):
    ck = _small_checkpoint(tmp_path).parent
    line = _one_line(capsys, ["eval", "--checkpoint-dir", str(ck), "--step", "7", "--data",
                              "stdlib"])  # fmt: skip
    assert "never written" in line and "interrupted" not in line, line


# ---- processes and kernels ------------------------------------------------------------------


def _env():
    import jaxpar

    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(jaxpar.__file__).parents[1]))
    env["XLA_FLAGS"] = TEST_XLA_FLAGS  # no device count of this process's; -O0 (conftest)
    return env


def test_sigterm_right_after_the_lock_is_taken_releases_it(tmp_path):
    d, m = tmp_path / "ck", tmp_path / "m.yaml"
    m.write_text(MODEL_YAML)
    cmd = [sys.executable, "-m", "jaxpar.cli", *DRY[:-1], "--model", str(m), "--steps", "3",
           "--checkpoint-dir", str(d), "--no-progress"]  # fmt: skip
    p = subprocess.Popen(cmd, env=_env(), stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not (d / LOCK_NAME).exists():
        assert p.poll() is None and time.monotonic() - t0 < 120, p.communicate()
        time.sleep(0.002)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    lines = [x for x in err.splitlines() if x.strip()]
    if p.returncode == 0:  # the signal reached the training loop: an agreed checkpoint
        assert any("stopped by SIGTERM" in x for x in lines), err
    else:
        assert p.returncode == 128 + signal.SIGTERM, err
        assert lines == ["jaxpar train: error: stopped by SIGTERM before training started; "
                         "no step was run or saved"], err  # fmt: skip
    assert not (d / LOCK_NAME).exists(), (p.returncode, err)


def test_a_cache_dir_that_cannot_be_written_runs_blockwise_with_one_warning(tmp_path, monkeypatch):
    from jaxpar.model import attention, native

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("JAXPAR_CACHE_DIR", str(tmp_path / "file" / "cache"))
    caches = (native._build, native._register, native.usable)
    for c in caches:
        c.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = attention.resolve("auto", False, jnp.float32, 16, platform="cpu")
        assert got == "blockwise"
        assert len(seen) == 1 and "cannot be created" in str(seen[0].message)
        with pytest.raises(ConfigError, match="model.attention='native': cache directory"):
            attention.resolve("native", False, jnp.float32, 16, platform="cpu")
    finally:
        for c in caches:
            c.cache_clear()


def test_the_native_library_is_loaded_only_with_its_recorded_hash(tmp_path, monkeypatch):
    """A stand-in compiler (writes its -o file) keeps this cheap: the cache's mode, the hash
    written by the build, and a library whose bytes changed being rebuilt, not loaded."""
    from jaxpar.model import native

    cxx = tmp_path / "fake-c++"
    cxx.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && echo built > "$2"; '
                   "shift; done\n")  # fmt: skip
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("JAXPAR_CACHE_DIR", str(tmp_path / "cache"))
    native._build.cache_clear()
    try:
        lib, why = native._build()
        assert why is None and lib.read_bytes() == b"built\n"
        assert (tmp_path / "cache" / "native").stat().st_mode & 0o777 == 0o700
        lib.write_bytes(b"not what was built")
        native._build.cache_clear()
        again, _ = native._build()  # the recorded hash does not match: rebuilt
        assert again == lib and lib.read_bytes() == b"built\n"
        (tmp_path / "cache" / "native").chmod(0o777)
        native._build.cache_clear()
        assert "not private" in native._build()[1]
    finally:
        native._build.cache_clear()


# ---- asynchronous checkpoints ---------------------------------------------------------------


def test_save_returns_before_the_step_is_final_and_wait_seals_it(tmp_path, monkeypatch):
    from jaxpar import checkpoint as ck

    monkeypatch.setenv(ck.SAVE_DELAY_ENV, "1")
    c = Checkpointer(tmp_path / "ck", every=1)
    state = {"params": {"w": jnp.arange(16.0)}, "step": jnp.array(1)}
    assert c.save(1, state, {"step": 1})
    assert c.steps() == []  # not final yet: no manifest, not a complete checkpoint
    c.wait()
    assert c.steps() == [1] and verify_step(tmp_path / "ck" / "1") is None
    c.save(2, state, {"step": 2})
    c.close()  # waits for the save in flight
    assert Checkpointer(tmp_path / "ck", writable=False).steps() == [1, 2]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds children in /proc")
def test_sigkill_of_one_worker_is_one_line_each_and_releases_the_lock(tmp_path):
    """``jaxpar launch --local 2``, SIGKILL to process 1 mid-run: the launcher names it and
    exits 137; process 0 names its dead peer in one line within the peer timeout, releases the
    directory lock, and the newest complete checkpoint passes its full CRC check."""
    from test_harden import _child  # noqa: PLC0415  (the launcher's child by process id)

    d, m = tmp_path / "ck", tmp_path / "m.yaml"
    m.write_text(MODEL_YAML)
    cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--local", "2", "--devices-per-process",
           "1", "--grace", "30", "--", "train", "--devices", "2", "--model", str(m), "--dp", "2",
           "--tp", "1", "--pp", "1", "--microbatches", "1", "--global-batch", "4", "--seq-len",
           "32", "--steps", "1000", "--eval-every", "0", "--no-progress", "--data", "synthetic",
           "--checkpoint-dir", str(d), "--checkpoint-every", "3"]  # fmt: skip
    env = dict(_env(), JAXPAR_PEER_TIMEOUT_S="5")
    launch = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, start_new_session=True)  # fmt: skip
    try:
        metrics, t0 = d / "metrics.jsonl", time.monotonic()

        def ready() -> bool:  # 4 steps done and one complete checkpoint to keep
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            return any(d.glob(f"*/{MANIFEST}")) and sum('"loss"' in x for x in lines) >= 4

        while not ready():
            assert launch.poll() is None and time.monotonic() - t0 < 240, launch.communicate()
            time.sleep(0.05)
        victim = _child(launch.pid, 1)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _, err = launch.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.communicate()
    lines = [x for x in err.splitlines() if "error" in x or x.startswith("jaxpar launch")]
    assert launch.returncode == 128 + signal.SIGKILL, err[-3000:]
    # the launcher's line and the survivor's race (two processes' stderr): either order
    launcher = [x for x in lines if x.startswith("jaxpar launch")]
    assert len(launcher) == 1, lines
    assert f"jaxpar launch: process 1 (pid {victim}) was killed by SIGKILL" in launcher[0], lines
    survivor = [x for x in lines if x.startswith("[p0]")]
    assert len(survivor) == 1 and "process 1 of this 2-process run is gone" in survivor[0], err
    assert "Traceback" not in err and took < 30, (took, err[-3000:])
    assert not (d / LOCK_NAME).exists()
    ck = Checkpointer(d, writable=False)
    newest = ck.latest_valid_step()
    assert newest is not None and newest >= 3 and verify_step(d / str(newest)) is None
