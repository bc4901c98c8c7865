"""The install paths the docs name, as a new user meets them.

``gpu-aot`` is checked in a new virtual environment holding only what that extra installs: the
suite's own environment (the ``test`` extra, with torch and its CUDA wheels) could hide a library
the extra forgets, as it once hid cuDNN. The missing-library refusal is checked in process.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import MODEL_YAML

from jaxpar.errors import ConfigError
from jaxpar.model import attention as A

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_gpu_aot_extra_alone_compiles_cudnn_attention():
    """A venv with only ``.[gpu-aot]``: ``jaxpar compile`` of the test model for an H100 node
    (dp 8) runs there, cuDNN attention in its program, forward and backward.

    What the venv proves is that the extra brings every library the GPU compile loads; any
    layout's compile loads the same ones, so the cheapest runs here (the suite's 3-D layout
    compile for the same node, with every other assertion, is test_gpu_compile's)."""
    root = Path(tempfile.mkdtemp(prefix="jaxpar-gpu-aot-"))
    try:
        venv = root / "venv"
        _run([sys.executable, "-m", "venv", str(venv)])
        py = str(venv / "bin" / "python")
        pip = [py, "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check"]
        _run([*pip, "-e", f"{REPO}[gpu-aot]"])  # no .pyc: the venv lives one test
        # Nothing of torch's CUDA wheels or of this process's environment leaks in.
        listed = _run([py, "-m", "pip", "list", "--format=json"]).stdout
        names = {p["name"].lower() for p in json.loads(listed)}
        assert "torch" not in names and "nvidia-cudnn-cu12" in names, sorted(names)
        model = root / "model.yaml"
        model.write_text(MODEL_YAML)
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
        proc = _run([py, "-m", "jaxpar.cli", "compile", "--model", str(model), "--mesh",
                     "h100-8", "--dp", "8", "--tp", "1", "--pp", "1", "--global-batch", "8",
                     "--seq-len", "64", "--json"], env=env, cwd=root)  # fmt: skip
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["target"]["device_kind"] == "NVIDIA H100 80GB HBM3"
        assert out["attention"]["chosen"] == "cudnn"
        calls = out["attention"]["in_program"]
        assert calls.get("__cudnn$fmhaSoftmax", 0) > 0, calls
        assert calls.get("__cudnn$fmhaSoftmaxBackward", 0) > 0, calls
    finally:
        shutil.rmtree(root, ignore_errors=True)


class _NoCudnn:
    @staticmethod
    def cudnn_get_version() -> int:
        raise RuntimeError("cuDNN not found.")


def test_missing_cudnn_library_is_one_line(monkeypatch):
    """cuDNN attention chosen (auto or forced) without the library: one line naming the package
    and the way around it, not jax's traceback at trace time."""
    import jax._src.lib as lib

    monkeypatch.setattr(lib, "cuda_versions", _NoCudnn)
    for setting in ("auto", "cudnn"):
        with pytest.raises(ConfigError) as e:
            A.resolve(setting, True, "bfloat16", 64)
        msg = str(e.value)
        assert "\n" not in msg and f"model.attention={setting!r}" in msg, msg
        assert A.CUDNN_PACKAGE in msg and "model.attention=blockwise" in msg, msg
    # Off NVIDIA nothing asks for the library.
    assert A.resolve("auto", False, "bfloat16", 64, platform="cpu") in ("native", "blockwise")
