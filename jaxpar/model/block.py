"""The decoder block: attention then a feed-forward, dense (:class:`~jaxpar.model.layers.MLP`)
or a mixture of experts (:class:`~jaxpar.model.moe.MoE`). Its own module so that ``layers``
(the dense parts) and ``moe`` (which builds its shared experts from ``layers.MLP``) import one
way."""

from __future__ import annotations

import jax
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model.layers import MLP, Attend, Attention, RMSNorm
from jaxpar.model.moe import MoE
from jaxpar.sharding import constrain


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)); with ``moe`` the
    feed-forward is a mixture of experts (:class:`jaxpar.model.moe.MoE`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False,
                 fp8_history: bool = False):  # fmt: skip
        """``fp8_history``: the FP8 GEMMs' amax histories of a delayed recipe
        (:mod:`jaxpar.model.fp8`)."""
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, rngs, fp8_history)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # The one switch between a dense and a MoE block: which feed-forward it holds.
        self.mlp = MoE(cfg, rngs, fp8_history) if moe else MLP(cfg, rngs, fp8_history=fp8_history)

    def __call__(
        self, x_BxSxD: jax.Array, positions_S: jax.Array, attend: Attend | None = None
    ) -> jax.Array:
        return self.with_stats(x_BxSxD, positions_S, attend)[0]

    def with_stats(self, x_BxSxD: jax.Array, positions_S: jax.Array, attend: Attend | None = None):
        """The block's output and its MoE statistics (None for a dense block)."""
        x_BxSxD = constrain(x_BxSxD, ("batch", "act_seq", "embed"))
        x_BxSxD = x_BxSxD + self.attn(self.attn_norm(x_BxSxD), positions_S, attend)
        stats = None
        if isinstance(self.mlp, MLP):
            y_BxSxD = self.mlp(self.mlp_norm(x_BxSxD))
        else:
            y_BxSxD, stats = self.mlp(self.mlp_norm(x_BxSxD))
        # The residual stream (and so the norms) stays sequence-sharded between blocks.
        return constrain(x_BxSxD + y_BxSxD, ("batch", "act_seq", "embed")), stats
