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
* stage 3 (FSDP): params stay sharded; every layer's weights are ``all_gather``-ed inside the
  layer scan (:meth:`gather`, forward and again in the backward — the remat policies never keep
  gathered weights, :mod:`jaxpar.train.remat`), and the gather's transpose is the reduce-scatter
  of that layer's gradient: 3kΨ.

Hybrid sharding (``dp_shard``): the scatter/gather run over ``dps`` (within a group), then a
``psum`` of the shard over ``dpr`` (across groups). A leaf too small or indivisible to shard
(e.g. a norm scale) is all-reduced over every dp axis at every stage.

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar import sharding as shd
from jaxpar.config import LayoutConfig
from jaxpar.model.names import weight

# What each stage compiles to (the run summary's ``layout.dp_reduction``).
REDUCTION_NAMES = {
    0: "all_reduce_once",
    1: "reduce_scatter_once",
    2: "reduce_scatter_per_microbatch",
    3: "reduce_scatter_per_layer",
}


def _spec_on(dim: int, ndim: int, axis: str, lead: tuple = ()) -> P:
    """A shard_map spec naming ``axis`` on ``dim`` (none if ``dim < 0``) after ``lead``."""
    parts: list[Any] = [None] * ndim
    for i, a in enumerate(lead):
        parts[i] = a
    if dim >= 0:
        parts[dim] = axis
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

    @staticmethod
    def of(layout: LayoutConfig, zero_specs: Any) -> DPReduction:
        """Build from the layout and the param specs with the ZeRO axis added."""
        axis = shd.zero_axis(layout)
        sizes = {"dp": layout.dp}
        if shd.hybrid(layout):
            sizes = {"dpr": layout.dp // layout.dp_shard, "dps": layout.dp_shard}
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
        )

    @property
    def name(self) -> str:
        """What the compiled step does (``dp_reduction`` in the run summary)."""
        return REDUCTION_NAMES[self.stage] if self.n > 1 else "none"

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

    def param_specs(self, ndims: Any, lead: Any) -> Any:
        """In-specs of the params: the ZeRO axis at stage 3 (sharded at rest), else none."""
        return jax.tree.map(
            lambda d, nd, ld: _spec_on(d if self.stage >= 3 else -1, nd, self.axis, ld),
            self.dims,
            ndims,
            lead,
        )

    def grad_specs(self, ndims: Any, lead: Any) -> Any:
        """Out-specs of the reduced grads: the ZeRO axis from stage 1 on."""
        return jax.tree.map(
            lambda d, nd, ld: _spec_on(d if self.stage >= 1 else -1, nd, self.axis, ld),
            self.dims,
            ndims,
            lead,
        )

    # ---- inside the manual region ---------------------------------------------------------

    def gather(self, tree: Any, dims: Any, specs: Any, shift: int = 0) -> Any:
        """ZeRO-3: all-gather each sharded leaf of ``tree`` in the compute dtype (its VJP is the
        reduce-scatter of the gradient in the reduction dtype); other stages: a cast only.
        ``shift`` is the number of leading dims dropped since ``dims`` was taken (the layer
        scan slices off ``[L]``); ``specs`` the leaves' :attr:`auto_specs`."""
        if self.stage < 3:
            return tree

        def one(x, d, spec):
            if d < 0:
                return weight(x.astype(self.compute_dtype))
            g = _gather(self.axis, d - shift, self.compute_dtype, self.reduce_dtype)
            # Tagged inside the nested region too: remat policies see the region's values.
            local = P(*list(spec)[shift:])
            return weight(on_local_blocks(lambda y: weight(g(y)), local, x))

        return jax.tree.map(one, tree, dims, specs)

    def per_microbatch(self, g: Any) -> Any:
        """Stage 2: reduce-scatter one micro-batch's gradient (the accumulator is a shard)."""
        if self.stage != 2:
            return g
        return jax.tree.map(
            lambda x, d, s: x if d < 0 else on_local_blocks(lambda y: self._scatter(y, d), s, x),
            g,
            self.dims,
            self.auto_specs,
        )

    def finish(self, g: Any) -> Any:
        """The rest of the reduction, once per step, and the mean over the dp ranks."""

        def one(x, d, spec):
            return on_local_blocks(lambda y: local(y, d), spec, x)

        def local(x, d):
            if d < 0 or self.stage == 0:
                x = self._psum(x, self.axes)  # all-reduce over every dp axis
            elif self.stage == 1:
                x = self._psum(self._scatter(x, d), self.repl)  # reduce-scatter (+ hybrid)
            else:
                x = self._psum(x, self.repl)  # already scattered; hybrid: across groups
            return x / self.n

        return jax.tree.map(one, g, self.dims, self.auto_specs)

    def mean(self, x: jax.Array) -> jax.Array:
        """Mean of a per-rank scalar (the loss) over the dp ranks."""
        return jax.lax.pmean(x, self.axes) if self.axes else x

    def _scatter(self, g: jax.Array, dim: int) -> jax.Array:
        out = jax.lax.psum_scatter(
            g.astype(self.reduce_dtype), self.axis, scatter_dimension=dim, tiled=True
        )
        return out.astype(g.dtype)

    def _psum(self, g: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        if not axes:
            return g
        return jax.lax.psum(g.astype(self.reduce_dtype), axes).astype(g.dtype)


def on_local_blocks(fn: Callable, spec: P, x: jax.Array) -> jax.Array:
    """``fn(x)`` with every still-automatic mesh axis (``tp``, ``sp``) made manual, on the
    local block ``spec`` describes.

    A dp collective issued where ``tp`` is automatic makes XLA's partitioner replicate its
    operand over ``tp`` first (measured on jax 0.10.2: reduce-scatters of full-width [D, F]
    gradients behind an all-gather over tp, 1.5x the stage's dp bytes at dp 4 x tp 2). On the
    local block, the collective moves exactly the block.
    """
    mesh = jax.sharding.get_abstract_mesh()
    auto = tuple(a for a in mesh.auto_axes if mesh.shape[a] > 1)  # size 1: nothing to split
    if not auto:
        return fn(x)
    spec = _drop_axes(spec, set(mesh.axis_names) - set(auto))  # size-1 axes: not manual here
    return jax.shard_map(fn, in_specs=spec, out_specs=spec, axis_names=set(auto), check_vma=False)(
        x
    )


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


def _gather(axis: str, dim: int, compute_dtype, reduce_dtype) -> Callable:
    """all_gather along ``dim`` in ``compute_dtype``; its VJP is a reduce-scatter of the
    cotangent in ``reduce_dtype``, returned in the shard's dtype."""

    @jax.custom_vjp
    def gather(x):
        return jax.lax.all_gather(x.astype(compute_dtype), axis, axis=dim, tiled=True)

    def fwd(x):
        return gather(x), jnp.zeros((), x.dtype)

    def bwd(res, g):
        # The transpose of all-gather: one reduce-scatter per gathered tensor.
        out = jax.lax.psum_scatter(g.astype(reduce_dtype), axis, scatter_dimension=dim, tiled=True)
        return (out.astype(res.dtype),)

    gather.defvjp(fwd, bwd)
    return gather


def _or(x: int | None, default: int) -> int:
    return default if x is None else x


def _is_p(x: Any) -> bool:
    return isinstance(x, P)
