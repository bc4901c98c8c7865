"""Sampling from the decoder: a jitted prefill, then one ``lax.while_loop`` of decode steps over a
KV cache, each compiled once per (batch, prompt length, new tokens) shape — never per token.

The model's own layers do the math (:meth:`jaxpar.model.Model.block` with an ``attend`` hook):
``Attention.qkv`` projects and rotates, the hook writes k and v into the cache and attends over
it (:func:`cached_attention`), ``Attention.out`` projects back. Prompts of different lengths are
left-padded to the longest, ``P``: row ``b`` has ``pad_b`` pads, its token at cache slot ``i``
sits at position ``i − pad_b`` (rotary positions are per row), and its keys before ``pad_b``
are masked, so every row computes exactly what it would alone. All rows then write the same
cache slot each step.

Cache: ``[L, B, M, K, Dh]`` for keys and for values (``M = P + new tokens``), heads sharded over
``tp`` like the attention heads themselves (each tp rank keeps its heads' cache: no collective
beyond the block's own all-reduces), updated in place (``dynamic_update_slice`` on the loop's
carry).

Sampling (:func:`next_token`): temperature 0 is greedy; otherwise logits / temperature, then
top-k, then top-p (nucleus: the smallest set of most likely tokens whose probability reaches
``p``), then a categorical draw with key ``fold_in(key(seed), t)`` at step ``t``. A row that
emits the end-of-text token stops; the loop ends when every row has stopped.

A MoE model (``model.moe``) decodes through the same stacks as its forward (dense prefix,
then the MoE groups), routing each token as training does (top-k of score + the learned
bias, gates from the scores) but **dropless**: a capacity factor set for training is ignored
(:func:`decode_model`). With a capacity, which assignments an expert drops depends on the other
tokens of the sequence (GShard's priority), so a prompt's pads and a one-token decode step
would route unlike the whole sequence; dropless, every token's output depends on itself only,
and cached decoding equals the dropless forward on the whole sequence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.errors import ConfigError
from jaxpar.model import Model
from jaxpar.sharding import Rules, constrain, use_rules

NEG = float(jnp.finfo(jnp.float32).min)
CACHE_AXES = ("layers", "batch", None, "heads", "head_dim")  # [L, B, M, K, Dh]


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits."""

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    def check(self, vocab_size: int) -> None:
        """Refuse bad values in one line (before anything compiles)."""
        t, k, p = self.temperature, self.top_k, self.top_p
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise ConfigError(f"--temperature={t}: must be a finite number >= 0 (0: greedy)")
        if not isinstance(k, int) or k < 0:
            raise ConfigError(f"--top-k={k}: must be an integer >= 0 (0: off)")
        if k > vocab_size:
            raise ConfigError(f"--top-k={k}: larger than the vocabulary ({vocab_size})")
        if not (isinstance(p, (int, float)) and 0 < p <= 1):
            raise ConfigError(f"--top-p={p}: must be in (0, 1] (1: off)")


def next_token(logits_BxV: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """One token per row, int32 ``[B]`` (``s`` is static)."""
    if s.temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits = logits_BxV.astype(jnp.float32) / s.temperature
    if s.top_k:
        kth_Bx1 = jax.lax.top_k(logits, s.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth_Bx1, NEG, logits)
    if s.top_p < 1:
        desc = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(desc, axis=-1)
        # Keep a token while the mass of the more likely ones is below p (the first always).
        keep = jnp.cumsum(probs, axis=-1) - probs < s.top_p
        cutoff_Bx1 = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff_Bx1, NEG, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def cached_attention(
    q_BxTxHxDh: jax.Array, k_BxMxKxDh: jax.Array, v_BxMxKxDh: jax.Array, mask_BxTxM: jax.Array
) -> jax.Array:
    """Grouped-query softmax attention of T queries over a cache of M slots, under a mask."""
    b, t, h, dh = q_BxTxHxDh.shape
    kvh = k_BxMxKxDh.shape[2]
    q = q_BxTxHxDh.reshape(b, t, kvh, h // kvh, dh)
    logits = jnp.einsum("btkgd,bmkd->bkgtm", q, k_BxMxKxDh).astype(jnp.float32) * dh**-0.5
    logits = jnp.where(mask_BxTxM[:, None, None], logits, NEG)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_BxMxKxDh.dtype)
    return jnp.einsum("bkgtm,bmkd->btkgd", probs, v_BxMxKxDh).reshape(b, t, h, dh)


def forward(model: Model, params, tokens_BxT, cache, index, pad_B, dtype=jnp.float32):
    """Feed ``T`` tokens at cache slots ``index .. index+T-1``: last position's logits
    ``[B, V]`` and the updated cache ``(k, v)``.

    The layers run as the training forward runs them: the dense stack ``layers``, then (a MoE
    model) the groups of ``moe_layers``, each ``every - 1`` dense blocks and one MoE block.
    Cache layer ``i`` is model layer ``i`` in that order."""
    b, t = tokens_BxT.shape
    slots_T = index + jnp.arange(t)
    positions_BxT = jnp.maximum(slots_T[None, :] - pad_B[:, None], 0)
    m = cache[0].shape[2]
    keys_M = jnp.arange(m)
    # Slot j is visible to the query at slot i iff pad_b <= j <= i.
    mask_BxTxM = (keys_M[None, None, :] <= slots_T[None, :, None]) & (
        keys_M[None, None, :] >= pad_B[:, None, None]
    )

    def layer(carry, layer_params, i, moe=False):
        x, k_cache, v_cache = carry

        def attend(q, k, v):
            nonlocal k_cache, v_cache
            at = (i, 0, index, 0, 0)
            k_cache = jax.lax.dynamic_update_slice(k_cache, k[None].astype(k_cache.dtype), at)
            v_cache = jax.lax.dynamic_update_slice(v_cache, v[None].astype(v_cache.dtype), at)
            k_all = jax.lax.dynamic_index_in_dim(k_cache, i, 0, keepdims=False)
            v_all = jax.lax.dynamic_index_in_dim(v_cache, i, 0, keepdims=False)
            return cached_attention(q, k_all.astype(q.dtype), v_all.astype(q.dtype), mask_BxTxM)

        return model.block(layer_params, x, positions_BxT, attend, moe), k_cache, v_cache

    def stack(carry, stacked, layer_ids):
        return jax.lax.scan(lambda c, xs: (layer(c, *xs), None), carry, (stacked, layer_ids))[0]

    cfg = model.cfg
    carry = (model.embed(params, tokens_BxT, dtype), *cache)
    if "layers" in params:
        carry = stack(carry, params["layers"], jnp.arange(cfg.dense_prefix()))
    if "moe_layers" in params:
        every = cfg.moe.every

        def group(carry, xs):
            group_params, first = xs
            if "dense" in group_params:
                carry = stack(carry, group_params["dense"], first + jnp.arange(every - 1))
            return layer(carry, group_params["moe"], first + every - 1, moe=True), None

        firsts_G = cfg.dense_prefix() + every * jnp.arange(cfg.moe_layers())
        carry, _ = jax.lax.scan(group, carry, (params["moe_layers"], firsts_G))
    x, k_cache, v_cache = carry
    logits = model.logits(params, x[:, -1:])[:, 0]
    return logits, (constrain(k_cache, CACHE_AXES), constrain(v_cache, CACHE_AXES))


def decode_model(model: Model) -> Model:
    """``model`` routing without capacity (``model.moe.capacity_factor`` 0): what sampling
    runs, so that each token's experts and gates depend on that token alone."""
    cfg = model.cfg
    moe = dataclasses.replace(cfg.moe, capacity_factor=0.0)
    return Model(dataclasses.replace(cfg, moe=moe))


@dataclass(frozen=True)
class Generation:
    """Tokens generated per row (up to, not including, the end-of-text token) and timings."""

    tokens: list[list[int]]
    steps: int  # decode steps run (the loop stops once every row has ended)
    prefill_s: float
    decode_s: float
    compile_s: float

    @property
    def tokens_per_s(self) -> float | None:
        """Decode throughput: rows × decode steps after the first token / decode time."""
        n = len(self.tokens) * (self.steps - 1)
        return n / self.decode_s if n and self.decode_s > 0 else None


class Generator:
    """Compiled prefill and decode loop of ``model`` on ``mesh`` under the layout's ``rules``.

    Executables are compiled ahead of time for the params' shardings and cached per (batch,
    prompt length, new tokens, sampling, end-of-text id): repeated calls of one shape compile
    nothing. Activations are computed in ``dtype``.
    """

    def __init__(self, model: Model, mesh, rules: Rules, dtype=jnp.float32):
        moe = model.cfg.moe
        if moe.enabled and moe.capacity_factor:  # sampling is dropless (see decode_model)
            model = decode_model(model)
        self.model, self.mesh, self.rules, self.dtype = model, mesh, rules, dtype
        self._compiled: dict[tuple, tuple[Any, Any]] = {}

    def _cache_shape(self, b: int, m: int) -> tuple[int, ...]:
        c = self.model.cfg
        from jaxpar.model.attention import kv_repeat

        r = kv_repeat(c.n_heads, c.n_kv_heads, self.rules.head_shards) or 1
        return (c.n_layers, b, m, c.n_kv_heads * r, c.hd)

    def _build(self, params: Any, b: int, p: int, n: int, s: Sampling, eos: int):
        model, dtype = self.model, self.dtype
        shape = self._cache_shape(b, p + n)

        def prefill(params, prompt_BxP, pad_B, key):
            zeros = jnp.zeros(shape, dtype)
            cache = (constrain(zeros, CACHE_AXES), constrain(zeros, CACHE_AXES))
            logits, cache = forward(model, params, prompt_BxP, cache, 0, pad_B, dtype)
            return next_token(logits, jax.random.fold_in(key, 0), s), cache

        def decode(params, first_B, cache, pad_B, key):
            out_BxN = jnp.full((b, n), eos, jnp.int32).at[:, 0].set(first_B)

            def cond(st):
                t, _, _, _, done = st
                return (t < n) & ~jnp.all(done)

            def step(st):
                t, tok_B, cache, out_BxN, done = st
                # The token sampled at step t-1 goes into slot P + t - 1.
                logits, cache = forward(
                    model, params, tok_B[:, None], cache, p + t - 1, pad_B, dtype
                )
                nxt = jnp.where(done, eos, next_token(logits, jax.random.fold_in(key, t), s))
                out_BxN = jax.lax.dynamic_update_slice(out_BxN, nxt[:, None], (0, t))
                return t + 1, nxt, cache, out_BxN, done | (nxt == eos)

            st = (jnp.int32(1), first_B, cache, out_BxN, first_B == eos)
            t, _, _, out_BxN, _ = jax.lax.while_loop(cond, step, st)
            return out_BxN, t

        rep = NamedSharding(self.mesh, P())
        cache_sh = NamedSharding(self.mesh, self.rules.spec(CACHE_AXES))
        sds = lambda shp, dt, sh=rep: jax.ShapeDtypeStruct(shp, dt, sharding=sh)  # noqa: E731
        params = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), params
        )
        key = jax.eval_shape(lambda: jax.random.key(0))
        key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep)
        with jax.set_mesh(self.mesh), use_rules(self.rules):
            pre = jax.jit(prefill, out_shardings=(rep, (cache_sh, cache_sh)))
            pre = pre.lower(params, sds((b, p), jnp.int32), sds((b,), jnp.int32), key).compile()
            dec = jax.jit(decode, out_shardings=(rep, rep))
            cache = (sds(shape, dtype, cache_sh), sds(shape, dtype, cache_sh))
            dec = dec.lower(params, sds((b,), jnp.int32), cache, sds((b,), jnp.int32), key)
            dec = dec.compile()
        return pre, dec

    def generate(
        self,
        params: Any,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        seed: int = 0,
        eos_id: int | None = None,
    ) -> Generation:
        """Continue each prompt (token ids) by up to ``max_new_tokens`` tokens."""
        c = self.model.cfg
        check_prompts(prompts, max_new_tokens, c.max_seq_len)
        sampling.check(c.vocab_size)
        b, p, n = len(prompts), max(len(x) for x in prompts), max_new_tokens
        eos = -1 if eos_id is None else int(eos_id)
        shape_key = (b, p, n, sampling, eos)
        t0 = time.perf_counter()
        if shape_key not in self._compiled:
            self._compiled[shape_key] = self._build(params, b, p, n, sampling, eos)
        compile_s = time.perf_counter() - t0
        pre, dec = self._compiled[shape_key]
        rep = NamedSharding(self.mesh, P())
        pad = np.array([p - len(x) for x in prompts], np.int32)
        padded = np.array([[0] * (p - len(x)) + list(x) for x in prompts], np.int32)
        args = [jax.device_put(a, rep) for a in (padded, pad)]
        key = jax.device_put(jax.random.key(seed), rep)
        t1 = time.perf_counter()
        first, cache = pre(params, args[0], args[1], key)
        first.block_until_ready()
        t2 = time.perf_counter()
        out, steps = dec(params, first, cache, args[1], key)
        out = np.asarray(out)
        t3 = time.perf_counter()
        rows = [list(map(int, r)) for r in out]
        rows = [r[: r.index(eos)] if eos in r else r for r in rows]
        return Generation(rows, int(steps), t2 - t1, t3 - t2, compile_s)


def check_prompts(prompts: list[list[int]], max_new_tokens: int, max_seq_len: int) -> None:
    """Refuse an empty batch or prompt, or a prompt that does not fit the context."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={max_new_tokens}: must be a positive integer")
    if not prompts:
        raise ConfigError("--prompt: no prompts given")
    for i, x in enumerate(prompts):
        if not x:
            raise ConfigError(f"prompt {i + 1}: encodes to no tokens")
        if len(x) + max_new_tokens > max_seq_len:
            raise ConfigError(
                f"prompt {i + 1}: {len(x)} tokens + --max-new-tokens={max_new_tokens} exceed the "
                f"context model.max_seq_len={max_seq_len}"
            )


@contextlib.contextmanager
def count_compilations() -> Iterator[list[str]]:
    """Collect one entry per XLA backend compilation inside the block (jax.monitoring)."""
    seen: list[str] = []

    def listener(name: str, *args, **kwargs) -> None:
        if name.endswith("backend_compile_duration"):
            seen.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
