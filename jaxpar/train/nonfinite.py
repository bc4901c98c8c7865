"""Bad numbers: the divergence budget, and what names a non-finite step.

- :class:`Divergence` counts non-finite and blown-up steps against ``train.max_skipped_steps``.
- :func:`nonfinite_leaves` / :func:`write_nonfinite_report` name what went non-finite.
- :func:`inject_nonfinite` is the test hook behind ``train.inject_nonfinite_step``.

The step itself skips a non-finite update (:class:`jaxpar.train.step.Trainer`); the loop's side
of the policy is :class:`jaxpar.train.hooks.DivergenceHook`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.lock import write_atomic
from jaxpar.report import _clean


class Divergence:
    """The divergence budget of a run (``train.max_skipped_steps``).

    A step *counts* when its loss or gradient is non-finite (the step itself then keeps the
    previous state: the update is skipped), or when its loss is finite but above
    ``factor`` x the run's first loss (a blow-up: the weights have grown without overflowing,
    e.g. ``lr=1e9``; that update was applied). A loss twice the untrained model's is worse
    than the model has ever been and does not come back by itself. Counts and the first loss
    are kept in checkpoints, so a resumed run continues the same budget.
    """

    def __init__(self, budget: int, factor: float, first_loss: float | None = None,
                 counted: int = 0) -> None:  # fmt: skip
        self.budget, self.factor = budget, factor
        self.first_loss, self.counted = first_loss, counted
        self.first_step: int | None = None

    def check(self, step: int, loss: float, finite: bool) -> str | None:
        """Why ``step`` counts against the budget (one phrase), or None."""
        why = None
        if not finite:
            why = "non-finite loss or gradient; update skipped"
        elif self.first_loss is None:
            self.first_loss = loss
        elif self.factor and loss > self.factor * self.first_loss:
            why = (
                f"loss {loss:.4g} above {self.factor:g}x the first loss {self.first_loss:.4g} "
                "(diverging; this update was applied)"
            )
        if why is not None:
            self.counted += 1
            self.first_step = self.first_step or step
        return why

    @property
    def exceeded(self) -> bool:
        """More steps counted than the budget allows."""
        return self.counted > self.budget

    def note(self) -> str:
        """``k of K allowed`` for the warning line."""
        return f"{self.counted} counted, --max-skipped-steps {self.budget}"


def _leaf_name(keypath: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)


def nonfinite_leaves(finite_tree: Any) -> list[str]:
    """Paths (``layers/attn/wq``) of the leaves whose flag in ``finite_tree`` is False."""
    return [_leaf_name(path) for path, ok in jax.tree.leaves_with_path(finite_tree) if not bool(ok)]


def write_nonfinite_report(path: str | Path, record: dict[str, Any]) -> Path:
    """Write the diagnostic of a non-finite step (JSON, atomically: a temporary name of this
    run, renamed) and return its path. It lands beside the run's locked outputs."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(p, (json.dumps(_clean(record), indent=2) + "\n").encode())  # NaN: null


def inject_nonfinite(grads: Any, poison: jax.Array) -> Any:
    """Test hook: where ``poison`` is true, the first gradient leaf (``embed/table``) is NaN.

    Used by ``train.inject_nonfinite_step`` to exercise the non-finite policies without
    contriving a diverging run; costs one select when enabled, nothing when not.
    """
    leaves, treedef = jax.tree.flatten(grads)
    leaves[0] = jnp.where(poison, jnp.full_like(leaves[0], jnp.nan), leaves[0])
    return jax.tree.unflatten(treedef, leaves)


def write_stop_report(cfg: Any, m: Any, last_checkpoint: int | None, div: Divergence) -> Path:
    """The diagnostic of the step ``m`` (:class:`~jaxpar.train.core.StepMetrics`) that stopped
    the run, next to the checkpoints (or the metrics file, or in the cwd)."""
    t = cfg.train
    base = t.checkpoint_dir or (str(Path(t.metrics_file).parent) if t.metrics_file else ".")
    record = {
        "step": m.step,
        "loss": m.loss,
        "grad_norm": m.grad_norm,
        "lr": m.lr,
        "nonfinite_leaves": m.nonfinite_leaves or [],
        "why": m.diverged,
        "loss_finite": math.isfinite(m.loss),
        "grad_norm_finite": math.isfinite(m.grad_norm),
        "policy": t.on_nonfinite,
        "diverged_steps": div.counted,
        "first_diverged_step": div.first_step,
        "max_skipped_steps": t.max_skipped_steps,
        "first_loss": div.first_loss,
        "last_checkpoint_step": last_checkpoint,
        "note": (
            "the loss of step N is that of the weights after step N-1, so checkpoints before "
            "step first_diverged_step - 1 predate the divergence; "
            + ("this step's update was applied" if m.finite else "this update was not applied")
            + " and its state was not checkpointed"
        ),
    }
    return write_nonfinite_report(Path(base) / f"nonfinite-step{m.step}.json", record)
