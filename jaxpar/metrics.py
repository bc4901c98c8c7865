"""Run bookkeeping: JSONL metrics (appended; cut back to the restored step on resume), a
progress bar, device memory.

A metrics file holds only the records jaxpar writes (:data:`RECORDS`), one JSON object a line
(``json.dumps``, so ASCII): a step's ``loss`` record, a held-out ``eval_loss`` record, and the
``start`` and ``preempted`` events. Each holds an integer ``step`` and only the fields of its
kind, each of its type (:func:`record_problem`). A line cut by a crash is the start of one
(``{"step": `` or ``{"event": "``) that ends inside a value. Anything else in the file — a
``#`` comment, another program's JSON, a record with a field jaxpar does not write — is the
user's, and a resume never deletes it: :func:`foreign_line` finds it before anything compiles
(:func:`jaxpar.outputs.check_outputs`), and :func:`truncate_after` refuses to cut such a file.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from jaxpar import typed
from jaxpar.errors import ConfigError
from jaxpar.report import _clean

_STEP = typed.Rule(("int",), lambda v: v >= 0, "must be an integer >= 0")
_NUMBER = typed.Rule(("float", "None"), required=False)  # a non-finite figure is written null
_NUMBERS = typed.Rule(("list",), lambda v: all(x is None or typed.finite(x) for x in v),
                      "must be a list of numbers", required=False)  # fmt: skip
_NAMES = typed.Rule(("list",), lambda v: all(isinstance(x, str) for x in v),
                    "must be a list of strings", required=False)  # fmt: skip
_COUNT = typed.Rule(("int",), lambda v: v >= 0, "must be an integer >= 0", required=False)
# The records jaxpar writes (jaxpar.train: StepMetrics.record, EvalHook, the start record of
# jaxpar.train.loop, PreemptionHook), by kind: every field a record of the kind may hold.
RECORDS: dict[str, dict[str, typed.Rule]] = {
    "step": {
        "step": _STEP,
        "loss": typed.Rule(("float", "None")),
        **dict.fromkeys(("grad_norm", "lr", "step_time_s", "tokens_per_s"), _NUMBER),
        "nonfinite": typed.Rule(("bool",), required=False),
        "nonfinite_leaves": _NAMES,
        "diverged": typed.Rule(("str",), required=False),
        "moe_load": _NUMBERS,
        "moe_dropped": _NUMBERS,
        "fp8_overflow": _COUNT,
    },
    "eval": {"step": _STEP, "eval_loss": typed.Rule(("float", "None"))},
    "start": {
        "event": typed.Rule(("str",)),
        "step": _STEP,
        "layout": typed.Rule(("dict",), required=False),
        "params": _COUNT,
        "compile_s": _NUMBER,
        "memory": typed.Rule(("dict",), required=False),
        "dropped_records": _COUNT,
    },
    "preempted": {"event": typed.Rule(("str",)), "step": _STEP, "signal": typed.Rule(("str",))},
}
_HEADS = ('{"step": ', '{"event": "')  # how every line jaxpar writes begins (json.dumps)
# what is left of a value cut short: part of a number or of true/false/null
_CUT_VALUE = re.compile(r"-?\d*(\.\d*)?([eE][+-]?\d*)?|t(r(ue?)?)?|f(a(l(se?)?)?)?|n(u(ll?)?)?")


def record_problem(line: str) -> str | None:
    """Why ``line`` (one line of a metrics file, stripped) is not jaxpar's: None for a record
    of :data:`RECORDS`, a blank line, or a record cut short by a crash."""
    if not line:
        return None
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        return None if _cut(line, e) else "not JSON"
    except (ValueError, RecursionError):
        return "not JSON"
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not an object"
    event = rec.get("event")
    kind = (
        event if event in ("start", "preempted")
        else None if "event" in rec
        else "eval" if "eval_loss" in rec
        else "step" if "loss" in rec
        else None
    )  # fmt: skip
    if kind is None:
        if "event" in rec:
            return f"event={typed._shown(event)}: jaxpar writes 'start' and 'preempted'"
        return "no loss, eval_loss or event field"
    schema = RECORDS[kind]
    unknown = [k for k in rec if k not in schema]
    if unknown:
        return f"field {unknown[0]!r}: not one jaxpar writes in a {kind} record"
    try:
        typed.check_record(f"{kind} record", rec, schema)
    except ConfigError as e:
        return str(e)
    return None


def _cut(line: str, e: json.JSONDecodeError) -> bool:
    """Whether an unparsable line is the start of one of jaxpar's, cut inside a value."""
    if not any(line.startswith(h) or h.startswith(line) for h in _HEADS):
        return False
    if e.msg.startswith("Unterminated string"):  # a string runs to the end of the line
        return True
    if e.msg.startswith("Invalid \\uXXXX escape"):  # cut inside \\u0041
        return len(line) - e.pos <= 6
    return _CUT_VALUE.fullmatch(line[e.pos :]) is not None


def foreign_line(path: str | Path) -> tuple[int, str, str] | None:
    """The first line of a metrics file that jaxpar did not write, as ``(number, text, why)``
    (None: every line is jaxpar's, or the file cannot be read)."""
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return None
    return _first_foreign(raw.split(b"\n"))


def _first_foreign(lines: list[bytes]) -> tuple[int, str, str] | None:
    for n, b in enumerate(lines, 1):
        try:
            line = b.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            text = b.decode("utf-8", errors="replace").strip()[:60]
            return n, text, f"not UTF-8 (byte {e.start})"
        why = record_problem(line)
        if why:
            return n, line[:60], why
    return None


def foreign_refusal(what: str, bad: tuple[int, str, str]) -> ConfigError:
    """The one-line refusal of a metrics file holding a line jaxpar did not write; ``what``
    names the file by the flag that chose it (:func:`jaxpar.outputs.metrics_field`)."""
    n, text, why = bad
    return ConfigError(
        f"{what}: line {n} ({text!r}) is not a jaxpar record ({why}), so this is not a jaxpar "
        "metrics file; choose another file, or pass --force to replace it whole"
    )


class MetricsLog:
    """JSONL file of step records, appended line by line; a no-op without a path.

    ``keep_until``: the step this run starts from when it continues the file's run (a
    resume): records of later steps — written by an earlier attempt after the checkpoint it
    is resuming from, e.g. before a SIGKILL — are dropped first (:func:`truncate_after`), so
    every step appears once and in order. Only process 0 writes, so a multi-host run keeps one
    file. :attr:`dropped` is how many records were dropped.
    """

    def __init__(self, path: str | None, keep_until: int | None = None, what: str | None = None):
        import jax

        self._f = None
        self.dropped = 0
        if path and jax.process_index() == 0:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                if keep_until is not None:
                    self.dropped = truncate_after(path, keep_until, what)
                # line-buffered: a crash loses at most a line
                self._f = open(path, "a", buffering=1)
            except OSError as e:
                raise ConfigError(
                    f"{what or f'train.metrics_file={path!r}'}: cannot write: {e.strerror or e}"
                ) from None
            if self._f.tell() and not _ends_with_newline(path):
                self._f.write("\n")  # a killed run left half a line: keep it off ours

    def write(self, record: dict[str, Any]) -> None:
        """Append one record."""
        if self._f is not None:
            self._f.write(json.dumps(_clean(record)) + "\n")

    def close(self) -> None:
        """Close the file."""
        if self._f is not None:
            self._f.close()
            self._f = None


def truncate_after(path: str | Path, step: int, what: str | None = None) -> int:
    """Drop the records of ``path`` after ``step`` (and lines cut by a crash), atomically: the
    kept records go to a temporary file that replaces the original (fsync, rename), so a crash
    during the cut leaves either file whole. Returns the number of lines dropped. A line jaxpar
    did not write (:func:`foreign_line`) is never dropped: the file is refused, untouched."""
    p = Path(path)
    if not p.exists():
        return 0
    lines = p.read_bytes().split(b"\n")
    bad = _first_foreign(lines)
    if bad:
        raise foreign_refusal(what or f"train.metrics_file={str(path)!r}", bad)
    kept, dropped = [], 0
    for raw in lines:
        text = raw.decode("utf-8").strip()
        if not text:
            continue
        try:
            rec = json.loads(text)
        except ValueError:  # cut by a crash
            dropped += 1
            continue
        if rec["step"] <= step:
            kept.append(raw.rstrip(b"\r") + b"\n")
        else:
            dropped += 1
    if dropped:
        tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(b"".join(kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    return dropped


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


class Progress:
    """A tqdm progress bar on stderr showing loss, tokens/s and step time."""

    def __init__(self, total: int, start: int, enabled: bool = True):
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                initial=start,
                file=sys.stderr,
                unit="step",
                dynamic_ncols=True,
                leave=True,
            )

    def update(self, step: int, loss: float, tokens_per_s: float, step_time: float) -> None:
        """Advance to ``step`` and show the latest figures."""
        if self._bar is not None:
            self._bar.set_postfix(
                loss=f"{loss:.4f}",
                tok_s=f"{tokens_per_s:,.0f}",
                step_s=f"{step_time:.3f}",
                refresh=False,
            )
            self._bar.update(step - self._bar.n)

    def note(self, text: str) -> None:
        """Print a line above the bar (nothing without a bar)."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)

    def warn(self, text: str) -> None:
        """Print a warning line on stderr, above the bar when there is one."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        """Finish the bar."""
        if self._bar is not None:
            self._bar.close()


def device_memory(trainer) -> dict[str, Any]:
    """Per-device memory of the step: the allocator's figures where the platform reports them
    (GPUs), else XLA's compiled estimate (arguments + outputs + temporaries − aliased)."""
    import jax

    out: dict[str, Any] = {}
    dev = trainer.mesh.devices.flat[0]
    stats = None
    try:
        stats = dev.memory_stats()
    except Exception:  # noqa: BLE001  (backends without allocator stats raise various errors)
        stats = None
    if stats:
        out["source"] = "memory_stats"
        out["bytes_in_use"] = stats.get("bytes_in_use")
        out["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    ma = trainer.compile_step().memory_analysis()
    if ma is not None:
        est = (
            ma.argument_size_in_bytes
            + ma.output_size_in_bytes
            + ma.temp_size_in_bytes
            - ma.alias_size_in_bytes
        )
        out.setdefault("source", "compiled_estimate")
        out.update(
            {
                "argument_bytes": ma.argument_size_in_bytes,
                "output_bytes": ma.output_size_in_bytes,
                "temp_bytes": ma.temp_size_in_bytes,
                "alias_bytes": ma.alias_size_in_bytes,
                "estimate_bytes": est,
            }
        )
    out["platform"] = jax.devices()[0].platform
    return out
