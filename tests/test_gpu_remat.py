"""XLA:GPU's rematerialization pass against jaxpar's own recompute policy.

XLA:GPU recomputes instructions when its estimate of a program's live memory passes
``(device memory - arguments) x slop / 100``. On jaxpar's programs that estimate runs well above
the buffer assignment's (1.5-1.8x on the GPU grid's llama3-8b programs), so the pass cloned
matmuls and fusions into programs that fit, at no saving in compiled memory. The GPU mesh
files set ``--xla_gpu_memory_limit_slop_factor=300``: the layout's ``remat`` decides what is
recomputed, and ``jaxpar compile`` reports the clones XLA still adds (``recomputed_by_xla``).

The test model is tiny, so the target's device memory is shrunk (4 MB) until XLA's limit binds;
the same program is compiled with XLA's default factor (95, the user's ``XLA_FLAGS`` winning
over the mesh's flag) and with the mesh's. Each compile runs in its own process: XLA reads
``XLA_FLAGS`` once.
"""

import json
import os
import subprocess
import sys

from conftest import MODEL_YAML

from jaxpar import config as C

DEVICE_BYTES = 4_000_000
_SCRIPT = """
import dataclasses, sys
import jaxpar.gpu.targets as T
full = T.target_config
T.target_config = lambda spec, plug: full(
    dataclasses.replace(spec, device_memory_size={mem}), plug)
from jaxpar.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _compile(tmp_path, xla_flags: str | None) -> dict:
    model = tmp_path / "model.yaml"
    model.write_text(MODEL_YAML)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-c", _SCRIPT.format(mem=DEVICE_BYTES), "compile", "--model",
           str(model), "--mesh", "h100-8", "--global-batch", "8", "--seq-len", "64", "--dp", "8",
           "--tp", "1", "--json"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_gpu_mesh_sets_xlas_memory_limit_above_its_estimate():
    for name in ("a100-8", "a100-40gb-8", "a100-64", "h100-8", "h100-1024", "h200-8"):
        flags = C.load_mesh(name).hardware.xla_flags
        assert "--xla_gpu_memory_limit_slop_factor=300" in flags, name


def test_xla_recomputes_nothing_under_the_mesh_flags(tmp_path):
    default = _compile(tmp_path, "--xla_gpu_memory_limit_slop_factor=95")
    (tmp_path / "model.yaml").unlink()
    mesh = _compile(tmp_path, None)
    # the user's XLA_FLAGS win over the mesh's flag of the same name
    assert default["xla_flags"]["overridden"] == ["--xla_gpu_memory_limit_slop_factor=300"]
    assert "--xla_gpu_memory_limit_slop_factor=95" in default["xla_flags"]["applied"]
    assert "--xla_gpu_memory_limit_slop_factor=300" in mesh["xla_flags"]["applied"]
    # the control: at XLA's default the shrunk device's limit binds and the pass clones work
    assert default["memory"]["recomputed_by_xla"] > 0
    assert mesh["memory"]["recomputed_by_xla"] == 0
    # what the clones cost: the same step computes more, in (nearly) the same memory
    assert mesh["estimate"]["compute_s"] < default["estimate"]["compute_s"]
    assert mesh["memory"]["total"] <= 1.01 * default["memory"]["total"]
