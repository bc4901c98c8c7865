"""The pipeline's part of the one gradient path (:mod:`jaxpar.train.grads`, ``layout.pp > 1``).

It adapts the run (:class:`~jaxpar.train.context.GradContext`: model, layout hooks, ZeRO
reduction) to the pipeline package's executor, which knows nothing of training.

:func:`jaxpar.train.grads.loss_and_grads` runs every layout inside one ``shard_map`` manual over
the dp axes; with a pipeline it is manual over ``pp`` too and calls :meth:`PipelineRun.local`
on each rank: the schedule (:func:`jaxpar.pipeline.executor.run_local`) with the model's own
pieces — :meth:`Model.embed` on stage 0, :meth:`Model.block` as the layer of every stage,
:meth:`Model.head_loss` on the last — under the layout's hooks (remat policy, ZeRO-3 gathers).
Gradients leave unreduced over dp; the caller reduces them once as the ZeRO stage says
(ZeRO-2: every micro-batch, inside the backward branch). :meth:`PipelineRun.local_loss` is the
forward-only schedule for evaluation.

**The form at rest** (:mod:`jaxpar.pipeline.rest`): the layer stack ``[L, ...]`` is sharded
over ``pp`` in placement order, so the arrangement ``[p, v, L/(p·v), ...]`` the executor reads
is a free reshape; the embedding and the head are stage-owned ``[pp, ...]`` leaves whose live
slot sits on the rank that uses them, so their gradients need no ``pp`` collective. Inside the
region a rank sees its ``[1, ...]`` slot; the reduction's dims of those leaves are taken one
lower for the hooks that see the slot itself (:attr:`PipelineRun.ctx`).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.model.moe import with_loss
from jaxpar.pipeline.executor import PipelineModel, run_local
from jaxpar.pipeline.rest import RestLayout
from jaxpar.pipeline.stage import StagePieces
from jaxpar.pipeline.step_tables import StepTables, stage_collectives
from jaxpar.train.context import GradContext, microbatch_split
from jaxpar.train.reduce import DPReduction
from jaxpar.train.remat import remat_of

ARRANGED_LEAD = 2  # [L, ...] -> [p, v, L/(p·v), ...]: two more leading dims


@lru_cache(maxsize=16)
def tables_for(kind: str, p: int, m: int, v: int, n_layers: int, forward_only=False,
               memory: str = "fast") -> StepTables:  # fmt: skip
    """The (cached) executor tables of a layout's schedule (``forward_only``: its forwards)."""
    return StepTables.make(kind, p, m, v, n_layers, forward_only, memory)


class PipelineRun:
    """One step's pipeline: arrangement of the layer stack, specs, and the per-rank body."""

    def __init__(self, ctx: GradContext, forward_only: bool = False):
        lay = ctx.layout
        self.rest = RestLayout.of(lay, ctx.model.cfg)
        self.key, n_stack = ctx.model.cfg.stack()  # "layers", or a MoE model's "moe_layers"
        self._rest_reduction = ctx.reduction  # dims and specs of the leaves at rest
        # Inside the region the hooks (ZeRO-3 gathers, ZeRO-2 scatters) see an owned leaf's
        # slot, one dim fewer than at rest.
        self.ctx = dataclasses.replace(ctx, reduction=self._slot_reduction(ctx.reduction))
        self.tables = tables_for(lay.schedule, lay.pp, lay.microbatches, lay.virtual, n_stack,
                                 forward_only, lay.pipeline_memory)  # fmt: skip

    # ---- outside the region (GSPMD) --------------------------------------------------------

    def arrange(self, params: Any) -> Any:
        """Params with the layer stack as ``[p, v, L/(p·v), ...]``: a reshape (at rest the
        stack is in placement order already)."""
        s = self.tables.schedule

        def one(a):
            return a.reshape(s.p, s.v, self.tables.per_chunk, *a.shape[1:])

        return dict(params, **{self.key: jax.tree.map(one, params[self.key])})

    def unarrange(self, grads: Any) -> Any:
        """Inverse of :meth:`arrange` for the gradients."""
        flat = lambda g: g.reshape(self.tables.n_layers, *g.shape[3:])  # noqa: E731
        return dict(grads, **{self.key: jax.tree.map(flat, grads[self.key])})

    def lead_specs(self, ndims: Any) -> Any:
        """Per leaf, the manual axes of the leading dims: ``pp`` on the arranged rank dim of
        the layer stack and on the slot dim of the stage-owned leaves."""
        out = {}
        for k, t in ndims.items():
            lead = ("pp",) if k == self.key or self._owned(k) else ()
            out[k] = jax.tree.map(lambda _, lead=lead: lead, t)
        return out

    def _owned(self, key: str) -> bool:
        return self.rest.owner(key) is not None

    def _slot_reduction(self, red: DPReduction) -> DPReduction:
        """``red`` with each owned leaf's dims and specs taken without its slot dim."""
        return _lead_dims(red, [k for k in red.dims if self._owned(k)], -1)

    def arranged_ndims(self, ndims: Any) -> Any:
        """Ranks of the arranged params."""
        return dict(ndims, **{self.key: jax.tree.map(lambda n: n + ARRANGED_LEAD, ndims[self.key])})

    def arranged_reduction(self) -> DPReduction:
        """The reduction with the layer dims shifted to the arranged layout."""
        return _lead_dims(self._rest_reduction, [self.key], ARRANGED_LEAD)

    # ---- inside the region (manual over pp and dp) -----------------------------------------

    def pieces_for(self, positions_S: jax.Array) -> PipelineModel:
        """The model pieces the executor runs for one step (hooks, remat, reductions)."""
        ctx, red = self.ctx, self.ctx.reduction
        model, dims = ctx.model, red.dims
        remat = ctx.remat
        recompute = remat.recompute_forward
        hooks = ctx.hooks(stage_recompute=recompute)

        key, cfg = self.key, model.cfg

        def pre(lp):  # ZeRO-3: each layer's (MoE group's) weights gathered where they are used
            if red.stage < 3:
                return lp
            return red.gather(lp, dims[key], red.auto_specs[key], shift=1)

        def layer(lp, x):
            if not cfg.moe.enabled:
                return model.block(pre(lp), x, positions_S), ()
            y, stats = model.group(pre(lp), x, positions_S)
            # The balancing loss's share of the step's loss: coefficient, mean over the MoE
            # layers and over the micro-batches (the head's loss is / m likewise).
            scale = cfg.moe.aux_loss / (cfg.moe_layers() * self.tables.schedule.m)
            return with_loss(y, stats.aux, scale), stats

        def embed(ep, tokens):
            return model.embed({"embed": hooks.embed(ep)}, tokens, ctx.compute_dtype)

        def head_loss(hp, y, targets):
            return hooks.head(model.head_loss)(hp, y, targets)

        # A layer never keeps a weight for its backward (not even a cast or fused copy): the
        # stash holds activations only. Recomputed stages run their layers unchecked.
        policy = remat_of("none" if recompute else remat.name).policy(regather=True, stage=True)
        pieces = StagePieces(layer, policy, recompute, self.tables.split_backward)
        lay = ctx.layout  # whether a stage's forward runs collectives of its own (executor)
        own = stage_collectives(lay.tp, lay.sp, lay.ep, lay.zero)
        return PipelineModel(pieces, embed, head_loss, self._reducers(), own)

    def _reducers(self) -> tuple:
        """Per chunk-gradient leaf, the per-micro-batch reduction of one layer's gradient
        (ZeRO-2's reduce-scatter of the local tp/sp block, issued in the backward's layer
        scan), else the identity."""
        red = self.ctx.reduction
        dims = jax.tree.leaves(red.dims[self.key])
        if red.stage != 2:
            return (lambda g: g,) * len(dims)
        # One layer's leaf is the stack's [L, ...] leaf without its layer dim.
        specs = jax.tree.leaves(red.auto_specs[self.key], is_leaf=lambda x: isinstance(x, P))
        return tuple(
            dataclasses.replace(red, dims=d - 1 if d >= 0 else d,
                                auto_specs=P(*tuple(s)[1:])).per_microbatch
            for d, s in zip(dims, specs, strict=True)
        )  # fmt: skip

    def _split_params(self, params: Any):
        """This rank's ``[v, Lc, ...]`` layers, and the embedding and head params it reads
        (owned leaves: this rank's slot; zeros unless it is the owner)."""
        first = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731
        ends = {k: first(t) if self._owned(k) else t for k, t in params.items() if k != self.key}
        return first(params[self.key]), ends["embed"], self.ctx.model.head_params(ends)

    def local(self, params: Any, tokens_BxS: jax.Array, targets_BxS: jax.Array):
        """Loss, unreduced gradients and MoE statistics of this rank's rows through the
        schedule: owned leaves' gradients in this rank's slot (zeros unless it owns them), no
        sum over ``pp``; the statistics of this rank's layers ``[1, v, Lc, ...]`` (None for a
        dense model; :meth:`canonical_stats` assembles them)."""
        red = self.ctx.reduction
        loss, d_local, d_embed, d_head, stats = self._run(params, tokens_BxS, targets_BxS)
        loss, stats = self._with_stats(loss, stats)
        grads = dict(d_head)
        if "embed" in d_head:  # tied: the table's two uses, on the first and the last stage
            grads["embed"] = jax.lax.psum(jax.tree.map(jnp.add, d_head["embed"], d_embed), "pp")
        else:
            grads["embed"] = d_embed
        if red.stage == 2:  # head/embed grads were not scattered per micro-batch
            sub = dataclasses.replace(red, dims={k: red.dims[k] for k in grads},
                                      auto_specs={k: red.auto_specs[k] for k in grads})  # fmt: skip
            grads.update(sub.per_microbatch(grads))
        slot = lambda t: jax.tree.map(lambda a: a[None], t)  # noqa: E731
        grads = {k: slot(t) if self._owned(k) else t for k, t in grads.items()}
        grads[self.key] = slot(d_local)
        return loss, grads, stats

    def local_loss(self, params: Any, tokens_BxS: jax.Array, targets_BxS: jax.Array):
        """Mean loss of this rank's rows through the forward-only schedule (no gradient)."""
        return self._with_stats(*self._run(params, tokens_BxS, targets_BxS))[0]

    def _with_stats(self, loss: jax.Array, stats: Any) -> tuple[jax.Array, Any]:
        """The loss with the MoE balancing term (the mean over layers and micro-batches of
        ``aux_loss · aux``, summed over ``pp``), and the statistics with this rank's slot dim:
        counts summed over the micro-batches, ``aux`` their mean (as without a pipeline)."""
        if stats is None:
            return loss, None
        cfg, m = self.ctx.model.cfg, self.tables.schedule.m
        if cfg.moe.aux_loss:
            term = jax.lax.psum(jnp.sum(stats.aux), "pp") / (cfg.moe_layers() * m)
            loss = loss + cfg.moe.aux_loss * term
        stats = stats._replace(aux=stats.aux / m)
        return loss, jax.tree.map(lambda a: a[None], stats)

    def canonical_stats(self, stats: Any) -> Any:
        """Statistics out of the region ``[p, v, Lc, ...]`` (placement order, as the stack at
        rest) as ``[G, ...]`` in canonical layer order."""
        if stats is None:
            return None
        order = self.rest.order
        inverse = None if order is None else np.argsort(order)

        def one(a):
            a = a.reshape(-1, *a.shape[3:])
            return a if inverse is None else a[inverse]

        return jax.tree.map(one, stats)

    def _run(self, params: Any, tokens_BxS: jax.Array, targets_BxS: jax.Array):
        """:func:`run_local` of this step's tables on this rank's rows, in micro-batches."""
        m = self.ctx.layout.microbatches
        local, embed_p, head_p = self._split_params(params)
        return run_local(
            self.tables,
            self.pieces_for(np.arange(tokens_BxS.shape[1])),  # static: constant rotary tables
            local,
            embed_p,
            head_p,
            microbatch_split(tokens_BxS, m),
            microbatch_split(targets_BxS, m),
        )


def _lead_dims(red: DPReduction, keys: list[str], n: int) -> DPReduction:
    """``red`` with ``n`` leading dims added (``n > 0``, unsharded) or dropped (``n < 0``) on
    the leaves under the top-level ``keys``: its ZeRO dims, expert dims and automatic specs
    follow."""
    shift = lambda d: d if d < 0 else d + n  # noqa: E731
    lead = (lambda s: P(*(None,) * n, *s)) if n > 0 else (lambda s: P(*tuple(s)[-n:]))
    is_p = lambda x: isinstance(x, P)  # noqa: E731
    dims, specs = dict(red.dims), dict(red.auto_specs)
    ep = dict(red.ep_dims) if red.ep_dims is not None else None
    for k in keys:
        dims[k] = jax.tree.map(shift, dims[k])
        specs[k] = jax.tree.map(lead, specs[k], is_leaf=is_p)
        if ep is not None:
            ep[k] = jax.tree.map(shift, ep[k])
    return dataclasses.replace(red, dims=dims, auto_specs=specs, ep_dims=ep)
