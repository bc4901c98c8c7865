"""The install paths the docs name, as a new user meets them.

``gpu-aot`` is checked in a new virtual environment holding only what that extra and pytest
install: the suite's own environment (the ``test`` extra, with torch and its CUDA wheels) could
hide a library the extra forgets, as it once hid cuDNN. The missing-library refusal is checked
in process.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from jaxpar.errors import ConfigError
from jaxpar.model import attention as A

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_gpu_aot_extra_alone_compiles_cudnn_attention():
    """A venv with only ``.[gpu-aot]`` and pytest: the suite's 3-D layout compile for an H100
    node passes there, cuDNN attention in its program (the test asserts the fmha calls)."""
    root = Path(tempfile.mkdtemp(prefix="jaxpar-gpu-aot-"))
    try:
        venv = root / "venv"
        _run([sys.executable, "-m", "venv", str(venv)])
        py = str(venv / "bin" / "python")
        pip = [py, "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check"]
        _run([*pip, "-e", f"{REPO}[gpu-aot]", "pytest"])  # no .pyc: the venv lives one test
        # Nothing of torch's CUDA wheels or of this process's environment leaks in.
        listed = _run([py, "-m", "pip", "list", "--format=json"]).stdout
        names = {p["name"].lower() for p in json.loads(listed)}
        assert "torch" not in names and "nvidia-cudnn-cu12" in names, sorted(names)
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
        _run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
              "compile_3d_layout_on_h100_node", str(REPO / "tests" / "test_gpu_compile.py")],
             env=env, cwd=REPO)  # fmt: skip
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
