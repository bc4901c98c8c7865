"""Loss and gradients of the whole model through the pipeline executor (``layout.pp > 1``).

``Trainer.grads_fn`` calls :func:`pipeline_grads` instead of its accumulation scan. Embedding
and its backward run as GSPMD code before and after the pipeline; the layer stack and the head
run inside :func:`jaxpar.pipeline.executor.run_pipeline`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar import sharding as shd
from jaxpar.config import LayoutConfig
from jaxpar.model import Model
from jaxpar.pipeline.executor import Plan, arrange, run_pipeline, stage_specs, unarrange


@lru_cache(maxsize=16)
def plan_for(kind: str, p: int, m: int, v: int, n_layers: int) -> Plan:
    """The (cached) plan of a layout's schedule."""
    return Plan.make(kind, p, m, v, n_layers)


def pipeline_grads(
    model: Model,
    params: Any,
    tokens_BxS: jax.Array,
    targets_BxS: jax.Array,
    layout: LayoutConfig,
    dtype=jnp.float32,
    wrap: Callable | None = None,
    recompute: bool = False,
) -> tuple[jax.Array, Any]:
    """Mean loss over ``layout.microbatches`` micro-batches and gradients of ``params``.

    Must be traced under ``jax.set_mesh`` (a mesh with a ``pp`` axis) and ``use_rules``.
    ``wrap`` is the per-layer remat wrapper inside a stage; ``recompute`` stashes only each
    stage's input and recomputes the stage in its backward.
    """
    from jaxpar.train.step import microbatch_split

    m = layout.microbatches
    plan = plan_for(layout.schedule, layout.pp, m, layout.virtual, model.cfg.n_layers)
    rules = shd.active_rules() or shd.rules_for(model.cfg, layout)
    logical = model.logical_axes()["layers"]
    layer_specs = jax.tree.map(rules.spec, logical, is_leaf=lambda x: isinstance(x, tuple))
    staged = arrange(params["layers"], plan, stage_specs(layer_specs))
    rest = {k: v for k, v in params.items() if k != "layers"}
    positions = jnp.arange(tokens_BxS.shape[1])

    def embed(emb):
        x = model.embed({"embed": emb}, tokens_BxS, dtype)
        return microbatch_split(x, m)  # [m, B/m, S, D], dp stays on the row dimension

    x_mb, embed_pullback = jax.vjp(embed, params["embed"])

    def stage_fn(chunk, x):
        return model.blocks(chunk, x, positions, wrap)

    def head_loss(r, y, tg):
        return model.head_loss(r, y, tg)

    loss, d_staged, d_rest, dx = run_pipeline(
        plan,
        stage_fn,
        head_loss,
        staged,
        rest,
        x_mb,
        microbatch_split(targets_BxS, m),
        recompute,
    )
    (d_embed,) = embed_pullback(dx.astype(x_mb.dtype))
    grads = dict(d_rest)
    grads["embed"] = jax.tree.map(jnp.add, d_rest["embed"], d_embed)
    grads["layers"] = unarrange(d_staged, plan)
    return loss, grads
