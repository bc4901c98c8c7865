"""Output helpers shared by the subcommands: ``--json`` prints one JSON object as the last line."""

from __future__ import annotations

import json
import math
from typing import Any


def _clean(obj: Any) -> Any:
    """Make ``obj`` JSON-safe: numpy scalars to Python, non-finite floats to None."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 1) == 0:
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def emit_json(obj: dict[str, Any]) -> None:
    """Print ``obj`` as a single JSON line on stdout (the last line a ``--json`` run prints)."""
    print(json.dumps(_clean(obj), separators=(",", ":")), flush=True)


def human_bytes(n: float) -> str:
    """Format a byte count: 1.5 GiB, 12.0 MiB, ..."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
