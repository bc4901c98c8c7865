"""Compiled facts of the attention, the loss and the layer loop (XLA's own figures, no timing).

* ``layer``: compiled temporaries of one attention layer's forward and backward (projections,
  rotary, core, output projection; d 256, 8/4 heads, batch 1) at sequence 1024, 2048, 4096,
  blockwise against dense: linear in the sequence against quadratic.
* ``step``: the full train step of issue 13's shape (4 layers, d 256, 8/4 heads, FFN 768,
  vocabulary 256, seq 256, batch 16, fp32, AdamW, one device): compiled temporaries, and the
  layout copies and transposes left in its optimized HLO (count, bytes, the largest).
* ``loss``: value and gradient of the head and loss at a 128K vocabulary (128256, llama3's),
  8K context, batch 1, d 512: temporaries of the chunked loss against one chunk.
* ``ring``: loss-and-gradient temporaries per device of ring attention over sp 2 and 4
  against one device (the test model of tests/test_tpsp.py), with theory's 1/P.

``--against PATH`` also measures ``step``, ``layer`` and ``ring`` on another checkout (e.g. the
main branch, where attention is dense and scores are kept), each part in a subprocess with
``PYTHONPATH=PATH``. The last stdout line is one JSON object.

    python scripts/bench_attention.py --against /path/to/main/checkout
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

PARTS = ("layer", "step", "loss", "ring")
TEMP = "temp"


def _has(cfg, field: str) -> bool:
    return hasattr(cfg, field)


def _model_cfg(**kw):
    from jaxpar import config as C

    m = C.ModelConfig(name="bench", n_layers=4, d_model=256, n_heads=8, n_kv_heads=4, d_ff=768,
                      vocab_size=256, max_seq_len=8192)  # fmt: skip
    for k, v in kw.items():
        if _has(m, k):  # another checkout may lack the field
            setattr(m, k, v)
    return m


def part_layer() -> dict:
    """One attention layer, forward + backward: temporaries by sequence and implementation."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxpar.analysis.hlo import compiled_memory
    from jaxpar.model.layers import Attention

    out = {}
    impls = ("blockwise", "dense") if _has(_model_cfg(), "attention") else ("dense",)
    for impl in impls:
        for s in (1024, 2048, 4096):
            attn = Attention(_model_cfg(attention=impl), nnx.Rngs(params=0))
            graph, state = nnx.split(attn)
            x = jax.ShapeDtypeStruct((1, s, 256), jnp.float32)

            def loss(state, x, graph=graph, s=s):
                return jnp.sum(nnx.merge(graph, state)(x, jnp.arange(s)) ** 2)

            fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
            mem = compiled_memory(fn.lower(state, x).compile())
            out[f"{impl}/{s}"] = mem[TEMP]
    return out


def _step_trainer(**model):
    import jax

    from jaxpar import config as C
    from jaxpar.devices import make_mesh
    from jaxpar.train.step import Trainer

    cfg = C.load("tiny", "cpu-8")
    for k, v in model.items():
        if _has(cfg.model, k):
            setattr(cfg.model, k, v)
    lay = cfg.layout
    lay.dp = lay.tp = lay.pp = lay.sp = lay.microbatches = 1
    lay.remat = "none"
    cfg.mesh.devices = 1
    cfg.train.global_batch, cfg.train.seq_len = 16, 256
    return Trainer(cfg, make_mesh(lay, jax.devices()[:1]))


def copies(hlo: str) -> dict:
    """Copy and transpose instructions (or fusions rooted in one) outside fused computations,
    per step (an instruction in the layer scan's body counts once per layer): executions,
    bytes written, and the five largest with the op that asked for them."""
    from jaxpar.analysis.hlo_text import execution_counts, parse_module, shape_bytes

    comps, entry = parse_module(hlo)
    runs, _ = execution_counts(comps, entry)
    fused = {c for ins_list in comps.values() for ins in ins_list if ins.opcode == "fusion"
             for c in re.findall(r"calls=%?([\w.\-]+)", ins.attrs)}  # fmt: skip
    rows = []
    for comp, ins_list in comps.items():
        trips = runs.get(comp, (0, True, False))[0]
        if comp in fused or not trips:
            continue
        for ins in ins_list:
            kind = ins.opcode in ("copy", "transpose") or (
                ins.opcode == "fusion" and re.match(r"(copy|transpose)", ins.name)
            )
            if kind and not ins.shape.startswith("("):
                where = re.search(r'op_name="([^"]*)"', ins.attrs)
                op = where.group(1) if where else "(copy insertion: loop-carried buffer)"
                rows.append((shape_bytes(ins.shape), trips, ins.shape.split("{")[0], op))
    rows.sort(key=lambda r: -r[0] * r[1])
    return {
        "executions": sum(r[1] for r in rows),
        "bytes": sum(r[0] * r[1] for r in rows),
        "largest": [{"bytes": b, "runs": t, "shape": s, "op": o[-90:]} for b, t, s, o in rows[:5]],
    }


def part_step() -> dict:
    """The train step: temporaries and layout copies, this checkout's defaults (and dense)."""
    from jaxpar.analysis.hlo import compiled_memory

    variants = {"default": {}}
    if _has(_model_cfg(), "attention"):
        variants["dense"] = {"attention": "dense"}
        variants["unrolled"] = {"layer_unroll": 0}
    out = {}
    for name, model in variants.items():
        compiled = _step_trainer(**model).compile_step()
        mem = compiled_memory(compiled)
        out[name] = {"temp": mem[TEMP], "total": mem["total"], "copies": copies(compiled.as_text())}
    return out


def part_loss() -> dict:
    """Head + loss at a 128K vocabulary, 8K context: chunked against one chunk."""
    import jax
    import jax.numpy as jnp

    from jaxpar.analysis.hlo import compiled_memory
    from jaxpar.model import Model

    b, s, v, d = 1, 8192, 128256, 512
    out = {"logits_fp32_bytes": b * s * v * 4}
    for chunk in (s, 1024):
        model = Model(_model_cfg(vocab_size=v, d_model=d, n_heads=8, n_kv_heads=4,
                                 loss_chunk=chunk, n_layers=1))  # fmt: skip
        params = jax.eval_shape(model.init, jax.random.key(0))
        x = jax.ShapeDtypeStruct((b, s, d), jnp.float32)
        tg = jax.ShapeDtypeStruct((b, s), jnp.int32)
        fn = jax.jit(jax.value_and_grad(model.head_loss, argnums=(0, 1)))
        out[f"chunk_{chunk}"] = compiled_memory(fn.lower(params, x, tg).compile())[TEMP]
    return out


def part_ring() -> dict:
    """Ring attention's loss-and-gradient temporaries per device against one device."""
    import jax

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from conftest import small_config

    from jaxpar.analysis import tpsp

    temps = {}
    for sp in (1, 2, 4):
        cfg = small_config(sp=sp, sp_mode="ring") if sp > 1 else small_config()
        temps[sp] = tpsp.measure(cfg, jax.devices()[: cfg.layout.n_devices])["temp_bytes"]
    return {f"ring{sp}": {"temp": temps[sp], "ratio": temps[sp] / temps[1], "theory": 1 / sp}
            for sp in (2, 4)} | {"one_device": temps[1]}  # fmt: skip


def _worker(part: str) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8 if part == "ring" else 1)
    print(json.dumps({part: globals()[f"part_{part}"]()}))


def _run(part: str, pythonpath: str) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, __file__, "--worker", part], env=env, text=True,
                         capture_output=True)  # fmt: skip
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])[part]


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--against", default=None, metavar="PATH", help="another checkout")
    args = ap.parse_args()
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    result = {}
    for part in args.parts.split(","):
        result[part] = {"this": _run(part, here)}
        if args.against and part != "loss":
            result[part]["against"] = _run(part, args.against)
        print(part, json.dumps(result[part]), file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
