"""XLA:GPU's memory limit: XLA's rematerialization left to the layout, and XLA's default where
the program does not fit.

XLA:GPU recomputes instructions when its estimate of a program's live memory passes
``(device memory - arguments) x slop / 100``. On jaxpar's programs that estimate runs well above
the buffer assignment's (1.5-1.8x on the GPU grid's llama3-8b programs), so the pass cloned
matmuls and fusions into programs that fit, at no saving in compiled memory. The GPU mesh
files set ``--xla_gpu_memory_limit_slop_factor=300``; a step whose program then does not fit
is compiled again at XLA's default (95) and the smaller kept (:mod:`jaxpar.xla_limit`).
``jaxpar compile`` reports the clones XLA adds (``recomputed_by_xla``) and the limit used.

The test model is tiny, so the target's device memory is shrunk (4 MB) until XLA's default
limit binds; the usable memory jaxpar checks against is the mesh's ``device_memory_bytes``.
Each compile runs in its own process (XLA reads ``XLA_FLAGS`` once).
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import MODEL_YAML
from test_gpu_compile import GPU_MESHES

from jaxpar import config as C
from jaxpar import xla_limit as XL

TARGET_BYTES = 4_000_000
_SCRIPT = """
import dataclasses, sys
import jaxpar.gpu.targets as T
full = T.target_config
T.target_config = lambda spec, plug: full(
    dataclasses.replace(spec, device_memory_size={mem}), plug)
from jaxpar.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _compile(tmp_path, *flags: str) -> dict:
    model = tmp_path / "model.yaml"
    model.write_text(MODEL_YAML)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-c", _SCRIPT.format(mem=TARGET_BYTES), "compile", "--model",
           str(model), "--mesh", "h100-8", "--global-batch", "8", "--seq-len", "64", "--dp", "8",
           "--tp", "1", "--json", *flags]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_gpu_mesh_raises_xlas_memory_limit():
    for name in GPU_MESHES:
        flags = C.load_mesh(name).hardware.xla_flags
        assert "--xla_gpu_memory_limit_slop_factor=300" in flags, name


def test_xla_recomputes_nothing_under_the_mesh_limit_and_falls_back_where_it_does_not_fit(
    tmp_path,
):
    # A pipeline: XLA's pass finds bytes to save in its program. In dp 8's, whose backward now
    # all-reduces each layer's gradient (jaxpar.train.reduce.DPReduction.reduces_in_backward),
    # it found none (both compiles 2872993 bytes), nor at ZeRO-3 or with 2 micro-batches.
    layout = ("--pp", "2", "--dp", "4", "--microbatches", "2")
    fits = _compile(tmp_path, *layout)
    m = fits["memory"]
    assert "--xla_gpu_memory_limit_slop_factor=300" in fits["xla_flags"]["applied"]
    assert m["fits"] and m["recomputed_by_xla"] == 0
    assert m["xla_memory_limit"] == {"slop_factor": 300, "recompiled": False,
                                     "first_bytes": None, "second_bytes": None}  # fmt: skip
    # the same program on a mesh whose device is 256 bytes smaller than it: compiled again at
    # XLA's default, where the shrunk target's limit binds and XLA's pass clones work, for 512
    # bytes less here: the one of the two the device holds, so it is kept
    (tmp_path / "model.yaml").unlink()
    again = _compile(tmp_path, *layout, "-o", f"hardware.device_memory_bytes={m['total'] - 256}")
    m2, lim = again["memory"], again["memory"]["xla_memory_limit"]
    assert not m2["fits"]
    assert m2["total"] < m["total"]
    assert lim == {"slop_factor": 95, "recompiled": True, "first_bytes": m["total"],
                   "second_bytes": m2["total"]}  # fmt: skip
    assert m2["recomputed_by_xla"] > 0
    # what the clones cost: the same step computes more
    assert again["estimate"]["compute_s"] > fits["estimate"]["compute_s"]


class _Lowered:
    """A lowered step whose compiles return programs of the given sizes (no XLA)."""

    def __init__(self, first: int, second: int):
        self.sizes, self.options = [first, second], []

    def compile(self, compiler_options=None):
        self.options.append(compiler_options)
        return self.sizes[len(self.options) - 1]


RAISED = "--xla_gpu_memory_limit_slop_factor=300"


@pytest.mark.parametrize(
    "flags, first, second, kept, limit",
    [
        ("", 900, 500, 900, XL.MemoryLimit(None)),
        ("--xla_gpu_memory_limit_slop_factor=95", 900, 500, 900, XL.MemoryLimit(95)),
        (RAISED, 700, 500, 700, XL.MemoryLimit(300)),  # fits: compiled once
        (RAISED, 900, 800, 800, XL.MemoryLimit(95, True, 900, 800)),  # the second fits
        (RAISED, 1100, 950, 950, XL.MemoryLimit(95, True, 1100, 950)),  # only it fits the device
        (RAISED, 950, 940, 950, XL.MemoryLimit(300, False, 950, 940)),  # neither: the faster
        (RAISED, 900, 950, 900, XL.MemoryLimit(300, False, 900, 950)),
        ("--xla_gpu_memory_limit_slop_factor=95 " + RAISED, 900, 800, 800,
         XL.MemoryLimit(95, True, 900, 800)),  # the last flag wins, as in XLA
    ],
)  # fmt: skip
def test_compile_within_keeps_a_program_that_fits(monkeypatch, flags, first, second, kept, limit):
    monkeypatch.setattr(XL, "_total", lambda compiled: compiled)
    low = _Lowered(first, second)
    got, lim = XL.compile_within(low, 800, 1000, env={"XLA_FLAGS": flags})
    assert (got, lim) == (kept, limit)
    again = [{XL.SLOP: XL.XLA_DEFAULT}] if limit.first_bytes is not None else []
    assert low.options == [None, *again]
