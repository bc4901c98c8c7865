"""The ``jaxpar`` command line: one subcommand module per verb under ``jaxpar.commands``.

Each module ``jaxpar/commands/<verb>.py`` defines ``HELP`` (one line), ``add_arguments(parser)``
and ``run(args) -> int``. Adding a verb is adding a module and its name to ``VERBS``; nothing
here imports JAX, so ``jaxpar --help`` is instant and device simulation can be set up before JAX
initialises.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from jaxpar.errors import JaxparError

VERBS = (
    "train",
    "schedule",
    "memory",
    "comm",
    "plan",
    "bench",
    "launch",
    "data",
    "eval",
    "generate",
)


def _load(verb: str):
    try:
        return importlib.import_module(f"jaxpar.commands.{verb.replace('-', '_')}")
    except ModuleNotFoundError as e:
        if e.name == f"jaxpar.commands.{verb.replace('-', '_')}":
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    """Parser with one sub-parser per available verb."""
    parser = argparse.ArgumentParser(
        prog="jaxpar", description="Parallel training of language models in JAX."
    )
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb in VERBS:
        mod = _load(verb)
        if mod is None:
            continue
        p = sub.add_parser(verb, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxpar`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except JaxparError as e:
        print(f"jaxpar {args.verb}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
