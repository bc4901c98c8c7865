"""A run's checkpoints: the directory it resumes from, the hook that saves, the final export.

:class:`CheckpointHook` saves on its cadence (``train.checkpoint_every``), after the last step
and after a preemption, through :class:`Saver`: a checkpointer whose ``save`` may return before
the write is final (once the device arrays are copied) and which then has ``wait()``; the
synchronous :class:`~jaxpar.checkpoint.Checkpointer` has none, and :class:`Saver` calls it only
where it exists, so the loop works with either.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Any

from jaxpar import config as C
from jaxpar.checkpoint import Checkpointer, CheckpointWarning
from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.train.core import Hook, LoopContext, StepMetrics
from jaxpar.train.nonfinite import Divergence


class Saver:
    """``save`` / ``wait`` / ``close`` over a checkpointer, asynchronous or not."""

    def __init__(self, checkpointer: Any) -> None:
        self.checkpointer = checkpointer

    def due(self, step: int) -> bool:
        """Whether a periodic save is due at ``step``."""
        return self.checkpointer.due(step)

    def save(self, step: int, state: Any, meta: dict[str, Any], force: bool = False) -> bool:
        """Start (or make) the save of ``state`` at ``step``; the arrays may be reused after."""
        return bool(self.checkpointer.save(step, state, meta, force=force))

    def wait(self) -> None:
        """Block until the save in flight is final (nothing to wait for when synchronous)."""
        wait = getattr(self.checkpointer, "wait", None)
        if callable(wait):
            wait()

    def close(self) -> None:
        """Wait for the save in flight, then release the checkpointer."""
        try:
            self.wait()
        finally:
            self.checkpointer.close()


def checkpoint_meta(cfg: C.RunConfig, step: int, div: Divergence, tokenizer: dict | None) -> dict:
    """The JSON record saved beside the state of ``step``."""
    t = cfg.train
    return {
        "step": step,
        # the divergence budget continues across resumes
        "first_loss": div.first_loss,
        "diverged_steps": div.counted,
        # Batches are a pure function of (seed, step): the step is the whole data position.
        "data_position": step,
        "model": dataclasses.asdict(cfg.model),
        "layout": dataclasses.asdict(cfg.layout),
        "seed": t.seed,
        "data": {"source": t.data, "global_batch": t.global_batch, "seq_len": t.seq_len},
        # What `jaxpar generate` decodes this model's tokens with.
        "tokenizer": tokenizer,
    }


class CheckpointHook(Hook):
    """Saves the state after a step: every ``checkpoint_every`` steps, after the last step, and
    after the step a preemption stops at (then waits until that save is final). No periodic
    save of a diverged step: a run that keeps skipping must not rotate its healthy checkpoints
    out (the final and the preemption checkpoints are written: they keep the data position)."""

    needs_state = True

    def __init__(self, saver: Saver, div: Divergence) -> None:
        self.saver, self.div = saver, div

    def due(self, ctx: LoopContext, step: int) -> bool:
        return ctx.preempted is not None or step == ctx.total or self.saver.due(step)

    def on_step(self, ctx: LoopContext, m: StepMetrics) -> None:
        force = m.step == ctx.total or ctx.preempted is not None
        if m.diverged and not force:
            return
        # Checkpoints hold the canonical form, whatever the layout's form at rest.
        canonical = ctx.trainer.convert(ctx.state, "canonical")
        meta = checkpoint_meta(ctx.cfg, m.step, self.div, ctx.batches.corpus.tokenizer)
        if self.saver.save(m.step, canonical, meta, force=force):
            ctx.checkpointed = m.step
        if ctx.preempted is not None:
            self.saver.wait()  # final before the run says where to resume from

    def close(self) -> None:
        self.saver.close()


class ExportHook(Hook):
    """``train.export_hf``: the final weights as a Hugging Face directory. Due every step: the
    exported state must be that of the step the run ended at, never of a dropped step run
    ahead, so a run with an export reads every step at once."""

    needs_state = True

    def __init__(self, path: str) -> None:
        self.path = path

    def due(self, ctx: LoopContext, step: int) -> bool:
        return True

    def on_end(self, ctx: LoopContext) -> None:
        from jaxpar.model import hf

        params = ctx.trainer.convert(ctx.state["params"], "canonical")
        hf.export(params, ctx.cfg.model, self.path)


def open_checkpoints(cfg: C.RunConfig) -> tuple[Checkpointer | None, int | None]:
    """The checkpointer and the step to resume from (None: start fresh); refuses to
    overwrite, and to resume without a complete checkpoint unless ``resume_or_start``."""
    t = cfg.train
    want_resume = t.resume or t.resume_or_start
    if not t.checkpoint_dir:
        if want_resume:  # named by the flag given (--resume or --resume-or-start)
            given = "train.resume" if t.resume else "train.resume_or_start"
            raise ConfigError(f"{given}=True: needs train.checkpoint_dir (--checkpoint-dir)")
        return None, None
    ckpt = Checkpointer(t.checkpoint_dir, keep=t.keep_checkpoints, every=t.checkpoint_every)
    existing = ckpt.all_steps()
    if not want_resume:
        if existing:
            raise CheckpointError(
                f"train.checkpoint_dir={t.checkpoint_dir!r}: already holds checkpoints up to "
                f"step {existing[-1]}; pass --resume to continue, or choose another directory "
                "(nothing was overwritten)"
            )
        return ckpt, None
    latest = ckpt.latest_valid_step()  # warns about and sets aside newer broken ones
    if latest is None:
        if t.resume_or_start:
            print(
                f"jaxpar: no complete checkpoint in {t.checkpoint_dir!r}; starting fresh",
                file=sys.stderr,
            )
            return ckpt, None
        raise CheckpointError(
            f"train.resume=True: no complete checkpoint in {t.checkpoint_dir!r}; pass "
            "--resume-or-start to start fresh there, or drop --resume"
        )
    if latest >= t.steps:
        raise ConfigError(f"train.steps={t.steps}: the checkpoint is already at step {latest}")
    return ckpt, latest


def warn_data_changes(meta: dict[str, Any], cfg: C.RunConfig) -> None:
    """A resume with another seed or batch shape continues, but not bitwise like the original."""
    t = cfg.train
    saved = {"seed": meta.get("seed"), **meta.get("data", {})}
    mine = {"seed": t.seed, "source": t.data, "global_batch": t.global_batch, "seq_len": t.seq_len}
    for k, v in mine.items():
        if saved.get(k) is not None and saved[k] != v:
            warnings.warn(
                f"resuming with {k}={v!r} but the checkpoint was written with {k}={saved[k]!r}: "
                "the data order differs from the original run",
                CheckpointWarning,
                stacklevel=3,
            )


def _record_or_none(ckpt: Checkpointer, step: int) -> dict[str, Any] | None:
    """The checkpoint's JSON record, None where it has none that reads."""
    try:
        return ckpt.read_meta(step)
    except Exception:  # noqa: BLE001  (not a jaxpar record: the caller's error stands)
        return None


def check_fp8_history(meta: dict[str, Any] | None, fp8: str, where: str) -> None:
    """Refuse weights whose FP8 amax histories (``layout.fp8='delayed'``: leaves of the
    parameter tree) do not match the run's recipe, in one line naming both; ``meta``: the
    checkpoint's record (None: weights without one, e.g. a Hugging Face directory)."""
    saved = (meta or {}).get("layout", {}).get("fp8", "none")
    if (saved == "delayed") == (fp8 == "delayed"):
        return
    if fp8 == "delayed":
        raise ConfigError(
            f"layout.fp8='delayed': {where} has no FP8 amax history (written with "
            f"layout.fp8={saved!r}); continue with --fp8 {saved}, or start delayed scaling in a "
            "new --checkpoint-dir"
        )
    raise ConfigError(
        f"layout.fp8={fp8!r}: {where} was written with layout.fp8='delayed' (its amax "
        "histories are in the parameter tree); continue with --fp8 delayed, or start another "
        "recipe in a new --checkpoint-dir"
    )


def restore(trainer: Any, ckpt: Checkpointer, step: int, cfg: C.RunConfig):
    """The state at ``step`` in this run's shardings (whatever layout wrote it), its record and
    the step to continue from; refuses another model shape first, naming the difference."""
    from jaxpar.checkpoint import check_model_matches

    abstract = trainer.canonical_abstract_state()  # what checkpoints hold
    try:
        ckpt.check_shapes(step, abstract)  # names the parameter and both shapes
    except CheckpointError:
        # a delayed FP8 recipe's histories on one side only: say that, not a missing leaf
        if (saved := _record_or_none(ckpt, step)) is not None:
            check_fp8_history(saved, cfg.layout.fp8, f"checkpoint step {step} in {ckpt.directory}")
        raise
    meta = ckpt.read_meta(step)
    check_model_matches(meta, cfg.model)
    warn_data_changes(meta, cfg)
    # Read straight into this run's shardings, whatever layout wrote the checkpoint.
    state, meta = ckpt.restore(step, abstract)
    return trainer.convert(state, "rest"), meta, int(meta.get("data_position", step))
