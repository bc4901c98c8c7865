"""Compile jaxpar's train step for GPU pods on this machine and compare with the planner (JSON).

Each row is one ``jaxpar compile --json`` run in its own process (XLA reads ``XLA_FLAGS`` once
per process; every GPU mesh file carries the same flags): compiled memory per device beside the
planner's, collective wire bytes per mesh axis beside the planner's, the share of collective
bytes with no matmul or attention kernel scheduled between start and done (``exposed_share``)
and the share marked ``is_sync``, the attention implementation found in the program, compile
time, and the compile's ``estimate`` (:mod:`jaxpar.gpu.timing`: the scheduled program simulated
on the mesh file's hardware — step, compute, exposed communication per mesh axis, TFLOP/s per
device, MFU — beside the planner's step, ``step_ratio`` = planner / estimate). Rows:

* llama2-70b on a100-64: the mesh file's production layout, the planner's pick as it stands
  (``--layout auto``), two former picks — dp 32 x tp 2 + SP, ZeRO-3, selective recompute, two
  micro-batches (``70b-planner``), the same with one micro-batch (past XLA:GPU's scheduler
  memory limit) and ZeRO-3 over dp 64 — and the rule of thumb (dp 4 x tp 8 + SP x pp 2,
  1F1B, ZeRO-1);
* llama3-8b on h100-8 at 8 × 4096 tokens: DDP, ZeRO-1/2/3, tp 8 + SP, pp 2 × tp 4, Ulysses sp 8;
* mixtral-8x7b on h100-8 at 16 × 8192 tokens, dp 8 ZeRO-3, full recompute, no offload (host
  offload does not compile deviceless): ep 1, ep 2 with the padded and the ragged dispatch,
  and pp 2 × dp 4 × ep 2 under DualPipeV (ragged dispatch inside the stages);
* every schedule at pp 4 × dp 2 on one 8-GPU node (llama3-8b, 16 × 2048 tokens, 8 micro-batches).

Needs the jax CUDA plugin (``pip install -e '.[gpu-aot]'``). Takes about a minute a row on two
cores, and up to ~20 GB of memory for the 70B rows. ``--rows`` picks rows by name prefix.

    python scripts/bench_gpu_grid.py [--rows 8b-zero3 70b] > grid.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
B8 = ("--global-batch", "8", "--seq-len", "4096")
MIX = ("--global-batch", "16", "--seq-len", "8192", "--dp", "8", "--tp", "1", "--pp", "1",
       "--zero", "3", "--remat", "full", "--offload", "none")  # fmt: skip
PP4 = ("--global-batch", "16", "--seq-len", "2048", "--pp", "4", "--dp", "2", "--tp", "1",
       "--zero", "1", "--microbatches", "8")  # fmt: skip
ROWS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "70b-production": ("llama2-70b", "a100-64", ()),
    "70b-pick": ("llama2-70b", "a100-64", ("--layout", "auto")),
    "70b-planner": ("llama2-70b", "a100-64", ("--dp", "32", "--tp", "2", "--sequence-parallel",
                                              "--pp", "1", "--zero", "3", "--remat", "selective",
                                              "--microbatches", "2")),
    "70b-planner-1mb": ("llama2-70b", "a100-64", ("--dp", "32", "--tp", "2",
                                                  "--sequence-parallel", "--pp", "1", "--zero",
                                                  "3", "--remat", "selective", "--microbatches",
                                                  "1")),
    "70b-dp64-zero3": ("llama2-70b", "a100-64", ("--dp", "64", "--tp", "1", "--pp", "1",
                                                 "--zero", "3", "--remat", "selective",
                                                 "--microbatches", "1")),
    "70b-rule-of-thumb": ("llama2-70b", "a100-64", ("--dp", "4", "--tp", "8",
                                                    "--sequence-parallel", "--pp", "2",
                                                    "--schedule", "1f1b", "--virtual", "1",
                                                    "--microbatches", "16", "--zero", "1",
                                                    "--remat", "selective")),
    "8b-ddp": ("llama3-8b", "h100-8", (*B8, "--dp", "8", "--tp", "1", "--zero", "0")),
    "8b-zero1": ("llama3-8b", "h100-8", (*B8, "--dp", "8", "--tp", "1", "--zero", "1")),
    "8b-zero2": ("llama3-8b", "h100-8", (*B8, "--dp", "8", "--tp", "1", "--zero", "2")),
    "8b-zero3": ("llama3-8b", "h100-8", (*B8, "--dp", "8", "--tp", "1", "--zero", "3")),
    "8b-tp8-sp": ("llama3-8b", "h100-8", (*B8, "--dp", "1", "--tp", "8", "--sequence-parallel")),
    "8b-pp2-tp4": ("llama3-8b", "h100-8", (*B8, "--dp", "1", "--tp", "4", "--pp", "2",
                                           "--microbatches", "8")),
    "8b-ulysses-sp8": ("llama3-8b", "h100-8", (*B8, "--dp", "1", "--tp", "1", "--sp", "8")),
    "moe-mixtral-ep1": ("mixtral-8x7b", "h100-8", MIX),
    "moe-mixtral-ep2-padded": ("mixtral-8x7b", "h100-8", (*MIX, "--ep", "2", "-o",
                                                          "model.moe.dispatch=padded")),
    "moe-mixtral-ep2-ragged": ("mixtral-8x7b", "h100-8", (*MIX, "--ep", "2", "-o",
                                                          "model.moe.dispatch=ragged")),
    "moe-mixtral-pp2-ep2-dualpipev": ("mixtral-8x7b", "h100-8", (
        *MIX, "--dp", "4", "--pp", "2", "--ep", "2", "--microbatches", "4",
        "--schedule", "dualpipev", "--virtual", "2")),  # fmt: skip
    **{
        f"pp4-{s}": ("llama3-8b", "h100-8", (*PP4, "--schedule", s, "--virtual", str(v)))
        for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2),
                     ("dualpipev", 2))
    },
}  # fmt: skip


ESTIMATE = ("step_s", "planner_step_s", "step_ratio", "compute_s", "exposed_s", "rank_wait_s",
            "comm_s", "tflops_per_device", "mfu", "assumptions")  # fmt: skip


def row(name: str, timeout: int) -> dict:
    """One compile's figures (or its error)."""
    model, mesh, flags = ROWS[name]
    cmd = ["jaxpar", "compile", "--model", model, "--mesh", mesh, *flags, "--json"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    try:
        proc = subprocess.run([sys.executable, "-m", "jaxpar.cli", *cmd[1:]], env=env,
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"row": name, "command": " ".join(cmd), "error": f"timeout after {timeout} s"}
    if proc.returncode != 0:
        err = proc.stderr.strip().splitlines()
        return {"row": name, "command": " ".join(cmd), "error": err[-1] if err else "failed"}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    m, ov = out["memory"], out["overlap"]
    axes = {
        k: {"wire_bytes": v["wire_bytes"], "planner_wire_bytes": v.get("planner_wire_bytes"),
            "ratio": v.get("ratio"), "exposed_share": v.get("exposed_share")}
        for k, v in out["collectives"].items() if v.get("wire_bytes") or v.get("planner_wire_bytes")
    }  # fmt: skip
    return {
        "row": name,
        "command": " ".join(cmd),
        "memory_bytes": m["total"],
        "temp_bytes": m["temp"],
        "planner_bytes": m["planner_bytes"],
        "memory_ratio": m["ratio"],
        "fits": m["fits"],
        "axes": axes,
        "exposed_share": ov["exposed_share"],
        "sync_share": ov["sync_share"],
        "attention": out["attention"]["chosen"],
        "cudnn_calls": sum(out["attention"]["in_program"].values()),
        "compile_seconds": out["compile_seconds"],
        # the time model of the scheduled program (jaxpar.gpu.timing) beside the planner's step
        "estimate": {k: out["estimate"][k] for k in ESTIMATE},
    }


def run_rows(doc: str, rows: dict, one, timeout: int) -> None:
    """A grid script's command line: ``--rows`` (names or prefixes) and ``--timeout``; each row's
    ``one(name, timeout)`` on stderr as it comes (progress), then ``{"rows": [...]}``."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--rows", nargs="*", default=None, help="row names or prefixes (default all)")
    p.add_argument("--timeout", type=int, default=timeout, help="seconds per compile")
    args = p.parse_args()
    names = [n for n in rows if not args.rows or any(n.startswith(r) for r in args.rows)]
    out = []
    for n in names:
        out.append(one(n, args.timeout))
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)  # progress, one row a line
    print(json.dumps({"rows": out}))


def main() -> None:
    run_rows(__doc__, ROWS, row, 1200)


if __name__ == "__main__":
    main()
