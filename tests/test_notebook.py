"""notebooks/quickstart.ipynb runs end to end in a fresh kernel, without errors."""

import os
from pathlib import Path

import pytest
from conftest import TEST_XLA_FLAGS

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent


def _text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        out.append(o.get("text", ""))
        out.append(o.get("data", {}).get("text/plain", ""))
    return "".join(out)


def test_quickstart_notebook_runs(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", TEST_XLA_FLAGS)  # the notebook sets its own device count
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "CpuDevice(id=7)" in text  # 8 simulated devices
    assert "layers/attn/wq" in text and "'tp'" in text  # the sharding table
    images = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    assert images >= 3  # the schedules, the two layouts' losses, train/held-out on own text
    assert "max relative difference" in text
    # Own text: prepared (train + held-out tokens), trained, sampled through the KV cache.
    assert "held out (" in text and "'split': 'train'" in text and "'dtype': 'uint16'" in text
    assert "new tokens; decode" in text and "--- 2:" in text
    # Re-initialising with another device count: the clear message, not a crash.
    assert "JAX is already initialised with 8 CPU devices" in text
    assert "restart the Python process or notebook kernel" in text
