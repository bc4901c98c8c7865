"""A fuzzer of the command line: generated flags, values, ``-o`` overrides and model/mesh YAML
files for every verb, run in-process through :func:`jaxpar.cli.main`.

The property, for every invocation: no exception escapes (no traceback), the exit code is 0,
1 (``plan``: nothing fits) or 2, a refusal (2) is exactly one line on stderr
(``jaxpar VERB: error: ...``), anything else on stderr is a one-line ``jaxpar`` message, and a
``--json`` success ends stdout with one JSON object.

Nothing compiles and no process starts: ``train`` and ``bench`` always get ``--dry-run``,
``memory`` gets ``--measure`` only with ``--params`` (a refusal), ``schedule --plot`` only
unwritable paths, and every ``launch`` command carries a refusal (starting a process fails
the test). At least 500 invocations per run (checked by the last test); about 10-20 s.
Profiles: ``HYPOTHESIS_PROFILE=explore`` draws new inputs and ten times as many (the default
profile is derandomized, so CI sees the same inputs every run).
"""

import contextlib
import dataclasses
import io
import json
import os
import string
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxpar.model.hf  # noqa: F401  (imports flax, which raises the recursion limit: not mid-test)
from jaxpar import config as C
from jaxpar.cli import main
from jaxpar.commands.train import FLAGS
from jaxpar.pipeline.schedules import KINDS

settings.register_profile(
    "ci",
    max_examples=100,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile("explore", parent=settings.get_profile("ci"), derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
SCALE = 10 if os.environ.get("HYPOTHESIS_PROFILE") == "explore" else 1
RUNS: Counter = Counter()
# examples per verb (sum >= 500)
EXAMPLES = {"train": 170, "bench": 50, "memory": 90, "plan": 50, "schedule": 90, "launch": 60}

# ---- values ---------------------------------------------------------------------------------

INTS = st.one_of(
    st.integers(-2, 9),
    st.sampled_from([0, -1, 16, 32, 64, 128, 2**20, 2**31, 2**63, 10**40]),
)
WORDS = [
    "nan", "inf", "-inf", "1e-3", "3e-3", "-0.5", "0.0", "1e308", "1e-320", "0x10", "1_000",
    "", " ", "abc", "true", "none", "null", "½", "١٢", "\n", "\x00", "a\nb", "--", "-", "=",
    "1,2", "é", "[1", "{a: 1}", "!!python/object:os.system", "~",
]  # fmt: skip
JUNK = st.text(alphabet=string.printable + "\x00é½\u2028", max_size=6)
TEXT = st.one_of(INTS.map(str), st.sampled_from(WORDS), JUNK, st.floats().map(repr))
PATHS = st.sampled_from(
    ["/nonexistent/x", "/proc/x/y", "/proc", ".", "", "\x00", "out", "a/b/c", "/dev/null"]
)


def _fields(cls, prefix):
    return [f"{prefix}.{f.name}" for f in dataclasses.fields(cls)]


OVERRIDE_FIELDS = (
    _fields(C.ModelConfig, "model")
    + _fields(C.LayoutConfig, "layout")
    + _fields(C.HardwareConfig, "hardware")
    + _fields(C.TrainConfig, "train")
    + ["mesh.devices", "mesh.name", "mesh.train", "mesh.layout", "train", "model", "layout",
       "layout.dp.x", "nope", "train.stpes", "", "mesh.hardware.platform"]
)  # fmt: skip
GOOD = {  # a valid value per field kind, so generated runs reach the later rules too
    "schedule": st.sampled_from([*KINDS, "2f2b"]),
    "sp_mode": st.sampled_from(["ulysses", "ring", "x"]),
    "pipeline_memory": st.sampled_from([*C.PIPELINE_MEMORY, "tiny"]),
    "remat": st.sampled_from([*C.REMAT, "most"]),
    "offload": st.sampled_from([*C.OFFLOAD, "gpu"]),
    "compute_dtype": st.sampled_from([*C.DTYPES, "int8"]),
    "on_nonfinite": st.sampled_from(["skip", "stop", "ignore"]),
    "data": st.sampled_from(["stdlib", "synthetic", "/nonexistent/tokens.bin", ""]),
}


SMALL = {  # sensible values of the integer flags
    "steps": ["1", "5", "100"], "seed": ["0", "1", "4294967295"], "global_batch": ["8", "16", "32"],
    "seq_len": ["16", "32", "64", "128"], "checkpoint_every": ["1", "50"], "eval_every": ["0", "5"],
    "keep_checkpoints": ["1", "3"], "max_skipped_steps": ["0", "3"], "zero": ["0", "1", "2", "3"],
    "devices": ["1", "2", "4", "8"], "dp": ["1", "2", "4"], "tp": ["1", "2"], "pp": ["1", "2"],
    "sp": ["1", "2"], "virtual": ["1", "2"], "microbatches": ["1", "2", "4"], "top": ["0", "3"],
}  # fmt: skip


def _rare(draw, n: int = 8) -> bool:
    """True about once in ``n + 1`` draws (a middle value: generation favours the ends)."""
    return draw(st.integers(0, n)) == n // 2


def _often(good, bad=TEXT):
    """Mostly ``good`` (7 in 8), sometimes ``bad``: an invocation has several values, and
    valid ones must be common enough to reach the later rules and the success path."""
    return st.integers(0, 7).flatmap(lambda i: bad if i == 5 else good)


def value_for(name: str):
    """A value strategy for flag ``name``: mostly sensible, often not."""
    if name in GOOD:
        return _often(GOOD[name])
    if name in ("checkpoint_dir", "metrics_file", "tensorboard", "profile_dir", "export_hf",
                "init_from_hf"):  # fmt: skip
        return st.one_of(PATHS, st.just("out/run"), TEXT)
    if name == "profile_steps":
        return _often(st.sampled_from(["1:2", "2", "3:1", "0:1", "a:b"]))
    if name == "lr":
        return _often(st.sampled_from(["3e-3", "1", "1e9"]))
    return _often(st.sampled_from(SMALL.get(name, ["1", "2", "8"])))


def override_value(field: str):
    """A value for ``-o field=...``: near the field's default, or anything."""
    section, _, name = field.partition(".")
    cls = {"model": C.ModelConfig, "layout": C.LayoutConfig, "hardware": C.HardwareConfig,
           "train": C.TrainConfig}.get(section)  # fmt: skip
    known = {f.name: f.default for f in dataclasses.fields(cls)} if cls else {}
    default = known.get(name)
    if name in GOOD:
        good = GOOD[name]
    elif isinstance(default, bool):
        good = st.sampled_from(["true", "false", "1", "off"])
    elif isinstance(default, int):
        good = st.sampled_from([str(default), str(default * 2), "0", "1"])
    elif isinstance(default, float):
        good = st.sampled_from([repr(default), repr(default / 10), "0", "1"])
    else:
        good = st.sampled_from(["none", "x"])
    return _often(good)


# ---- YAML files -----------------------------------------------------------------------------

YAML_VALUES = st.one_of(
    INTS,
    st.floats(),
    st.booleans(),
    st.none(),
    JUNK,
    st.lists(st.integers(-1, 9), max_size=2),
    st.dictionaries(JUNK, st.integers(), max_size=2),
)
MODEL = {"n_layers": 4, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128,
         "vocab_size": 256, "max_seq_len": 64}  # fmt: skip
FAIR = [1, 2, 4, 8, 64, 256, 1e-5, 0.5, "swiglu", "gelu", "cpu", "1f1b", "none", True, False]
BROKEN_YAML = [
    "n_layers: [4, 8\n", "n_layers: 4\x00\n", "n_layers: !!python/object/apply:os.system [id]\n",
    "\tn_layers: 4\n", "- 1\n- 2\n", "", "# nothing\n", "n_layers: 4\nn_layers 8\n", "{", "]",
    "a: b: c\n", "n_layers: &a 4\nd_model: *b\n", "\xff\xfe", "n_layers: '4\n", "? [1]\n: 2\n",
    "!!binary AAAA\n", "n_layers: 2024-01-01\n",
]  # fmt: skip


@st.composite
def model_yaml(draw):
    if _rare(draw, 5):
        return draw(st.one_of(st.sampled_from(BROKEN_YAML), JUNK))
    data = {} if _rare(draw, 5) else dict(MODEL)
    names = [f.name for f in dataclasses.fields(C.ModelConfig)] + ["d_modle", "layers"]
    for _ in range(draw(st.integers(0, 2))):
        data[draw(st.sampled_from(names))] = draw(_often(st.sampled_from(FAIR), YAML_VALUES))
    return yaml.safe_dump(data)


@st.composite
def mesh_yaml(draw):
    if _rare(draw, 4):
        return draw(st.one_of(st.sampled_from(BROKEN_YAML), JUNK))
    data = {"devices": 8, "hardware": {"platform": "cpu", "peak_flops_bf16": 1e11},
            "layout": {"dp": 8, "tp": 1, "pp": 1, "microbatches": 1}}  # fmt: skip
    for _ in range(draw(st.integers(0, 3))):
        where = draw(st.sampled_from(["", "hardware", "layout", "train"]))
        cls = {"": C.MeshConfig, "hardware": C.HardwareConfig, "layout": C.LayoutConfig,
               "train": C.TrainConfig}[where]  # fmt: skip
        key = draw(st.sampled_from([f.name for f in dataclasses.fields(cls)] + ["bogus"]))
        target = data if not where else data.setdefault(where, {})
        if isinstance(target, dict):
            target[key] = draw(_often(st.sampled_from(FAIR), YAML_VALUES))
    return yaml.safe_dump(data)


_files = Counter()


def _write(text: str) -> str:
    _files["n"] += 1
    path = Path(f"gen-{_files['n']}.yaml")
    path.write_bytes(text.encode("utf-8", errors="surrogatepass"))
    return str(path)


def model_arg():
    named = st.sampled_from(["tiny", "gpt2-124m", "llama2-7b", "llama3-8b", "nope", ".", "/no"])
    return st.one_of(named, st.just(yaml.safe_dump(MODEL)).map(_write), model_yaml().map(_write))


def mesh_arg():
    named = st.sampled_from(["cpu-8", "a100-8", "h100-8", "tpu-9"])
    return st.one_of(named, mesh_yaml().map(_write))


@st.composite
def flags(draw, names, extra=()):
    """A list of ``--flag value`` pairs drawn from ``names`` (and ``extra`` switches)."""
    argv = []
    for name in draw(st.lists(st.sampled_from(sorted(names)), max_size=4)):
        argv += ["--" + name.replace("_", "-"), draw(value_for(name))]
    for switch in draw(st.lists(st.sampled_from(list(extra)), max_size=2)) if extra else []:
        argv.append(switch)
    for _ in range(draw(st.integers(0, 2))):
        field = draw(st.sampled_from(OVERRIDE_FIELDS))
        value = draw(override_value(field))
        argv += ["-o", draw(TEXT) if _rare(draw, 9) else f"{field}={value}"]
    return argv


LAYOUTS = [  # consistent layouts of the test model on 1, 2, 4 or 8 devices
    ["--devices", "1", "--dp", "1", "--tp", "1", "--pp", "1", "--microbatches", "1"],
    ["--devices", "8", "--dp", "8", "--tp", "1", "--pp", "1", "--microbatches", "1"],
    ["--devices", "8", "--dp", "4", "--tp", "2", "--pp", "1", "--zero", "3"],
    ["--devices", "8", "--dp", "2", "--tp", "2", "--pp", "2", "--microbatches", "4"],
    ["--devices", "4", "--dp", "1", "--tp", "1", "--pp", "4", "--microbatches", "8",
     "--schedule", "zbv", "--virtual", "2"],
    ["--devices", "2", "--dp", "1", "--tp", "1", "--pp", "2", "--microbatches", "4",
     "--schedule", "interleaved", "--virtual", "2"],
    ["--devices", "4", "--dp", "1", "--tp", "2", "--pp", "1", "--sp", "2", "--sp-mode", "ring"],
    [],  # the mesh's own layout
]  # fmt: skip


TRAIN_SWITCHES = ("--json", "--json", "--sequence-parallel", "--resume", "--resume-or-start",
                  "--no-progress", "--no-progress", "--bogus")  # fmt: skip


MULTI = [
    ["--num-processes", "2"],
    ["--process-id", "3"],
    ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "1"],
    ["--coordinator", "nohost"],
]


@st.composite
def train_argv(draw, verb="train"):
    argv = [verb]
    if draw(st.booleans()):
        argv += ["--model", draw(model_arg())]
    if _rare(draw, 3):
        argv += ["--mesh", draw(mesh_arg())]
    argv += draw(st.sampled_from(LAYOUTS))
    argv += ["--seq-len", "32", "--global-batch", "16"] if draw(st.booleans()) else []
    argv += draw(flags(FLAGS, TRAIN_SWITCHES))
    if _rare(draw, 9):
        argv += draw(st.sampled_from(MULTI))
    if verb == "bench":
        argv += draw(st.sampled_from([[], ["--warmup", draw(TEXT)], ["--profile", draw(PATHS)]]))
    return [*argv, "--dry-run"]  # last: nothing compiles, whatever came before


# ---- the property ---------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _in_a_scratch_directory(tmp_path_factory):
    """Generated files and relative paths land in a scratch directory; nothing may start."""
    import subprocess

    from jaxpar.commands import launch

    def refuse(*a, **k):
        raise AssertionError("the fuzzer started a process")

    old, cwd = launch.subprocess.Popen, os.getcwd()
    os.chdir(tmp_path_factory.mktemp("fuzz"))
    launch.subprocess.Popen = refuse
    try:
        yield
    finally:
        launch.subprocess.Popen = old
        assert subprocess.Popen is old
        os.chdir(cwd)


def check(argv: list[str]) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    RUNS[argv[0]] += 1
    lines = err.getvalue().splitlines()
    assert "Traceback" not in err.getvalue(), (argv, err.getvalue())
    assert rc in (0, 1, 2), (argv, rc, lines)
    if rc == 2:
        assert len(lines) == 1, (argv, lines)
        assert lines[0].startswith("jaxpar") and ": error: " in lines[0], (argv, lines)
    else:
        assert all(x.startswith("jaxpar") for x in lines), (argv, lines)
        text = out.getvalue()
        if rc == 0 and "--json" in argv and not text.startswith("usage:"):
            assert isinstance(json.loads(text.splitlines()[-1]), dict), (argv, text[-300:])


def _n(verb):
    return settings(max_examples=EXAMPLES[verb] * SCALE)


@_n("train")
@given(train_argv())
def test_fuzz_train(argv):
    check(argv)


@_n("bench")
@given(train_argv("bench"))
def test_fuzz_bench(argv):
    check(argv)


MEMORY_FLAGS = ("dp", "tp", "pp", "sp", "zero", "dp_shard", "microbatch_size", "microbatches",
                "seq", "remat", "compute_dtype")  # fmt: skip


@_n("memory")
@given(st.data())
def test_fuzz_memory(data):
    argv = ["memory"]
    src = data.draw(st.integers(0, 2))
    if src == 1:
        argv += ["--model", data.draw(model_arg())]
    elif src == 2:
        argv += ["--params", data.draw(st.one_of(st.sampled_from(["7.5e9", "1e3"]), TEXT))]
        argv += ["--measure"] if data.draw(st.booleans()) else []
    for name in data.draw(st.lists(st.sampled_from(MEMORY_FLAGS), max_size=4)):
        argv += ["--" + name.replace("_", "-"), data.draw(value_for(name))]
    argv += data.draw(st.sampled_from([[], ["--json"]]))
    check(argv)


PLAN_FLAGS = ("dp", "tp", "pp", "sp", "zero", "microbatches", "schedule", "virtual", "remat")


@_n("plan")
@given(st.data())
def test_fuzz_plan(data):
    model = data.draw(_often(st.sampled_from(["tiny", "gpt2-124m"]), model_arg()))
    mesh = data.draw(_often(st.sampled_from(["cpu-8", "h100-8"]), mesh_yaml().map(_write)))
    argv = ["plan", "--model", model, "--mesh", mesh]
    small = _often(st.sampled_from(["1", "2", "8", "64"]), st.sampled_from(["0", "-3", "x", "nan"]))
    for name in data.draw(st.lists(st.sampled_from(("global_batch", "seq", "top", "devices",
                                                    *PLAN_FLAGS)), max_size=4)):  # fmt: skip
        value = data.draw(small if name in ("global_batch", "devices", "top") else value_for(name))
        argv += ["--" + name.replace("_", "-"), value]
    argv += data.draw(st.lists(st.sampled_from(["--json", "--layout-from-mesh",
                                                "--sequence-parallel"]), max_size=2))  # fmt: skip
    check(argv)


@_n("schedule")
@given(st.data())
def test_fuzz_schedule(data):
    argv = ["schedule"]
    size = _often(st.integers(1, 12).map(str))
    for name, values in (("--kind", _often(st.sampled_from(KINDS))), ("--stages", size),
                         ("--microbatches", _often(st.integers(1, 40).map(str))),
                         ("--virtual", _often(st.integers(1, 3).map(str))),
                         ("--max-ticks", size)):  # fmt: skip
        if data.draw(st.booleans()):
            argv += [name, data.draw(values)]
    if _rare(data.draw, 7):  # only paths that cannot be written: no rendering
        argv += ["--plot", data.draw(st.sampled_from(["/nonexistent/p.png", "/proc/p.png",
                                                      "p.txt", ".", "", "/dev/null"]))]  # fmt: skip
    argv += data.draw(st.sampled_from([[], ["--json"]]))
    check(argv)


@_n("launch")
@given(st.data())
def test_fuzz_launch(data):
    """Only refusals: each command ends with something the launcher refuses."""
    argv = ["launch"]
    if data.draw(st.integers(0, 5)):
        argv += ["--local", data.draw(st.one_of(st.sampled_from(["1", "2", "4"]), TEXT))]
    for name in data.draw(st.lists(st.sampled_from(["--devices-per-process", "--timeout",
                                                    "--init-timeout"]), max_size=2)):  # fmt: skip
        argv += [name, data.draw(st.one_of(st.sampled_from(["1", "4", "60"]), TEXT))]
    child = data.draw(train_argv(data.draw(st.sampled_from(["train", "bench"]))))[:-1]
    refusal = data.draw(st.sampled_from([
        ["--process-id", "1"], ["--num-processes=2"], ["--coordinator", "h:1"], ["--steps", "0"],
        ["--bogus"], ["--lr", "-1"], ["--dp", "0"],
    ]))  # fmt: skip
    argv += ["--", *child, *refusal] if data.draw(st.integers(0, 9)) else []
    check(argv)


def test_fuzz_ran_enough():
    """At least 500 invocations in this run (when every fuzz test above ran)."""
    if set(RUNS) != set(EXAMPLES):
        pytest.skip(f"only {sorted(RUNS)} ran")
    assert sum(RUNS.values()) >= 500, RUNS
