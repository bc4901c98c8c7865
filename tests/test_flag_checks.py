"""Bad input refused in one line before anything compiles, in the real run and ``--dry-run``
alike (one source of checks: jaxpar.validation and jaxpar.preflight): XLA flags with a value
XLA cannot read (``XLA_FLAGS`` or the mesh's ``xla_flags``: XLA itself aborts, printing
nothing a user would read), a ragged MoE exchange on CPU, a bad matmul efficiency curve."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpar import config as C
from jaxpar import preflight as PF
from jaxpar import validation as V
from jaxpar.cli import main
from jaxpar.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
BAD = "--xla_gpu_enable_latency_hiding_scheduler=banana"


def test_xla_flag_values_are_checked_by_xla_before_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAR_CACHE_DIR", str(tmp_path))
    PF._xla_says.cache_clear()
    with pytest.raises(ConfigError, match=r"^XLA_FLAGS='--xla_gpu_enable_latency_hiding_sch"
                       r"eduler=banana': XLA cannot interpret 'banana'"):  # fmt: skip
        PF.check_xla_values([("--xla_cpu_enable_fast_math=true", "XLA_FLAGS"), (BAD, "XLA_FLAGS")])
    with pytest.raises(ConfigError, match=r"^XLA_FLAGS='xla_cpu_ftz': not an XLA flag"):
        PF.check_xla_values([("xla_cpu_ftz", "XLA_FLAGS")])
    # The mesh file's flags, where the run applies them (a CPU mesh: jaxlib's XLA).
    hw = C.load_mesh("cpu-8").hardware
    hw.xla_flags = ["--xla_cpu_prefer_vector_width=wide"]
    with pytest.raises(ConfigError, match=r"^hardware.xla_flags='--xla_cpu_prefer_vector_"
                       r"width=wide': XLA cannot interpret 'wide'"):  # fmt: skip
        PF.check_xla_flags(hw, env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_ftz=true"})
    # A GPU plugin's own flag names are its check (jaxpar.gpu.compile): values only here.
    PF.check_xla_values([("--xla_jaxpar_plugin_only=1", "XLA_FLAGS")], known_names=False)
    # What XLA accepted is remembered: the child starts once per new flag.
    PF.check_xla_values([("--xla_cpu_enable_fast_math=true", "XLA_FLAGS")])
    assert "--xla_cpu_enable_fast_math=true" in PF._accepted()


def test_bad_xla_flags_env_is_one_line_in_a_real_run(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS=BAD,
               JAXPAR_CACHE_DIR=str(tmp_path))  # fmt: skip
    p = subprocess.run([sys.executable, "-m", "jaxpar.cli", "train", "--steps", "1"], env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [
        f"jaxpar train: error: XLA_FLAGS='{BAD}': XLA cannot interpret 'banana' as "
        "xla_gpu_enable_latency_hiding_scheduler"
    ]


def _dry_run(capsys, *argv) -> list[str]:
    assert main(["train", "--dry-run", *argv]) == 2
    return capsys.readouterr().err.strip().splitlines()


def test_dry_run_refuses_what_the_run_refuses(capsys):
    # The ragged exchange on CPU: the trainer's platform rule, run by the dry run too.
    (line,) = _dry_run(capsys, "--model", "tiny-moe", "--pp", "1", "--dp", "4", "--ep", "4",
                       "--microbatches", "1", "-o", "model.moe.dispatch=ragged")  # fmt: skip
    assert line.startswith("jaxpar train: error: model.moe.dispatch='ragged': with layout.ep=4")
    cfg = C.load("tiny-moe", "cpu-8")
    for field, value in [("layout.pp", 1), ("layout.dp", 4), ("layout.ep", 4),
                         ("layout.microbatches", 1), ("model.moe.dispatch", "ragged")]:  # fmt: skip
        C.override(cfg, field, value)
    with pytest.raises(ConfigError, match="platform 'cpu'"):
        PF.check_platform(cfg)
    # A matmul efficiency curve: one rule (validation) for the run, the dry run and the planner.
    (line,) = _dry_run(capsys, "-o", "hardware.matmul_efficiency=100:0.5,10:0.6")
    assert line == ("jaxpar train: error: hardware.matmul_efficiency=[[100.0, 0.5], [10.0, "
                    "0.6]]: must be [[size, share], ...] with sizes >= 1 ascending and shares "
                    "in (0, 1]")  # fmt: skip
    cfg = C.load("tiny", "cpu-8")
    for curve in ([[1, 2]], [[64, float("nan")]], [[0.5, 0.5]]):
        cfg.mesh.hardware.matmul_efficiency = curve
        with pytest.raises(ConfigError, match="hardware.matmul_efficiency"):
            V.validate(cfg, cfg.mesh.devices)
    # Not measured: the run needs none, so neither does its dry run (memory reads none).
    assert main(["train", "--dry-run", "-o", "hardware.matmul_efficiency="]) == 0


def test_list_and_typed_overrides_name_field_value_and_rule(capsys):
    """``-o hardware.matmul_efficiency=1:nan`` said ``=list: expected a list``: a list field's
    refusal names the field, the value given and the rule, from the command line and a file
    alike; the latency figures (a traceback at nan, a negative one accepted) have a rule."""
    curve = "expected SIZE:SHARE,SIZE:SHARE,... of finite numbers (sizes >= 1 ascending, "
    for text in ("1:nan", "1e400:0.5", "64:x"):
        (line,) = _dry_run(capsys, "-o", f"hardware.matmul_efficiency={text}")
        assert line == f"jaxpar train: error: hardware.matmul_efficiency='{text}': {curve}" + (
            "shares in (0, 1])"
        )
    for value in ("nan", "-1e-06"):
        (line,) = _dry_run(capsys, "-o", f"hardware.inter_node_latency_s={value}")
        assert line == (f"jaxpar train: error: hardware.inter_node_latency_s={value}: must be "
                        "a finite number in [0, inf)")  # fmt: skip
    # A mapping read from a file goes through the same check.
    fields = {f.name: f for f in C.fields(C.HardwareConfig)}
    with pytest.raises(ConfigError) as e:
        C.typed.check("hardware.matmul_efficiency", [1, 2], fields["matmul_efficiency"])
    assert str(e.value) == ("hardware.matmul_efficiency=[1, 2]: expected a list of [number, "
                            "...] rows of finite numbers")  # fmt: skip
    with pytest.raises(ConfigError) as e:
        C.typed.check("hardware.xla_flags", ["--a", 5], fields["xla_flags"])
    assert str(e.value) == "hardware.xla_flags=['--a', 5]: expected a list of strings"
