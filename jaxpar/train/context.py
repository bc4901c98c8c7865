"""What the gradient path needs to know about a run (:class:`GradContext`), and micro-batching.

Shared by the one gradient function (:mod:`jaxpar.train.grads`) and its pipeline part
(:mod:`jaxpar.train.pipeline_run`), which both import it: neither imports the other's
internals, so the imports run one way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar import sharding as shd
from jaxpar.config import LayoutConfig
from jaxpar.model import Model
from jaxpar.model.llama import Hooks
from jaxpar.train.reduce import DPReduction
from jaxpar.train.remat import Remat, remat_of


def microbatch_split(x_BxT: jax.Array, k: int) -> jax.Array:
    """``[B, ...] -> [k, B/k, ...]`` without gathering a dp-sharded batch.

    Reshaping to ``[B/k, k, ...]`` keeps each device's rows contiguous on the leading dimension;
    swapping axes then gives micro-batch ``j`` = rows ``{i·k + j}``, each device still holding
    its share. A direct reshape to ``[k, B/k]`` would all-gather the batch.
    """
    b = x_BxT.shape[0]
    return jnp.swapaxes(x_BxT.reshape(b // k, k, *x_BxT.shape[1:]), 0, 1)


@dataclass(frozen=True)
class GradContext:
    """What computing gradients needs to know about a run."""

    model: Model
    layout: LayoutConfig
    rules: shd.Rules  # the layout's rules (outside the manual region)
    reduction: DPReduction
    abstract: Any  # ShapeDtypeStructs of the params (parameter dtype)
    compute_dtype: Any

    @property
    def remat(self) -> Remat:
        """The layout's remat setting."""
        return remat_of(self.layout.remat)

    @property
    def manual_axes(self) -> tuple[str, ...]:
        """Mesh axes manual inside the region: dp axes, and ``pp`` with a pipeline."""
        return (("pp",) if self.layout.pp > 1 else ()) + self.reduction.axes

    def inner_rules(self) -> shd.Rules:
        """The rules inside the region: manual axes are gone from every constraint (the batch
        rows and, with a pipeline, the layer stack are already local)."""
        manual = set(self.manual_axes)
        table = tuple(
            (name, tuple(a for a in axes if a not in manual)) for name, axes in self.rules.table
        )
        # Without a pipeline each micro-batch's loss is its own mean (averaged after the
        # accumulation); a pipeline's head divides each by the micro-batch count already.
        k = self.layout.microbatches if self.layout.pp <= 1 else 1
        return dataclasses.replace(self.rules, table=table, loss_microbatches=k)

    def constrain_grads(self, g: Any, lead: int = 0) -> Any:
        """Pin gradients inside the region to their parameters' tp/sp shardings.

        Without it XLA's partitioner leaves many weight gradients replicated over ``tp``
        inside the manual-dp region and slices them only after the dp reduction (measured:
        reduce-scatters of full-width [D, F] gradients, 1.5x the stage's dp bytes at dp 4 x
        tp 2). ``lead``: leading dims of the pipeline's arranged layer stack.
        """
        inner = self.inner_rules()
        logical = self.model.logical_axes()

        def one(ax, x):
            spec = inner.spec(ax)
            pad = [None] * (x.ndim - len(ax))
            return jax.lax.with_sharding_constraint(x, P(*pad, *spec))

        return jax.tree.map(one, logical, g, is_leaf=lambda x: isinstance(x, tuple))

    def hooks(self, stage_recompute: bool = False, reduced: tuple[str, ...] = ()) -> Hooks:
        """The layout's hooks into the model's forward (remat, ZeRO-3 gathers).

        ``stage_recompute``: the pipeline recomputes whole stages under ``remat full``; the
        layers inside then run without a checkpoint of their own (ZeRO-3 still must not keep
        gathered weights, which the ``none`` policy guarantees). ``reduced``: the layer stacks
        (``layers``, ``moe_layers``) whose gradient the backward reduces layer by layer
        (stages 0-2, :meth:`DPReduction.reduced_in_backward`); their scan then carries
        ``(params, slot)`` per layer.
        """
        red, dims = self.reduction, self.reduction.dims
        remat = remat_of("none") if stage_recompute else self.remat
        if red.stage < 3:
            sp = self.layout.sequence_parallel and self.layout.tp > 1

            def wrap(key):
                base = remat.wrap(regather=sp)
                if key not in reduced:
                    return base

                def around(body):
                    # Outside the checkpoint: the layer's params reach its (checkpointed) body
                    # through the identity whose backward reduces their gradient.
                    inner = base(body) if base is not None else body
                    return lambda x, t: inner(x, red.reduced_in_backward(key, *t))

                return around

            return Hooks(layer=wrap("layers"), moe_layer=wrap("moe_layers"))

        def stack(name):  # ZeRO-3: one packed gather per layer (per MoE group) in the scan
            return lambda lp: red.gather(lp, dims[name], red.auto_specs[name], shift=1)

        def head(fn):
            def gathered(hp, x, targets):
                sub = {k: dims[k] for k in hp}
                return fn(red.gather(hp, sub, {k: red.auto_specs[k] for k in hp}), x, targets)

            # Nothing saved: the backward regathers the head and recomputes it. A policy that
            # saves activations here would override the chunked loss's own checkpoint and keep
            # every chunk's fp32 softmax and one-hot ([chunks, B, C, V] each, 2-3x the logits
            # of the whole sequence); with nothing saved, the forward's loss scan is dead in
            # the backward and each chunk recomputes its logits there, as without ZeRO-3 (one
            # extra [B, S, D] x [D, V] matmul a step; XLA:GPU temporaries of llama3-8b, 4
            # layers, dp 8: 13.8 -> 10.1 GiB).
            policy = jax.checkpoint_policies.nothing_saveable
            return jax.checkpoint(gathered, prevent_cse=False, policy=policy)

        return Hooks(
            layer=remat.wrap(pre=stack("layers")),
            embed=lambda ep: red.gather(ep, dims["embed"], red.auto_specs["embed"]),
            head=head,
            moe_layer=remat.wrap(pre=stack("moe_layers")),
        )
