"""The Llama block in Flax NNX: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Each parameter is declared once, here, with its shape, initializer and logical axes
(``nnx.Param(..., logical_axes=...)``); the abstract tree, the shardings and the init all derive
from these declarations. Activation constraints name logical axes too; the active
:class:`jaxpar.sharding.Rules` turn them into mesh axes (and so into collectives).

Shape suffixes: B batch, S sequence, D model width, H query heads, K kv heads, G = H/K query
heads per kv head, Dh head dim, F FFN width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.sharding import constrain


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> jax.Array:
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


class RMSNorm(nnx.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019); statistics in fp32."""

    def __init__(self, d: int, eps: float):
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32), logical_axes=("embed",))
        self.eps = eps

    def __call__(self, x_BxSxD: jax.Array) -> jax.Array:
        x32 = x_BxSxD.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * inv * self.scale[...]).astype(x_BxSxD.dtype)


def rope(x_BxSxNxDh: jax.Array, positions_S: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (Su et al. 2021), half-split convention (as in Llama/HF)."""
    half = x_BxSxNxDh.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_SxHalf = positions_S.astype(jnp.float32)[:, None] * freq[None, :]
    sin, cos = jnp.sin(angle_SxHalf)[None, :, None, :], jnp.cos(angle_SxHalf)[None, :, None, :]
    x1, x2 = jnp.split(x_BxSxNxDh.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxSxNxDh.dtype)


def causal_attention(q_BxSxHxDh: jax.Array, k_BxSxKxDh: jax.Array, v_BxSxKxDh: jax.Array):
    """Softmax attention with a causal mask, grouped-query (H = K·G), softmax in fp32."""
    b, s, h, dh = q_BxSxHxDh.shape
    kvh = k_BxSxKxDh.shape[2]
    q_BxSxKxGxDh = q_BxSxHxDh.reshape(b, s, kvh, h // kvh, dh)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", q_BxSxKxGxDh, k_BxSxKxDh).astype(jnp.float32)
    logits = logits * (dh**-0.5)
    mask_SxS = jnp.tril(jnp.ones((s, s), bool))
    logits = jnp.where(mask_SxS, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_BxSxKxDh.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v_BxSxKxDh)
    return out.reshape(b, s, h, dh)


class Attention(nnx.Module):
    """Grouped-query self-attention; QKV column-parallel, output row-parallel over ``tp``."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, k, dh, std = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.hd, cfg.init_std
        self.wq = nnx.Param(
            _normal(rngs, (d, h, dh), std), logical_axes=("embed", "heads", "head_dim")
        )
        self.wk = nnx.Param(
            _normal(rngs, (d, k, dh), std), logical_axes=("embed", "kv_heads", "head_dim")
        )
        self.wv = nnx.Param(
            _normal(rngs, (d, k, dh), std), logical_axes=("embed", "kv_heads", "head_dim")
        )
        # Scaled init of the residual projections (GPT-2): std / sqrt(2 * layers).
        out_std = std / (2 * cfg.n_layers) ** 0.5
        self.wo = nnx.Param(
            _normal(rngs, (h, dh, d), out_std), logical_axes=("heads", "head_dim", "embed")
        )
        self.theta = cfg.rope_theta

    def __call__(self, x_BxSxD: jax.Array, positions_S: jax.Array) -> jax.Array:
        dt = x_BxSxD.dtype
        # Heads on tp: each TP rank computes its heads from the replicated input (no collective).
        q = constrain(
            jnp.einsum("bsd,dhk->bshk", x_BxSxD, self.wq[...].astype(dt)),
            ("batch", "seq", "heads", "head_dim"),
        )
        k = constrain(
            jnp.einsum("bsd,dhk->bshk", x_BxSxD, self.wk[...].astype(dt)),
            ("batch", "seq", "kv_heads", "head_dim"),
        )
        v = constrain(
            jnp.einsum("bsd,dhk->bshk", x_BxSxD, self.wv[...].astype(dt)),
            ("batch", "seq", "kv_heads", "head_dim"),
        )
        q, k = rope(q, positions_S, self.theta), rope(k, positions_S, self.theta)
        o_BxSxHxDh = causal_attention(q, k, v)
        o_BxSxHxDh = constrain(o_BxSxHxDh, ("batch", "seq", "heads", "head_dim"))
        # Row-parallel: contracting the tp-sharded heads gives partial sums -> one all-reduce.
        out = jnp.einsum("bshk,hkd->bsd", o_BxSxHxDh, self.wo[...].astype(dt))
        return constrain(out, ("batch", "seq", "embed"))


class MLP(nnx.Module):
    """SwiGLU (Shazeer 2020) or GELU feed-forward; up column-parallel, down row-parallel."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, std = cfg.d_model, cfg.d_ff, cfg.init_std
        self.kind = cfg.mlp
        if cfg.mlp == "swiglu":
            self.w_gate = nnx.Param(_normal(rngs, (d, f), std), logical_axes=("embed", "mlp"))
        self.w_up = nnx.Param(_normal(rngs, (d, f), std), logical_axes=("embed", "mlp"))
        self.w_down = nnx.Param(
            _normal(rngs, (f, d), std / (2 * cfg.n_layers) ** 0.5), logical_axes=("mlp", "embed")
        )

    def __call__(self, x_BxSxD: jax.Array) -> jax.Array:
        dt = x_BxSxD.dtype
        up_BxSxF = x_BxSxD @ self.w_up[...].astype(dt)
        if self.kind == "swiglu":
            h_BxSxF = jax.nn.silu(x_BxSxD @ self.w_gate[...].astype(dt)) * up_BxSxF
        else:
            h_BxSxF = jax.nn.gelu(up_BxSxF)
        h_BxSxF = constrain(h_BxSxF, ("batch", "seq", "mlp"))
        return constrain(h_BxSxF @ self.w_down[...].astype(dt), ("batch", "seq", "embed"))


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x_BxSxD: jax.Array, positions_S: jax.Array) -> jax.Array:
        x_BxSxD = x_BxSxD + self.attn(self.attn_norm(x_BxSxD), positions_S)
        x_BxSxD = x_BxSxD + self.mlp(self.mlp_norm(x_BxSxD))
        return constrain(x_BxSxD, ("batch", "seq", "embed"))
