"""Value checks for command-line flags, used as argparse ``type=`` callables.

Each check turns the flag's text into a value or raises ``argparse.ArgumentTypeError`` with the
rule, so a bad flag is refused by the parser itself, in one line naming the flag, the value and
the rule (``jaxpar memory: error: argument --dp: '0': must be a positive integer``), before
anything is loaded or compiled. Values that also arrive through YAML files or ``-o`` overrides
are checked again by :func:`jaxpar.validation.validate`; these checks only make the flag's own
error come first and name the flag.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

from jaxpar.validation import MAX_SEED


def _int(text: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (sizes, counts, steps)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive integer")
    return value


def nonneg_int(text: str) -> int:
    """An integer >= 0 (0 usually disables)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= 0")
    return value


def seed(text: str) -> int:
    """A seed in 0 .. 2**32 - 1."""
    value = _int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer in 0..{MAX_SEED}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (learning rates, parameter counts, timeouts)."""
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive finite number")
    return value


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An integer in ``lo..hi`` (e.g. the ZeRO stage 0..3)."""

    def check(text: str) -> int:
        value = _int(text)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{text!r}: must be an integer in {lo}..{hi}")
        return value

    check.__name__ = f"int_in_{lo}_{hi}"
    return check


def writable_file(text: str) -> str:
    """A path a file can be written to: its directory exists and is writable, and it is not a
    directory itself. Checked when parsing, so a run never computes a result it cannot save."""
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r}: not a file path")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: is a directory, expected a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: directory {str(parent)!r} does not exist")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: not writable (permission denied)")
    _probe(parent, text)
    return text


def new_file(text: str) -> str:
    """A :func:`writable_file` that does not exist yet: an output written once and never
    replaced (``jaxpar compile --save/--hlo``), refused when parsing, before anything runs."""
    writable_file(text)
    if os.path.lexists(text):
        raise argparse.ArgumentTypeError(f"{text!r}: file exists; refusing to overwrite it")
    return text


IMAGE_SUFFIXES = (".png", ".pdf", ".svg")


def image_file(text: str) -> str:
    """A writable file path ending in .png, .pdf or .svg (matplotlib picks the format from it)."""
    if Path(text).suffix.lower() not in IMAGE_SUFFIXES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: must end in {', '.join(IMAGE_SUFFIXES)} (the image format)"
        )
    return writable_file(text)


def writable_dir(text: str) -> str:
    """A directory that exists writable, or can be created under a writable ancestor."""
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r}: not a directory path")
    path = Path(text).absolute()
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {str(probe)!r} is a file, not a directory")
    _probe(probe, text)
    return text


def _probe(directory: Path, text: str) -> None:
    """Create and remove a file in ``directory``: permission bits alone do not tell (root,
    read-only mounts, /proc)."""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".jaxpar-probe-"):
            pass
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise argparse.ArgumentTypeError(
            f"{text!r}: {str(directory)!r} is not writable ({why})"
        ) from None


def raw_hardware(mesh: str) -> dict | None:
    """The mesh file's ``hardware`` mapping as written (no defaults filled in)."""
    from jaxpar import config as C

    path = C._resolve(mesh, C.MESHES_DIR, "mesh")
    return C._read_yaml(path).get("hardware")
