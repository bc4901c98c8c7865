"""How often each branch of the executor's switches runs, and how the compiled program says so.

A pipeline tick runs one branch of each ``lax.switch``/``lax.cond`` per rank (idle, ``F``,
``B``, ``I``, ``W``, ``FB``; embed or not; a send's pair set or none). XLA compiles every
branch, so an analysis of the compiled program that counts each branch's collectives and
copies once per loop trip overstates them. :class:`BranchWeights` is computed once from the
tick table, beside the program (:class:`jaxpar.pipeline.step_tables.StepTables`); the executor
opens each switch under a named scope made by :func:`branch_scope`, which reaches the compiled
HLO as the conditional's ``op_name`` metadata; :func:`parse_branch_scope` reads it back
(:func:`jaxpar.analysis.hlo_text.execution_counts` counts branch ``i`` ``trips × weights[i]``
times).

Every weight is the share of the conditional's executions, averaged over devices and ticks,
that take that branch (a ``cond``: ``[false, true]``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.pipeline.tables import B_FULL, B_INPUT, F_FB, F_RUN, TickTable

SCOPE_PREFIX = "jaxpar_branches"
_SCOPE = re.compile(SCOPE_PREFIX + r"\[([0-9.e,+\-]*)\]/[\w.\-]*$")
FB_BRANCH = 4  # the backward switch's branch for a forward-phase FB (after idle, B, I, W)


def branch_scope(weights: Sequence[float]) -> str:
    """The ``jax.named_scope`` name stating ``weights`` for the conditional directly inside."""
    return SCOPE_PREFIX + "[" + ",".join(f"{float(w):.6g}" for w in weights) + "]"


def switch(index, branches, weights: Sequence[float], *args):
    """``lax.switch`` under the scope stating ``weights``."""
    with jax.named_scope(branch_scope(weights)):
        return jax.lax.switch(index, branches, *args)


def cond(pred, true_fn, false_fn, weights: tuple[float, float], *args):
    """``lax.cond`` under the scope stating ``weights`` (``[false, true]``)."""
    with jax.named_scope(branch_scope(weights)):
        return jax.lax.cond(pred, true_fn, false_fn, *args)


def when(pred, skip_fn, run_fn, weights: tuple[float, float], *args):
    """``run_fn(*args)`` where ``pred``, else ``skip_fn(*args)``: the conditional a gradient
    accumulator passes through, ``skip_fn`` handing it back untouched and ``run_fn`` adding to
    it in place, under the scope stating ``weights`` (``[skip, run]``).

    Its form is what keeps XLA from copying the accumulator. In a scan over ticks (jax 0.10.2,
    XLA:CPU and XLA:GPU alike) a buffer untouched in branch 0 of a two-branch switch on an
    integer index and written in branch 1 (there, or in a switch of this form nested in it) was
    not copied; written in branch 0 and passed through in branch 1 — what a ``lax.cond`` on a
    predicate becomes on XLA:GPU, which orders its true branch first — or passed through a
    third branch, or written in two, it was copied in every branch and again at the loop's end
    (XLA's copy insertion orders a conditional's branches by index). Each call site its own
    ``skip_fn``: one computation shared by two conditionals was cloned, and copied, on
    XLA:GPU. ``tests/test_pipeline_grads.py`` checks the tick has no such copy."""
    with jax.named_scope(branch_scope(weights)):
        return jax.lax.switch(jnp.asarray(pred).astype(jnp.int32), [skip_fn, run_fn], *args)


def parse_branch_scope(op_name: str) -> list[float] | None:
    """The weights :func:`branch_scope` put at the end of ``op_name``, or None."""
    found = _SCOPE.search(op_name)
    return [float(w) for w in found.group(1).split(",") if w] if found else None


def _share(values: np.ndarray, among: np.ndarray, value: int) -> float:
    """Share of ``values[among]`` equal to ``value`` (0 when ``among`` is empty)."""
    picked = values[among]
    return float(np.sum(picked == value)) / max(picked.size, 1)


def _cond(p_true: float) -> tuple[float, float]:
    return (1.0 - p_true, p_true)


@dataclass(frozen=True)
class BranchWeights:
    """The weights of every conditional of one tick (module docstring)."""

    forward: tuple[float, float]  # the forward phase: idle or F
    embed: tuple[float, float]  # inside F: stage 0 embeds its tokens, or not
    head: tuple[float, float]  # inside F: the last stage's head and loss, or not
    backward: tuple[float, ...]  # share of each backward kind: idle, B, I, W, FB
    embed_grad: tuple[float, float]  # after the backward: stage 0's B or I adds the embedding's
    sends: tuple[tuple[float, ...], ...]  # per send route: no send, then each pair set

    @staticmethod
    def of(table: TickTable, last_stage: int, send_index: Sequence[np.ndarray]) -> BranchWeights:
        """From the table, the last stage's index and each send route's per-tick index."""
        is_f = table.f_kind == F_RUN
        kind = np.where(table.f_kind == F_FB, FB_BRANCH, table.b_kind)
        is_bi = (kind == B_FULL) | (kind == B_INPUT)
        return BranchWeights(
            forward=_cond(float(np.mean(is_f))),
            embed=_cond(_share(table.f_stage, is_f, 0)),
            head=_cond(_share(table.f_stage, is_f, last_stage)),
            backward=tuple(float(np.mean(kind == k)) for k in range(FB_BRANCH + 1)),
            embed_grad=_cond(float(np.mean(is_bi & (table.b_stage == 0)))),
            sends=tuple(
                tuple(float(np.mean(idx == k)) for k in range(int(idx.max()) + 1))
                for idx in send_index
            ),
        )

    def split(self, skip: Sequence[int], run: Sequence[int]) -> tuple[float, float]:
        """Weights of a conditional the backward kinds ``skip`` and ``run`` reach (``[skip,
        run]``): each side's share of the ticks that reach it."""
        a, b = (sum(self.backward[k] for k in ks) for ks in (skip, run))
        return (a / (a + b), b / (a + b)) if a + b > 0 else (0.5, 0.5)
