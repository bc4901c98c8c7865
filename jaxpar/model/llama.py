"""Llama-style decoder with a pure functional boundary: embed → stack of blocks → head + loss.

Parameters are declared once in Flax NNX modules (:mod:`jaxpar.model.layers`); training works on
a plain nested dict of arrays::

    {"embed": {"table": [V, D]},
     "layers": {<Block params, each with a leading [L] axis>},
     "head": {"norm": {"scale": [D]}, "w_out": [D, V]}}      # no w_out when tied

A MoE model (``model.moe``) keeps its first ``first_dense`` blocks in ``layers`` (absent when
there are none) and the rest in ``moe_layers``: ``G`` groups, each ``every - 1`` dense blocks
(``dense``, ``[G, every-1, ...]``, absent when ``every`` is 1) then one MoE block (``moe``,
``[G, ...]``). Two stacks, each scanned with ``lax.scan`` over identical bodies, rather than one
stack of blocks that all carry both FFNs (E times the dense FFN's memory in every dense layer)
or a ``lax.switch`` per layer (every branch's parameters in every slice of the scan).

so that sharding, ZeRO, the layer scan and the pipeline executor can slice and place it without
touching the math. :class:`Model` binds the pure dict back into NNX modules per call (at trace
time only; the compiled program is the same as hand-written functions).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model.block import Block
from jaxpar.model.layers import Attend, RMSNorm, gather_sequence
from jaxpar.model.names import weight
from jaxpar.sharding import active_rules, constrain, use_rules

Params = dict[str, Any]
Wrap = Callable[[Callable], Callable]


def _same(x: Any) -> Any:
    return x


@dataclass(frozen=True)
class Hooks:
    """How a layout reaches into the forward without rewiring it (one wiring, every layout).

    ``layer`` wraps the layer-scan body ``(x, layer_params) -> (x, None)`` (remat policy, and
    the ZeRO-3 per-layer gather); ``embed`` maps the embedding params at their point of use
    (ZeRO-3: gathered once, its backward needs no weights); ``head`` wraps
    ``head_loss(head_params, x, targets)`` (ZeRO-3: gather inside a checkpoint, so the gathered
    head weights are not kept for the backward).
    """

    layer: Wrap | None = None
    embed: Callable[[Params], Params] = _same
    head: Wrap = _same
    moe_layer: Wrap | None = None  # as ``layer``, for the MoE group scan (``moe_layers``)


class Embed(nnx.Module):
    """Token embedding table, vocabulary on ``tp``."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        table = cfg.init_std * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model))
        self.table = nnx.Param(table, logical_axes=("vocab", "embed"))

    def __call__(self, tokens_BxS: jax.Array, dtype) -> jax.Array:
        # A gather from the vocab-sharded table: GSPMD partitions it as a masked local lookup
        # per tp rank plus an all-reduce over tp of [B, S, D] (the table is never gathered).
        x_BxSxD = jnp.take(self.table[...].astype(dtype), tokens_BxS, axis=0)
        # Pinned to `seq` first: straight to `act_seq` (Megatron-SP), GSPMD would all-gather the
        # table instead; from here the SP slice is local.
        x_BxSxD = constrain(x_BxSxD, ("batch", "seq", "embed"))
        return constrain(x_BxSxD, ("batch", "act_seq", "embed"))


class Head(nnx.Module):
    """Final norm and output projection (or the transposed embedding when tied)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tied_embeddings:
            w = cfg.init_std * jax.random.normal(rngs.params(), (cfg.d_model, cfg.vocab_size))
            self.w_out = nnx.Param(w, logical_axes=("embed", "vocab"))
        self.chunk = cfg.loss_chunk
        # A layout whose tp does not divide the vocabulary stores a padded one
        # (ModelConfig.padded_vocab): columns from here on are masked out of the softmax.
        self.vocab = cfg.vocab_size

    def _hidden(self, x_BxSxD: jax.Array, table_VxD: jax.Array | None):
        # Norm on the (sequence-sharded under SP) residual stream, then all-gather over tp into
        # the column-parallel vocabulary projection.
        h = gather_sequence(self.norm(x_BxSxD))
        w_DxV = table_VxD.T if table_VxD is not None else self.w_out[...]
        return h, weight(w_DxV.astype(h.dtype))

    def logits(self, x_BxSxD: jax.Array, table_VxD: jax.Array | None) -> jax.Array:
        h, w_DxV = self._hidden(x_BxSxD, table_VxD)
        return _logits(h, w_DxV)[..., : self.vocab]

    def loss(self, x_BxSxD, targets_BxS, table_VxD: jax.Array | None) -> jax.Array:
        """Mean cross entropy, in sequence chunks of at most ``loss_chunk`` positions.

        Only one chunk's fp32 logits ``[B, C, V/tp]`` exist at a time: a ``lax.scan`` over the
        chunks whose body is rematerialised, so the backward recomputes each chunk's logits
        from the normed hidden states (one extra ``[B, S, D] x [D, V]`` matmul) instead of
        keeping ``[B, S, V]``. Chunk ``k`` takes positions ``k, k + n, k + 2n, ...`` (n
        chunks): each chunk keeps the sequence sharding (over sp) of the whole.
        """
        h, w_DxV = self._hidden(x_BxSxD, table_VxD)
        b, s, d = h.shape
        n = _chunks(s, self.chunk)
        vocab = self.vocab if w_DxV.shape[-1] > self.vocab else None
        if n == 1:
            return _chunk_loss(h, targets_BxS, w_DxV, vocab) / (b * s)
        c = s // n
        h_NxBxCxD = jnp.moveaxis(h.reshape(b, c, n, d), 2, 0)
        t_NxBxC = jnp.moveaxis(targets_BxS.reshape(b, c, n), 2, 0)
        body = jax.checkpoint(_chunk_loss, policy=jax.checkpoint_policies.nothing_saveable,
                              static_argnums=(3,))  # fmt: skip

        def step(total, xs):
            return total + body(xs[0], xs[1], w_DxV, vocab), None

        total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), (h_NxBxCxD, t_NxBxC))
        return total / (b * s)


def _under(rules: Any, body: Callable) -> Callable:
    """``body`` traced under ``rules``: a function of its own, so that no trace of ``body``
    under other rules is reused for it (JAX caches a loop body's trace by function and
    shapes, not by the rules active while tracing)."""

    def fn(*args):
        with use_rules(rules):
            return body(*args)

    return fn


def _chunks(s: int, chunk: int) -> int:
    """The fewest equal chunks of at most ``chunk`` positions that cut ``s``."""
    n = -(-s // chunk)
    while s % n:
        n += 1
    return n


def _logits(h_BxSxD: jax.Array, w_DxV: jax.Array) -> jax.Array:
    # Vocab-sharded logits: each tp rank holds V/tp columns; fp32 for a stable softmax.
    logits = jnp.einsum("bsd,dv->bsv", h_BxSxD, w_DxV).astype(jnp.float32)
    return constrain(logits, ("batch", "seq", "vocab"))


def _chunk_loss(h_BxCxD: jax.Array, targets_BxC: jax.Array, w_DxV: jax.Array,
                vocab: int | None = None) -> jax.Array:  # fmt: skip
    """Summed cross entropy of one chunk (nats, fp32); ``vocab``: the true vocabulary of a
    padded ``w_DxV`` (:func:`cross_entropy`)."""
    h_BxCxD = constrain(h_BxCxD, ("batch", "seq", "embed"))
    return cross_entropy(_logits(h_BxCxD, w_DxV), targets_BxC, vocab) * targets_BxC.size


def cross_entropy(logits_BxSxV: jax.Array, targets_BxS: jax.Array,
                  vocab: int | None = None) -> jax.Array:  # fmt: skip
    """Mean next-token cross entropy in nats (fp32).

    ``vocab``: the true vocabulary when the last dim is padded past it (a tp that does not
    divide it, :meth:`jaxpar.config.ModelConfig.padded_vocab`): the padded columns are -inf in
    the softmax's normaliser, so they add nothing to the loss and get no gradient (the target
    is always a true column; its logit is read from the unmasked logits, where 0 * -inf
    would be NaN)."""
    masked_BxSxV = logits_BxSxV
    if vocab is not None and vocab < logits_BxSxV.shape[-1]:
        column_V = jax.lax.broadcasted_iota(jnp.int32, logits_BxSxV.shape, 2)
        masked_BxSxV = jnp.where(column_V < vocab, logits_BxSxV, -jnp.inf)
    lse_BxS = jax.nn.logsumexp(masked_BxSxV, axis=-1)
    onehot = jax.nn.one_hot(targets_BxS, logits_BxSxV.shape[-1], dtype=logits_BxSxV.dtype)
    # One-hot contraction instead of a gather keeps the vocab dimension sharded.
    picked_BxS = jnp.einsum("bsv,bsv->bs", logits_BxSxV, onehot)
    return jnp.mean(lse_BxS - picked_BxS)


def _stack(factory: Callable[[nnx.Rngs], nnx.Module], key: jax.Array, n: int) -> nnx.Module:
    """``n`` modules stacked on a leading axis, one key each."""

    @nnx.vmap(in_axes=0, out_axes=0)
    def stack(k):
        return factory(nnx.Rngs(params=k))

    return stack(jax.random.split(key, n))


class _MoeGroup(nnx.Module):
    """``every - 1`` dense blocks, then one MoE block."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, fp8_history: bool = False):
        if cfg.moe.every > 1:
            block = lambda r: Block(cfg, r, fp8_history=fp8_history)  # noqa: E731
            self.dense = _stack(block, rngs.params(), cfg.moe.every - 1)
        self.moe = Block(cfg, rngs, moe=True, fp8_history=fp8_history)


class _Full(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, fp8_history: bool = False):
        self.embed = Embed(cfg, rngs)
        if cfg.dense_prefix():
            block = lambda r: Block(cfg, r, fp8_history=fp8_history)  # noqa: E731
            self.layers = _stack(block, rngs.params(), cfg.dense_prefix())
        if cfg.moe.enabled:
            groups = cfg.moe_layers()
            group = lambda r: _MoeGroup(cfg, r, fp8_history)  # noqa: E731
            self.moe_layers = _stack(group, rngs.params(), groups)
        self.head = Head(cfg, rngs)


def _logical(state: nnx.State) -> Any:
    return jax.tree.map(
        lambda v: v.get_metadata()["logical_axes"],
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


class Model:
    """Functional view of the decoder for one :class:`ModelConfig`; ``fp8_history``: its dense
    blocks carry the amax histories of a delayed FP8 recipe (``layout.fp8='delayed'``,
    :mod:`jaxpar.model.fp8`), leaves ``fp8_*`` of the parameter tree."""

    def __init__(self, cfg: ModelConfig, fp8_history: bool = False):
        self.cfg, self.fp8_history = cfg, fp8_history
        abstract = nnx.eval_shape(lambda: _Full(cfg, nnx.Rngs(params=0), fp8_history))
        _, state = nnx.split(abstract)
        self._abstract_state = state
        self._defs: dict[str, tuple[Any, nnx.State]] = {}
        for name, factory in (
            ("embed", lambda: Embed(cfg, nnx.Rngs(params=0))),
            ("block", lambda: Block(cfg, nnx.Rngs(params=0), fp8_history=fp8_history)),
            (
                "moe_block",
                lambda: Block(
                    cfg, nnx.Rngs(params=0), moe=cfg.moe.enabled, fp8_history=fp8_history
                ),
            ),  # fmt: skip
            ("head", lambda: Head(cfg, nnx.Rngs(params=0))),
        ):
            self._defs[name] = nnx.split(nnx.eval_shape(factory))

    # ---- the parameter tree -----------------------------------------------------------------

    def init(self, key: jax.Array) -> Params:
        """Initial parameters (fp32). Jit it with ``out_shardings`` to create them sharded;
        with partitionable threefry the values do not depend on the sharding."""
        return nnx.to_pure_dict(nnx.state(_Full(self.cfg, nnx.Rngs(params=key), self.fp8_history)))

    def abstract(self) -> Params:
        """Shape/dtype tree of the parameters."""
        return jax.tree.map(
            lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(self._abstract_state)
        )

    def logical_axes(self) -> Params:
        """Logical axes of every parameter; stacked layers get a leading ``layers`` axis (the
        dense blocks inside a MoE group ``layers, sublayers``)."""
        tree = nnx.to_pure_dict(_logical(self._abstract_state))

        def stacked(t, lead=("layers",)):
            return jax.tree.map(lambda ax: lead + ax, t, is_leaf=lambda x: isinstance(x, tuple))

        if "layers" in tree:
            tree["layers"] = stacked(tree["layers"])
        if "moe_layers" in tree:
            group = tree["moe_layers"]
            group["moe"] = stacked(group["moe"])
            if "dense" in group:
                group["dense"] = stacked(group["dense"], ("layers", "sublayers"))
        return tree

    def _bind(self, name: str, params: Params) -> nnx.Module:
        graphdef, abstract = self._defs[name]
        state = jax.tree.map(lambda x: x, abstract)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)

    # ---- the functional boundary ------------------------------------------------------------

    def embed(self, params: Params, tokens_BxS: jax.Array, dtype=jnp.float32) -> jax.Array:
        """Token embeddings ``[B, S, D]`` in ``dtype``."""
        return self._bind("embed", params["embed"])(tokens_BxS, dtype)

    def block(
        self,
        layer_params: Params,
        x_BxSxD: jax.Array,
        positions_S: jax.Array,
        attend: Attend | None = None,
        moe: bool = False,
    ):
        """One decoder block on one layer's parameters (no leading layer axis); ``attend``
        replaces the attention core (:data:`jaxpar.model.layers.Attend`); ``moe``: a MoE
        block (``moe_layers/moe``), its statistics dropped."""
        return self._bind("moe_block" if moe else "block", layer_params)(
            x_BxSxD, positions_S, attend
        )

    def blocks(
        self,
        stacked: Params,
        x_BxSxD: jax.Array,
        positions_S: jax.Array,
        wrap: Callable[[Callable], Callable] | None = None,
    ) -> jax.Array:
        """Apply a stack of blocks (leading ``layers`` axis), in order.

        ``wrap`` transforms the per-layer body ``(x, layer_params) -> (x, None)``, e.g.
        ``jax.checkpoint`` with a remat policy, or a ZeRO-3 gather of the layer's weights.
        ``model.layer_unroll`` chooses the loop (:meth:`loop_unroll`).
        """

        def body(x, layer_params):
            return self.block(layer_params, x, positions_S), None

        return self._in_spans("layers", body, stacked, x_BxSxD, wrap)[0]

    def moe_groups(
        self,
        stacked: Params,
        x_BxSxD: jax.Array,
        positions_S: jax.Array,
        wrap: Callable[[Callable], Callable] | None = None,
    ) -> tuple[jax.Array, Any]:
        """Apply the MoE groups (``moe_layers``), in order: the output and the per-group
        :class:`jaxpar.model.moe.MoeStats` stacked ``[G, ...]``."""

        def body(x, group):
            return self.group(group, x, positions_S)

        return self._in_spans("moe_layers", body, stacked, x_BxSxD, wrap)

    def group(self, group: Params, x_BxSxD: jax.Array, positions_S: jax.Array):
        """One MoE group (one slice of ``moe_layers``): its dense blocks, then its MoE block;
        returns the output and the MoE block's :class:`jaxpar.model.moe.MoeStats`."""
        if "dense" in group:

            def body(x, layer_params):
                return self.block(layer_params, x, positions_S), None

            # one loop over the group's dense blocks, under the group's rules (its FP8 span)
            x_BxSxD = self._scan(body, group["dense"], x_BxSxD, None)[0]
        return self._bind("moe_block", group["moe"]).with_stats(x_BxSxD, positions_S)

    def _in_spans(self, stack: str, body: Callable, stacked: Params, x_BxSxD: jax.Array,
                  wrap) -> tuple:  # fmt: skip
        """:meth:`_scan` of ``body`` over the layer stack ``stack``; under an FP8 recipe with
        bf16 ends (``layout.fp8_bf16_first/last``, :meth:`ModelConfig.bf16_spans`) three
        loops, the stack's first and last entries traced with the recipe off (copies of their
        slices), the outputs concatenated."""
        rules = active_rules()
        n = jax.tree.leaves(stacked)[0].shape[0]
        first = last = 0
        if rules is not None and rules.fp8 != "none" and any(rules.fp8_bf16_ends):
            first, last = self.cfg.bf16_spans(*rules.fp8_bf16_ends).get(stack, (0, 0))
        if not (first or last):
            return self._scan(body, stacked, x_BxSxD, wrap)
        if n < first + last:  # config validation refuses this before tracing
            raise ValueError(f"fp8 bf16 ends {first} + {last} exceed the {n} entries of {stack}")
        bf16 = replace(rules, fp8="none")
        outs = []
        for lo, hi, seg_rules in ((0, first, bf16), (first, n - last, rules), (n - last, n, bf16)):
            if hi > lo:
                part = jax.tree.map(lambda a, lo=lo, hi=hi: a[lo:hi], stacked)
                x_BxSxD, out = self._scan(body, part, x_BxSxD, wrap, seg_rules)
                outs.append(out)
        return x_BxSxD, jax.tree.map(lambda *o: jnp.concatenate(o), *outs)

    def _scan(self, body: Callable, stacked: Params, x_BxSxD: jax.Array, wrap,
              rules: Any = None) -> tuple:  # fmt: skip
        """``body`` over the leading axis of ``stacked`` (wrapped), as ``model.layer_unroll``
        says; returns the carry and the bodies' stacked outputs. ``rules``: the wrapped body
        traced under them (the wrap too: a ZeRO-3 gather follows the recipe of its layers)."""
        fn = wrap(body) if wrap else body
        fn = _under(rules, fn) if rules is not None else fn
        n = jax.tree.leaves(stacked)[0].shape[0]
        unroll = self.loop_unroll(n, wrap is not None)
        if unroll is None:
            outs = []
            for i in range(n):
                x_BxSxD, out = fn(x_BxSxD, jax.tree.map(lambda a, i=i: a[i], stacked))
                outs.append(out)
            return x_BxSxD, jax.tree.map(lambda *o: jnp.stack(o), *outs)
        return jax.lax.scan(fn, x_BxSxD, stacked, unroll=unroll)

    def loop_unroll(self, n_layers: int, wrapped: bool) -> int | None:
        """How :meth:`blocks` loops over ``n_layers`` layers: ``None`` for straight-line code
        (``layer_unroll`` 0), else the ``lax.scan`` unroll factor.

        Unrolled layers keep each layer's residuals as separate buffers; a rolled scan writes
        them into ``[L, ...]`` stacks in the forward and reads them back in the backward. A
        wrapped body (remat, ZeRO-3 gathers) always runs in a rolled scan: in straight-line
        code (which a scan unrolled to its length also becomes) XLA may merge the backward's
        recomputation with the forward and keep what the wrap meant to drop.
        """
        u = self.cfg.layer_unroll
        if wrapped:
            return 1
        return None if u == 0 else min(u, n_layers)

    def logits(self, params: Params, x_BxSxD: jax.Array) -> jax.Array:
        """Final norm and vocabulary projection, fp32 ``[B, S, V]``."""
        table = params["embed"]["table"] if self.cfg.tied_embeddings else None
        return self._bind("head", params["head"]).logits(x_BxSxD, table)

    def head_loss(self, params: Params, x_BxSxD: jax.Array, targets_BxS: jax.Array):
        """Mean cross entropy of the last hidden states against the targets (chunked over
        the sequence, :meth:`Head.loss`: never ``[B, S, V]`` fp32 logits at once)."""
        table = params["embed"]["table"] if self.cfg.tied_embeddings else None
        return self._bind("head", params["head"]).loss(x_BxSxD, targets_BxS, table)

    def head_params(self, params: Params) -> Params:
        """The parameters :meth:`head_loss` reads (the embedding table too when tied)."""
        out = {"head": params["head"]}
        if self.cfg.tied_embeddings:
            out["embed"] = params["embed"]
        return out

    def loss(
        self,
        params: Params,
        tokens_BxS: jax.Array,
        targets_BxS: jax.Array,
        dtype=jnp.float32,
        hooks: Hooks | None = None,
    ) -> jax.Array:
        """Mean next-token loss of the whole model: embed → blocks → head and loss.

        This is the one wiring of the model; the pipeline runs the same three pieces
        (:meth:`embed`, :meth:`blocks` as its stage function, :meth:`head_loss`) under the
        same ``hooks``.
        """
        return self.loss_and_stats(params, tokens_BxS, targets_BxS, dtype, hooks)[0]

    def loss_and_stats(
        self,
        params: Params,
        tokens_BxS: jax.Array,
        targets_BxS: jax.Array,
        dtype=jnp.float32,
        hooks: Hooks | None = None,
    ) -> tuple[jax.Array, Any]:
        """:meth:`loss` and the MoE layers' :class:`jaxpar.model.moe.MoeStats` ``[G, ...]``
        (None for a dense model); the loss includes ``moe.aux_loss`` times the mean over the
        MoE layers of their balancing loss."""
        hooks = hooks or Hooks()
        # Static positions: the rotary tables become constants (jaxpar.model.layers.rope).
        positions_S = np.arange(tokens_BxS.shape[1])
        x = self.embed({"embed": hooks.embed(params["embed"])}, tokens_BxS, dtype)
        if "layers" in params:
            x = self.blocks(params["layers"], x, positions_S, hooks.layer)
        stats = None
        if "moe_layers" in params:
            wrap = hooks.moe_layer if hooks.moe_layer is not None else hooks.layer
            x, stats = self.moe_groups(params["moe_layers"], x, positions_S, wrap)
        loss = hooks.head(self.head_loss)(self.head_params(params), x, targets_BxS)
        if stats is not None and self.cfg.moe.aux_loss:
            loss = loss + self.cfg.moe.aux_loss * jnp.mean(stats.aux)
        return loss, stats
