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
line and the column; duplicate keys, nesting deeper than :data:`MAX_YAML_DEPTH` and files larger
than :data:`MAX_YAML_BYTES` are refused the same way.

Files jaxpar reads back (token sidecars, checkpoint manifests, lock records, Hugging Face
``config.json`` and safetensors headers) go through one mechanism too: :func:`read_json` (size
and nesting bounded, every failure one line naming the file) and :func:`check_record`, which
holds a mapping to a schema of :class:`Rule` (types, with ``True`` never an integer, and a rule
per field), refusing in one line ``FILE: FIELD=VALUE: RULE``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
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
        # a list, but not of what the field holds: say which elements, not "expected a list"
        raise ConfigError(f"{where}={_brief(value)}: expected {_describe_list(_element(f))}")
    elif isinstance(value, dict) and "dict" in names:
        return value
    shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    raise ConfigError(f"{where}={shown}: expected {_describe(names)}")


def _element(f: dataclasses.Field) -> str:
    """The element annotation of a ``list[...]`` field (``'str'``, ``'list[float]'``)."""
    text = f.type if isinstance(f.type, str) else str(f.type)
    start = text.find("list[")
    return text[start + 5 : text.rindex("]")].strip() if start >= 0 else "str"


def _describe_list(element: str) -> str:
    if element == "list[float]":
        return "a list of [number, ...] rows of finite numbers"
    return f"a list of {_describe({element}).split(' ', 1)[1]}s"


def _brief(value: Any) -> str:
    """``repr(value)``, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
                rows = [[float(x) for x in part.split(":")] for part in parts]
            except ValueError:
                rows = None
            if rows is None or not all(finite(x) for row in rows for x in row):
                # the one such field is a matmul curve (jaxpar.validation.check_curve)
                raise ConfigError(
                    f"{where}={text!r}: expected SIZE:SHARE,SIZE:SHARE,... of finite numbers "
                    "(sizes >= 1 ascending, shares in (0, 1])"
                )
            return rows
        return parts
    if "str" in names:
        return text
    raise ConfigError(f"{where}={text!r}: expected {_describe(names)}")


def finite(value: Any) -> bool:
    """A real number that is neither NaN nor infinite (bools excluded)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


MAX_YAML_BYTES = 1 << 20  # model and mesh files are a few hundred bytes
MAX_YAML_DEPTH = 32  # the deepest jaxpar config nests three levels
MAX_JSON_DEPTH = 64


class _Loader(yaml.SafeLoader):
    """The safe loader, refusing duplicate keys (which would silently keep the last value) and
    nesting deeper than :data:`MAX_YAML_DEPTH` (the composer recurses per level)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            mark = self.peek_event().start_mark
            raise yaml.MarkedYAMLError(
                problem=f"nested deeper than {MAX_YAML_DEPTH} levels", problem_mark=mark
            )
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the base constructor refuses it
                    continue
                if first is not key_node:
                    raise yaml.MarkedYAMLError(
                        problem=f"duplicate key {key!r} (first at line "
                        f"{first.start_mark.line + 1})",
                        problem_mark=key_node.start_mark,
                    )
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path`` (safe loader, duplicate keys refused, bounded size and
    depth); every failure is one ConfigError line."""
    raw = read_bytes(path, MAX_YAML_BYTES)
    try:
        return yaml.load(raw, Loader=_Loader)  # noqa: S506  (a SafeLoader subclass)
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


# ---- files jaxpar reads back: JSON through a schema -------------------------------------------


def read_bytes(path: str | Path, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``; one ConfigError line otherwise
    (a directory, a FIFO, a missing or unreadable file, a file too large to be one of jaxpar's)."""
    p = Path(path)
    why = not_a_file(p)
    if why:
        raise ConfigError(f"{path}: {why}")
    try:
        size = p.stat().st_size
        if size > max_bytes:
            raise ConfigError(f"{path}: {size} bytes: larger than the {max_bytes} allowed")
        with open(p, "rb") as f:
            return f.read(max_bytes + 1)[:max_bytes]
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or type(e).__name__}") from None


def not_a_file(path: Path) -> str | None:
    """Why ``path`` is not a regular file (the right word: missing, a directory, a FIFO...)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as e:
        return f"cannot be read: {e.strerror or type(e).__name__}"
    import stat

    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory, expected a file"
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"is {kind}, not a regular file"


def _depth(value: Any, limit: int) -> bool:
    """Whether ``value`` nests at most ``limit`` levels (iterative: no recursion limit)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return False
        if isinstance(v, dict):
            stack += [(x, d + 1) for x in v.values()]
        elif isinstance(v, list):
            stack += [(x, d + 1) for x in v]
    return True


def parse_json(raw: bytes | str, where: str) -> Any:
    """JSON text as Python values; one ConfigError line for undecodable bytes, a syntax error
    (with line and column), a non-finite constant or nesting deeper than :data:`MAX_JSON_DEPTH`."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text (byte {e.start})") from None

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        value = json.loads(text, parse_constant=constant)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    except (ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise ConfigError(f"{where}: invalid JSON: {why}") from None
    if not _depth(value, MAX_JSON_DEPTH):
        raise ConfigError(f"{where}: invalid JSON: nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def read_json(path: str | Path, max_bytes: int = 16 << 20) -> Any:
    """The JSON document in the regular file ``path`` (bounded size and depth)."""
    return parse_json(read_bytes(path, max_bytes), str(path))


_KINDS: dict[str, Callable[[Any], bool]] = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": finite,
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "list": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, dict),
    "None": lambda v: v is None,
}


@dataclasses.dataclass(frozen=True)
class Rule:
    """What one field of a file must hold: its types (``"int"``, ``"float"`` — finite, an int
    accepted —, ``"str"``, ``"bool"``, ``"list"``, ``"dict"``, ``"None"``; ``True`` is never an
    int), an optional predicate with the rule it states, and whether the field may be absent."""

    kinds: tuple[str, ...]
    ok: Callable[[Any], bool] | None = None
    rule: str = ""
    required: bool = True

    def why(self, value: Any) -> str | None:
        """The rule ``value`` breaks, or None."""
        if not any(_KINDS[k](value) for k in self.kinds):
            return f"expected {_describe(set(self.kinds))}"
        if value is not None and self.ok is not None:
            try:
                good = bool(self.ok(value))
            except (TypeError, ValueError, OverflowError):
                good = False
            if not good:
                return self.rule or "invalid"
        return None


def _shown(value: Any) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def check_record(where: str, record: Any, schema: dict[str, Rule]) -> dict[str, Any]:
    """``record`` if it is a mapping whose fields meet ``schema`` (unknown fields are kept
    and ignored); else one ConfigError line ``WHERE: FIELD=VALUE: RULE``."""
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for name, rule in schema.items():
        if name not in record:
            if rule.required:
                raise ConfigError(f"{where}: {name}: missing")
            continue
        why = rule.why(record[name])
        if why:
            raise ConfigError(f"{where}: {name}={_shown(record[name])}: {why}")
    return record


def plain_name(value: Any) -> bool:
    """A file name inside its directory: no separator, not ``.``/``..``, not hidden, no NUL —
    so a path read from a file stays in the directory that holds the file."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= 255
        and "/" not in value
        and "\\" not in value
        and "\0" not in value
        and not value.startswith(".")
    )


def plain_path(value: Any) -> bool:
    """A relative path that stays inside its directory (no ``..``, not absolute, no NUL)."""
    if not isinstance(value, str) or not value or "\0" in value or value.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in value.split("/"))
