"""``jaxpar eval``: held-out loss and perplexity of a checkpoint (or Hugging Face weights) on a
token file, on any layout."""

from __future__ import annotations

import argparse
import math
import sys
import time

HELP = "held-out loss and perplexity of a checkpoint or Hugging Face weights on a token file"

LAYOUT_FLAGS = (
    "dp", "tp", "pp", "sp", "zero", "sp_mode", "compute_dtype", "fp8", "global_batch", "seq_len",
    "data_dtype",
)  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``jaxpar eval``."""
    from jaxpar import inference

    p.add_argument(
        "--data",
        required=True,
        help="token file (.bin) to evaluate on, e.g. the NAME.val.bin of `jaxpar data "
        "prepare`, or 'stdlib' (the embedded corpus's held-out files)",
    )
    p.add_argument(
        "--max-batches", type=int, default=None, help="evaluate at most this many batches"
    )
    inference.add_arguments(p, LAYOUT_FLAGS)


def evaluate(src, tokens, max_batches: int | None = None):
    """Mean loss over the first ``max_batches`` (default: all) batches of consecutive windows of
    ``tokens`` (see :class:`jaxpar.data.SequentialBatches`): the measure of training's held-out
    loss (:func:`jaxpar.train.hooks.heldout_loss`, ``--max-batches`` = ``train.eval_batches``).
    Returns the ``--json`` fields: ``batches`` evaluated of ``batches_available``."""
    from jaxpar import inference
    from jaxpar.data import SequentialBatches
    from jaxpar.train.hooks import heldout_loss
    from jaxpar.train.step import Trainer

    t = src.cfg.train
    batches = SequentialBatches(tokens, t.global_batch, t.seq_len, f"--data ({len(tokens)} tokens)")
    n = batches.steps if max_batches is None else min(max_batches, batches.steps)
    mesh = inference.start(src)
    trainer = Trainer(src.cfg, mesh)
    # Weights on disk are in canonical form; a pipeline keeps its own form at rest.
    params = trainer.convert(inference.load_params(src, trainer.canonical_param_shardings), "rest")
    t0 = time.perf_counter()
    loss = heldout_loss(trainer, params, batches, n)
    return {
        "loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else None,
        "batches": n,
        "batches_available": batches.steps,
        "tokens": n * t.global_batch * t.seq_len,
        "seconds": time.perf_counter() - t0,
        "devices": len(mesh.devices.flat),
        "platform": mesh.devices.flat[0].platform,
    }


def run(args: argparse.Namespace) -> int:
    """Validate, load, evaluate, report."""
    import dataclasses
    from pathlib import Path

    from jaxpar import inference
    from jaxpar.data import TokenFile, check_vocab, open_token_file, stdlib_corpus
    from jaxpar.errors import ConfigError
    from jaxpar.report import emit_json

    if args.max_batches is not None and args.max_batches < 1:
        raise ConfigError(f"--max-batches={args.max_batches}: must be a positive integer")
    src = inference.resolve(args, LAYOUT_FLAGS)
    if args.data == "stdlib":  # the embedded corpus's held-out files (bytes)
        corpus = stdlib_corpus()
        f = TokenFile(Path("stdlib"), corpus.heldout, 256, "bytes", {"tokenizer": corpus.tokenizer})
    else:
        f = open_token_file(args.data, src.cfg.train.data_dtype, "--data")
    check_vocab(f, src.cfg.model.vocab_size)
    if src.tokenizer and f.tokenizer and src.tokenizer != f.tokenizer:
        print(
            f"jaxpar eval: warning: {args.data} was tokenised by {f.tokenizer}, the model was "
            f"trained on tokens of {src.tokenizer}",
            file=sys.stderr,
        )
    result = {
        **evaluate(src, f.tokens, args.max_batches),
        **inference.describe(src),
        "data": args.data,
        "seq_len": src.cfg.train.seq_len,
        "global_batch": src.cfg.train.global_batch,
        "layout": dataclasses.asdict(src.cfg.layout),
    }
    if args.json:
        emit_json(result)
    else:
        lay = src.cfg.layout
        ppl = result["perplexity"]
        print(
            f"{args.data}: loss {result['loss']:.4f} nats/token, perplexity "
            f"{'inf' if ppl is None else f'{ppl:.2f}'} over {result['tokens']:,} tokens "
            f"({_which(result)} of {src.cfg.train.global_batch} x "
            f"{src.cfg.train.seq_len}; pp={lay.pp} dp={lay.dp} sp={lay.sp} tp={lay.tp})"
        )
    return 0


def _which(result: dict) -> str:
    """``all 12 batches`` or ``the first 4 of 12 batches`` (consecutive windows): training's
    held-out loss is the latter with ``train.eval_batches``."""
    n, of = result["batches"], result["batches_available"]
    return f"all {n} batches" if n == of else f"the first {n} of {of} batches"
