"""One owner per output: the files a training run writes, locked for it and checked first.

A run writes its checkpoint directory, its metrics file (by default ``metrics.jsonl`` in the
checkpoint directory) and, with ``train.export_hf``, a Hugging Face directory. Before anything
compiles, :func:`lock_outputs` takes one lock per output (:mod:`jaxpar.lock`; process 0 takes
them and every process learns the outcome), so a second run is refused in one line naming the
holder whichever flag pointed it there; :func:`check_outputs` (also run by ``--dry-run``)
refuses outputs that are not this run's to write:

- a metrics file inside another run's checkpoint directory (it would add a second copy of
  steps to that run's records);
- a metrics file holding a line jaxpar did not write (a resume cuts the file back to its step,
  which would delete it): a ``#`` comment, another program's JSON, a record with a field
  jaxpar does not write (:data:`jaxpar.metrics.RECORDS`). Refused unless ``train.force``, which
  then replaces it whole. A record of jaxpar's cut by a crash is jaxpar's own;
- an export directory holding files jaxpar's export does not write: refused unless
  ``train.force``, which replaces the directory whole (:func:`jaxpar.model.hf.export`).
"""

from __future__ import annotations

from pathlib import Path

from jaxpar.config import RunConfig
from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.lock import _HELD, LOCK_NAME, RunLock, output_lock, write_atomic
from jaxpar.metrics import foreign_line, foreign_refusal

__all__ = ["check_outputs", "foreign_line", "is_checkpoint_dir", "lock_outputs", "metrics_field",
           "metrics_path"]  # fmt: skip

MANIFEST = "jaxpar_manifest.json"  # the checkpoint module's integrity record (no import: no JAX)


def metrics_path(cfg: RunConfig) -> str | None:
    """The metrics file of a run: ``train.metrics_file``, else the checkpoint dir's own."""
    t = cfg.train
    return t.metrics_file or (f"{t.checkpoint_dir}/metrics.jsonl" if t.checkpoint_dir else None)


def metrics_field(cfg: RunConfig) -> str:
    """The metrics file named by the flag that chose it: ``train.metrics_file=...``, or the
    checkpoint directory's own file (the user gave no metrics file)."""
    t = cfg.train
    if t.metrics_file:
        return f"train.metrics_file={t.metrics_file!r}"
    return f"train.checkpoint_dir={t.checkpoint_dir!r}: metrics.jsonl"


def is_checkpoint_dir(directory: Path) -> bool:
    """Whether ``directory`` is a jaxpar checkpoint directory (its lock, or a sealed step)."""
    try:
        if (directory / LOCK_NAME).exists():
            return True
        return any(
            p.is_dir() and (p / MANIFEST).exists() for p in directory.iterdir() if p.name.isdigit()
        )
    except OSError:
        return False


def check_outputs(cfg: RunConfig) -> None:
    """Refuse outputs that are not this run's to write (see the module docstring)."""
    t = cfg.train
    metrics = metrics_path(cfg)
    if metrics:
        m = Path(metrics).absolute()
        own = Path(t.checkpoint_dir).absolute() if t.checkpoint_dir else None
        if m.parent != own and is_checkpoint_dir(m.parent):
            raise ConfigError(
                f"train.metrics_file={t.metrics_file!r}: inside another run's checkpoint "
                f"directory {m.parent}; choose a file outside it"
            )
        bad = foreign_line(m) if m.is_file() else None
        if bad and not t.force:
            raise foreign_refusal(metrics_field(cfg), bad)
    if t.export_hf:
        from jaxpar.model.hf import check_export_target

        check_export_target(t.export_hf, t.force)


def lock_outputs(cfg: RunConfig) -> list[RunLock]:
    """Lock the checkpoint directory, the metrics file and the export directory for this run
    (process 0 takes the locks; every process learns whether it could), then
    :func:`check_outputs`; a metrics file of foreign lines is emptied under ``train.force``."""
    import jax

    from jaxpar.distributed import any_process

    t = cfg.train
    locks: list[RunLock] = []
    error: Exception | None = None
    before = set(_HELD)
    if jax.process_index() == 0:
        try:
            if t.checkpoint_dir:
                what = f"train.checkpoint_dir={t.checkpoint_dir!r}"
                d = Path(t.checkpoint_dir)
                try:
                    d.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise CheckpointError(f"{what}: not writable: {e.strerror or e}") from None
                locks.append(RunLock(d / LOCK_NAME, what).acquire())
            metrics = metrics_path(cfg)
            if metrics:
                locks.append(output_lock(metrics, metrics_field(cfg)))
            if t.export_hf:
                locks.append(output_lock(t.export_hf, f"train.export_hf={t.export_hf!r}"))
            check_outputs(cfg)
            if metrics and t.force and Path(metrics).is_file() and foreign_line(Path(metrics)):
                write_atomic(metrics, b"")  # replaced whole, never partly rewritten
        except (CheckpointError, ConfigError) as e:
            error = e
    if any_process(error is not None):
        for lock in _HELD - before:  # also one a signal kept from reaching `locks`
            lock.release()
        raise error or CheckpointError(
            "the outputs of this run are in use or not its own (process 0 says why)"
        )
    return locks
