"""The pipeline's part of the one gradient path (:mod:`jaxpar.train.grads`, ``layout.pp > 1``).

:func:`jaxpar.train.grads.loss_and_grads` runs every layout inside one ``shard_map`` manual over
the dp axes; with a pipeline it is manual over ``pp`` too and calls :meth:`PipelineRun.local`
on each rank: the embedding of the rank's rows (and its pullback after the schedule), the
schedule itself (:func:`jaxpar.pipeline.executor.run_local`) with the model's own stage
function (:meth:`Model.blocks`) and head (:meth:`Model.head_loss`) under the layout's hooks
(remat, ZeRO-3 gathers). Gradients leave unreduced over dp; the caller reduces them once as
the ZeRO stage says (ZeRO-2: every micro-batch, inside the backward branch).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.pipeline.executor import Plan, arrange, run_local, unarrange

if TYPE_CHECKING:
    from jaxpar.train.grads import GradContext
    from jaxpar.train.reduce import DPReduction

ARRANGED_LEAD = 2  # [L, ...] -> [p, v, L/(p·v), ...]: two more leading dims


@lru_cache(maxsize=16)
def plan_for(kind: str, p: int, m: int, v: int, n_layers: int) -> Plan:
    """The (cached) plan of a layout's schedule."""
    return Plan.make(kind, p, m, v, n_layers)


class PipelineRun:
    """One step's pipeline: arrangement of the layer stack, specs, and the per-rank body."""

    def __init__(self, ctx: GradContext):
        lay = ctx.layout
        self.ctx = ctx
        self.plan = plan_for(lay.schedule, lay.pp, lay.microbatches, lay.virtual,
                             ctx.model.cfg.n_layers)  # fmt: skip

    # ---- outside the region (GSPMD) --------------------------------------------------------

    def arrange(self, params: Any) -> Any:
        """Params with the layer stack as ``[p, v, L/(p·v), ...]`` in placement order."""
        rules = self.ctx.rules
        logical = self.ctx.model.logical_axes()["layers"]
        at_rest = jax.tree.map(rules.spec, logical, is_leaf=lambda x: isinstance(x, tuple))
        red = self.ctx.reduction
        if red.stage >= 3:  # keep the ZeRO axis: the layers enter the region sharded
            at_rest = jax.tree.map(
                lambda s, d: _with_axis(s, d, red.axis), at_rest, red.dims["layers"],
                is_leaf=lambda x: isinstance(x, P),
            )  # fmt: skip
        specs = jax.tree.map(
            lambda s: P("pp", None, None, *list(s)[1:]), at_rest, is_leaf=lambda x: isinstance(x, P)
        )
        return dict(params, layers=arrange(params["layers"], self.plan, specs))

    def unarrange(self, grads: Any) -> Any:
        """Inverse of :meth:`arrange` for the gradients."""
        return dict(grads, layers=unarrange(grads["layers"], self.plan))

    def lead_specs(self, ndims: Any) -> Any:
        """Per leaf, the manual axes of the leading dims: ``pp`` on the arranged rank dim."""
        out = jax.tree.map(lambda _: (), ndims)
        out["layers"] = jax.tree.map(lambda _: ("pp",), ndims["layers"])
        return out

    def arranged_ndims(self, ndims: Any) -> Any:
        """Ranks of the arranged params."""
        return dict(ndims, layers=jax.tree.map(lambda n: n + ARRANGED_LEAD, ndims["layers"]))

    def arranged_reduction(self) -> DPReduction:
        """The reduction with the layer dims shifted to the arranged layout."""
        red = self.ctx.reduction
        shift = lambda d: d if d < 0 else d + ARRANGED_LEAD  # noqa: E731
        dims = dict(red.dims, layers=jax.tree.map(shift, red.dims["layers"]))
        lead = lambda s: P(None, None, *s)  # noqa: E731
        is_p = lambda x: isinstance(x, P)  # noqa: E731
        specs = dict(
            red.auto_specs, layers=jax.tree.map(lead, red.auto_specs["layers"], is_leaf=is_p)
        )
        return dataclasses.replace(red, dims=dims, auto_specs=specs)

    # ---- inside the region (manual over pp and dp) -----------------------------------------

    def local(self, params: Any, tokens_BxS: jax.Array, targets_BxS: jax.Array):
        """Loss and unreduced gradients of this rank's rows through the schedule."""
        from jaxpar.train.grads import microbatch_split  # noqa: PLC0415

        ctx, plan = self.ctx, self.plan
        model, red, m = ctx.model, ctx.reduction, ctx.layout.microbatches
        recompute = ctx.remat.recompute_forward
        hooks = ctx.hooks(stage_recompute=recompute)
        positions = jnp.arange(tokens_BxS.shape[1])

        def embed(emb):
            x = model.embed({"embed": hooks.embed(emb)}, tokens_BxS, ctx.compute_dtype)
            return microbatch_split(x, m)  # [m, b/m, S, D]

        x_mb, embed_pullback = jax.vjp(embed, params["embed"])

        def stage_fn(chunk, x):
            return model.blocks(chunk, x, positions, hooks.layer)

        # ZeRO-2: each micro-batch's chunk gradient is reduce-scattered before accumulating.
        chunk_red = dataclasses.replace(
            red, dims=red.dims["layers"], auto_specs=red.auto_specs["layers"]
        )
        reduce_each = chunk_red.per_microbatch if red.stage == 2 else None
        local = jax.tree.map(lambda a: a[0], params["layers"])  # [v, Lc, ...]
        loss, d_local, d_head, dx = run_local(
            plan,
            stage_fn,
            hooks.head(model.head_loss),
            local,
            model.head_params(params),
            x_mb,
            microbatch_split(targets_BxS, m),
            recompute,
            reduce_each,
        )
        (d_embed,) = embed_pullback(dx.astype(x_mb.dtype))
        grads = dict(d_head)
        grads["embed"] = jax.tree.map(jnp.add, d_head["embed"], d_embed) if "embed" in d_head \
            else d_embed  # fmt: skip
        grads["layers"] = jax.tree.map(lambda a: a[None], d_local)
        if red.stage == 2:  # head/embed grads were not scattered per micro-batch
            rest = {k: v for k, v in grads.items() if k != "layers"}
            sub = dataclasses.replace(red, dims={k: red.dims[k] for k in rest},
                                      auto_specs={k: red.auto_specs[k] for k in rest})  # fmt: skip
            rest = sub.per_microbatch(rest)
            grads.update(rest)
        return loss, grads


def _with_axis(spec: P, dim: int, axis: str) -> P:
    if dim < 0:
        return spec
    parts = list(spec) + [None] * max(0, dim + 1 - len(spec))
    parts[dim] = axis
    return P(*parts)
