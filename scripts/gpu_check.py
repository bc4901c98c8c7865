"""One-GPU check of jaxpar (run through ``scripts/gpu_check.sh``); the last stdout line is JSON.

1. **Bench**: a ~1.1 B-parameter Llama (20 layers, d 2048, 16/8 heads of 128, FFN 5632,
   vocabulary 32000) at batch 8 × 2048 on one GPU with the GPU mesh files' precision (bf16
   compute, fp32 master weights and reductions): compile time, step time, tokens/s, TFLOP/s,
   MFU, peak memory, and the attention implementation ``model.attention=auto`` chose (cuDNN
   flash attention where it applies). If cuDNN attention fails to compile, the failure is
   recorded and the bench reruns with the blockwise kernel.
2. **Loss check**: 2 training steps of a small model (2 layers, d 256, seq 128, batch 8, seed 0)
   on the GPU in fp32 (matmul precision ``highest``: no TF32) against the same run on the CPU in
   fp32 (a subprocess with ``JAX_PLATFORMS=cpu``): relative difference of each step's loss,
   passing under 1e-4; and the same run on the GPU in bf16 (auto attention) against the CPU's
   fp32, passing under 2e-2.

``--dry`` runs everything on the CPU at tiny sizes (what tests/test_attention.py exercises).
Budget: a few minutes on one H100/H200 (mostly compiling), well inside 10.
Uses only what ``pip install -e .`` installs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

BENCH = dict(
    model=dict(n_layers=20, d_model=2048, n_heads=16, n_kv_heads=8, d_ff=5632,
               vocab_size=32000, max_seq_len=2048),
    train=dict(global_batch=8, seq_len=2048, steps=10),
)  # fmt: skip
CHECK = dict(
    model=dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, d_ff=512, vocab_size=256,
               max_seq_len=128),
    train=dict(global_batch=8, seq_len=128, steps=2),
)  # fmt: skip
DRY = dict(
    model=dict(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=256,
               max_seq_len=16),
    train=dict(global_batch=2, seq_len=16, steps=2),
)  # fmt: skip
# Dense bf16 peak FLOP/s by device kind (H200 has H100's compute); else the mesh file's figure.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def _config(shape: dict, compute_dtype: str, attention: str = "auto"):
    from jaxpar import config as C

    cfg = C.load("tiny", "h100-8")
    for k, v in shape["model"].items():
        setattr(cfg.model, k, v)
    cfg.model.name, cfg.model.attention = "gpu-check", attention
    lay = cfg.layout
    lay.dp, lay.tp, lay.pp, lay.sp, lay.zero, lay.microbatches = 1, 1, 1, 1, 0, 1
    lay.param_dtype, lay.compute_dtype, lay.reduce_dtype = "float32", compute_dtype, "float32"
    lay.remat = "none"
    cfg.mesh.devices = 1
    for k, v in shape["train"].items():
        setattr(cfg.train, k, v)
    cfg.train.eval_every, cfg.train.progress, cfg.train.seed = 0, False, 0
    cfg.train.warmup_steps = 1
    return cfg


def _losses(shape: dict, compute_dtype: str, device) -> dict:
    """Losses of ``shape``'s short run on ``device`` (fp32 matmuls at full precision)."""
    import jax

    from jaxpar.train.loop import run

    with jax.default_matmul_precision("highest"):
        out = run(_config(shape, compute_dtype), devices=[device], quiet=True)
    return {"losses": out["losses"], "attention": out["attention"]}


def _cpu_reference(dry: bool) -> dict:
    """The fp32 losses of the check run on the CPU, in a fresh process (JAX_PLATFORMS=cpu)."""
    # A CPU process of its own: without the GPU flags (the mesh profile's, or the user's) and
    # without a simulated device count; any other XLA flag the user set applies to it too.
    keep = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_gpu") and "device_count" not in f]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(keep))
    cmd = [sys.executable, os.path.abspath(__file__), "--cpu-reference"] + (["--dry"] * dry)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _bench(shape: dict, device) -> dict:
    from jaxpar import config as C
    from jaxpar.commands.bench import bench
    from jaxpar.model.attention import implementation_for

    kind = getattr(device, "device_kind", "")
    failures = []
    for attention in ("auto", "blockwise"):
        cfg = _config(shape, "bfloat16", attention)
        if device.platform != "gpu":  # --dry: the CPU mesh's figure
            cfg.mesh.hardware = C.load_mesh("cpu-8").hardware
        peak = next((p for k, p in PEAK_BF16.items() if k in kind), None)
        if peak:
            cfg.mesh.hardware.peak_flops_bf16 = peak
        impl = implementation_for(cfg, device)
        try:
            r = bench(cfg, devices=[device], warmup=1 if device.platform == "cpu" else 2)
        except Exception as e:  # noqa: BLE001  (a cuDNN that cannot run this shape)
            if impl != "cudnn":
                raise
            failures.append(f"{impl}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        keep = ("compile_s", "step_time_s", "tokens_per_s", "tflops_per_device", "peak_tflops",
                "mfu", "memory_per_device_bytes", "memory_source", "final_loss")  # fmt: skip
        return {
            "params": cfg.model.param_count(),
            "batch": [cfg.train.global_batch, cfg.train.seq_len],
            "attention": impl,
            "attention_failures": failures,
            **{k: r[k] for k in keep},
        }
    raise RuntimeError(f"no attention implementation ran: {failures}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry", action="store_true", help="CPU, tiny sizes")
    ap.add_argument("--cpu-reference", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    check = DRY if args.dry else CHECK
    if args.cpu_reference:
        import jax

        print(json.dumps(_losses(check, "float32", jax.devices("cpu")[0])))
        return 0
    if not args.dry:
        from jaxpar import config as C
        from jaxpar.distributed import apply_xla_flags

        apply_xla_flags("gpu", list(C.load_mesh("h100-8").hardware.xla_flags))
    import jax

    from jaxpar.model.attention import nvidia

    device = jax.devices()[0]
    out = {
        "dry": args.dry,
        "jax": jax.__version__,
        "platform": device.platform,
        "device_kind": getattr(device, "device_kind", ""),
        "ok": False,
    }
    if not args.dry and not nvidia(device):
        out["error"] = f"no NVIDIA GPU: JAX's first device is {device.platform!r} (try --dry)"
        print(json.dumps(out))
        return 1
    t0 = time.perf_counter()
    try:
        out["bench"] = _bench(DRY if args.dry else BENCH, device)
        cpu = _cpu_reference(args.dry)
        out["loss_check"] = {"cpu_float32": cpu["losses"]}
        ok = True
        for dtype in ("float32", "bfloat16"):
            got = _losses(check, dtype, device)
            rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], cpu["losses"], strict=True)]
            passed = max(rel) < TOL[dtype]
            ok = ok and passed
            out["loss_check"][dtype] = {
                "losses": got["losses"],
                "attention": got["attention"],
                "max_rel_diff": max(rel),
                "tolerance": TOL[dtype],
                "passed": passed,
            }
        out["ok"] = ok
    except Exception as e:  # noqa: BLE001  (report, then fail)
        out["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    out["wall_s"] = time.perf_counter() - t0
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
