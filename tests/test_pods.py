"""Multi-host runs, XLA flags per platform, and the step profiler."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import MODEL_YAML, TEST_XLA_FLAGS

from jaxpar import config as C
from jaxpar.cli import main
from jaxpar.distributed import apply_xla_flags, free_port, process_config, wait_for_coordinator
from jaxpar.errors import ConfigError, JaxparError
from jaxpar.profiling import StepProfiler, parse_steps
from jaxpar.train.loop import run

ROOT = Path(__file__).resolve().parent.parent
# The CLI spelling of tests/conftest.py's small_config (dp=4, tp=2).
TRAIN_ARGS = [
    "--global-batch", "16", "--seq-len", "32", "--steps", "5", "--dp", "4", "--tp", "2",
    "--pp", "1", "--microbatches", "1",
    "-o", "train.warmup_steps=2", "--eval-every", "0", "--no-progress", "--json",
]  # fmt: skip


def _env(**extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = TEST_XLA_FLAGS  # no simulated device count of this process's
    return dict(env, **extra)


def test_two_processes_match_single_process(make_cfg, tmp_path):
    """2 processes × 4 simulated CPU devices (gloo) train like one process with 8 devices;
    process 0 alone writes metrics; each process writes a profiler trace of steps 2..3."""
    model = tmp_path / "model.yaml"
    model.write_text(MODEL_YAML)
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--local", "2"]
    cmd += ["--devices-per-process", "4", "--timeout", "240", "--init-timeout", "60", "--"]
    cmd += ["train", "--model", str(model), "--metrics-file", str(metrics), *TRAIN_ARGS]
    cmd += ["--profile-steps", "2:3", "--profile-dir", str(tmp_path / "prof")]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ROOT,
        start_new_session=True,  # launcher and its children form one group, killed together
    )
    try:  # the reference runs here meanwhile
        ref = run(make_cfg(dp=4, tp=2), devices=jax.devices())
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert got["processes"] == 2 and got["devices"] == 8
    assert ref["losses"][-1] < ref["losses"][0]
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    # One writer: process 0's records only (a start record and one per step, not two of each).
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r.get("event") for r in records].count("start") == 1
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]
    # The profiler: one trace per process, holding exactly the annotated steps 2 and 3.
    assert got["profiled_steps"] == [2, 3]
    files = StepProfiler(None, str(tmp_path / "prof")).trace_files()
    assert sorted(f.relative_to(tmp_path / "prof").parts[0] for f in files) == [
        "process_0",
        "process_1",
    ]
    for f in files:
        assert _annotated_steps(f) == [2, 3]


def _annotated_steps(xplane: Path) -> list[int]:
    data = jax.profiler.ProfileData.from_file(str(xplane))
    return sorted(
        dict(ev.stats)["step_num"]
        for plane in data.planes
        for line in plane.lines
        for ev in line.events
        if ev.name == "train"
    )


def test_unreachable_coordinator_times_out_clearly(tmp_path):
    port = free_port()  # nothing listens there
    cmd = [sys.executable, "-m", "jaxpar.cli", "train", "--coordinator", f"127.0.0.1:{port}"]
    cmd += ["--num-processes", "2", "--process-id", "1", "--steps", "1"]
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=90, env=_env(JAXPAR_INIT_TIMEOUT="2")
    )
    assert time.monotonic() - t0 < 60
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert f"coordinator 127.0.0.1:{port}: not reachable within 2s" in err
    assert "process 0 is running" in err


def test_wait_for_coordinator_sees_a_listener():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        wait_for_coordinator(f"127.0.0.1:{s.getsockname()[1]}", 2.0)  # returns, no error
    with pytest.raises(JaxparError, match="not reachable within 0.5s"):
        wait_for_coordinator(f"127.0.0.1:{free_port()}", 0.5)


def test_process_config_sources_and_bad_ids(capsys):
    env = {"JAXPAR_COORDINATOR": "h:1", "JAXPAR_NUM_PROCESSES": "4", "JAXPAR_PROCESS_ID": "3"}
    pc = process_config(env=env)
    assert (pc.coordinator, pc.num_processes, pc.process_id, pc.source) == ("h:1", 4, 3, "env")
    pc = process_config("a:2", 2, 0, env=env)  # explicit flags win over the environment
    assert (pc.coordinator, pc.num_processes, pc.process_id, pc.source) == ("a:2", 2, 0, "flags")
    slurm = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5"}
    pc = process_config(env=slurm)
    assert (pc.num_processes, pc.process_id, pc.source) == (8, 5, "slurm")
    assert process_config(env={"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    assert process_config(env={}) is None

    with pytest.raises(ConfigError, match=r"^--process-id=2: must be in 0..1 \(num_processes=2\)$"):
        process_config("h:1", 2, 2, env={})
    with pytest.raises(ConfigError, match="^JAXPAR_PROCESS_ID=4: must be in 0..3"):
        process_config(env=dict(env, JAXPAR_PROCESS_ID="4"))
    with pytest.raises(ConfigError, match="^SLURM_PROCID=8: must be in 0..7"):
        process_config(env=dict(slurm, SLURM_PROCID="8"))
    with pytest.raises(ConfigError, match="^--process-id=-1"):
        process_config("h:1", 2, -1, env={})
    with pytest.raises(ConfigError, match="^--coordinator='nohost': expected HOST:PORT"):
        process_config("nohost", 2, 0, env={})
    # Through the CLI: one line, exit 2, nothing started.
    rc = main(["train", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "7"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [
        "jaxpar train: error: --process-id=7: must be in 0..1 (num_processes=2)"
    ]


def test_gpu_xla_flags_exist_in_jaxlib():
    """Every flag of the GPU mesh files starts XLA (an unknown flag aborts it, shown by a bogus
    one), and flags are applied only for the matching platform, the user's own winning."""
    flags = sorted({f for m in ("a100-8", "a100-64", "h100-8", "h100-1024")
                    for f in C.load_mesh(m).hardware.xla_flags})  # fmt: skip
    assert len(flags) >= 8
    code = "import jax; jax.numpy.zeros(2).block_until_ready()"
    for extra, ok in (([], True), (["--xla_gpu_no_such_flag=true"], False)):
        env = _env(XLA_FLAGS=" ".join(flags + extra))
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, timeout=120
        )
        assert (proc.returncode == 0) == ok, proc.stderr[-1000:]

    env = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": "--xla_gpu_enable_command_buffer="}
    added = apply_xla_flags("gpu", flags, env)
    assert "--xla_gpu_enable_command_buffer=FUSION,CUBLAS" not in added
    assert env["XLA_FLAGS"].split()[0] == "--xla_gpu_enable_command_buffer="
    assert len(added) == len(flags) - 1
    cpu_env = {"JAX_PLATFORMS": "cpu"}
    assert apply_xla_flags("gpu", flags, cpu_env) == [] and "XLA_FLAGS" not in cpu_env


@pytest.mark.parametrize("spec", ["3:2", "0:1", "2:9", "a:b", "1:2:3"])
def test_bad_profile_steps(spec):
    with pytest.raises(ConfigError, match=r"^train\.profile_steps="):
        parse_steps(spec, 5)
    assert parse_steps("2:3", 5) == (2, 3) and parse_steps("4", 5) == (4, 4)


def test_launch_reports_a_failing_child(tmp_path, capsys):
    """A command every process would refuse is refused by the launcher, in one line, before
    any process starts; a failure only the processes see (no checkpoint to resume) is
    reported by each and stops the launch with its exit code."""
    assert main(["launch", "--local", "2", "--", "train", "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "jaxpar launch: error: in the command (train ...): argument --steps: '0': must be a "
        "positive integer"
    ]
    cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--local", "2", "--timeout", "60"]
    proc = subprocess.run(
        [*cmd, "--", "train", "--resume", "--checkpoint-dir", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=90,
        env=_env(),
    )
    assert proc.returncode == 2
    assert "[p1] jaxpar train: error: train.resume=True: no complete checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr
