"""What one virtual stage computes in each pipeline action, and what it keeps in between.

The executor runs a stage's forward in one tick and its backward (``B``, or ``I`` then ``W``)
in a later one. Between the two, what the backward needs lives in fixed slot buffers
(:mod:`jaxpar.pipeline.tables`): one buffer per leaf with a leading ``[slots]`` axis. A
:class:`Stage` says which leaves those are, probed once per trace.

Every action is a scan over the chunk's layers that reads each layer's parameters straight from
the rank's ``[v, Lc, ...]`` stack (:class:`Chunk`: one dynamic slice per layer, fused into its
first use). A chunk sliced out whole before its scan was a copy of the chunk's fp32 weights
per forward and per backward (XLA:GPU, llama2-70b, dp 2 × tp 8 × pp 4 interleaved: 0.57 s of a
11.1 s step). So the forward takes each layer's VJP in the scan, and every backward piece is a
reverse scan that rebuilds one layer's pullback at a time:

* **residual mode** (``remat`` none/selective): the leaves of each layer's
  ``jax.vjp(layer, params, x)`` pullback, stacked ``[Lc, ...]`` by the forward's scan — the
  residuals; the layer's own parameters among them are recognised by identity and left out
  (the backward puts the layer's current parameters back), and constants (values the trace
  made, not computed from the layer's inputs) are kept once, not per layer. Each layer runs
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
# What a backward piece does with one layer's parameter gradient: ``sink(acc, i, d_layer,
# computed) -> (acc, rest)``, ``computed`` saying per parameter leaf whether the piece computed
# its gradient (the others are zeros); ``acc`` is the caller's, carried through the layer scan
# (the executor's accumulators: added to in place, layer by layer), ``rest`` a list of leaves
# the scan stacks ``[Lc, ...]`` and returns.
GradSink = Callable[[Any, jax.Array, Any, tuple[bool, ...]], tuple[Any, Leaves]]

_STASH, _CONST = -1, -2  # a pullback leaf's kind besides a parameter's position


def _shapes(leaves: Leaves) -> tuple[jax.ShapeDtypeStruct, ...]:
    return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaves)


def _stacked(n: int, shapes) -> tuple[jax.ShapeDtypeStruct, ...]:
    return tuple(jax.ShapeDtypeStruct((n, *s.shape), s.dtype) for s in shapes)


class Chunk:
    """Local chunk ``c`` of a rank's ``[v, Lc, ...]`` layer stack, read one layer at a time
    (:meth:`layer`: a dynamic slice of the stack, fused into the layer's first use of it): the
    chunk is never sliced out whole. ``c`` a Python int (one chunk per rank) or a traced
    index."""

    def __init__(self, local: Any, c: jax.Array | int):
        self.local, self.c = local, c
        self.n_layers = jax.tree.leaves(local)[0].shape[1]

    def layer(self, i: jax.Array | int) -> Any:
        """Layer ``i``'s parameters."""

        def one(a):
            start = (self.c, i) + (0,) * (a.ndim - 2)
            return jax.lax.dynamic_slice(a, start, (1, 1, *a.shape[2:])).reshape(a.shape[2:])

        return jax.tree.map(one, self.local)

    @staticmethod
    def layer_shapes(local: Any) -> Any:
        """The shapes of one layer's parameters of a ``[v, Lc, ...]`` stack."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), local)


@dataclass(frozen=True)
class StagePieces:
    """How the layout computes one layer of a stage."""

    layer: LayerFn  # (layer params, x) -> y, the layout's hooks applied (ZeRO-3 gather)
    policy: Any  # jax.checkpoint policy of a layer (never keeps weights); None: no checkpoint
    recompute: bool  # stash each layer's input; the backward re-runs each layer's forward
    split: bool  # zero-bubble: I and W; the forward keeps the weight matmuls' taps


class Stage:
    """The actions of one virtual stage (a chunk of ``Lc`` stacked layers); see the module
    docstring. Built once per trace from the rank's ``[v, Lc, ...]`` layer stack (arrays or
    shapes) and an input of the message shape."""

    def __init__(self, pieces: StagePieces, local: Any, x: jax.Array):
        self.p = pieces
        self.n_layers = lc = jax.tree.leaves(local)[0].shape[1]
        layer0 = Chunk.layer_shapes(local)
        n_params = len(jax.tree.leaves(layer0))
        self.split = SplitLayer(pieces.layer, layer0, x) if pieces.split else None
        self.all_leaves = (True,) * n_params
        # Which parameter leaves each backward piece computes a gradient of.
        split = self.split
        self.i_leaves = tuple(split.input_grad_mask) if split else self.all_leaves
        self.w_leaves = tuple(split.weight_grad_mask) if split else self.all_leaves
        self.stash_shapes: tuple[jax.ShapeDtypeStruct, ...] = _stacked(lc, [x])  # layer inputs
        self.taps_shapes: tuple[jax.ShapeDtypeStruct, ...] = ()
        self.wpend_shapes: tuple[jax.ShapeDtypeStruct, ...] = ()
        self._treedef, self._kinds, self._consts = None, (), {}
        if self.split:
            taps = _stacked(lc, self.split.tap_shapes)
            dys = _stacked(lc, self.split.probe_shapes)
            self.wpend_shapes = dys + (taps if pieces.recompute else ())
            self.taps_shapes = () if pieces.recompute else taps
        if not pieces.recompute:

            def residuals(lp, h):
                _, pb, _, _ = self._layer_vjp(lp, h)
                return self._stash_of(lp, pb)

            self.stash_shapes = _stacked(lc, _shapes(jax.eval_shape(residuals, layer0, x)))
        # The layers' statistics [Lc, ...] (a MoE stage's expert load); None for a stage that
        # reports none.
        stats = jax.eval_shape(lambda lp, h: pieces.layer(lp, h)[1], layer0, x)
        stats = jax.tree.map(lambda s: jax.ShapeDtypeStruct((lc, *s.shape), s.dtype), stats)
        self.stats_shapes: Any = stats if jax.tree.leaves(stats) else None

    # ---- one layer ---------------------------------------------------------------------------

    def _layer(self, fn: Callable) -> Callable:
        if self.p.policy is None:
            return fn
        return jax.checkpoint(fn, prevent_cse=False, policy=self.p.policy)

    def _probed_layer(self, lp: Any, x: jax.Array, probes: Leaves):
        """One layer's probed form: ``(y, (taps, stats))``, its VJP's output and auxiliaries."""
        y, taps, stats = self.split.forward(lp, x, probes)
        return y, (taps, stats)

    def _probes(self) -> Leaves:
        return [jnp.zeros(s.shape, s.dtype) for s in self.split.probe_shapes]

    def _layer_vjp(self, lp: Any, x: jax.Array):
        """``(y, pullback, taps, stats)`` of one layer; the pullback maps ``g`` to ``(d lp,
        dx[, dys])`` (split: each weight dot's output cotangent; the statistics take none)."""
        if self.split is None:
            y, pb, stats = jax.vjp(self._layer(self.p.layer), lp, x, has_aux=True)
            return y, pb, [], stats
        y, pb, (taps, stats) = jax.vjp(self._layer(self._probed_layer), lp, x, self._probes(),
                                       has_aux=True)  # fmt: skip
        return y, pb, list(taps), stats

    def _stash_of(self, lp: Any, pb: Any) -> Leaves:
        """The leaves of one layer's pullback the stash keeps: not the layer's parameters
        (recognised by identity) and not constants (kept once, from the first trace)."""
        leaves, treedef = jax.tree_util.tree_flatten(pb)
        plist = jax.tree.leaves(lp)

        def kind(leaf):
            pos = next((k for k, q in enumerate(plist) if q is leaf), None)
            if pos is not None:
                return pos
            return _STASH if isinstance(leaf, jax.core.Tracer) else _CONST

        kinds = tuple(kind(leaf) for leaf in leaves)
        if self._treedef is None:
            self._treedef, self._kinds = treedef, kinds
            self._consts = {k: leaves[k] for k, t in enumerate(kinds) if t == _CONST}
        elif kinds != self._kinds:  # the treedef holds the trace's own linearized function
            raise RuntimeError("stage VJP structure changed between traces")
        return [leaf for leaf, t in zip(leaves, kinds, strict=True) if t == _STASH]

    def _pullback_of(self, lp: Any, stash: Leaves) -> Callable:
        """One layer's pullback from its stash slices and its current parameters."""
        plist, it = jax.tree.leaves(lp), iter(stash)
        leaves = [plist[t] if t >= 0 else self._consts[k] if t == _CONST else next(it)
                  for k, t in enumerate(self._kinds)]  # fmt: skip
        return jax.tree_util.tree_unflatten(self._treedef, leaves)

    # ---- the forward ---------------------------------------------------------------------------

    def apply(self, ch: Chunk, x: jax.Array) -> tuple[jax.Array, Any]:
        """The stage without a backward: its layers in a ``lax.scan``; the output and the
        layers' statistics stacked ``[Lc, ...]``."""
        layer = self._layer(self.p.layer)
        return jax.lax.scan(lambda h, i: layer(ch.layer(i), h), x, jnp.arange(ch.n_layers))

    def forward(self, ch: Chunk, x: jax.Array) -> tuple[jax.Array, Leaves, Leaves, Any]:
        """``F``: the stage output, the stash leaves, the taps (split, residual mode) and the
        layers' statistics."""
        if self.p.recompute:
            layer = self._layer(self.p.layer)

            def keep_input(h, i):
                y, stats = layer(ch.layer(i), h)
                return y, (h, stats)

            y, (inputs, stats) = jax.lax.scan(keep_input, x, jnp.arange(ch.n_layers))
            return y, [inputs], [], stats

        def body(h, i):
            lp = ch.layer(i)
            y, pb, taps, stats = self._layer_vjp(lp, h)
            return y, (self._stash_of(lp, pb), taps, stats)

        y, (stash, taps, stats) = jax.lax.scan(body, x, jnp.arange(ch.n_layers))
        return y, list(stash), list(taps), stats

    # ---- the backward pieces -----------------------------------------------------------------

    def _layer_pullback(self, lp: Any, kept: Leaves):
        """``(pullback, taps)`` of one layer from what the forward kept of it: its stash slices
        (residual mode), or its input, the layer re-run under its own VJP (recompute mode;
        split: its probed form, whose forward gives the taps)."""
        if not self.p.recompute:
            return self._pullback_of(lp, kept), []
        _, pb, taps, _ = self._layer_vjp(lp, kept[0])
        return pb, taps

    def _scan_back(self, ch: Chunk, body: Callable, carry: Any, xs: Any):
        """``body(carry, i, lp, xs_i)`` over the chunk's layers, last to first."""
        layers = jnp.arange(ch.n_layers)
        return jax.lax.scan(lambda c, z: body(c, z[0], ch.layer(z[0]), z[1]), carry,
                            (layers, xs), reverse=True)  # fmt: skip

    def backward(self, ch: Chunk, stash: Leaves, taps: Leaves, g: jax.Array, acc: Any,
                 sink: GradSink):  # fmt: skip
        """``B``: ``(acc, rest, dx)``, each layer's gradient given to ``sink``; with a split
        backward, ``I`` then ``W``."""
        if self.split is not None:
            acc, rest_i, dx, wpend = self.input_grads(ch, stash, g, acc, sink)
            acc, rest_w = self.weight_grads(ch, taps, wpend, acc, sink)
            return acc, [a + b for a, b in zip(rest_i, rest_w, strict=True)], dx

        def body(carry, i, lp, kept):
            g, acc = carry
            pb, _ = self._layer_pullback(lp, list(kept))
            d_lp, dx = pb(g)
            acc, rest = sink(acc, i, d_lp, self.all_leaves)
            return (dx, acc), rest

        (dx, acc), rest = self._scan_back(ch, body, (g, acc), list(stash))
        return acc, list(rest), dx

    def input_grads(self, ch: Chunk, stash: Leaves, g: jax.Array, acc: Any, sink: GradSink):
        """``I``: ``(acc, rest, dx, what W needs)``, the gradients of the parameters not reached
        through a weight dot given to ``sink``."""

        def body(carry, i, lp, kept):
            g, acc = carry
            pb, taps = self._layer_pullback(lp, list(kept))
            d_lp, dx, dys = pb(g)
            acc, rest = sink(acc, i, d_lp, self.i_leaves)
            return (dx, acc), (rest, list(dys), taps)  # recompute: W needs the taps too

        (dx, acc), (rest, dys, taps) = self._scan_back(ch, body, (g, acc), list(stash))
        return acc, list(rest), dx, list(dys) + list(taps)

    def weight_grads(self, ch: Chunk, taps: Leaves, wpend: Leaves, acc: Any, sink: GradSink):
        """``W``: ``(acc, rest)``, the weight dots' gradients from the taps and the dys ``I``
        filed, given to ``sink``."""
        n = len(self.split.dots)
        dys, taps = wpend[:n], (wpend[n:] if self.p.recompute else taps)

        def body(acc, i, lp, xs):
            tp, dy = xs
            d_lp = self.split.weight_grads(lp, list(tp), list(dy))
            return sink(acc, i, d_lp, self.w_leaves)

        acc, rest = self._scan_back(ch, body, acc, (list(taps), list(dys)))
        return acc, list(rest)
