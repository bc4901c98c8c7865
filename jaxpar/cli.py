"""The ``jaxpar`` command line: one subcommand module per verb under ``jaxpar.commands``.

Each module ``jaxpar/commands/<verb>.py`` defines ``HELP`` (one line), ``add_arguments(parser)``
and ``run(args) -> int``. Adding a verb is adding a module and its name to ``VERBS``; nothing
here imports JAX, so ``jaxpar --help`` is instant and device simulation can be set up before JAX
initialises.

Every refusal is one line on stderr and exit code 2 — a bad flag (the parser's own errors), a
bad configuration (:class:`~jaxpar.errors.JaxparError`) and an I/O failure (``OSError``: a
full disk, a permission) alike — and every warning is one line too.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import warnings

from jaxpar.errors import JaxparError, one_line

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


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage block): ``PROG: error: ...``."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def _load(verb: str):
    try:
        return importlib.import_module(f"jaxpar.commands.{verb.replace('-', '_')}")
    except ModuleNotFoundError as e:
        if e.name == f"jaxpar.commands.{verb.replace('-', '_')}":
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    """Parser with one sub-parser per available verb."""
    parser = Parser(prog="jaxpar", description="Parallel training of language models in JAX.")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb in VERBS:
        mod = _load(verb)
        if mod is None:
            continue
        p = sub.add_parser(verb, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    return parser


@contextlib.contextmanager
def one_line_warnings(prefix: str):
    """Print every warning as ``PREFIX: warning: ...`` on one line while the block runs."""

    def show(message, category, filename, lineno, file=None, line=None):
        kind = "" if issubclass(category, UserWarning) else f"{category.__name__}: "
        print(f"{prefix}: warning: {kind}{one_line(message)}", file=file or sys.stderr)

    before = warnings.showwarning
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = before


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxpar`` console script; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a refused flag (2, already printed in one line)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    prefix = f"jaxpar {args.verb}"
    with one_line_warnings(prefix):
        try:
            return int(args._module.run(args) or 0)
        except JaxparError as e:
            print(f"{prefix}: error: {one_line(e)}", file=sys.stderr)
            return int(getattr(e, "exit_code", 2))  # 2; 128+N for a run stopped by signal N
        except OSError as e:  # full disk, permissions, a vanished file: no traceback
            where = f"{e.filename}: " if e.filename else ""
            print(f"{prefix}: error: {one_line(where + (e.strerror or str(e)))}", file=sys.stderr)
            return 2
        except Exception as e:
            # a multi-process run whose peer died: one line, locks released, exit at once
            # (jaxpar.distributed.stop_after_failure); elsewhere a bug keeps its traceback
            from jaxpar.distributed import stop_after_failure

            stop_after_failure(prefix, e)
            raise


if __name__ == "__main__":
    sys.exit(main())
