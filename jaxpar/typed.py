"""Values by their dataclass annotations, and YAML files read with one-line errors.

The config dataclasses (:mod:`jaxpar.config`) declare each field's type once; everything that
sets a field — a YAML file, a ``-o FIELD=VALUE`` override, a library user — goes through the
same two functions here:

- :func:`check` refuses a value of the wrong type (``train.lr='fast': expected a number``),
  turning an ``int`` into a ``float`` where a float is declared;
- :func:`from_text` parses command-line text by the declared type (not by the current
  value's type, so ``-o model.head_dim=64`` works although the default is ``None``).

:func:`read_yaml` turns every way a YAML file can be unreadable (a missing or unreadable file,
a syntax error, NUL bytes, undecodable bytes, a ``!!python/...`` tag, which the safe loader
refuses to construct) into one :class:`~jaxpar.errors.ConfigError` line naming the file, the
line and the column.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import yaml

from jaxpar.errors import ConfigError

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def kinds(f: dataclasses.Field) -> set[str]:
    """Base type names of a field's annotation: ``'int | None'`` -> ``{'int', 'None'}``."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return {part.strip().split("[")[0] for part in text.split("|")}


def _describe(names: set[str]) -> str:
    words = {
        "int": "an integer",
        "float": "a number",
        "str": "a string",
        "bool": "a boolean (true/false)",
        "list": "a list",
        "dict": "a mapping",
        "None": "null",
    }
    return " or ".join(words.get(n, f"a {n} mapping") for n in sorted(names, key=str.lower))


def check(where: str, value: Any, f: dataclasses.Field) -> Any:
    """``value`` if it fits ``f``'s declared type (an int widened to float), else ConfigError.

    Nested dataclass fields are not handled here (the caller recurses into them).
    """
    names = kinds(f)
    if value is None and "None" in names:
        return None
    if isinstance(value, bool):
        if "bool" in names:
            return value
    elif isinstance(value, int) and "int" in names:
        return value
    elif isinstance(value, (int, float)) and "float" in names:
        return float(value)
    elif isinstance(value, str) and "str" in names:
        return value
    elif isinstance(value, str) and "float" in names:
        # YAML 1.1 reads ``3e-3`` (no dot) as a string; accept what Python reads as a number
        try:
            return float(value)
        except ValueError:
            pass
    elif isinstance(value, list) and "list" in names:
        items = _list_items(value, _element(f))
        if items is not None:
            return items
    elif isinstance(value, dict) and "dict" in names:
        return value
    shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    raise ConfigError(f"{where}={shown}: expected {_describe(names)}")


def _element(f: dataclasses.Field) -> str:
    """The element annotation of a ``list[...]`` field (``'str'``, ``'list[float]'``)."""
    text = f.type if isinstance(f.type, str) else str(f.type)
    start = text.find("list[")
    return text[start + 5 : text.rindex("]")].strip() if start >= 0 else "str"


def _list_items(value: list, element: str) -> list | None:
    """``value`` checked against a list element annotation (numbers widened), or None."""
    if element == "str":
        return value if all(isinstance(v, str) for v in value) else None
    if element == "list[float]":
        rows = []
        for row in value:
            if not isinstance(row, list) or not all(finite(x) for x in row):
                return None
            rows.append([float(x) for x in row])
        return rows
    return None


def from_text(text: str, f: dataclasses.Field, where: str) -> Any:
    """Parse command-line ``text`` as ``f``'s declared type."""
    names = kinds(f)
    low = text.strip().lower()
    if "None" in names and low in ("none", "null"):
        return None
    if "bool" in names:
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
    if "int" in names:
        try:
            return int(text)
        except ValueError:
            if "float" not in names and "str" not in names:
                raise ConfigError(f"{where}={text!r}: expected {_describe(names)}") from None
    if "float" in names:
        try:
            return float(text)
        except ValueError:
            if "str" not in names:
                raise ConfigError(f"{where}={text!r}: expected {_describe(names)}") from None
    if "list" in names:
        parts = [v for v in text.split(",") if v]
        if _element(f) == "list[float]":  # "64:0.31,1024:0.62" -> [[64.0, 0.31], [1024.0, 0.62]]
            try:
                return [[float(x) for x in part.split(":")] for part in parts]
            except ValueError:
                raise ConfigError(f"{where}={text!r}: expected SIZE:SHARE,SIZE:SHARE,...") from None
        return parts
    if "str" in names:
        return text
    raise ConfigError(f"{where}={text!r}: expected {_describe(names)}")


def finite(value: Any) -> bool:
    """A real number that is neither NaN nor infinite (bools excluded)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path`` (safe loader); every failure is one ConfigError line."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or type(e).__name__}") from None
    try:
        return yaml.safe_load(raw)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        what = " ".join(x for x in (e.context, e.problem) if x) or type(e).__name__
        if mark is None:
            raise ConfigError(f"{path}: invalid YAML: {what}") from None
        raise ConfigError(
            f"{path}:{mark.line + 1}:{mark.column + 1}: invalid YAML: {what}"
        ) from None
    except yaml.reader.ReaderError as e:
        # no mark: count lines up to the offending position (characters, or bytes when the
        # file did not decode)
        if isinstance(e.character, str):
            before = raw.decode(e.encoding or "utf-8", errors="replace")[: e.position]
            nl = "\n"
        else:
            before, nl = raw[: e.position], b"\n"
        line, col = before.count(nl) + 1, len(before) - (before.rfind(nl) + 1) + 1
        char = e.character if isinstance(e.character, str) else bytes([e.character])
        raise ConfigError(
            f"{path}:{line}:{col}: invalid YAML: unacceptable character {char!r} ({e.reason})"
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {type(e).__name__}") from None
