"""A fuzzer of the files jaxpar reads: generated contents for every file kind (token sidecars
and token files, checkpoint manifests and records, model/mesh YAML, safetensors headers,
Hugging Face config.json, tokenizer files, lock records, metrics files, prompts files), run
in-process through the function that reads each kind (and ``jaxpar.cli.main`` for YAML).

The property, for every case: nothing but a :class:`~jaxpar.errors.JaxparError` escapes (no
traceback; the command line maps it to exit 2), and its message is one line. Contents come
from valid files mutated by type (any JSON value in any field, ``true`` for integers, strings
for objects), truncation, encoding (undecodable bytes, NUL), size and nesting (thousands of
levels). At least 500 cases per run (checked by the last test), in a few seconds; the default
profile is derandomized (CI sees the same inputs); ``HYPOTHESIS_PROFILE=explore`` draws new
ones, ten times as many.
"""

import argparse
import contextlib
import io
import json
import os
import struct
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import MODEL_YAML, TEST_MODEL
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxpar.model.hf  # noqa: F401  (imports flax, which raises the recursion limit: not mid-test)
from jaxpar import config as C
from jaxpar import tokenizer as T
from jaxpar.checkpoint import MANIFEST, verify_step, write_manifest
from jaxpar.cli import main
from jaxpar.data import SIDECAR_FORMAT
from jaxpar.errors import JaxparError
from jaxpar.lock import RunLock
from jaxpar.model import hf
from jaxpar.outputs import foreign_line

EXPLORE = os.environ.get("HYPOTHESIS_PROFILE") == "explore"
SCALE = 10 if EXPLORE else 1
RUNS: Counter = Counter()
EXAMPLES = {"sidecar": 90, "manifest": 60, "yaml": 60, "safetensors": 70, "config": 60,
            "tokenizer": 30, "lock": 40, "metrics": 40, "prompts": 30, "record": 40}  # fmt: skip


def fuzz(kind: str):
    """``settings`` of one file kind (its own, so test_fuzz.py's profile does not leak here)."""
    return settings(
        max_examples=EXAMPLES[kind] * SCALE,
        derandomize=not EXPLORE,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


@contextlib.contextmanager
def refusal(kind: str):
    """The property: only a one-line JaxparError may escape."""
    RUNS[kind] += 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    except JaxparError as e:
        assert "\n" not in str(e), (kind, str(e))


# ---- values ---------------------------------------------------------------------------------

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 2**32]),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
    st.sampled_from(["", "..", "../x", "/etc/passwd", "a/b", ".hidden", "x\x00y", "²", "byte"]),
)  # fmt: skip
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def mutated(draw, valid: dict) -> bytes:
    """A valid JSON object with fields replaced or dropped, or its text truncated, re-encoded,
    deepened or replaced by other bytes."""
    record = dict(valid)
    for key in draw(st.lists(st.sampled_from(sorted(valid)), max_size=3, unique=True)):
        if draw(st.booleans()):
            record[key] = draw(JSON)
        else:
            record.pop(key)
    text = json.dumps(record).encode()
    how = draw(st.sampled_from(["as is", "as is", "truncate", "bytes", "deep", "latin1", "other"]))
    if how == "truncate":
        return text[: draw(st.integers(0, len(text)))]
    if how == "bytes":
        return draw(st.binary(max_size=64))
    if how == "deep":
        n = draw(st.sampled_from([70, 1000, 100_000]))
        return b'{"a": ' + b"[" * n + b"]" * n + b"}"
    if how == "latin1":
        return text.replace(b'"', b'"\xff', 1)
    if how == "other":
        return json.dumps(draw(JSON)).encode()
    return text


# ---- file kinds -----------------------------------------------------------------------------

SIDECAR = {"format": SIDECAR_FORMAT, "dtype": "uint16", "vocab_size": 256, "tokens": 64,
           "tokenizer": {"kind": "byte"}, "eos_id": 0, "documents": 1, "split": "train",
           "validation_fraction": 0.1, "validation_file": "t.val.bin", "sources": ["a"],
           "text_field": None}  # fmt: skip


@fuzz("sidecar")
@given(side=mutated(SIDECAR), n_bytes=st.sampled_from([0, 1, 127, 128, 130]))
def test_sidecar_and_token_file(side, n_bytes):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.bin"
        path.write_bytes(np.arange(n_bytes, dtype=np.uint8).tobytes())
        (Path(d) / "t.json").write_bytes(side)
        (Path(d) / "t.val.bin").write_bytes(np.arange(64, dtype=np.uint16).tobytes())
        with refusal("sidecar"):
            from jaxpar.data import token_file_corpus

            token_file_corpus(str(path), "uint16")


@fuzz("manifest")
@given(manifest=mutated({"version": 1, "files": {"state/a": [4, 0]}}))
def test_manifest(manifest):
    with tempfile.TemporaryDirectory() as d:
        step = Path(d) / "3"
        (step / "state").mkdir(parents=True)
        (step / "state" / "a").write_bytes(b"abcd")
        (step / MANIFEST).write_bytes(manifest)
        RUNS["manifest"] += 1
        why = verify_step(step)  # a reason or None, never an exception
        assert why is None or "\n" not in why


@fuzz("record")
@given(meta=mutated({"model": dict(TEST_MODEL, name="t"), "tokenizer": {"kind": "byte"},
                     "data": {"source": "stdlib"}, "layout": {}}))  # fmt: skip
def test_checkpoint_record(meta):
    from jaxpar.inference import checkpoint_record

    with tempfile.TemporaryDirectory() as d:
        step = Path(d) / "1"
        (step / "meta").mkdir(parents=True)
        (step / "meta" / "metadata").write_bytes(meta)
        write_manifest(step)
        with refusal("record"):
            checkpoint_record(d, None)


YAML_PIECES = st.sampled_from([
    "n_layers: 2\n", "n_layers: true\n", "n_layers: '4'\n", "d_model: [1, 2]\n", "d_ff: {a: 1}\n",
    "vocab_size: 1e400\n", "name: 5\n", "hardware: 3\n", "a: &x [1]\nb: *x\n", "- 1\n", "\t\n",
    "n_heads: 4\nn_heads: 2\n", "x: !!binary aGk=\n", "y: !!python/name:os.system\n", ": :\n",
    "z: " + "[" * 2000 + "]" * 2000 + "\n", "k: \"\\xff\"\n", "w: 0o777\n", "v: .inf\n",
])  # fmt: skip


@fuzz("yaml")
@given(
    pieces=st.lists(YAML_PIECES, max_size=3),
    tail=st.binary(max_size=16),
    cut=st.integers(0, 400),
    mesh=st.booleans(),
)
def test_model_and_mesh_yaml(pieces, tail, cut, mesh, capsys):
    text = (MODEL_YAML + "".join(pieces)).encode()
    text = (text[:cut] if cut < len(text) else text) + (tail if cut % 3 == 0 else b"")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f.yaml"
        path.write_bytes(text)
        flag = "--mesh" if mesh else "--model"
        RUNS["yaml"] += 1
        one = ["--devices", "1", "--dp", "1", "--tp", "1", "--pp", "1", "--microbatches", "1"]
        rc = main(["train", flag, str(path), "--dry-run", *one, "--data", "synthetic"])
        err = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
        assert rc in (0, 2) and (rc == 0 or len(err) == 1), (rc, err)


def _safetensors(n_tensors: int) -> bytes:
    header = {"__metadata__": {"format": "pt"}}
    data = b""
    for i in range(n_tensors):
        header[f"t{i}"] = {"dtype": "F32", "shape": [2, 2], "data_offsets": [16 * i, 16 * i + 16]}
        data += np.arange(4, dtype=np.float32).tobytes()
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@st.composite
def safetensors(draw) -> bytes:
    raw = _safetensors(draw(st.integers(0, 3)))
    how = draw(st.sampled_from(["truncate", "header", "length", "bytes", "entry"]))
    if how == "truncate":
        return raw[: draw(st.integers(0, len(raw)))]
    if how == "length":
        return struct.pack("<Q", draw(st.integers(0, 2**64 - 1))) + raw[8:]
    if how == "bytes":
        return draw(st.binary(max_size=64))
    if how == "entry":
        entry = draw(mutated({"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}))
        head = b'{"t0": ' + entry + b"}"
        return struct.pack("<Q", len(head)) + head + b"\0" * 16
    head = draw(mutated({"t0": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}))
    return struct.pack("<Q", len(head)) + head + b"\0" * 8


@fuzz("safetensors")
@given(raw=safetensors())
def test_safetensors_header(raw):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "model.safetensors"
        path.write_bytes(raw)
        with refusal("safetensors"):
            entries = hf.read_header(path)
            from safetensors import safe_open

            with safe_open(str(path), framework="np") as f:  # what passed, safetensors reads
                for name in entries:
                    f.get_tensor(name)


@fuzz("config")
@given(config=mutated(hf.hf_config(C.ModelConfig(name="t", **TEST_MODEL))))
def test_hugging_face_config(config):
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_bytes(config)
        with refusal("config"):
            hf.check_config(d, hf.model_config(d))


@fuzz("tokenizer")
@given(
    tok=st.one_of(mutated({"version": "1.0", "model": {"type": "BPE"}}), st.binary(max_size=40)),
    cfg=mutated({"eos_token": "<|endoftext|>"}),
)
def test_tokenizer_files(tok, cfg):
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "tokenizer.json").write_bytes(tok)
        (Path(d) / "tokenizer_config.json").write_bytes(cfg)
        with refusal("tokenizer"):
            T.load(d)


@fuzz("lock")
@given(record=mutated({"host": os.uname().nodename, "pid": 1, "proc_start": 5,
                       "started": "x", "command": "jaxpar train"}))  # fmt: skip
def test_lock_record(record):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "jaxpar.lock"
        path.write_bytes(record)
        with refusal("lock"):
            RunLock(path, "train.checkpoint_dir").acquire().release()


@fuzz("metrics")
@given(lines=st.lists(st.one_of(mutated({"step": 3, "loss": 1.0}), st.binary(max_size=20)),
                      max_size=4))  # fmt: skip
def test_metrics_file(lines):
    from jaxpar.metrics import truncate_after

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "metrics.jsonl"
        path.write_bytes(b"\n".join(lines))
        RUNS["metrics"] += 1
        foreign_line(path)
        if foreign_line(path) is None:  # only a file of jaxpar's own is ever cut back
            truncate_after(path, 2)


@fuzz("prompts")
@given(raw=st.one_of(st.binary(max_size=64), st.text(max_size=30).map(str.encode)))
def test_prompts_file(raw):
    from jaxpar.commands.generate import _prompts

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "p.txt"
        path.write_bytes(raw)
        with refusal("prompts"), contextlib.redirect_stderr(io.StringIO()):
            _prompts(argparse.Namespace(prompt=[], prompts_file=str(path)))


def test_at_least_500_cases_ran():
    if len(RUNS) < len(EXAMPLES):
        pytest.skip("run with the whole module: counts the cases of every file kind")
    assert sum(RUNS.values()) >= 500, RUNS
