"""Orbax checkpoints of the train state, restorable onto any layout.

A checkpoint holds the state tree (params, optimizer state, step) and a JSON record (model
shape, layout, data position). Restoring takes an abstract state whose leaves carry the *target*
shardings, so a checkpoint written under one layout is read directly into another.

Orbax writes each step into a temporary directory and renames it when complete, so an
interrupted save never replaces a finished one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from jaxpar.config import ModelConfig
from jaxpar.errors import CheckpointError


class Checkpointer:
    """Save every ``every`` steps, keep the newest ``keep``; restore the newest."""

    def __init__(self, directory: str | Path, keep: int = 3, every: int = 50):
        self.directory = Path(directory).absolute()
        self.every = every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False
        )
        try:
            self._mgr = ocp.CheckpointManager(self.directory, options=options)
        except OSError as e:
            raise CheckpointError(f"checkpoint_dir={str(self.directory)!r}: {e}") from None

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints present, oldest first."""
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> int | None:
        """Newest complete checkpoint, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, meta: dict[str, Any], force: bool = False) -> bool:
        """Write ``state`` at ``step`` (when due, or always with ``force``)."""
        if not force and step % self.every:
            return False
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        try:
            saved = self._mgr.save(step, args=args, force=force)
            self._mgr.wait_until_finished()
        except OSError as e:
            raise CheckpointError(
                f"checkpoint_dir={str(self.directory)!r}: save failed: {e}"
            ) from None
        return bool(saved)

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON record of a checkpoint."""
        out = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """Read a checkpoint into the shardings carried by ``abstract_state``."""
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
        )
        out = self._mgr.restore(step, args=args)
        return out["state"], dict(out["meta"])

    def close(self) -> None:
        """Finish pending writes and release the manager."""
        self._mgr.close()


def check_model_matches(meta: dict[str, Any], model: ModelConfig) -> None:
    """Refuse a checkpoint written for another model shape, naming the first difference."""
    saved = meta.get("model", {})
    shape_fields = (
        "n_layers",
        "d_model",
        "n_heads",
        "n_kv_heads",
        "d_ff",
        "vocab_size",
        "head_dim",
        "mlp",
        "tied_embeddings",
    )
    mine = dataclasses.asdict(model)
    for f in shape_fields:
        if f in saved and saved[f] != mine[f]:
            raise CheckpointError(
                f"checkpoint model.{f}={saved[f]!r} does not match the configured "
                f"model.{f}={mine[f]!r}; use another --checkpoint-dir or the matching --model"
            )
