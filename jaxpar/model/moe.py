"""Mixture-of-experts feed-forward with expert parallelism folded onto data parallelism.

A MoE block replaces the SwiGLU FFN by a router, ``E`` routed SwiGLU experts of width ``F`` of
which each token uses ``k``, and optional shared experts (one SwiGLU of width
``shared_experts · F`` that every token runs, as DeepSeek and Qwen). Shape suffixes: B batch
rows, S sequence, D model width, E experts, K = top_k, C slots per expert per sequence, F
expert width, N tokens an expert receives.

**Routing** (fp32): scores are ``softmax`` (Mixtral, Qwen) or ``sigmoid`` (DeepSeek-V3) of
``x · W_router``; the ``k`` experts with the highest ``score + bias`` are chosen
(``lax.top_k``: ties go to the lower expert index, so every layout routes every token alike);
their scores, normalised to sum 1 and scaled by ``route_scale``, gate the outputs. The bias is
the auxiliary-loss-free balancing of DeepSeek-V3: a per-expert, per-layer vector in the
parameter tree that selection reads and the gradient never reaches (``stop_gradient``, the
``expert_bias`` logical axis keeps it out of weight decay); after each step
:func:`update_bias` moves it by ``bias_rate · sign(mean load − load)``. So it is in the train
state and in checkpoints like any other leaf. A Switch-style auxiliary loss
``E · Σ_e f_e · P_e`` (per sequence, averaged) is added with coefficient ``aux_loss``.

**Capacity** is per sequence, not per device, so the tokens dropped do not depend on the
layout: expert ``e`` takes at most ``C = ceil(capacity_factor · k · S / E)`` assignments of a
row, first choices before second choices, then by position (GShard's priority); dropless
(``capacity_factor`` 0) is ``C = S``, the most one expert can receive from one row.

**Dispatch** is a padded buffer ``[E, B·C, D]``: each kept assignment scattered to its
expert's slot, the experts applied as batched einsums (a grouped matmul over equal groups),
the outputs gathered back and summed with the gates. XLA:CPU implements no
``ragged-all-to-all``, so this padded form is the CPU path; on GPU targets
(``model.moe.dispatch`` auto) :mod:`jaxpar.model.ragged` sends only the ``k·B·S`` kept
rows over ``ep`` (a ragged all-to-all) and computes them in this padded layout, with the
same result.

**Expert parallelism: folded onto dp, not a fifth mesh axis.** ``layout.ep`` divides
``layout.dp``; the mesh splits ``dp`` into ``edp × ep`` exactly as hybrid sharding splits it
into ``dpr × dps`` (:func:`jaxpar.devices.make_mesh`), and the batch runs over both. Every
mesh helper, the planner's device count, the CLI and the pipeline keep assuming the four axes
``pp × dp × sp × tp`` with ``pp·dp·sp·tp`` devices, and the gradient path
(:mod:`jaxpar.train.reduce`) already handles a dp split in two; a separate axis would have
touched all of them to say what DeepSpeed-MoE says with one: experts are parallel *within*
the data-parallel group, and the non-expert weights stay data-parallel over the same devices.
Routed experts are sharded over ``ep`` (the ``experts`` logical axis), everything else is
replicated over it; ZeRO shards over ``edp`` (``dp/ep`` ranks). The step's region is manual
over ``edp`` and ``ep``, so here each device sorts its tokens into the buffer, one tiled
``all_to_all`` over ``ep`` sends expert ``e``'s slots to its owner, the owner runs its
``E/ep`` experts on ``ep·B·C`` rows, and the inverse all-to-all returns them. Outside that
region (evaluation) the exchange runs in a ``shard_map`` of its own. TP splits each expert's
FFN (``F`` on ``tp``: column- then row-parallel, one all-reduce over tp). Gradients: the
all-to-all's transpose brings every ep rank's cotangents to the owner, so an expert's gradient
is whole on its owner and is not all-reduced over ``ep`` (:class:`jaxpar.train.reduce.
DPReduction` ``ep_dims``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config import ModelConfig, MoeConfig
from jaxpar.model import fp8, ragged
from jaxpar.model.attention import target
from jaxpar.model.layers import MLP, gather_sequence
from jaxpar.model.names import projected, weight
from jaxpar.sharding import active_rules, constrain, use_rules

EP_AXIS = "ep"


class RoutingBias(nnx.Variable):
    """Per-expert selection bias of auxiliary-loss-free balancing (not trained by gradient)."""


class MoeStats(NamedTuple):
    """What one MoE layer reports per step (a pytree; stacked ``[G, ...]`` by the layer scan).

    ``load``: assignments routed to each expert before any drop ``[E]`` (a count, summed over
    the batch); ``dropped``: assignments over capacity (count); ``aux``: the Switch balancing
    loss (mean over sequences)."""

    load: jax.Array
    dropped: jax.Array
    aux: jax.Array


class Routing(NamedTuple):
    """Where a row's assignments go: ``slot`` in the ``[E·C]`` buffer (``E·C`` when dropped),
    their gates (0 when dropped) and the layer's statistics."""

    slot_BxSxK: jax.Array
    gate_BxSxK: jax.Array
    stats: MoeStats


def capacity(cfg: ModelConfig, seq_len: int) -> int:
    """Slots per expert per sequence: ``S`` dropless, else ``ceil(c·k·S/E)`` (at most S; the
    rule is :meth:`jaxpar.config.MoeConfig.capacity`, which validation reads without JAX)."""
    return cfg.moe.capacity(seq_len)


def route(cfg: ModelConfig, logits_BxSxE: jax.Array, bias_E: jax.Array, c: int) -> Routing:
    """Top-k selection, gates, capacity slots and statistics from fp32 router logits."""
    e = cfg.moe
    n_e, k = logits_BxSxE.shape[-1], e.top_k
    if e.router == "sigmoid":
        scores = jax.nn.sigmoid(logits_BxSxE)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    else:
        scores = probs = jax.nn.softmax(logits_BxSxE, axis=-1)
    # Selection sees the bias, the gates do not (DeepSeek-V3); ties: lower index first.
    _, expert_BxSxK = jax.lax.top_k(scores + jax.lax.stop_gradient(bias_E), k)
    picked = jnp.take_along_axis(scores, expert_BxSxK, axis=-1)
    gate_BxSxK = e.route_scale * picked / jnp.sum(picked, axis=-1, keepdims=True)
    # Position of each assignment in its expert's queue: choice-major, then by position.
    b, s, _ = expert_BxSxK.shape
    onehot_BxKxSxE = jax.nn.one_hot(jnp.swapaxes(expert_BxSxK, 1, 2), n_e, dtype=jnp.int32)
    queue = jnp.cumsum(onehot_BxKxSxE.reshape(b, k * s, n_e), axis=1).reshape(onehot_BxKxSxE.shape)
    pos_BxSxK = jnp.swapaxes(jnp.sum(queue * onehot_BxKxSxE, axis=-1) - 1, 1, 2)
    kept = pos_BxSxK < c
    slot_BxSxK = jnp.where(kept, expert_BxSxK * c + pos_BxSxK, n_e * c)
    gate_BxSxK = jnp.where(kept, gate_BxSxK, 0.0)
    count_BxE = jnp.sum(onehot_BxKxSxE, axis=(1, 2)).astype(jnp.float32)
    # Switch loss per row: E · Σ_e (fraction of the row's assignments) · (mean probability).
    aux_B = n_e * jnp.sum(count_BxE / (k * s) * jnp.mean(probs, axis=1), axis=-1)
    stats = MoeStats(
        load=jnp.sum(count_BxE, axis=0),
        dropped=jnp.sum(~kept).astype(jnp.float32),
        aux=jnp.mean(aux_B),
    )
    return Routing(slot_BxSxK, gate_BxSxK, stats)


def _experts(x_ExNxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *histories):
    """The routed experts as batched einsums over equal groups (SwiGLU per expert);
    ``histories``: the gate, up and down GEMMs' amax histories under a delayed FP8 recipe."""
    dt = x_ExNxD.dtype
    recipe = fp8.active()  # layout.fp8: each expert's GEMMs in FP8 (jaxpar.model.fp8)
    h_gate, h_up, h_down = histories or (None, None, None)
    if recipe is None:
        mm = lambda x, w, h: jnp.einsum("end,edf->enf", x, w)  # noqa: E731
    else:
        mm = lambda x, w, h: projected(fp8.experts(x, w, recipe, h))  # noqa: E731
    g = mm(x_ExNxD, weight(w_gate_ExDxF.astype(dt)), h_gate)
    u = mm(x_ExNxD, weight(w_up_ExDxF.astype(dt)), h_up)
    # Column-parallel up (F on tp), row-parallel down: one all-reduce over tp of [E, N, D].
    h_ExNxF = constrain(jax.nn.silu(g) * u, ("experts", None, "mlp"))
    y = mm(h_ExNxF, weight(w_down_ExFxD.astype(dt)), h_down)
    return constrain(y, ("experts", None, "embed"))


def routed(x_BxSxD, slot_BxSxK, gate_BxSxK, ws, n_experts: int, c: int, ep: bool):
    """Dispatch to the routed experts, apply them, combine: local rows, local expert weights
    ``ws`` (``[E/ep, ...]``); ``ep``: exchange over the manual ``ep`` axis."""
    b, s, d = x_BxSxD.shape
    k = slot_BxSxK.shape[-1]

    def scatter(x_SxD, slot_SxK):  # token t's k assignments, t-major as slot_SxK.reshape(-1)
        buf = jnp.zeros((n_experts * c + 1, d), x_SxD.dtype)
        return buf.at[slot_SxK.reshape(-1)].add(jnp.repeat(x_SxD, k, axis=0))[:-1]

    buf_BxExCxD = jax.vmap(scatter)(x_BxSxD, slot_BxSxK).reshape(b, n_experts, c, d)
    buf_ExBxCxD = jnp.swapaxes(buf_BxExCxD, 0, 1)
    if ep:  # expert e's slots to its owner; received sources side by side on the row dim
        buf_ExBxCxD = jax.lax.all_to_all(buf_ExBxCxD, EP_AXIS, 0, 1, tiled=True)
    e_l, rows = buf_ExBxCxD.shape[0], buf_ExBxCxD.shape[1]
    y = _experts(buf_ExBxCxD.reshape(e_l, rows * c, d), *ws).reshape(e_l, rows, c, d)
    if ep:  # the inverse: every source's rows back, experts in order again
        y = jax.lax.all_to_all(y, EP_AXIS, 1, 0, tiled=True)
    y_BxNxD = jnp.swapaxes(y, 0, 1).reshape(b, n_experts * c, d)
    y_BxNxD = jnp.concatenate([y_BxNxD, jnp.zeros((b, 1, d), y.dtype)], axis=1)  # dropped: 0
    picked = jax.vmap(lambda yb, sb: yb[sb.reshape(-1)])(y_BxNxD, slot_BxSxK)
    gates = gate_BxSxK.astype(x_BxSxD.dtype).reshape(b, s * k, 1)
    return jnp.sum((picked * gates).reshape(b, s, k, d), axis=2)


def _ep_state() -> tuple[bool, bool]:
    """(expert parallel, ``ep`` already manual here) from the current abstract mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EP_AXIS not in mesh.axis_names or mesh.shape[EP_AXIS] == 1:
        return False, False
    return True, EP_AXIS in mesh.manual_axes


def _in_region(fn, x_BxSxD, slot, gate, ws):
    """``fn`` in a ``shard_map`` manual over the data-parallel axes (evaluation under GSPMD):
    rows and expert shards local, the rules without the region's axes."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(a for a in ("edp", EP_AXIS) if a in mesh.axis_names and a not in mesh.manual_axes)
    rules = active_rules()
    inner = None
    if rules is not None:
        table = tuple((n, tuple(a for a in ax if a not in axes)) for n, ax in rules.table)
        inner = dataclasses.replace(rules, table=table)
    P = jax.sharding.PartitionSpec
    rows, experts = P(axes), P(EP_AXIS)

    def body(x, sl, g, w):
        with use_rules(inner):
            return fn(x, sl, g, w)

    return jax.shard_map(
        body,
        in_specs=(rows, rows, rows, (experts,) * len(ws)),
        out_specs=rows,
        axis_names=set(axes),
        check_vma=False,
    )(x_BxSxD, slot, gate, ws)


class MoE(nnx.Module):
    """Router, routed experts and shared experts of one MoE block."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, fp8_history: bool = False):
        """``fp8_history``: the experts' and shared experts' amax histories of a delayed FP8
        recipe (:mod:`jaxpar.model.fp8`), per routed expert ``[E, 3, BUCKETS]``."""
        e, d, f, std = cfg.moe, cfg.d_model, cfg.expert_ff, cfg.init_std
        down_std = std / (2 * cfg.n_layers) ** 0.5

        def normal(shape, s):
            return s * jax.random.normal(rngs.params(), shape, jnp.float32)

        self.cfg = cfg
        self.router = nnx.Param(normal((d, e.experts), std), logical_axes=("embed", None))
        self.bias = RoutingBias(jnp.zeros((e.experts,), jnp.float32), logical_axes=("expert_bias",))
        up = ("experts", "embed", "mlp")
        self.w_gate = nnx.Param(normal((e.experts, d, f), std), logical_axes=up)
        self.w_up = nnx.Param(normal((e.experts, d, f), std), logical_axes=up)
        self.w_down = nnx.Param(
            normal((e.experts, f, d), down_std), logical_axes=("experts", "mlp", "embed")
        )
        if e.shared_experts:
            self.shared = MLP(cfg, rngs, d_ff=e.shared_experts * f, fp8_history=fp8_history)
        if fp8_history:
            axes = ("experts", "fp8_operand", "fp8_bucket")
            for name in ("gate", "up", "down"):
                hist = jnp.broadcast_to(fp8.history_init(), (e.experts, *fp8.history_init().shape))
                setattr(self, f"fp8_{name}", fp8.History(hist, logical_axes=axes))

    def __call__(self, x_BxSxD: jax.Array) -> tuple[jax.Array, MoeStats]:
        cfg = self.cfg
        # Router input replicated over tp (an all-gather under Megatron-SP, else a no-op).
        x_BxSxD = gather_sequence(x_BxSxD)
        logits = jnp.einsum("bsd,de->bse", x_BxSxD.astype(jnp.float32), self.router[...])
        c = capacity(cfg, x_BxSxD.shape[1])
        r = route(cfg, logits, self.bias[...], c)
        ws = (self.w_gate[...], self.w_up[...], self.w_down[...])
        if hasattr(self, "fp8_gate"):  # delayed FP8: the histories travel with the weights
            ws = (*ws, self.fp8_gate[...], self.fp8_up[...], self.fp8_down[...])
        parallel, manual = _ep_state()
        ep = jax.sharding.get_abstract_mesh().shape[EP_AXIS] if parallel else 1
        if cfg.moe.ragged(target()[1], ep):
            fn = lambda x, sl, g, w: ragged.routed(x, sl, g, w, _experts, cfg.moe.experts, c)  # noqa: E731
        else:
            fn = lambda x, sl, g, w: routed(x, sl, g, w, cfg.moe.experts, c, parallel)  # noqa: E731
        if parallel and not manual:
            y = _in_region(fn, x_BxSxD, r.slot_BxSxK, r.gate_BxSxK, ws)
        else:
            y = fn(x_BxSxD, r.slot_BxSxK, r.gate_BxSxK, ws)
        if cfg.moe.shared_experts:
            y = y + self.shared(x_BxSxD, gathered=True)  # the router's gathered input
        return constrain(y, ("batch", "act_seq", "embed")), r.stats


def with_loss(y: jax.Array, term: jax.Array, scale: float) -> jax.Array:
    """``y`` unchanged; in the backward ``term`` also takes the cotangent ``scale``, as if
    ``scale · term`` were added to the loss. A pipeline stage differentiates only its output
    (:mod:`jaxpar.pipeline.stage`), so a MoE layer's balancing loss enters its gradient here,
    where it is computed; its value is reported as a statistic and added to the loss."""
    return _with_loss(float(scale), y, term) if scale else y


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _with_loss(scale: float, y: jax.Array, term: jax.Array) -> jax.Array:
    return y


def _with_loss_fwd(scale, y, term):
    return y, jnp.zeros((), term.dtype)


def _with_loss_bwd(scale, zero, dy):
    return dy, zero + scale


_with_loss.defvjp(_with_loss_fwd, _with_loss_bwd)


def balance(moe: MoeConfig, params: dict, stats: MoeStats, ok: jax.Array,
            order: np.ndarray | None = None) -> tuple[dict, dict]:  # fmt: skip
    """After a step: the params with the bias rule applied (``bias_rate`` 0: unchanged) and
    the step's MoE metrics: ``moe_load`` (max/mean expert load per MoE layer) and
    ``moe_dropped`` (assignments dropped by the capacity, per MoE layer). ``stats`` are in
    canonical layer order; ``order``: the canonical layer at each position of the params' stack
    (a pipeline's form at rest, :class:`jaxpar.pipeline.rest.RestLayout`), None: canonical."""
    if moe.bias_rate:
        load = stats.load if order is None else stats.load[order]
        params = update_bias(params, load, moe.bias_rate, ok)
    return params, {"moe_load": load_ratio(stats.load), "moe_dropped": stats.dropped}


def update_bias(params: dict, load_GxE: jax.Array, rate: float, ok: jax.Array) -> dict:
    """``params`` with each MoE layer's bias moved by ``rate · sign(mean load − load)``:
    up for an underloaded expert, down for an overloaded one (DeepSeek-V3); unchanged where
    ``ok`` is false (a skipped step)."""
    mlp = params["moe_layers"]["moe"]["mlp"]
    bias_GxE = mlp["bias"]
    mean_Gx1 = jnp.mean(load_GxE, axis=-1, keepdims=True)
    new = bias_GxE + rate * jnp.sign(mean_Gx1 - load_GxE).astype(bias_GxE.dtype)
    new = jnp.where(ok, new, bias_GxE)
    moe = {**params["moe_layers"]["moe"], "mlp": {**mlp, "bias": new}}
    return {**params, "moe_layers": {**params["moe_layers"], "moe": moe}}


def load_ratio(load_GxE: jax.Array) -> jax.Array:
    """Per MoE layer, the busiest expert's load over the mean load ``[G]`` (1 = balanced)."""
    return jnp.max(load_GxE, axis=-1) / jnp.maximum(jnp.mean(load_GxE, axis=-1), 1e-9)
