"""The memory-bound bytes of jaxpar's compiled XLA:GPU step, per layer, from small programs (JSON).

Compiles llama3-8b's layer shape at 2 and 4 layers for h100-8 (``jaxpar compile``, deviceless)
for each calibration layout below, simulates each scheduled program with the time model
(:mod:`jaxpar.gpu.timing`) and sums the compute stream's memory-bound kernels (kind
``memory``: fusions, copies, slices at HBM bandwidth; :mod:`jaxpar.gpu.costs`). One layer's
bytes are half the difference between the 4- and the 2-layer program's. From them:

* **activation passes** (``act_passes``): the bytes that grow with a micro-batch's tokens, in
  units of the planner's saved-activation bytes per layer (``block_residuals``, as
  :func:`jaxpar.planner.cost.layer_time` reads them), forward and backward together: the
  1- and 2-sequence micro-batches of one layout (``z1`` and ``z1-2seq``; ``tp8`` and
  ``tp8-2seq`` under Megatron-SP);
* **FP8 under Megatron-SP** (``fp8_sp_act_passes``, ``fp8_tp_hidden``): the same activation
  passes on dp 2 × tp 4 + SP ``--fp8 delayed`` (no collective-matmul rings under FP8), less
  the quantization bytes the planner prices apart; and the share of one layer's tp collective
  seconds the simulated schedule hides (``--fp8-only`` compiles these four programs alone);
* **FP8 quantization** (``quant_measured_over_priced``): per recipe, one layer's bytes on
  ZeRO-3 over dp 8 with the recipe less bf16's, over what the planner prices at
  ``QUANT_BYTES`` per element (:func:`jaxpar.planner.fp8.quant_bytes`);
* **weight bytes** per local layer parameter: what remains of a layer's bytes after the
  activation passes, at 1, 2 and 4 micro-batches: a per-micro-batch part (the slope between 2
  and 4), a part the micro-batch loop adds once (2 less 1, less the slope) and a per-step part
  (what 1 micro-batch leaves after the slope), per ZeRO stage.

These are the constants of :data:`jaxpar.planner.frameworks.PROGRAM_BYTES`. The grid's llama3-8b
rows (``scripts/bench_gpu_grid.py``) share this layer shape, so they are not independent
checks of it; the llama2-70b, Mixtral and pipeline rows are.

    python scripts/calibrate_program_bytes.py [--hlo-dir DIR] > program_bytes.json

``--hlo-dir`` keeps each compiled program (``NAME_L2.hlo``/``.json``) and reads it again when
present.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

SEQ = 4096
# name: (global batch, flags); 8 sequences over dp 8 is one sequence a device
LAYOUTS = {
    "z1": (8, ("--dp", "8", "--tp", "1", "--zero", "1")),
    "z1-2seq": (16, ("--dp", "8", "--tp", "1", "--zero", "1")),
    "z1-m2": (16, ("--dp", "8", "--tp", "1", "--zero", "1", "--microbatches", "2")),
    "z1-m4": (32, ("--dp", "8", "--tp", "1", "--zero", "1", "--microbatches", "4")),
    "z0": (8, ("--dp", "8", "--tp", "1", "--zero", "0")),
    "z0-m2": (16, ("--dp", "8", "--tp", "1", "--zero", "0", "--microbatches", "2")),
    "z0-m4": (32, ("--dp", "8", "--tp", "1", "--zero", "0", "--microbatches", "4")),
    "z3": (8, ("--dp", "8", "--tp", "1", "--zero", "3")),
    "z3-m2": (16, ("--dp", "8", "--tp", "1", "--zero", "3", "--microbatches", "2")),
    "z3-m4": (32, ("--dp", "8", "--tp", "1", "--zero", "3", "--microbatches", "4")),
    "tp8": (8, ("--dp", "1", "--tp", "8", "--sequence-parallel")),
    "tp8-2seq": (16, ("--dp", "1", "--tp", "8", "--sequence-parallel")),
    # FP8 under Megatron-SP: no collective-matmul rings (GSPMD places the FP8 gathers); another
    # shape than the llama3-8b tp 8 + SP rows the planner is checked on
    "tp4-fp8": (2, ("--dp", "2", "--tp", "4", "--sequence-parallel", "--fp8", "delayed")),
    "tp4-fp8-2seq": (4, ("--dp", "2", "--tp", "4", "--sequence-parallel", "--fp8", "delayed")),
    # each recipe's quantization bytes beside z3's bf16 program (no tp: no FP8 gathers)
    "z3-tensorwise": (8, ("--dp", "8", "--tp", "1", "--zero", "3", "--fp8", "tensorwise")),
    "z3-delayed": (8, ("--dp", "8", "--tp", "1", "--zero", "3", "--fp8", "delayed")),
    "z3-rowwise": (8, ("--dp", "8", "--tp", "1", "--zero", "3", "--fp8", "rowwise")),
}
RECIPE_ROWS = {"tensorwise": "z3-tensorwise", "delayed": "z3-delayed", "rowwise": "z3-rowwise"}


def compile_one(name: str, layers: int, out: Path) -> Path:
    """The program's HLO path (compiled unless already in ``out``)."""
    hlo, js = out / f"{name}_L{layers}.hlo", out / f"{name}_L{layers}.json"
    if hlo.exists() and js.exists() and js.stat().st_size:
        return hlo
    hlo.unlink(missing_ok=True)
    batch, flags = LAYOUTS[name]
    cmd = [sys.executable, "-m", "jaxpar.cli", "compile", "--model", "llama3-8b", "--mesh",
           "h100-8", "--global-batch", str(batch), "--seq-len", str(SEQ), *flags, "-o",
           f"model.n_layers={layers}", "--hlo", str(hlo), "--json"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    with open(js, "w") as f:
        subprocess.run(cmd, env=env, stdout=f, check=True)
    return hlo


@functools.cache
def simulated(hlo: Path):
    """(the simulated step of one program, the target's hardware)."""
    from jaxpar import config as C
    from jaxpar.analysis.hlo_text import parse
    from jaxpar.gpu.lhs import mesh_of
    from jaxpar.gpu.timing import simulate

    hw = C.load_mesh("h100-8").hardware
    layout = json.loads(hlo.with_suffix(".json").read_text().splitlines()[-1])["layout"]
    st = simulate(parse(hlo.read_text()), mesh_of(layout), hw)
    if st.events_dropped:
        raise SystemExit(f"{hlo}: {st.events_dropped} events dropped; the sum would be short")
    return st, hw


def memory_bytes(hlo: Path) -> float:
    """Bytes of the compute stream's memory-bound kernels in one simulated step."""
    st, hw = simulated(hlo)
    return sum(e.dur for e in st.events if e.stream == "compute" and e.kind == "memory") * hw.hbm_bw


def tp_seconds(hlo: Path) -> tuple[float, float]:
    """(all, exposed) seconds of the step's collectives over ``tp`` alone."""
    st, _ = simulated(hlo)
    return st.comm_s.get("tp", 0.0), st.exposed_s.get("tp", 0.0)


def layer_figures(name: str, out: Path) -> dict:
    """Per-layer memory-bound bytes, the planner's activation bytes and local layer params."""
    import dataclasses

    from jaxpar import config as C
    from jaxpar.analysis.theory import DTYPE_BYTES
    from jaxpar.planner import fp8 as F8
    from jaxpar.planner.activations import block_residuals
    from jaxpar.planner.shapes import param_counts

    hlos = [compile_one(name, n, out) for n in (2, 4)]
    two, four = (memory_bytes(h) for h in hlos)
    (c2, e2), (c4, e4) = (tp_seconds(h) for h in hlos)
    batch, flags = LAYOUTS[name]
    cfg = C.load("llama3-8b", "h100-8")
    args, i = {}, 0  # "--flag value" pairs and bare switches
    while i < len(flags):
        bare = i + 1 == len(flags) or flags[i + 1].startswith("--")
        args[flags[i]] = None if bare else flags[i + 1]
        i += 1 if bare else 2
    lay = dataclasses.replace(
        cfg.layout, dp=int(args.get("--dp", 1)), tp=int(args.get("--tp", 1)), pp=1, sp=1,
        zero=int(args.get("--zero", cfg.layout.zero)),
        microbatches=int(args.get("--microbatches", 1)), fp8=args.get("--fp8") or "none",
        sequence_parallel="--sequence-parallel" in args)  # fmt: skip
    model = dataclasses.replace(cfg.model, n_layers=2)
    tokens = batch * SEQ / lay.dp / lay.microbatches  # per micro-batch on one device
    res = block_residuals(model, lay, SEQ, "blockwise", "none")
    wc = DTYPE_BYTES[lay.compute_dtype]
    act = res.bytes(tokens, wc) - res.weights * wc
    pc = param_counts(model, lay)
    # the planner prices FP8's quantization apart: forward and backward, 3 x the forward's
    quant = 3 * F8.quant_bytes(model, lay, tokens)
    return {"layer_bytes": (four - two) / 2, "act_bytes": act, "microbatches": lay.microbatches,
            "layer_params": pc.blocks / 2, "two_layers": two, "four_layers": four,
            "quant_bytes": quant, "layer_tp_s": (c4 - c2) / 2,
            "layer_tp_exposed_s": (e4 - e2) / 2}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hlo-dir", default=None, help="keep (and reuse) the compiled programs here")
    p.add_argument("--fp8-only", action="store_true",
                   help="compile and print the FP8 layouts' figures alone")  # fmt: skip
    args = p.parse_args()
    out = Path(args.hlo_dir or tempfile.mkdtemp(prefix="jaxpar-calib-"))
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in LAYOUTS if not args.fp8_only or "fp8" in n or n == "z3"
             or n in RECIPE_ROWS.values()]  # fmt: skip
    f = {n: layer_figures(n, out) for n in names}
    # measured quantization bytes of one layer (the recipe's program less bf16's) per byte
    # the planner prices at QUANT_BYTES per element (jaxpar.planner.fp8.quant_bytes): 1.0
    # where those constants hold
    quant = {
        r: (f[n]["layer_bytes"] - f["z3"]["layer_bytes"]) / f[n]["quant_bytes"]
        for r, n in RECIPE_ROWS.items()
    }
    a, b = f["tp4-fp8"], f["tp4-fp8-2seq"]
    fp8 = {  # FP8's quantization bytes are priced apart (jaxpar.planner.fp8.quant_bytes)
        "fp8_sp_act_passes": ((b["layer_bytes"] - b["quant_bytes"])
                              - (a["layer_bytes"] - a["quant_bytes"]))
        / (b["act_bytes"] - a["act_bytes"]),
        # share of one layer's tp collective seconds the scheduler hides (FP8_TP_HIDDEN)
        "fp8_tp_hidden": 1 - b["layer_tp_exposed_s"] / b["layer_tp_s"],
        "fp8_tp_hidden_1seq": 1 - a["layer_tp_exposed_s"] / a["layer_tp_s"],
        "quant_measured_over_priced": quant,
    }  # fmt: skip
    if args.fp8_only:
        print(json.dumps({"layers": f, **fp8}, indent=1))
        return

    def passes(one: str, two: str) -> float:  # bytes that grow with the tokens, per act byte
        a, b = f[one], f[two]
        return (b["layer_bytes"] - a["layer_bytes"]) / (b["act_bytes"] - a["act_bytes"])

    act = passes("z1", "z1-2seq")
    sp = passes("tp8", "tp8-2seq")

    def weights(base: str, m2: str | None, m4: str | None, a: float) -> dict:
        def left(n: str) -> float:  # per local layer param, after the activation passes
            x = f[n]
            return (x["layer_bytes"] - a * x["act_bytes"] * x["microbatches"]) / x["layer_params"]

        one = left(base)
        if m2 is None:
            return {"step": one, "microbatch": 0.0, "loop": 0.0}
        per = (left(m4) - left(m2)) / 2 if m4 else left(m2) - one
        return {"step": one - per, "microbatch": per, "loop": left(m2) - one - per}

    result = {
        "layers": f,
        "act_passes": act,
        "sp_act_passes": sp,
        **fp8,
        "weight_bytes": {
            "zero0": weights("z0", "z0-m2", "z0-m4", act),
            "zero1": weights("z1", "z1-m2", "z1-m4", act),
            "zero3": weights("z3", "z3-m2", "z3-m4", act),
            "tp8_sp_zero1_m1": weights("tp8", None, None, sp),
        },
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
