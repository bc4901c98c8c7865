"""The ``jaxpar`` command line: one subcommand module per verb under ``jaxpar.commands``.

Each module ``jaxpar/commands/<verb>.py`` defines ``HELP`` (one line), ``add_arguments(parser)``
and ``run(args) -> int``. Adding a verb is adding a module and its name to ``VERBS``; nothing
here imports JAX, so ``jaxpar --help`` is instant and device simulation can be set up before JAX
initialises.

Every refusal is one line on stderr and exit code 2 — a bad flag (the parser's own errors), a
bad configuration (:class:`~jaxpar.errors.JaxparError`) and an I/O failure (``OSError``: a
full disk, a permission) alike — and every warning is one line too. A reader that closes
stdout early (``| head``) ends the command quietly (exit 141, no error line).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
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
    "compile",
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
    """Parser with one sub-parser per available verb. No parser takes an abbreviated flag
    (:func:`_exact_flags`)."""
    parser = Parser(prog="jaxpar", description="Parallel training of language models in JAX.")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb in VERBS:
        mod = _load(verb)
        if mod is None:
            continue
        p = sub.add_parser(verb, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_module=mod, _parser=p)
    _exact_flags(parser)
    return parser


def _exact_flags(parser: argparse.ArgumentParser) -> None:
    """``allow_abbrev=False`` on ``parser`` and every sub-parser under it (a verb's own
    sub-commands too): ``jaxpar plan --layout auto`` once parsed as ``--layout-from-mesh``, and
    a flag added later would change what an abbreviation means."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _exact_flags(sub)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with arguments the verb does not take refused by the verb's
    own parser (``jaxpar plan: error: unrecognized arguments: ...``, not ``jaxpar: ...``)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


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


def cpu_unless_gpu(env=None) -> None:
    """With a jax CUDA plugin installed on a machine without an NVIDIA driver, JAX would try
    CUDA first and print the plugin's traceback before falling back to the CPU: run on the CPU
    from the start unless the user chose (``JAX_PLATFORMS``) or a driver is present."""
    import importlib.util
    import os

    env = os.environ if env is None else env
    if "JAX_PLATFORMS" in env or os.path.exists("/proc/driver/nvidia/version"):
        return
    if any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        env["JAX_PLATFORMS"] = "cpu"


def quiet_cuda_plugin_start(env=None) -> None:
    """On a run whose ``JAX_PLATFORMS`` leave CUDA out, with a jax CUDA plugin installed (the
    ``test`` and ``gpu-aot`` extras install one for deviceless GPU compiles), start JAX and
    register its plugins now, with the CUDA stubs' "no driver" notices that native code writes
    to stderr dropped (four lines on every run otherwise; every other line is kept). Only the
    plugins are registered here, no backend is created, so simulated CPU devices can still be
    set later."""
    import importlib.util
    import os

    env = os.environ if env is None else env
    platforms = env.get("JAX_PLATFORMS", "")
    if not platforms or any(p in platforms for p in ("cuda", "gpu")):
        return
    if not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        return
    from jaxpar.gpu.targets import quiet_native_stderr

    with quiet_native_stderr():
        from jax._src import xla_bridge  # importing JAX loads the plugin's libraries

        # private, hence looked up: jax registers the plugins itself at first use otherwise
        register = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
        if register is not None:
            register()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxpar`` console script; returns the exit code."""
    cpu_unless_gpu()
    quiet_cuda_plugin_start()
    try:
        args = parse(build_parser(), argv)
    except SystemExit as e:  # --help (0) or a refused flag (2, already printed in one line)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    prefix = f"jaxpar {args.verb}"
    with one_line_warnings(prefix):
        try:
            code = int(args._module.run(args) or 0)
            sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
            return code
        except BrokenPipeError:
            return _reader_gone()
        except JaxparError as e:
            from jaxpar.distributed import caused_by_peer, stop_after_failure

            if caused_by_peer(e):  # e.g. a checkpoint save whose collective met a dead peer:
                stop_after_failure(prefix, e)  # the watch names the peer (else this line)
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


def _reader_gone() -> int:
    """stdout's reader closed the pipe (``jaxpar plan ... | head``): end quietly, as a program
    killed by SIGPIPE would (exit 128 + 13), with no error line. stdout now points at
    ``/dev/null``, so the interpreter's last flush of the unwritten rest cannot fail again.
    (SIGPIPE itself stays ignored, as Python sets it: a closed socket of a multi-host run must
    raise, not kill the process.)"""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is no file (captured, replaced)
        pass
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
