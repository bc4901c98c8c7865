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


def test_default_sequence_fits_every_model(capsys, monkeypatch):
    """A workload nobody stated fits the model: the mesh file's sequence (h100-8: 8192) cut to
    the model's context (gpt3-175b's 2048), in plan, train --dry-run and compile alike; a
    stated --seq/--seq-len past the context stays a one-line refusal."""
    import json

    from jaxpar.gpu import targets as T

    class Compiles(Exception):
        pass

    def compiles():
        raise Compiles  # compile got past every check: stop before the plugin

    monkeypatch.setattr(T, "require_plugin", compiles)
    flags = ("--mesh", "h100-8", "--devices", "1", "--json")  # 1 device: a short search
    for model in sorted(p.stem for p in C.MODELS_DIR.glob("*.yaml")):
        want = min(8192, C.load_model(model).max_seq_len)
        assert C.load(model, "h100-8").train.seq_len == want
        assert main(["plan", "--model", model, *flags]) in (0, 1), model  # 1: nothing fits
        out = capsys.readouterr()
        assert "error" not in out.err, out.err
        assert json.loads(out.out.splitlines()[-1])["workload"]["seq_len"] == want
        for verb in (["train", "--dry-run"], ["compile"]):
            try:
                assert main([*verb, "--model", model, "--layout", "auto", *flags]) in (0, 1)
            except Compiles:
                pass
            assert "error" not in capsys.readouterr().err, (model, verb)
    # -o model.max_seq_len after loading: the default follows the model as it ends up
    assert main(["train", "--dry-run", "--json", "-o", "model.max_seq_len=64"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["train"]["seq_len"] == 64
    assert _err(capsys, ["plan", "--model", "gpt3-175b", "--mesh", "h100-8", "--seq", "4096"]) == (
        "jaxpar plan: error: train.seq_len=4096: must be <= model.max_seq_len=2048"
    )
    assert _err(capsys, ["train", "--model", "gpt3-175b", "--mesh", "h100-8", "--dry-run",
                         "-o", "train.seq_len=4096"]) == (
        "jaxpar train: error: train.seq_len=4096: must be <= model.max_seq_len=2048"
    )  # fmt: skip
