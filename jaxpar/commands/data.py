"""``jaxpar data prepare | train-tokenizer``: token files from text, and BPE tokenizers."""

from __future__ import annotations

import argparse

HELP = "prepare token files from text (prepare) and train BPE tokenizers (train-tokenizer)"


def _inputs(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text files (one document each), .jsonl files (one per line), directories, or "
        "'stdlib' (the embedded corpus)",
    )
    p.add_argument("--text-field", default="text", help="the text field of .jsonl lines")
    p.add_argument("--json", action="store_true", help="print one JSON summary as the last line")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Sub-commands ``prepare`` and ``train-tokenizer``."""
    sub = p.add_subparsers(dest="data_verb", required=True, metavar="SUBCOMMAND")
    prep = sub.add_parser(
        "prepare", help="tokenise text into NAME.bin + NAME.json (and NAME.val.bin)"
    )
    _inputs(prep)
    prep.add_argument(
        "--tokenizer",
        required=True,
        help="'byte', or a directory with tokenizer.json (e.g. a Hugging Face Llama checkpoint)",
    )
    prep.add_argument("--out", default="tokens.bin", help="output token file (default tokens.bin)")
    prep.add_argument(
        "--validation-fraction",
        type=float,
        default=0.0,
        help="fraction of documents held out into NAME.val.bin (default 0: none)",
    )
    prep.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    prep.add_argument("--eos", default=None, help="end-of-text token (default: the tokenizer's)")
    prep.add_argument("--force", action="store_true", help="replace existing output files")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    tt = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer (no downloads)")
    _inputs(tt)
    tt.add_argument("--vocab-size", type=int, required=True, help="tokens, <|endoftext|> included")
    tt.add_argument("--out", required=True, help="directory for tokenizer.json")
    tt.add_argument(
        "--force", action="store_true", help="replace --out whole even if it holds other files"
    )


def run(args: argparse.Namespace) -> int:
    """Run the sub-command; print a summary (or the ``--json`` object)."""
    from jaxpar import prepare
    from jaxpar.report import emit_json

    if args.data_verb == "prepare":
        result = prepare.prepare(
            args.inputs,
            args.tokenizer,
            args.out,
            text_field=args.text_field,
            validation_fraction=args.validation_fraction,
            workers=args.workers,
            eos=args.eos,
            force=args.force,
            progress=not args.no_progress and not args.json,
        )
        if args.json:
            emit_json(result)
            return 0
        val = result["validation_output"]
        print(
            f"{result['output']}: {result['tokens']:,} tokens ({result['dtype']}), "
            f"{result['documents']:,} documents"
            + (
                f"; {val}: {result['validation_tokens']:,} tokens, "
                f"{result['validation_documents']:,} documents"
                if val
                else ""
            )
        )
        print(
            f"{result['input_bytes'] / 1e6:.1f} MB of text in {result['seconds']:.1f} s "
            f"({result['mb_per_s']:.1f} MB/s, {result['workers']} workers); vocabulary "
            f"{result['vocab_size']}, end-of-text id {result['eos_id']}"
        )
        return 0
    result = prepare.train_tokenizer(
        args.inputs, args.vocab_size, args.out, args.text_field, force=args.force
    )
    if args.json:
        emit_json(result)
    else:
        print(
            f"{result['output']}/tokenizer.json: {result['vocab_size']} tokens from "
            f"{result['input_bytes'] / 1e6:.1f} MB in {result['seconds']:.1f} s"
        )
    return 0
