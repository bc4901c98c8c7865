"""Splitting a layer's backward into an input half (``I``) and a weight half (``W``).

Zero-bubble schedules run the input-gradient half of a backward early (it is on the critical
path) and the weight-gradient half later. A ``W`` that only holds the stage's pullback must
re-run the input-gradient chain to reach each weight matmul's output cotangent (measured:
W ≈ 2 F). Here ``I`` keeps what each weight matmul's gradient needs instead, and ``W`` is the
weight matmuls alone (≈ F):

* A **weight dot** is a ``dot_general`` of the layer (or a custom VJP around one, such as the
  model's column-parallel ``project``) whose one operand depends on the layer's input ``x``
  (the activation) and whose other does not (the weight, after the layout's casts, kv
  repeats, fused concatenations and ZeRO-3 gather). They are found once per trace from the
  layer's jaxpr by following which values depend on ``x``; the model code is not touched.
* :meth:`SplitLayer.forward` evaluates the layer's jaxpr with every weight dot rewritten as
  ``dot(a, stop_gradient(w)) + probe`` (``probe`` is a zero input of the dot's output shape)
  and also returns each dot's activation operand ``a`` (the *taps*). Its VJP with respect to
  ``(x, probes, params)`` is ``I``: the input cotangent, the cotangent of every weight dot's
  output (``d probe = dy``), and the gradients of the parameters not reached through a weight
  dot (norm scales); no weight matmul's gradient is computed, and ``a`` is not kept for it.
* :meth:`SplitLayer.weight_grads` is ``W``: the VJP of ``params -> [dot(a_i, w_i(params))]``
  at the ``dy_i`` — each weight matmul's ``aᵀ·dy`` and the transposes of the weight's path
  (ZeRO-3: the gather's reduce-scatter). ``I`` and ``W`` add up to the full gradient.

The layer is evaluated by a small jaxpr interpreter (each equation re-bound as traced, so
sharding constraints, ring attention's nested ``shard_map`` and ZeRO-3's collectives stay as
they are). A weight dot nested inside another primitive (a ``jit`` of its own, say) is not
rewritten: its weight gradient is then computed in ``I``, which stays correct and only moves
cost from ``W`` to ``I``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from jax.extend.core import Literal

# (layer params, x) -> (y, stats): ``stats`` a pytree of what the layer reports (a MoE
# layer's expert load; ``()`` for a dense one), never differentiated.
LayerFn = Callable[[Any, jax.Array], tuple[jax.Array, Any]]


@dataclass(frozen=True)
class _Dot:
    index: int  # equation index in the layer's jaxpr
    act: int  # which operand (0 or 1) is the activation


def _read(env: dict, v: Any) -> Any:
    return v.val if isinstance(v, Literal) else env[v]


def _bind(eqn: Any, invals: list) -> list:
    """Re-bind one equation as traced (jax 0.10 returns params, older JAX (subfuns, params))."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _is_dot(eqn: Any) -> bool:
    """A ``dot_general``, or a custom VJP around one dot of its two operands (jaxpar's
    ``project``, whose backward contracts in another order): linear in each operand, so its
    weight gradient at a kept activation is the same product either way."""
    if eqn.primitive.name == "dot_general":
        return True
    if eqn.primitive.name != "custom_vjp_call" or len(eqn.invars) != 2:
        return False
    inner = eqn.params.get("call_jaxpr")
    eqns = getattr(getattr(inner, "jaxpr", None), "eqns", ())
    return (len(eqns) == 1 and eqns[0].primitive.name == "dot_general"
            and list(eqns[0].invars) == list(inner.jaxpr.invars)
            and list(eqns[0].outvars) == list(inner.jaxpr.outvars))  # fmt: skip


class SplitLayer:
    """One layer function, traced once, with its weight dots located (module docstring)."""

    def __init__(self, fn: LayerFn, params: Any, x: jax.Array):
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, x))
        closed, out = jax.make_jaxpr(fn, return_shape=True)(*shapes)
        self.jaxpr, self.consts = closed.jaxpr, closed.consts
        self.out_tree = jax.tree.structure(out)  # (y, stats)
        self.param_tree = jax.tree.structure(params)
        n_params = self.param_tree.num_leaves
        tainted = set(self.jaxpr.invars[n_params:])  # values that depend on x
        self.dots: list[_Dot] = []
        for i, eqn in enumerate(self.jaxpr.eqns):
            hit = [not isinstance(v, Literal) and v in tainted for v in eqn.invars]
            if _is_dot(eqn) and sum(hit) == 1:
                self.dots.append(_Dot(i, hit.index(True)))
            if any(hit):
                tainted.update(eqn.outvars)
        self._dot_at = {d.index: k for k, d in enumerate(self.dots)}
        self._input_grad = self._params_reaching_output(n_params)
        self._weight_grad = self._params_reaching_dots(n_params)
        self.tainted = frozenset(tainted)
        self.probe_shapes = [self._aval(d.index, out=True) for d in self.dots]
        self.tap_shapes = [self._aval(d.index, operand=d.act) for d in self.dots]

    def _params_reaching_output(self, n_params: int) -> tuple[bool, ...]:
        """Per param leaf: whether the output depends on it other than through a weight dot's
        weight operand (so ``I`` has a gradient for it: norm scales)."""
        reach: dict = {v: {k} for k, v in enumerate(self.jaxpr.invars[:n_params])}
        for i, eqn in enumerate(self.jaxpr.eqns):
            ins = list(eqn.invars)
            if i in self._dot_at:
                ins = [ins[self.dots[self._dot_at[i]].act]]
            elif eqn.primitive.name == "stop_gradient":
                ins = []
            got = set().union(*(reach.get(v, set()) for v in ins if not isinstance(v, Literal)))
            for v in eqn.outvars:
                reach[v] = got
        y = self.jaxpr.outvars[0]  # the statistics after it carry no gradient
        out = reach.get(y, set()) if not isinstance(y, Literal) else set()
        return tuple(k in out for k in range(n_params))

    def _params_reaching_dots(self, n_params: int) -> tuple[bool, ...]:
        """Per param leaf: whether a weight dot's weight operand depends on it (so ``W`` has a
        gradient for it; with ZeRO-3's one gather of a layer's leaves, every leaf)."""
        reach: dict = {v: {k} for k, v in enumerate(self.jaxpr.invars[:n_params])}
        hit: set = set()
        for i, eqn in enumerate(self.jaxpr.eqns):
            ins = [v for v in eqn.invars if not isinstance(v, Literal)]
            got = set().union(*(reach.get(v, set()) for v in ins))
            if i in self._dot_at:
                w = eqn.invars[1 - self.dots[self._dot_at[i]].act]
                hit |= reach.get(w, set()) if not isinstance(w, Literal) else set()
            for v in eqn.outvars:
                reach[v] = got
        return tuple(k in hit for k in range(n_params))

    @property
    def input_grad_mask(self) -> tuple[bool, ...]:
        """Per param leaf: whether ``I`` computes its gradient (the others come from ``W``)."""
        return self._input_grad

    @property
    def weight_grad_mask(self) -> tuple[bool, ...]:
        """Per param leaf: whether ``W`` computes a gradient of it."""
        return self._weight_grad

    def _aval(self, index: int, out: bool = False, operand: int = 0) -> jax.ShapeDtypeStruct:
        eqn = self.jaxpr.eqns[index]
        aval = eqn.outvars[0].aval if out else eqn.invars[operand].aval
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype)

    def _env(self, params: Any, x: jax.Array | None) -> dict:
        env = dict(zip(self.jaxpr.constvars, self.consts, strict=True))
        leaves = jax.tree.leaves(params)
        env.update(zip(self.jaxpr.invars[: len(leaves)], leaves, strict=True))
        if x is not None:
            env[self.jaxpr.invars[len(leaves)]] = x
        return env

    def forward(self, params: Any, x: jax.Array, probes: list) -> tuple[jax.Array, list, Any]:
        """The layer's output, with ``probe_k`` added to weight dot ``k``; the taps; the
        layer's statistics."""
        env, taps = self._env(params, x), [None] * len(self.dots)
        for i, eqn in enumerate(self.jaxpr.eqns):
            invals = [_read(env, v) for v in eqn.invars]
            k = self._dot_at.get(i)
            if k is None:
                outs = _bind(eqn, invals)
            else:
                act = self.dots[k].act
                taps[k] = invals[act]
                # The weight operand carries no gradient here: W computes it from the tap.
                invals[1 - act] = jax.lax.stop_gradient(invals[1 - act])
                outs = [_bind(eqn, invals)[0] + probes[k]]
            for v, val in zip(eqn.outvars, outs, strict=True):
                env[v] = val
        y, stats = jax.tree.unflatten(self.out_tree, [_read(env, v) for v in self.jaxpr.outvars])
        return y, taps, stats

    def dot_outputs(self, params: Any, taps: list) -> list:
        """``[dot_k(tap_k, w_k(params))]``: the weight path (everything that does not depend on
        ``x``) evaluated from ``params``, and each weight dot applied to its tap."""
        env, outs = self._env(params, None), []
        for i, eqn in enumerate(self.jaxpr.eqns):
            k = self._dot_at.get(i)
            if k is not None:
                invals = [None, None]
                act = self.dots[k].act
                invals[act] = taps[k]
                invals[1 - act] = _read(env, eqn.invars[1 - act])
                outs.append(_bind(eqn, invals)[0])
            elif not (set(eqn.outvars) & self.tainted):
                for v, val in zip(eqn.outvars, _bind(eqn, [_read(env, v) for v in eqn.invars]),
                                  strict=True):  # fmt: skip
                    env[v] = val
        return outs

    def weight_grads(self, params: Any, taps: list, dys: list) -> Any:
        """``W``: the parameters' gradient through the weight dots, from taps and ``dy``s."""
        _, pullback = jax.vjp(lambda p: self.dot_outputs(p, taps), params)
        return pullback(dys)[0]
