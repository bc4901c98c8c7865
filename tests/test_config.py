"""Bad configurations are refused before compiling, with one line naming field, value, rule."""

import pytest

from jaxpar import config as C
from jaxpar import validation as V
from jaxpar.cli import main
from jaxpar.errors import ConfigError


def _err(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1, err
    return err[0]


def test_unknown_model_and_mesh(capsys):
    assert "unknown model" in _err(capsys, ["train", "--model", "llama9-1t"])
    assert "unknown mesh" in _err(capsys, ["train", "--mesh", "tpu-4096"])


def test_unknown_yaml_field(tmp_path, capsys):
    bad = tmp_path / "m.yaml"
    bad.write_text("n_layers: 2\nd_modle: 64\n")
    line = _err(capsys, ["train", "--model", str(bad)])
    assert "d_modle" in line and "d_model" in line


def test_unknown_override(capsys):
    assert "train.stpes" in _err(capsys, ["train", "-o", "train.stpes=3"])


def test_axes_must_multiply_to_device_count(capsys):
    line = _err(capsys, ["train", "--dp", "2", "--tp", "2", "--pp", "1"])
    assert "4" in line and "8" in line and "device" in line


def test_heads_not_divisible_by_tp(capsys):
    line = _err(capsys, ["train", "--devices", "3", "--dp", "1", "--tp", "3", "--pp", "1"])
    assert "layout.tp=3" in line and "n_heads" in line


def test_batch_not_divisible_by_dp(capsys):
    line = _err(capsys, ["train", "--dp", "8", "--tp", "1", "--pp", "1", "--global-batch", "12"])
    assert "global_batch=12" in line and "dp=8" in line


def test_missing_data_file(capsys):
    line = _err(capsys, ["train", "--data", "/nonexistent/tokens.bin"])
    assert "train.data" in line and "does not exist" in line


def test_bad_values_each_name_the_field():
    cases = {
        "layout.zero": 4,
        "layout.remat": "most",
        "layout.schedule": "2f2b",
        "train.seq_len": 100000,
        "layout.microbatches": 3,
    }
    for field, value in cases.items():
        cfg = C.load("tiny", "cpu-8")
        C.override(cfg, field, value)
        with pytest.raises(ConfigError) as e:
            V.validate(cfg, 8)
        assert field.split(".")[1] in str(e.value), (field, e.value)
        assert "\n" not in str(e.value)


def test_published_shapes():
    # Parameter counts of the published models follow from their shapes.
    expect = {
        "llama2-7b": 6.74e9,
        "llama2-70b": 68.98e9,
        "llama3-8b": 8.03e9,
        "llama3-405b": 405.85e9,
        "gpt2-124m": 123.6e6,
    }
    for name, n in expect.items():
        assert abs(C.load_model(name).param_count() / n - 1) < 0.003, name
