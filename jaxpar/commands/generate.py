"""``jaxpar generate``: continue prompts with a checkpoint or Hugging Face weights (KV-cache
decoding, one device or weights sharded over ``tp``)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

HELP = "continue text prompts with a checkpoint or Hugging Face weights (KV-cache sampling)"

LAYOUT_FLAGS = ("dp", "tp", "ep", "compute_dtype")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``jaxpar generate``."""
    from jaxpar import inference

    p.add_argument(
        "--prompt", action="append", default=[], help="a prompt (repeat for a batch of several)"
    )
    p.add_argument("--prompts-file", default=None, help="a file of prompts, one per line")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to add to each prompt")
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: off)")
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1: off)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    inference.add_arguments(p, LAYOUT_FLAGS)


MAX_PROMPTS_BYTES = 64 << 20


def _prompts(args: argparse.Namespace) -> list[str]:
    from jaxpar.errors import ConfigError

    prompts = list(args.prompt)
    if args.prompts_file is not None:
        from jaxpar import typed

        where = f"--prompts-file={args.prompts_file!r}"
        try:
            raw = typed.read_bytes(Path(args.prompts_file), MAX_PROMPTS_BYTES)
            text = raw.decode("utf-8")
        except ConfigError as e:
            raise ConfigError(f"{where}: {str(e).split(': ', 1)[-1]}") from None
        except UnicodeDecodeError as e:
            line = raw[: e.start].count(b"\n") + 1
            raise ConfigError(f"{where}: line {line}: not UTF-8 text (byte {e.start})") from None
        # one prompt a line: split at "\n" (and "\r\n") only, so a prompt keeps every other
        # character (str.splitlines would also split at form feeds, \x1c-\x1e, \u2028, ...)
        lines = (ln[:-1] if ln.endswith("\r") else ln for ln in text.split("\n"))
        prompts += [ln for ln in lines if ln.strip()]
    if not prompts:
        raise ConfigError("--prompt: no prompts given (--prompt TEXT or --prompts-file FILE)")
    return prompts


def _check_nul(texts: list[str], prompts: list[list[int]], tok) -> None:
    """Refuse a prompt whose NUL characters the tokenizer does not keep (a normaliser that
    strips control characters): the model would read another prompt than the one given. The
    byte tokenizer keeps them (byte 0)."""
    from jaxpar.errors import ConfigError

    for i, (text, ids) in enumerate(zip(texts, prompts, strict=True)):
        if "\0" in text and tok.decode(ids).count("\0") != text.count("\0"):
            where = tok.identity().get("path", tok.identity().get("kind"))
            raise ConfigError(
                f"prompt {i + 1}: a NUL character at position {text.index(chr(0))}: the "
                f"tokenizer {where} drops it; remove it, or use a tokenizer that keeps it"
            )


def run(args: argparse.Namespace) -> int:
    """Validate everything, then load, compile, sample and report."""
    from jaxpar import inference
    from jaxpar.errors import ConfigError
    from jaxpar.generate import Sampling, check_prompts
    from jaxpar.report import emit_json

    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    texts = _prompts(args)
    src = inference.resolve(args, LAYOUT_FLAGS)
    dp = src.cfg.layout.dp
    if len(texts) % dp:
        raise ConfigError(
            f"--dp={dp}: {len(texts)} prompt(s) do not split into {dp} equal shards (the batch "
            f"is split over dp); pass a multiple of {dp} prompts or a smaller --dp"
        )
    m = src.cfg.model
    sampling.check(m.vocab_size)
    tok = inference.tokenizer_for(src, args.tokenizer)
    if tok is None:
        raise ConfigError(
            "--tokenizer: none known for these weights (the checkpoint names none, e.g. trained "
            "on synthetic tokens, or the Hugging Face directory has no tokenizer.json); pass "
            "--tokenizer DIR or 'byte'"
        )
    if tok.vocab_size > m.vocab_size:
        raise ConfigError(
            f"--tokenizer: its vocabulary ({tok.vocab_size}) exceeds model.vocab_size="
            f"{m.vocab_size}"
        )
    prompts = tok.encode_batch(texts)
    _check_nul(texts, prompts, tok)
    check_prompts(prompts, args.max_new_tokens, m.max_seq_len)

    mesh = inference.start(src)
    from jaxpar.generate import Generator
    from jaxpar.model import Model
    from jaxpar.train.step import DTYPES, Trainer

    trainer = Trainer(src.cfg, mesh)
    params = inference.load_params(src, trainer.canonical_param_shardings)  # canonical form
    gen = Generator(Model(m), mesh, trainer.rules, DTYPES[src.cfg.layout.compute_dtype])
    out = gen.generate(params, prompts, args.max_new_tokens, sampling, args.seed, tok.eos_id)
    completions = [
        {
            "prompt": text,
            "text": tok.decode(ids),
            "prompt_tokens": len(p),
            "new_tokens": len(ids),
            "token_ids": ids,
        }  # fmt: skip
        for text, p, ids in zip(texts, prompts, out.tokens, strict=True)
    ]
    result = {
        "completions": completions,
        "new_tokens": sum(len(ids) for ids in out.tokens),
        "tokens_per_s": out.tokens_per_s,
        "steps": out.steps,
        "prefill_s": out.prefill_s,
        "decode_s": out.decode_s,
        "compile_s": out.compile_s,
        "batch": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "sampling": dataclasses.asdict(sampling),
        "seed": args.seed,
        "tokenizer": tok.identity(),
        "tp": src.cfg.layout.tp,
        "dp": src.cfg.layout.dp,
        "ep": src.cfg.layout.ep,
        "devices": len(mesh.devices.flat),
        "platform": mesh.devices.flat[0].platform,
        **inference.describe(src),
    }
    if args.json:
        emit_json(result)
        return 0
    for i, c in enumerate(completions):
        print(f"--- {i + 1}: {c['prompt_tokens']} prompt tokens + {c['new_tokens']} new")
        print(c["prompt"] + c["text"])
    rate = out.tokens_per_s
    print(
        f"--- {result['new_tokens']} new tokens; decode {'n/a' if rate is None else f'{rate:,.0f}'}"
        f" tokens/s (batch {len(prompts)}, {out.steps} steps), prefill "
        f"{out.prefill_s * 1e3:.1f} ms, compile {out.compile_s:.1f} s, tp={src.cfg.layout.tp}"
    )
    return 0
