"""What one virtual stage computes in each pipeline action, and what it keeps in between.

The executor runs a stage's forward in one tick and its backward (``B``, or ``I`` then ``W``)
in a later one. Between the two, what the backward needs lives in fixed slot buffers
(:mod:`jaxpar.pipeline.tables`): one buffer per leaf with a leading ``[slots]`` axis. A
:class:`Stage` says which leaves those are, probed once per trace:

* **residual mode** (``remat`` none/selective): the leaves of ``jax.vjp(stage, params, x)``'s
  pullback — a pytree holding the residuals (stacked over the chunk's layer scan) *and* the
  primal parameters, which are recognised by identity and left out, so a slot holds
  activations only; the backward puts the chunk's current parameters back. Each layer runs
  under a checkpoint policy that never keeps a weight (:mod:`jaxpar.train.remat`), so the
  stash holds no copy of cast or fused weights either.
* **recompute mode** (``remat full``): the slot holds each layer's input ``[Lc, ...]``; every
  backward piece runs the chunk's layers last to first, each re-running its own forward under
  ``jax.vjp`` from its input, so one layer's residuals exist at a time (as ``remat full``
  without a pipeline). Re-running the whole chunk under one VJP from the stage input held
  every layer's residuals of the chunk at once (XLA:GPU, Mixtral-8x7b's shape with 8 layers,
  pp 2 × dp 4 × ep 2, 1F1B, 8192-token micro-batches: 78.1 GiB of temporaries, 34.2 one
  layer at a time; XLA:CPU test model: ``tests/test_pipeline.py::test_recompute_holds_one_layers_
  residuals``).

Split backward (zero-bubble schedules, :mod:`jaxpar.pipeline.split`): the forward also keeps
each weight matmul's activation operand (the *taps*, a buffer of their own); ``I`` returns the
input cotangent and files each weight matmul's output cotangent (``dys``) for ``W``, which is
then the weight matmuls alone. A full ``B`` of such a schedule is ``I`` followed by ``W``.
Under recompute ``I`` re-runs the forward and files the taps with the ``dys``.

**The stage interface** (what a layer must satisfy to run inside a stage; a MoE layer too):

* :attr:`StagePieces.layer` is a pure function ``(layer params, x) -> (y, stats)`` of one
  layer with ``y`` shaped like ``x`` and fixed shapes (a capacity-padded MoE dispatch, not a
  data-dependent one): the stash buffers are sized once per trace from its VJP's residuals.
  The executor scans it over the chunk's ``[Lc, ...]`` layers and differentiates ``y`` with
  ``jax.vjp``. ``stats`` is what the layer reports (a MoE group's
  :class:`~jaxpar.model.moe.MoeStats`; ``()`` for a dense layer): the VJP's auxiliary output,
  never differentiated, summed per layer over the forwards of the step.
* Split schedules (``I``/``W``) defer only a layer's top-level ``dot_general`` weight matmuls to
  ``W`` (:mod:`jaxpar.pipeline.split`); anything else (a ``ragged_dot``, a nested ``jit``) keeps
  its weight gradient in ``I``: correct, only less deferred.
* It may run collectives over the automatic axes (tp, sp, an expert axis); ``pp`` and the dp
  axes are manual around it and belong to the executor and the reduction. In a fused tick the
  backward of one micro-batch and then the forward of another run on every rank, all of the
  backward's collectives issued before any of the forward's (the executor's barrier), so a
  layer's collectives meet in one order on every device: what DualPipeV-style ticks that
  overlap one micro-batch's forward with another's backward need.
* A loss term of its own (a MoE balancing loss) reaches the gradient inside the layer: its
  constant cotangent enters where the term is computed (:func:`jaxpar.model.moe.with_loss`),
  and its value is a statistic the caller adds to the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.pipeline.split import LayerFn, SplitLayer

Leaves = list[jax.Array]


def _shapes(leaves: Leaves) -> tuple[jax.ShapeDtypeStruct, ...]:
    return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaves)


def _first(tree: Any) -> Any:
    return jax.tree.map(lambda a: a[0], tree)


@dataclass(frozen=True)
class StagePieces:
    """How the layout computes one layer of a stage."""

    layer: LayerFn  # (layer params, x) -> y, the layout's hooks applied (ZeRO-3 gather)
    policy: Any  # jax.checkpoint policy of a layer (never keeps weights); None: no checkpoint
    recompute: bool  # stash each layer's input; the backward re-runs each layer's forward
    split: bool  # zero-bubble: I and W; the forward keeps the weight matmuls' taps


class Stage:
    """The actions of one virtual stage (a chunk of ``Lc`` stacked layers); see the module
    docstring. Built once per trace from a chunk's params and an input of the message shape."""

    def __init__(self, pieces: StagePieces, chunk: Any, x: jax.Array):
        self.p = pieces
        self.n_layers = jax.tree.leaves(chunk)[0].shape[0]
        self.split = SplitLayer(pieces.layer, _first(chunk), x) if pieces.split else None
        self.stash_shapes: tuple[jax.ShapeDtypeStruct, ...] = (
            jax.ShapeDtypeStruct((self.n_layers, *x.shape), x.dtype),  # recompute: layer inputs
        )
        self.taps_shapes: tuple[jax.ShapeDtypeStruct, ...] = ()
        self.wpend_shapes: tuple[jax.ShapeDtypeStruct, ...] = ()
        self._treedef, self._param_pos = None, ()
        if self.split:
            lc = self.n_layers
            stack = lambda ss: tuple(  # noqa: E731
                jax.ShapeDtypeStruct((lc, *s.shape), s.dtype) for s in ss
            )
            taps, dys = stack(self.split.tap_shapes), stack(self.split.probe_shapes)
            self.wpend_shapes = dys + (taps if pieces.recompute else ())
            self.taps_shapes = () if pieces.recompute else taps
        if not pieces.recompute:
            shapes = jax.eval_shape(lambda c, x: self._residual_leaves(c, x), chunk, x)
            self.stash_shapes = _shapes(shapes)
        # The layers' statistics [Lc, ...] (a MoE stage's expert load); None for a stage that
        # reports none.
        stats = jax.eval_shape(self.apply, chunk, x)[1]
        self.stats_shapes: Any = stats if jax.tree.leaves(stats) else None

    # ---- the stage function ------------------------------------------------------------------

    def _layer(self, fn: Callable) -> Callable:
        if self.p.policy is None:
            return fn
        return jax.checkpoint(fn, prevent_cse=False, policy=self.p.policy)

    def apply(self, chunk: Any, x: jax.Array) -> tuple[jax.Array, Any]:
        """The stage: its layers in a ``lax.scan``; the output and the layers' statistics
        stacked ``[Lc, ...]``."""
        layer = self._layer(self.p.layer)
        return jax.lax.scan(lambda h, lp: layer(lp, h), x, chunk)

    def probed(self, chunk: Any, x: jax.Array, probes: Leaves):
        """The stage with each weight dot probed (split mode): the output and, as the VJP's
        auxiliary output, the stacked taps and statistics."""
        layer = self._layer(self._probed_layer)
        return jax.lax.scan(lambda h, xs: layer(xs[0], h, xs[1]), x, (chunk, probes))

    def _probed_layer(self, lp: Any, x: jax.Array, probes: Leaves):
        """One layer's probed form: ``(y, (taps, stats))``, its VJP's output and auxiliaries."""
        y, taps, stats = self.split.forward(lp, x, probes)
        return y, (taps, stats)

    def _probes(self) -> Leaves:
        return [jnp.zeros((self.n_layers, *s.shape), s.dtype) for s in self.split.probe_shapes]

    def _vjp(self, chunk: Any, x: jax.Array):
        """``(y, pullback, taps, stats)``; the pullback maps ``g`` to ``(d chunk, dx[, dys])``
        (the statistics take no cotangent)."""
        if self.split is None:
            y, pb, stats = jax.vjp(self.apply, chunk, x, has_aux=True)
            return y, pb, [], stats
        y, pb, (taps, stats) = jax.vjp(self.probed, chunk, x, self._probes(), has_aux=True)
        return y, pb, taps, stats

    # ---- what the forward leaves behind ------------------------------------------------------

    def _residual_leaves(self, chunk: Any, x: jax.Array) -> Leaves:
        _, pb, _, _ = self._vjp(chunk, x)
        leaves, treedef = jax.tree_util.tree_flatten(pb)
        plist = jax.tree.leaves(chunk)
        pos = tuple(next((i for i, q in enumerate(plist) if q is leaf), -1) for leaf in leaves)
        if self._treedef is None:
            self._treedef, self._param_pos = treedef, pos
        elif pos != self._param_pos:
            raise RuntimeError("stage VJP structure changed between traces")
        return [leaf for leaf, i in zip(leaves, pos, strict=True) if i < 0]

    def forward(self, chunk: Any, x: jax.Array) -> tuple[jax.Array, Leaves, Leaves, Any]:
        """``F``: the stage output, the stash leaves, the taps (split, residual mode) and the
        layers' statistics."""
        if self.p.recompute:
            layer = self._layer(self.p.layer)

            def body(h, lp):
                y, stats = layer(lp, h)
                return y, (h, stats)

            y, (inputs, stats) = jax.lax.scan(body, x, chunk)
            return y, [inputs], [], stats
        y, pb, taps, stats = self._vjp(chunk, x)
        leaves = jax.tree.leaves(pb)
        if len(leaves) != len(self._param_pos):
            raise RuntimeError("stage VJP structure changed between traces")
        stash = [leaf for leaf, i in zip(leaves, self._param_pos, strict=True) if i < 0]
        return y, stash, list(taps), stats

    def _recompute_pullback(self, chunk: Any, inputs: jax.Array) -> Callable:
        """Recompute mode: ``g -> (d chunk, dx[, dys, taps])``, the layers last to first, each
        re-run under its own VJP from its input (split: its probed form, whose VJP also gives
        the weight dots' output cotangents and whose forward gives their taps)."""
        split = self.split

        def body(g, xs):
            lp, x = xs
            if split is None:
                _, pb, _ = jax.vjp(self._layer(self.p.layer), lp, x, has_aux=True)
                d_lp, dx = pb(g)
                return dx, d_lp
            probes = [jnp.zeros(s.shape, s.dtype) for s in split.probe_shapes]
            _, pb, (taps, _) = jax.vjp(self._layer(self._probed_layer), lp, x, probes,
                                       has_aux=True)  # fmt: skip
            d_lp, dx, dys = pb(g)
            return dx, (d_lp, dys, taps)

        def pullback(g):
            dx, out = jax.lax.scan(body, g, (chunk, inputs), reverse=True)
            return (out, dx) if split is None else (out[0], dx, out[1], out[2])

        return pullback

    def _pullback(self, chunk: Any, stash: Leaves):
        """``(pullback, taps)`` from the stash and the current parameters (residual mode)."""
        plist, it = jax.tree.leaves(chunk), iter(stash)
        leaves = [plist[i] if i >= 0 else next(it) for i in self._param_pos]
        return jax.tree_util.tree_unflatten(self._treedef, leaves), []

    # ---- the backward pieces -----------------------------------------------------------------

    def backward(self, chunk: Any, stash: Leaves, taps: Leaves, g: jax.Array):
        """``B``: ``(d chunk, dx)``; with a split backward, ``I`` then ``W``."""
        if self.split is None:
            if self.p.recompute:
                return self._recompute_pullback(chunk, stash[0])(g)
            pb, _ = self._pullback(chunk, stash)
            return pb(g)
        d_small, dx, wpend = self.input_grads(chunk, stash, g)
        d_dots = self.weight_grads(chunk, taps, wpend)
        return jax.tree.map(jnp.add, d_small, d_dots), dx

    def input_grads(self, chunk: Any, stash: Leaves, g: jax.Array):
        """``I``: ``(d chunk through no weight dot, dx, what W needs)``."""
        if self.p.recompute:  # W needs the taps too: filed beside the dys
            d_small, dx, dys, taps = self._recompute_pullback(chunk, stash[0])(g)
            return d_small, dx, list(dys) + list(taps)
        pb, taps = self._pullback(chunk, stash)
        d_small, dx, dys = pb(g)
        return d_small, dx, list(dys) + taps

    def weight_grads(self, chunk: Any, taps: Leaves, wpend: Leaves) -> Any:
        """``W``: the weight dots' gradients from the taps and the dys ``I`` filed."""
        n = len(self.split.dots)
        dys, taps = wpend[:n], (wpend[n:] if self.p.recompute else taps)

        def body(_, xs):
            lp, tp, dy = xs
            return None, self.split.weight_grads(lp, list(tp), list(dy))

        _, d = jax.lax.scan(body, None, (chunk, taps, dys))
        return d
