"""The data-parallel gradient reduction of a ZeRO stage, as explicit collectives.

Runs inside a ``jax.shard_map`` that is manual over the data-parallel mesh axes (``dp``, or
``dpr × dps`` under hybrid sharding) and over ``pp`` in a pipeline; ``tp``/``sp`` stay automatic,
so the Megatron/Ulysses/ring sharding constraints of the model keep placing their own
collectives. The region is not type-checked for varying manual axes, so autodiff of each
rank's local loss inserts no reduction of its own: the per-micro-batch gradients stay
**unreduced** over dp, are accumulated, and the stage says which collective reduces them and
when (Ψ = parameters per device after tp/pp, N = ZeRO shards,
ring factor (N−1)/N, k micro-batches):

* stage 0 (DDP): one ``psum`` (all-reduce) of the accumulated gradient per step: 2Ψ;
* stage 1: one ``psum_scatter`` (reduce-scatter) per step, full-size accumulator; the optimizer
  updates its shard and the new params are all-gathered by the step's out-sharding: Ψ + Ψ;
* stage 2: a reduce-scatter of every micro-batch's gradient into a sharded accumulator:
  kΨ + Ψ;
* stage 3 (FSDP): params stay sharded; every layer's weights are ``all_gather``-ed (one
  packed collective per layer) inside the layer scan (:meth:`gather`, forward and again in the
  backward — the remat policies never keep gathered weights, :mod:`jaxpar.train.remat`), and
  the gather's transpose is the reduce-scatter of that layer's gradient: 3kΨ.

On a GPU target without a pipeline, each layer's gradient is reduced inside the backward's
layer scan instead, with the same bytes (:meth:`DPReduction.reduces_in_backward`): in flight
beside the backward of the layers below it; stages 0-2 with one micro-batch, stage 2 in every
micro-batch's backward.

Hybrid sharding (``dp_shard``): the scatter/gather run over ``dps`` (within a group), then a
``psum`` of the shard over ``dpr`` (across groups). Expert parallelism (``ep``,
:mod:`jaxpar.model.moe`) splits dp the same way into ``edp × ep``: ZeRO over ``edp``, a
``psum`` over ``ep`` for every leaf but the routed experts' — those are sharded over ``ep``
(``ep_dims``), and each owner's gradient already sums every ep rank's tokens (the dispatch
all-to-all's transpose brought them). A leaf too small or indivisible to shard
(e.g. a norm scale) is all-reduced over every dp axis at every stage.

Many leaves, one collective: the sharded leaves of one layer (stage 3), or of the whole gradient
(stage 1's and 2's reduce-scatters), are packed into one buffer — each leaf's ZeRO dim moved to
the front, flattened into ``N`` rows, cast to the collective's dtype, the leaves side by side —
so each layer pass issues one all-gather and one reduce-scatter instead of one per weight
tensor, all inside one nested tp/sp region (:func:`on_local_blocks` over the tree). Measured at
dp 4 × tp 2, ZeRO-3, 4 layers: 10 all-gathers and 6 reduce-scatters per step instead of 75 and
39, same bytes. XLA GPU's collective combiners would merge per-tensor collectives anyway; the
CPU compile does not (it combines all-reduces only), and on simulated CPU devices every
collective is a rendezvous of all the device threads, so the count sets the step time. The cost
is a copy: the concatenation before the collective and the split after it move the layer's
weights (and gradients) once more through memory, and compiled temporaries grow by up to a few
percent (one packed layer buffer live next to its pieces).

Why shard_map and not JAX's ``unreduced`` partition specs: with parameters typed
``P(..., reduced={'dp'})`` autodiff does return ``{U:dp}`` gradients that accumulate without
communication, but it needs every mesh axis Explicit (mixed Explicit dp / Auto tp fails in the
matmul transpose on jax 0.10.2) and the final ``reshard`` to a dp-sharded spec compiles to a
full all-reduce on CPU, not a reduce-scatter (``scripts/bench_unreduced.py``: dp 4 × tp 2, the
reshard is one all-reduce over dp of both gradients; the explicit form, one reduce-scatter of
each: half the wire bytes).
The explicit form gives the stage's collectives by construction on every backend.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar import sharding as shd
from jaxpar.config import LayoutConfig
from jaxpar.model import fp8
from jaxpar.model.names import weight

# What each stage compiles to (the run summary's ``layout.dp_reduction``).
REDUCTION_NAMES = {
    0: "all_reduce_once",
    1: "reduce_scatter_once",
    2: "reduce_scatter_per_microbatch",
    3: "reduce_scatter_per_layer",
}


def _spec_on(dim: int, ndim: int, axis: str, lead: tuple = (), ep_dim: int = -1) -> P:
    """A shard_map spec naming ``axis`` on ``dim`` (none if ``dim < 0``) after ``lead``, and
    ``ep`` on ``ep_dim`` (routed experts)."""
    parts: list[Any] = [None] * ndim
    for i, a in enumerate(lead):
        parts[i] = a
    if dim >= 0:
        parts[dim] = axis
    if ep_dim >= 0:  # on the ZeRO dim too: ep-major (sharding.zero_spec)
        parts[ep_dim] = ("ep", axis) if ep_dim == dim else "ep"
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)


@dataclass(frozen=True)
class DPReduction:
    """The collectives of one ZeRO stage over the data-parallel axes of a layout.

    ``dims`` is a tree like the params holding, per leaf, the dimension the ZeRO axis shards
    (-1: replicated over dp at every stage).
    """

    stage: int
    axes: tuple[str, ...]  # the dp mesh axes of size > 1 (manual inside the region)
    axis: str  # the ZeRO axis (dps under hybrid sharding)
    sizes: dict[str, int]  # mesh axis sizes of ``axes``
    dims: Any
    auto_specs: Any  # per leaf, its sharding over the automatic (tp/sp) axes
    compute_dtype: Any
    reduce_dtype: Any
    ep_dims: Any = None  # per leaf, its dim sharded over ``ep`` (-1: none); None without ep

    @staticmethod
    def of(layout: LayoutConfig, zero_specs: Any) -> DPReduction:
        """Build from the layout and the param specs with the ZeRO axis added."""
        axis = shd.zero_axis(layout)
        sizes = {"dp": layout.dp}
        if shd.hybrid(layout):
            sizes = {"dpr": layout.dp // layout.dp_shard, "dps": layout.dp_shard}
        ep_dims = None
        if shd.expert_parallel(layout):
            sizes = {"edp": layout.dp // layout.ep, "ep": layout.ep}
            ep_dims = jax.tree.map(
                lambda s: _or(shd.zero_dim(s, "ep"), -1), zero_specs, is_leaf=_is_p
            )
        # Only axes of size > 1 are manual: a size-1 dp axis needs no collective, and leaving
        # it automatic keeps one device (or tp/pp-only layouts) free of a manual region.
        axes = tuple(a for a in shd.dp_axes(layout) if sizes[a] > 1)
        dims = jax.tree.map(lambda s: _or(shd.zero_dim(s, axis), -1), zero_specs, is_leaf=_is_p)
        manual = {"pp", *shd.dp_axes(layout)}
        auto_specs = jax.tree.map(lambda s: _drop_axes(s, manual), zero_specs, is_leaf=_is_p)
        return DPReduction(
            stage=layout.zero,
            axes=axes,
            axis=axis,
            sizes=sizes,
            dims=dims,
            auto_specs=auto_specs,
            compute_dtype=jnp.dtype(layout.compute_dtype),
            reduce_dtype=jnp.dtype(layout.reduce_dtype),
            ep_dims=ep_dims,
        )

    @property
    def name(self) -> str:
        """What the compiled step does once per step or micro-batch (``dp_reduction`` in the run
        summary where the backward does not reduce: :meth:`compiled_name`)."""
        return REDUCTION_NAMES[self.stage] if self.n > 1 else "none"

    def compiled_name(self, microbatches: int, pp: int) -> str:
        """``dp_reduction`` of the step compiled for the active mesh with ``microbatches`` and
        ``pp``: ``all_reduce_per_layer`` / ``reduce_scatter_per_layer`` where the backward
        reduces each layer (:meth:`reduces_in_backward`), else :attr:`name`."""
        if self.reduces_in_backward(microbatches, pp):
            return "all_reduce_per_layer" if self.stage == 0 else "reduce_scatter_per_layer"
        return self.name

    @property
    def n(self) -> int:
        """Data-parallel ranks (the mean divides by it)."""
        out = 1
        for size in self.sizes.values():
            out *= size
        return out

    @property
    def repl(self) -> tuple[str, ...]:
        """dp axes a ZeRO shard is replicated over (``dpr`` under hybrid sharding)."""
        return tuple(a for a in self.axes if a != self.axis)

    # ---- shard_map specs (manual axes only; tp/sp shardings travel with the arrays) -------

    def _ep(self) -> Any:
        """Per leaf, its dim on ``ep`` (-1 everywhere without expert parallelism)."""
        return self.ep_dims if self.ep_dims is not None else jax.tree.map(lambda _: -1, self.dims)

    def param_specs(self, ndims: Any, lead: Any) -> Any:
        """In-specs of the params: the ZeRO axis at stage 3 (sharded at rest), else none;
        routed experts on ``ep``."""
        return jax.tree.map(
            lambda d, nd, ld, e: _spec_on(d if self.stage >= 3 else -1, nd, self.axis, ld, e),
            self.dims,
            ndims,
            lead,
            self._ep(),
        )

    def grad_specs(self, ndims: Any, lead: Any) -> Any:
        """Out-specs of the reduced grads: the ZeRO axis from stage 1 on; experts on ``ep``."""
        return jax.tree.map(
            lambda d, nd, ld, e: _spec_on(d if self.stage >= 1 else -1, nd, self.axis, ld, e),
            self.dims,
            ndims,
            lead,
            self._ep(),
        )

    # ---- inside the manual region ---------------------------------------------------------

    def gather(self, tree: Any, dims: Any, specs: Any, shift: int = 0) -> Any:
        """ZeRO-3: all-gather the sharded leaves of ``tree`` (one layer's weights, the embedding,
        the head) in the compute dtype, packed into one all-gather whose VJP is one
        reduce-scatter of their gradients in the reduction dtype; other stages: ``tree`` as it
        is. ``shift`` is the number of leading dims dropped since ``dims`` was taken (the layer
        scan slices off ``[L]``); ``specs`` the leaves' :attr:`auto_specs`."""
        if self.stage < 3:
            return tree
        dims = jax.tree.map(lambda d: d if d < 0 else d - shift, dims)
        local = jax.tree.map(lambda s: P(*list(s)[shift:]), specs, is_leaf=_is_p)
        groups = _fp8_groups(tree, dims)  # GEMM weights gathered as FP8 (tensorwise, delayed)

        def gathered(t):
            n, cd, rd = self.sizes[self.axis], self.compute_dtype, self.reduce_dtype
            if groups is None:
                t = _on_sharded(lambda xs, ds: _gather_leaves(self.axis, n, xs, ds, cd, rd), t,
                                dims)  # fmt: skip
            else:
                t = _gather_fp8(self.axis, n, t, dims, groups, cd, rd)
            # Tagged inside the nested region too: remat policies see the region's values.
            return jax.tree.map(lambda x: weight(x.astype(cd)), t)

        return jax.tree.map(weight, on_local_blocks(gathered, local, tree))

    def per_microbatch(self, g: Any, done: tuple[str, ...] = ()) -> Any:
        """Stage 2: reduce-scatter one micro-batch's gradient (the accumulator is a shard), all
        sharded leaves in one collective; the top-level keys in ``done`` were scattered in the
        backward (:meth:`reduced_in_backward`) and pass through."""
        if self.stage != 2:
            return g
        if done:
            return self._but(done, g, lambda red, t: red.per_microbatch(t))
        return on_local_blocks(lambda t: self._scatter_tree(t, self.dims), self.auto_specs, g)

    def finish(self, g: Any, done: tuple[str, ...] = ()) -> Any:
        """The rest of the reduction, once per step, and the mean over the dp ranks; the
        top-level keys in ``done`` were reduced in the backward already
        (:meth:`reduced_in_backward`) and pass through."""
        if done:
            return self._but(done, g, lambda red, t: red.finish(t))

        def local(t):
            if self.stage == 1:
                t = self._scatter_tree(t, self.dims)  # one reduce-scatter of every shard
            return jax.tree.map(self._mean_over_ranks, t, self.dims, self._ep())

        return on_local_blocks(local, self.auto_specs, g)

    def _mean_over_ranks(self, x: jax.Array, d: int, e: int) -> jax.Array:
        """One leaf's last collective and the mean: replicated leaves and stage 0 all-reduced
        over every dp axis; shards (already scattered) across hybrid groups only. XLA's
        combiner merges these all-reduces."""
        axes = self.axes if d < 0 or self.stage == 0 else self.repl
        if e >= 0:  # a routed expert's owner holds its whole gradient over ep already
            axes = tuple(a for a in axes if a != "ep")
        return self._psum(x, axes) / self.n

    def _but(self, done: tuple[str, ...], g: dict, fn: Callable) -> dict:
        """``g`` with ``fn(this reduction for the other keys, their gradients)`` applied to
        every top-level key but those in ``done``, which pass through."""
        keys = [k for k in g if k not in done]
        pick = lambda t: None if t is None else {k: t[k] for k in keys}  # noqa: E731
        sub = replace(self, dims=pick(self.dims), auto_specs=pick(self.auto_specs),
                      ep_dims=pick(self.ep_dims))  # fmt: skip
        rest = fn(sub, pick(g))
        return {k: g[k] if k in done else rest[k] for k in g}

    # ---- stages 0-2: each layer's gradient reduced inside the backward's layer scan ------

    def reduces_in_backward(self, microbatches: int, pp: int) -> bool:
        """Whether stages 0-2 reduce each layer's gradient in the backward's layer scan (one
        set of collectives per layer, each in flight beside the backward of the layers below
        it) rather than the stacked gradient once after the scan, for a step of
        ``microbatches`` and ``pp`` on the active mesh.

        On a GPU target (:func:`packed_collectives` is false there), where the latency-hiding
        scheduler overlaps a collective started in one iteration of the backward loop with the
        next iterations' matmuls; after the scan nothing is left to overlap with (llama3-8b,
        ZeRO-1 over an H100 node: 0.075 s of 0.629 s exposed before, 0.035 of 0.543 s after;
        BENCHMARKS.md). Not on CPU, where every collective is a rendezvous of all device
        threads and one per step is cheapest. Not with a pipeline: its ticks accumulate a
        layer's gradient until the last micro-batch's backward through it, at a tick that
        differs by rank. With micro-batches, stage 2 reduce-scatters each one's gradient in its
        backward (its accumulator is a shard already); stages 0/1 reduce once after the
        accumulation: the last micro-batch's backward would add the accumulator in and hold the
        reduced gradient beside it (llama3-8b at 8 layers, dp 8, 2 micro-batches, H100: +5.7
        GiB at ZeRO-1, +9.7 GiB at ZeRO-0, against 0.02 s of dp hidden)."""
        if self.stage >= 3 or self.n == 1 or pp > 1 or (microbatches > 1 and self.stage < 2):
            return False
        return not packed_collectives()

    def _layer(self, key: str) -> DPReduction:
        """This reduction for one layer of the stack ``key`` (its ``[L]`` dim sliced off)."""
        lower = lambda t: jax.tree.map(lambda d: d if d < 0 else d - 1, t)  # noqa: E731
        specs = jax.tree.map(lambda s: P(*tuple(s)[1:]), self.auto_specs[key], is_leaf=_is_p)
        ep = None if self.ep_dims is None else lower(self.ep_dims[key])
        return replace(self, dims=lower(self.dims[key]), auto_specs=specs, ep_dims=ep)

    def slots(self, key: str, stacked: Any) -> Any:
        """Stages 1/2: zeros shaped like the reduced gradient of the layer stack ``key``
        (``[L, ...]``, a ZeRO shard): the input :meth:`reduced_in_backward` returns it as the
        cotangent of. Only its shape is read; the forward never uses it."""

        def one(a, d):
            shape = list(a.shape)
            if d >= 0:
                shape[d] //= self.sizes[self.axis]
            return jnp.zeros(shape, a.dtype)

        return jax.tree.map(one, stacked, self.dims[key])

    def reduced_in_backward(self, key: str, lp: Any, slot: Any) -> Any:
        """``lp`` (one layer of the stack ``key``) as it is, whose backward reduces the
        layer's gradient: at stages 0/1 as :meth:`finish` would (stage 0 all-reduce, stage 1
        reduce-scatter) and divided by the dp ranks; at stage 2 its micro-batch's
        reduce-scatter (:meth:`per_microbatch`), :meth:`finish` doing the rest once per step.
        Stage 0 (``slot`` None) returns it as the cotangent of ``lp``; stages 1/2, a ZeRO
        shard, as the cotangent of ``slot`` (:meth:`slots`; ``lp``'s own gradient stopped by
        the caller). One layer's leaves go in one region (:func:`on_local_blocks`), so they
        move exactly their tp/sp blocks."""
        one = self._layer(key)

        @jax.custom_vjp
        def layer(lp, slot):
            return lp

        def fwd(lp, slot):
            return lp, None

        def bwd(_, g):
            def local(g):
                if one.stage >= 1:
                    g = one._scatter_tree(g, one.dims)
                if one.stage == 2:
                    return g
                return jax.tree.map(one._mean_over_ranks, g, one.dims, one._ep())

            reduced = on_local_blocks(local, one.auto_specs, g)
            return (reduced, None) if slot is None else (None, reduced)

        layer.defvjp(fwd, bwd)
        return layer(lp, slot)

    def mean(self, x: jax.Array) -> jax.Array:
        """Mean of a per-rank scalar (the loss) over the dp ranks."""
        return jax.lax.pmean(x, self.axes) if self.axes else x

    def _scatter_tree(self, tree: Any, dims: Any) -> Any:
        """One reduce-scatter over the ZeRO axis of every leaf with ``dims >= 0`` (local
        blocks, each returned as its shard in its own dtype); other leaves as they are."""
        n, rd = self.sizes[self.axis], self.reduce_dtype

        def scatter(xs: list, ds: list) -> list:
            if packed_collectives():
                return _packed_scatter(self.axis, n, xs, ds, rd)
            return [
                _packed_scatter(self.axis, n, [x], [d], rd)[0] for x, d in zip(xs, ds, strict=True)
            ]

        return _on_sharded(scatter, tree, dims)

    def _psum(self, g: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        if not axes:
            return g
        return jax.lax.psum(g.astype(self.reduce_dtype), axes).astype(g.dtype)


def on_local_blocks(fn: Callable, specs: Any, tree: Any) -> Any:
    """``fn(tree)`` with every still-automatic mesh axis (``tp``, ``sp``) made manual, on the
    local blocks ``specs`` (a tree of specs like ``tree``, or one spec for all) describe; ``fn``
    returns a tree of the same shardings. One region for the whole tree, so that packed
    collectives see every leaf at once.

    A dp collective issued where ``tp`` is automatic makes XLA's partitioner replicate its
    operand over ``tp`` first (measured on jax 0.10.2: reduce-scatters of full-width [D, F]
    gradients behind an all-gather over tp, 1.5x the stage's dp bytes at dp 4 x tp 2). On the
    local block, the collective moves exactly the block.
    """
    mesh = jax.sharding.get_abstract_mesh()
    auto = tuple(a for a in mesh.auto_axes if mesh.shape[a] > 1)  # size 1: nothing to split
    if not auto:
        return fn(tree)
    manual = set(mesh.axis_names) - set(auto)  # size-1 axes: not manual here
    specs = jax.tree.map(lambda s: _drop_axes(s, manual), specs, is_leaf=_is_p)
    return jax.shard_map(
        fn, in_specs=(specs,), out_specs=specs, axis_names=set(auto), check_vma=False
    )(tree)


def _drop_axes(spec: P, axes: set[str]) -> P:
    """``spec`` without the mesh axes in ``axes``."""
    parts = []
    for part in spec:
        if isinstance(part, tuple):
            kept = tuple(a for a in part if a not in axes)
            parts.append(kept if len(kept) > 1 else (kept[0] if kept else None))
        else:
            parts.append(None if part in axes else part)
    return P(*parts)


def _on_sharded(fn: Callable, tree: Any, dims: Any) -> Any:
    """``tree`` with its leaves of ``dims >= 0`` replaced by ``fn(those leaves, their dims)``,
    one call for all of them (the packed collectives)."""
    xs, tdef = jax.tree.flatten(tree)
    ds = tdef.flatten_up_to(dims)
    idx = [i for i, d in enumerate(ds) if d >= 0]
    if idx:
        for i, y in zip(idx, fn([xs[i] for i in idx], [ds[i] for i in idx]), strict=True):
            xs[i] = y
    return jax.tree.unflatten(tdef, xs)


def _fp8_groups(tree: Any, dims: Any) -> list[int] | None:
    """Per leaf of ``tree`` (one layer's parameters), the GEMM whose scale it shares where the
    active recipe gathers ZeRO-3 weights as FP8 (:func:`jaxpar.model.fp8.gather_groups`), else
    None; None too where a GEMM weight is not sharded (its amax would be missing from the
    shards')."""
    groups = fp8.gather_groups(_leaf_keys(tree))
    if groups is None:
        return None
    ds = jax.tree.structure(tree).flatten_up_to(dims)
    return None if any(g >= 0 and d < 0 for g, d in zip(groups, ds, strict=True)) else groups


def _leaf_keys(tree: Any) -> list[tuple[str, ...]]:
    """Each leaf's path in ``tree`` as a tuple of keys."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [tuple(getattr(k, "key", str(k)) for k in path) for path, _ in paths]


def _gather_bytes(axis: str, n: int, xs: list, dims: list) -> list:
    """The shards ``xs`` all-gathered over ``axis`` (``n`` ranks) along their ``dims`` as they
    are (FP8 as bytes): packed into one all-gather per dtype, or one each
    (:func:`packed_collectives`)."""

    def one(part: list, ds: list) -> list:
        dtypes = [x.dtype for x in part]
        raw = [jax.lax.bitcast_convert_type(x, jnp.uint8) if x.dtype.itemsize == 1 else x
               for x in part]  # fmt: skip
        full = [(*x.shape[:d], x.shape[d] * n, *x.shape[d + 1 :])
                for x, d in zip(raw, ds, strict=True)]  # fmt: skip
        flat = jax.lax.all_gather(_rows(raw, ds, 1, raw[0].dtype)[0], axis)
        out = _unrows(flat, full, ds, [x.dtype for x in raw])
        return [jax.lax.bitcast_convert_type(y, t) if t != y.dtype else y
                for y, t in zip(out, dtypes, strict=True)]  # fmt: skip

    if not packed_collectives():
        return [one([x], [d])[0] for x, d in zip(xs, dims, strict=True)]
    out: list = [None] * len(xs)
    for dtype in sorted({x.dtype for x in xs}, key=str):  # one buffer per dtype (e4m3, bf16)
        idx = [i for i, x in enumerate(xs) if x.dtype == dtype]
        for i, y in zip(idx, one([xs[i] for i in idx], [dims[i] for i in idx]), strict=True):
            out[i] = y
    return out


def _gather_fp8(axis: str, n: int, tree: Any, dims: Any, groups: list, compute_dtype,
                reduce_dtype) -> Any:  # fmt: skip
    """:func:`_gather_leaves` of ``tree``'s sharded leaves with the GEMM weights (``groups`` >= 0)
    quantized to e4m3 with their GEMM's scale before the all-gather and scaled back after it
    (one byte an element on the wire; the GEMM quantizes them to the same values,
    :mod:`jaxpar.model.fp8`); the VJP is the same reduce-scatter of the cotangents in
    ``reduce_dtype``. Tensorwise: the scale from the shards' amax. Delayed: from each GEMM's
    history (a leaf of ``tree``, passed through), whose cotangent's weight row the VJP sets to
    the record of the weight itself (:func:`jaxpar.model.fp8.weight_records`). One custom VJP
    around the whole, so the remat policies see a gather (re-run, never saved)."""
    leaves, tdef = jax.tree.flatten(tree)
    ds = tdef.flatten_up_to(dims)
    idx = [i for i, d in enumerate(ds) if d >= 0]
    xs, dims = [leaves[i] for i in idx], [ds[i] for i in idx]
    groups = [groups[i] for i in idx]
    dtypes = [x.dtype for x in xs]
    recipe = fp8.active()
    hist_at = {}  # GEMM -> the index of its history among the leaves (delayed)
    if recipe.delayed:
        hist_at = {g: i for i, g in enumerate(fp8.history_groups(_leaf_keys(tree))) if g >= 0}
    hs = [leaves[hist_at[g]] if g in hist_at else None for g in range(len(fp8.GEMM_GROUPS))]
    mesh = jax.sharding.get_abstract_mesh()
    # the GEMM's amax is over the whole weight: every axis a shard is split over (the ZeRO
    # axis, tp) but pp, whose ranks hold other layers
    axes = tuple(a for a in mesh.axis_names if a != "pp" and mesh.shape[a] > 1)

    @jax.custom_vjp
    def gather(xs, hs):
        xs = [x.astype(compute_dtype) for x in xs]
        given = fp8.history_scales(hs, recipe.history) if recipe.delayed else None
        q, scales = fp8.quantize_shards(xs, groups, axes, given)
        full = _gather_bytes(axis, n, q, dims)
        ys = [y if g < 0 else (y.astype(jnp.float32) * s).astype(compute_dtype)
              for y, s, g in zip(full, scales, groups, strict=True)]  # fmt: skip
        return ys, hs

    def forward(xs, hs):
        # the gather called as itself: a remat policy sees one custom_vjp_call holding an
        # all_gather and re-runs it (traced inline, its dequantized outputs would be saved)
        records = None
        if recipe.delayed:
            records = fp8.weight_records([x.astype(compute_dtype) for x in xs], groups, axes)
        return gather(xs, hs), records

    def bwd(records, cts):
        gs, dhs = cts
        if packed_collectives():
            dxs = _packed_scatter(axis, n, gs, dims, reduce_dtype, dtypes)
        else:
            dxs = [_packed_scatter(axis, n, [g], [d], reduce_dtype, [t])[0]
                   for g, d, t in zip(gs, dims, dtypes, strict=True)]  # fmt: skip
        return dxs, [None if dh is None else _own_record(dh, records[g])
                     for g, dh in enumerate(dhs)]  # fmt: skip

    gather.defvjp(forward, bwd)
    ys, hs = gather(xs, hs)
    for i, y in zip(idx, ys, strict=True):
        leaves[i] = y
    for g, i in hist_at.items():
        leaves[i] = hs[g]
    return jax.tree.unflatten(tdef, leaves)


def _own_record(dh: jax.Array, record: jax.Array) -> jax.Array:
    """A delayed GEMM's history cotangent ``dh`` ``[3, BUCKETS]`` with its weight row holding
    ``record`` (the one-hot of the scale the weight needed) in place of the GEMM's record of
    the gathered values, at the weight the GEMM gave its records: JAX scales a cotangent that
    crosses a manual region (``1/tp`` inside ``on_local_blocks``), so the row keeps the mass of
    the GEMM's rows (one record an operand; the weight's row alone is empty where the clipped
    values were all zero)."""
    mass = jnp.max(jnp.sum(dh, axis=-1))
    return dh.at[1].set(record.astype(dh.dtype) * mass)


def _rows(xs: list, dims: list, n: int, dtype: Any) -> jax.Array:
    """``[n, T]``: each leaf with its dim ``d`` moved to the front, split into ``n`` rows (row
    ``r`` = the ``r``-th block along ``d``) and cast to ``dtype``, the leaves side by side."""
    parts = [
        jnp.moveaxis(x, d, 0).astype(dtype).reshape(n, -1) for x, d in zip(xs, dims, strict=True)
    ]
    return jnp.concatenate(parts, axis=1)


def _unrows(r_nxT: jax.Array, shapes: list, dims: list, dtypes: list) -> list:
    """Inverse of :func:`_rows` for leaves of ``shapes`` (the ``n`` rows stacked along each
    leaf's dim ``d``), cast to ``dtypes``."""
    n = r_nxT.shape[0]
    moved = [(sh[d] // n, *sh[:d], *sh[d + 1 :]) for sh, d in zip(shapes, dims, strict=True)]
    sizes = [math.prod(m) for m in moved]
    offsets = list(itertools.accumulate(sizes))[:-1]
    out = []
    for piece, m, d, dt in zip(jnp.split(r_nxT, offsets, axis=1), moved, dims, dtypes, strict=True):
        x = piece.reshape(n * m[0], *m[1:])
        out.append(jnp.moveaxis(x, 0, d).astype(dt))
    return out


def _packed_scatter(
    axis: str, n: int, gs: list, dims: list, reduce_dtype: Any, dtypes: list | None = None
) -> list:
    """One reduce-scatter (in ``reduce_dtype``) over ``axis`` of the leaves ``gs`` along their
    ``dims``; each shard returned in ``dtypes`` (default: its leaf's dtype)."""
    shard = jax.lax.psum_scatter(_rows(gs, dims, n, reduce_dtype), axis, scatter_dimension=0)
    shapes = [
        (*g.shape[:d], g.shape[d] // n, *g.shape[d + 1 :]) for g, d in zip(gs, dims, strict=True)
    ]
    return _unrows(shard[None], shapes, dims, dtypes or [g.dtype for g in gs])


def packed_collectives() -> bool:
    """Whether a layer's ZeRO-3 leaves go in one gather (and one reduce-scatter), and stage 1's
    and 2's gradients in one reduce-scatter.

    Everywhere but on a GPU target (the mesh's devices, :func:`jaxpar.model.attention.target`):
    XLA:CPU combines no all-gathers and every collective is a rendezvous of all device threads
    (module docstring). On GPU, XLA's collective pipeliner and latency-hiding scheduler overlap
    per-leaf gathers and reduce-scatters with the neighbouring layers' compute, and not the
    packed ones: compiled for H100 (llama3-8b, ZeRO-3 over dp 8, seq 4096, docs/gpu.md),
    99% of the dp bytes had no matmul scheduled between start and done when packed, about a
    third per leaf; the packed reduce-scatter was never pipelined. Stage 1's one packed
    reduce-scatter of the whole gradient holds a second, concatenated copy of it after the
    accumulation (16 GiB per device for llama2-70b at tp 8 x pp 2, though not at that step's
    peak, which is inside the pipeline's loop); per leaf, XLA's combiner groups them in buffers
    of its threshold.
    """
    dev = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return dev is None or dev.platform not in ("gpu", "cuda")


def _gather_leaves(axis: str, n: int, xs: list, dims: list, compute_dtype, reduce_dtype) -> list:
    """:func:`_packed_gather` of all leaves at once, or of each leaf (:func:`packed_collectives`):
    the same collectives' bytes and dtypes either way."""
    if packed_collectives():
        return _packed_gather(axis, n, xs, dims, compute_dtype, reduce_dtype)
    return [
        _packed_gather(axis, n, [x], [d], compute_dtype, reduce_dtype)[0]
        for x, d in zip(xs, dims, strict=True)
    ]


def _packed_gather(axis: str, n: int, xs: list, dims: list, compute_dtype, reduce_dtype) -> list:
    """One all_gather over ``axis`` of the shards ``xs`` along their ``dims``, in
    ``compute_dtype``; its VJP is one reduce-scatter of the cotangents in ``reduce_dtype``,
    returned in the shards' dtypes. The packing happens inside the ``custom_vjp``, so the
    remat policies see one gather whose outputs are whole weights (never saved)."""
    dtypes = [x.dtype for x in xs]

    @jax.custom_vjp
    def gather(xs):
        return _gather_bytes(axis, n, [x.astype(compute_dtype) for x in xs], dims)

    def fwd(xs):
        return gather(xs), None

    def bwd(_, gs):
        # The transpose of the packed all-gather: one reduce-scatter of the packed cotangents.
        return (_packed_scatter(axis, n, gs, dims, reduce_dtype, dtypes),)

    gather.defvjp(fwd, bwd)
    return gather(xs)


def _or(x: int | None, default: int) -> int:
    return default if x is None else x


def _is_p(x: Any) -> bool:
    return isinstance(x, P)
