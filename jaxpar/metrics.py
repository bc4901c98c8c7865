"""Run bookkeeping: JSONL metrics (appended, never rewritten), a progress bar, device memory."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from jaxpar.report import _clean


class MetricsLog:
    """Append-only JSONL file of step records; a no-op without a path.

    Only process 0 writes, so a multi-host run keeps one file.
    """

    def __init__(self, path: str | None):
        import jax

        self._f = None
        if path and jax.process_index() == 0:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._f = open(path, "a", buffering=1)  # line-buffered: a crash loses at most a line
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
        """Print a line above the bar."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)

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
