"""Data preparation throughput and decode speed; prints one JSON object.

    python scripts/bench_data.py [--vocab-size 4096] [--repeats 2] [--skip-prepare]

Prepare: a BPE trained by ``jaxpar data train-tokenizer`` on the embedded corpus (the standard
library's sources), then ``jaxpar data prepare stdlib`` with 1 worker and with every core,
interleaved ``--repeats`` times; MB/s of input text, CPU seconds of the main and the worker
processes (on a shared machine the wall clock only shows the CPU share it got), and whether every
run's outputs are byte-identical (sha256 of the token files and sidecars).

Decode: the default tiny model (random weights: speed does not depend on them) on simulated CPU
devices, greedy, 16-token prompts, 128 new tokens, batch 1 and 8, one device and tp 2; decode
tokens/s (rows × steps / decode time), prefill time, and backend compilations counted while
generating a second time with other prompts (0: nothing recompiles per call or per token).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
CHILDREN = resource.RUSAGE_CHILDREN  # the forked tokeniser processes (JAX is not yet imported)


def _sha(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()


def bench_prepare(vocab_size: int, repeats: int) -> dict:
    from jaxpar.prepare import prepare, train_tokenizer

    work = Path(tempfile.mkdtemp(prefix="jaxpar_bench_data_"))
    t0 = time.perf_counter()
    tok = train_tokenizer(["stdlib"], vocab_size, work / "tok")
    train_s = time.perf_counter() - t0
    cores = os.cpu_count() or 1
    runs: dict[int, list[float]] = {1: [], cores: []}
    cpu: dict[int, list[dict]] = {1: [], cores: []}
    digests = set()
    summary = None
    for r in range(repeats):
        for workers in runs:
            out = work / f"w{workers}r{r}" / "tokens.bin"
            out.parent.mkdir()
            me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(CHILDREN)
            summary = prepare(["stdlib"], str(work / "tok"), out, validation_fraction=0.05,
                              workers=workers, progress=False)  # fmt: skip
            me2, kids2 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(CHILDREN)
            main_s = me2.ru_utime - me.ru_utime + me2.ru_stime - me.ru_stime
            kids_s = kids2.ru_utime - kids.ru_utime + kids2.ru_stime - kids.ru_stime
            cpu[workers].append({"main_cpu_s": main_s, "workers_cpu_s": kids_s})
            runs[workers].append(summary["mb_per_s"])
            files = [out, out.with_suffix(".json"), out.with_name("tokens.val.bin"),
                     out.with_name("tokens.val.json")]  # fmt: skip
            # the sidecar names the tokenizer path, the same for every run
            digests.add(_sha(files))
    return {
        "input_mb": summary["input_bytes"] / 1e6,
        "tokens": summary["tokens"] + summary["validation_tokens"],
        "bytes_per_token": summary["input_bytes"]
        / (summary["tokens"] + summary["validation_tokens"]),
        "vocab_size": tok["vocab_size"],
        "train_tokenizer_s": train_s,
        "mb_per_s": {str(w): statistics.median(v) for w, v in runs.items()},
        "mb_per_s_runs": {str(w): v for w, v in runs.items()},
        # CPU seconds of the main process (reading, writing) and of the worker processes
        # (tokenising): what a busy machine does not show in wall-clock throughput.
        "cpu_s_runs": {str(w): v for w, v in cpu.items()},
        "mb_per_cpu_s": summary["input_bytes"]
        / 1e6
        / statistics.median(c["main_cpu_s"] + c["workers_cpu_s"] for v in cpu.values() for c in v),
        "byte_identical": len(digests) == 1,
        "runs": repeats * len(runs),
    }


def bench_decode() -> dict:
    from jaxpar.devices import simulate_cpu_devices

    simulate_cpu_devices(2)
    import jax
    import numpy as np

    from jaxpar import config as C
    from jaxpar.devices import make_mesh
    from jaxpar.generate import Generator, Sampling, count_compilations
    from jaxpar.model import Model
    from jaxpar.train.step import Trainer

    rows = []
    for tp in (1, 2):
        cfg = C.load("tiny", "cpu-8")
        cfg.layout.dp, cfg.layout.tp, cfg.layout.pp, cfg.layout.zero = 1, tp, 1, 0
        mesh = make_mesh(cfg.layout, jax.devices()[:tp])
        tr = Trainer(cfg, mesh)
        params = tr.init_state(0)["params"]
        gen = Generator(Model(cfg.model), mesh, tr.rules)
        rng = np.random.default_rng(0)
        for batch in (1, 8):
            prompts = [list(map(int, rng.integers(1, 255, 16))) for _ in range(batch)]
            first = gen.generate(params, prompts, 128, Sampling(0.0))
            with count_compilations() as compiles:
                again = [
                    gen.generate(params, [[t + 1 for t in p] for p in prompts], 128, Sampling(0.0))
                    for _ in range(3)
                ]
            rows.append({
                "tp": tp,
                "batch": batch,
                "new_tokens": 128,
                "tokens_per_s": statistics.median(g.tokens_per_s for g in again),
                "prefill_ms": statistics.median(g.prefill_s for g in again) * 1e3,
                "compile_s": first.compile_s,
                "compiles_after_first_call": len(compiles),
            })  # fmt: skip
    return {"model": "tiny", "params": C.load("tiny", "cpu-8").model.param_count(), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-prepare", action="store_true")
    args = ap.parse_args()
    out = {"cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}
    if not args.skip_prepare:
        out["prepare"] = bench_prepare(args.vocab_size, args.repeats)
    out["decode"] = bench_decode()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
