"""Run bookkeeping: JSONL metrics (appended; cut back to the restored step on resume), a
progress bar, device memory."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.report import _clean


class MetricsLog:
    """JSONL file of step records, appended line by line; a no-op without a path.

    ``keep_until``: the step this run starts from when it continues the file's run (a
    resume): records of later steps — written by an earlier attempt after the checkpoint it
    is resuming from, e.g. before a SIGKILL — are dropped first (:func:`truncate_after`), so
    every step appears once and in order. Only process 0 writes, so a multi-host run keeps one
    file. :attr:`dropped` is how many records were dropped.
    """

    def __init__(self, path: str | None, keep_until: int | None = None):
        import jax

        self._f = None
        self.dropped = 0
        if path and jax.process_index() == 0:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                if keep_until is not None:
                    self.dropped = truncate_after(path, keep_until)
                # line-buffered: a crash loses at most a line
                self._f = open(path, "a", buffering=1)
            except OSError as e:
                raise ConfigError(
                    f"train.metrics_file={path!r}: cannot write: {e.strerror or e}"
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


def truncate_after(path: str | Path, step: int) -> int:
    """Drop the records of ``path`` after ``step`` (and lines cut by a crash), atomically: the
    kept records go to a temporary file that replaces the original (fsync, rename), so a crash
    during the cut leaves either file whole. Returns the number of lines dropped."""
    p = Path(path)
    if not p.exists():
        return 0
    kept, dropped = [], 0
    for line in p.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
            ok = isinstance(rec, dict) and int(rec.get("step", 0)) <= step
        except (ValueError, TypeError):
            ok = False
        if ok:
            kept.append(line)
        else:
            dropped += line.strip() != ""
    if dropped:
        tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in kept))
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
