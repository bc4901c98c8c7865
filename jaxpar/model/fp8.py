"""FP8 matmuls (``layout.fp8``): the linear layers' GEMMs as scaled FP8 products.

A recipe quantizes both operands of every GEMM of the attention projections and the MLP —
the forward's ``y = x·W``, and the backward's ``dx = dy·Wᵀ`` and ``dW = xᵀ·dy`` — to an FP8
format with fp32 scales, multiplies the FP8 values with fp32 accumulation into the compute
dtype and rescales the product: ``y = (q(x)·q(W)) · s_x · s_W``, ``q(t) = clip(t / s_t)`` cast
to FP8. Scales are powers of two (the smallest at or above ``amax / format max``, as MXFP8's
E8M0 scales): dividing by one and rescaling the product are exact, so the only roundings are
FP8's and the product's into the compute dtype. The product is
an FP8 ``dot`` in the program (``f8e4m3fn``/``f8e5m2`` operands, ``f32`` result), which XLA:GPU
runs on Hopper's FP8 tensor cores and XLA:CPU emulates exactly (the FP8 values are products of
small integers and powers of two, fp32 accumulation), so a CPU run has the GPU's numerics.

Recipes ("current" scaling takes the scale from the tensor being quantized, "delayed" from
the amax of the same tensor in earlier steps):

==========  =====================================================  ==========================
recipe      scale of each operand                                  formats (forward/backward)
==========  =====================================================  ==========================
tensorwise  one per tensor: amax over the whole tensor / format max e4m3 / e5m2 gradients
rowwise     one per row of the non-contracted axes of that GEMM     e4m3 / e4m3
delayed     one per tensor: the largest tensorwise scale of the     e4m3 / e5m2 gradients
            last ``layout.fp8_history`` steps (Transformer
            Engine's delayed scaling, "max" of the amax history)
==========  =====================================================  ==========================

Why those formats: a tensorwise scale must cover every value of the gradient tensor at once,
whose range spans more decades than activations or weights, so it takes e5m2's range (max
57344, two mantissa bits) over e4m3's precision, as Transformer Engine's HYBRID format does;
a rowwise scale adapts to each row, so e4m3's extra mantissa bit is worth more than range.

**A scale is the tensor's, whatever the layout.** The amax is taken over the whole logical
tensor of this micro-batch (tensorwise) or the whole logical row (rowwise): where the reduced
axes are split over tp/sp, GSPMD reduces it with a small all-reduce (max) over them; where they
include the batch, which is split over the manual dp axes of the gradient region, an explicit
``pmax`` over those axes does (:func:`_batch_axes`). So every layout computes the same scales as
one device with the same micro-batches, and equals it. Under a pipeline the ``pp`` axis is
excluded: its ranks hold different layers.

Embeddings, norms, attention's softmax core, the LM head, the loss and the optimizer stay in
their precision; master weights are unchanged. The scales are residuals named
:data:`jaxpar.model.names.FP8_SCALE`, which every remat policy keeps (a scalar or a row vector),
so the backward re-quantizes its saved operands without a second amax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.model import collective_matmul as cm
from jaxpar.model.names import fp8_scale
from jaxpar.sharding import active_rules, constrain

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


@dataclass(frozen=True)
class Recipe:
    """One FP8 recipe: the gradients' format, whether scales are per row, and for delayed
    scaling the steps of amax history its scales cover (0: current scaling)."""

    name: str
    grad_dtype: Any  # the format of the backward's incoming gradient dy
    rowwise: bool
    history: int = 0  # delayed scaling: steps of history (layout.fp8_history)

    @property
    def delayed(self) -> bool:
        return self.history > 0


RECIPES: dict[str, Recipe] = {
    "tensorwise": Recipe("tensorwise", E5M2, rowwise=False),
    "rowwise": Recipe("rowwise", E4M3, rowwise=True),
    "delayed": Recipe("delayed", E5M2, rowwise=False, history=16),
}
NAMES = ("none", *RECIPES)  # layout.fp8's values


def active() -> Recipe | None:
    """The recipe of the active rules (``layout.fp8``, with ``layout.fp8_history`` for delayed
    scaling), or None for bf16/fp32 GEMMs."""
    rules = active_rules()
    recipe = RECIPES.get(rules.fp8) if rules is not None else None
    if recipe is not None and recipe.delayed:
        recipe = replace(recipe, history=rules.fp8_history)
    return recipe


def _batch_axes() -> tuple[str, ...]:
    """The manual mesh axes an activation's batch rows are split over here: the gradient
    region's dp axes (not ``pp``, whose ranks hold other layers), sizes above 1."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(a for a in mesh.manual_axes if a != "pp" and mesh.shape[a] > 1)


def _scale(t: jax.Array, dtype: Any, axes: tuple[int, ...], batch: bool,
           rows: Callable[[], tuple[str, ...]] | None = None) -> jax.Array:  # fmt: skip
    """fp32 scale of ``t`` reduced over ``axes`` (kept as size-1 dims): the power of two at or
    above ``amax / max(dtype)``; ``batch``: the reduced axes include the batch rows, split over
    the manual axes ``rows()`` names (default :func:`_batch_axes`): a pmax over them. An
    all-zero row gets scale 1 (its quantized values are zeros)."""
    amax = jnp.max(jnp.abs(t), axis=axes, keepdims=True).astype(jnp.float32)
    if batch and (dp := (rows or _batch_axes)()):
        amax = jax.lax.pmax(amax, dp)  # a small all-reduce (max) over dp: the tensor's amax
    return scale_of(amax, dtype)


def scale_of(amax: jax.Array, dtype: Any) -> jax.Array:
    """The fp32 scale an operand of largest magnitude ``amax`` is quantized to ``dtype`` with:
    the power of two at or above ``amax / max(dtype)``, 1 where ``amax`` is 0."""
    mant, exp = jnp.frexp(amax / float(jnp.finfo(dtype).max))  # mant in [0.5, 1)
    return jnp.where(amax > 0, jnp.ldexp(jnp.float32(1), exp - (mant == 0.5)), 1.0)


def _quantize(t: jax.Array, s: jax.Array, dtype: Any) -> jax.Array:
    """``t / s`` in ``dtype``, clipped to its range (a cast past e4m3fn's max gives NaN)."""
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(t.astype(jnp.float32) / s, -fmax, fmax).astype(dtype)


def _dot(a: jax.Array, b: jax.Array, ca: tuple[int, ...], cb: tuple[int, ...], out: Any
         ) -> jax.Array:  # fmt: skip
    """The FP8 GEMM: ``a`` and ``b`` contracted over ``ca``/``cb`` (fp32 accumulation) into
    ``out`` (the compute dtype). A product whose contraction is split over tp is a partial sum
    that GSPMD reduces at the dot's output: in ``out``, as the bf16 GEMMs' (an fp32 output
    all-reduced the whole fp32 activation: llama3-8b tp 8 + SP, 1.8x the tp wire bytes)."""
    return jax.lax.dot_general(a, b, ((ca, cb), ((), ())), preferred_element_type=out)


def _squeeze(s: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """A keepdims scale without its reduced axes (its shape on the product's axes)."""
    return jnp.squeeze(s, axes) if s.ndim else s


def _outer(sa: jax.Array, sb: jax.Array, nb: int) -> jax.Array:
    """``sa`` (over the product's leading axes) times ``sb`` (its trailing ``nb`` axes)."""
    if not sa.ndim:
        return sa * sb
    return sa.reshape(sa.shape + (1,) * nb) * sb


# The residual stream's layout and a column-parallel matmul's input layout (jaxpar.model.layers:
# gather_sequence): under Megatron-SP the first has the sequence on tp too.
_STREAM, _GATHERED = ("batch", "act_seq", "embed"), ("batch", "seq", "embed")


def _gather(q: jax.Array) -> jax.Array:
    """An FP8 operand from the residual stream's layout to the whole sequence: under
    Megatron-SP an all-gather over tp of FP8 values (half a bf16 gather's bytes), else a no-op.
    The first constraint keeps the quantization on the sequence shard."""
    return constrain(constrain(q, _STREAM), _GATHERED)


def _scatter(y: jax.Array) -> jax.Array:
    """A product's partial sums over tp onto the residual stream's layout, at the dot's output
    (before any rescaling, which GSPMD would otherwise precede with an all-reduce of the whole
    activation): under Megatron-SP a reduce-scatter, else the all-reduce of the partial sums."""
    return constrain(y, _STREAM)


def _rings(stream: str, x: jax.Array, recipe: Recipe):
    """The collective matmul's axes (:func:`jaxpar.model.collective_matmul.axes`) where a
    tensorwise-scaled product meets the residual stream under Megatron-SP and the layout runs
    its FP8 tp collectives as rings (:func:`jaxpar.sharding.fp8_rings`): the FP8 gather or
    reduce-scatter is then a ring of sends beside the chunks' FP8 GEMMs, as the bf16 GEMMs'
    are. None elsewhere: GSPMD's collective at the dot."""
    rules = active_rules()
    if not stream or recipe.rowwise or rules is None or not rules.fp8_rings:
        return None
    return cm.axes(x.shape[1])


def _product(qx, qw, n: int, stream: str, dtype, ax) -> jax.Array:
    """The forward FP8 product of quantized ``qx`` (``x``'s last ``n`` axes) and ``qw`` onto
    the residual stream's layout for ``stream`` (:func:`tensordot`), unscaled: GSPMD's FP8
    gather or reduce-scatter at the dot, or the ring (``ax``)."""
    cx, cw = tuple(range(qx.ndim - n, qx.ndim)), tuple(range(n))

    def product(a, b):
        return _dot(a, b, cx, cw, dtype)

    if ax is None:
        y = product(_gather(qx) if stream == "in" else qx, qw)
        return _scatter(y) if stream == "out" else y
    if stream == "in":
        return cm.gather_products(qx, qw, ax, product, dtype)
    return cm.scatter_products(qx, qw, ax, product)


def _products_bwd(qx, qw, qdy, n: int, stream: str, dtypes, ax):
    """``(dx, dW)`` of :func:`_product`, unscaled: ``dx = qdy·qwᵀ`` onto ``x``'s layout and
    ``dW = qxᵀ·qdy`` over batch and sequence, in ``dtypes`` (x's, w's)."""
    lead = qx.ndim - n
    dlead, dout = tuple(range(lead)), tuple(range(lead, qdy.ndim))
    wout = tuple(range(n, qw.ndim))

    def dx_of(d, w):
        return _dot(d, w, dout, wout, dtypes[0])

    def dw_of(a, d):
        return _dot(a, d, dlead, dlead, dtypes[1])

    if ax is None:
        qdy_full = _gather(qdy) if stream == "out" else qdy
        dx = dx_of(qdy_full, qw)
        dx = _scatter(dx) if stream == "in" else dx
        return dx, dw_of(_gather(qx) if stream == "in" else qx, qdy_full)
    if stream == "in":
        return cm.gather_products_bwd(qx, qw, qdy, ax, dx_of, dw_of)
    return cm.scatter_products_bwd(qx, qw, qdy, ax, dx_of, dw_of, dtypes[0])


def tensordot(x: jax.Array, w: jax.Array, n: int, recipe: Recipe, stream: str = "",
              history: jax.Array | None = None) -> jax.Array:  # fmt: skip
    """``jnp.tensordot(x, w, n)`` (``x``'s last ``n`` axes against ``w``'s first ``n``) as an
    FP8 GEMM of ``recipe``, in ``x``'s dtype; ``x``'s leading axes are batch and sequence.

    ``stream``: where the residual stream's layout (``[B, S, D]``, under Megatron-SP the
    sequence on tp) meets the product. ``"in"``: ``x`` is the stream (a column-parallel
    matmul's input); it is quantized on its sequence shard and its FP8 values gathered (forward,
    and again for the weight gradient), and ``dx`` is reduce-scattered back at its dot.
    ``"out"``: the output goes to the stream (a row-parallel matmul): reduce-scattered at the
    dot, and the incoming gradient is quantized on its shard and gathered as FP8 for both
    backward GEMMs. ``""``: no layout change. An FP8 gather moves half a bf16 one's bytes.

    ``history``: this GEMM's amax history (:class:`History`, ``[3, BUCKETS]``), which a
    delayed recipe needs and the others ignore."""
    if recipe.delayed:
        if history is None:
            raise ValueError(f"layout.fp8={recipe.name!r}: this GEMM has no amax history")
        return _delayed(x, w, history, n, recipe, stream)
    return _current(x, w, n, recipe, stream)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _current(x: jax.Array, w: jax.Array, n: int, recipe: Recipe, stream: str) -> jax.Array:
    """:func:`tensordot` with current scaling (tensorwise, rowwise)."""
    return _forward(x, w, n, recipe, stream)[0]


def _forward(x, w, n, recipe, stream):
    cx = tuple(range(x.ndim - n, x.ndim))  # contracted: x's trailing n, w's leading n
    cw = tuple(range(n))
    if stream == "in":
        x = constrain(x, _STREAM)
    if recipe.rowwise:  # x per row (its lead axes), w per column (its trailing axes)
        sx, sw = _scale(x, E4M3, cx, batch=False), _scale(w, E4M3, cw, batch=False)
        s = _outer(_squeeze(sx, cx), _squeeze(sw, cw), w.ndim - n)
    else:
        sx = jnp.squeeze(_scale(x, E4M3, tuple(range(x.ndim)), batch=True))
        sw = jnp.squeeze(_scale(w, E4M3, tuple(range(w.ndim)), batch=False))  # scalars
        s = sx * sw
    sx, sw = fp8_scale(sx), fp8_scale(sw)
    qx, qw = _quantize(x, sx, E4M3), _quantize(w, sw, E4M3)
    y = _product(qx, qw, n, stream, x.dtype, _rings(stream, x, recipe))
    return (y * s).astype(x.dtype), (x, w, sx, sw)


def _tensordot_fwd(x, w, n, recipe, stream):
    return _forward(x, w, n, recipe, stream)


def _tensordot_bwd(n, recipe, stream, res, dy):
    x, w, sx, sw = res
    lead = x.ndim - n  # batch and sequence (and any other non-contracted axes of x)
    dlead, dout = tuple(range(lead)), tuple(range(lead, dy.ndim))  # dy's axes
    wout = tuple(range(n, w.ndim))  # w's output axes (dy's trailing ones)
    g = recipe.grad_dtype
    gx = _gather if stream == "in" else (lambda q: q)  # x's FP8 values to the whole sequence
    gdy = _gather if stream == "out" else (lambda q: q)  # dy's
    sdx = _scatter if stream == "in" else (lambda t: t)  # dx's partial sums to the stream
    if stream == "out":
        dy = constrain(dy, _STREAM)
    if recipe.rowwise:
        # dx = dy·Wᵀ contracts the output axes: dy per row, W per input row (over its outputs).
        sdy_r, sw_r = _scale(dy, g, dout, batch=False), _scale(w, E4M3, wout, batch=False)
        dx = sdx(_dot(gdy(_quantize(dy, sdy_r, g)), _quantize(w, sw_r, E4M3), dout, wout,
                      x.dtype))  # fmt: skip
        dx = dx * _outer(_squeeze(sdy_r, dout), _squeeze(sw_r, wout), n)
        # dW = xᵀ·dy contracts batch and sequence (split over dp): per column of each.
        sx_c, sdy_c = _scale(x, E4M3, dlead, batch=True), _scale(dy, g, dlead, batch=True)
        qx, qdy = gx(_quantize(x, sx_c, E4M3)), gdy(_quantize(dy, sdy_c, g))
        dw = _dot(qx, qdy, dlead, dlead, w.dtype)
        dw = dw * _outer(_squeeze(sx_c, dlead), _squeeze(sdy_c, dlead), w.ndim - n)
    else:
        sdy = jnp.squeeze(_scale(dy, g, tuple(range(dy.ndim)), batch=True))
        qx, qw, qdy = _quantize(x, sx, E4M3), _quantize(w, sw, E4M3), _quantize(dy, sdy, g)
        dx, dw = _products_bwd(qx, qw, qdy, n, stream, (x.dtype, w.dtype),
                               _rings(stream, x, recipe))  # fmt: skip
        dx, dw = dx * (sdy * sw), dw * (sx * sdy)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_current.defvjp(_tensordot_fwd, _tensordot_bwd)


# ---- ZeRO-3: the weights gathered as FP8 ------------------------------------------------
#
# A tensorwise GEMM quantizes its whole weight with one power-of-two scale from the weight's
# amax. ZeRO-3 can take that amax before the gather (each shard's, then a max over the
# shards), quantize each shard with the scale, gather one byte an element instead of two, and
# hand the GEMM the gathered values times the scale. Those are exactly representable in bf16
# and the GEMM quantizes them back to the same e4m3 values (with the scale, or half of it and
# the values doubled when rounding lowered the largest: the same products), so the numerics
# are the bf16 gather's. The scale must be the GEMM's: one per GEMM, over every weight the
# layer concatenates into it (jaxpar.model.layers: Q, K and V; the MLP's gate and up).
#
# A delayed GEMM's weight scale comes from its history, which every rank holds whole: the
# shards are quantized with it and no amax is on the gather's path. But the history records
# the scale the weight *needed*, and the gathered values (clipped at the history's scale,
# rounded) may need a smaller one than the weight: the gather takes the weight's amax from
# the shards (one small all-reduce, off the GEMM's path) and its VJP writes that record into
# the history's cotangent in place of the one the GEMM took from the gathered values, so the
# weight's record is the one a device holding the whole weight makes.

# A dense block's weights by GEMM (paths in one layer's parameters).
GEMM_GROUPS = (
    (("attn", "wq"), ("attn", "wk"), ("attn", "wv")),
    (("attn", "wo"),),
    (("mlp", "w_gate"), ("mlp", "w_up")),
    (("mlp", "w_down"),),
)
# Each GEMM's amax history under a delayed recipe (jaxpar.model.layers: ``fp8_<name>``).
GEMM_HISTORIES = (("attn", "fp8_qkv"), ("attn", "fp8_out"), ("mlp", "fp8_up"), ("mlp", "fp8_down"))


def gather_groups(paths: list[tuple[str, ...]]) -> list[int] | None:
    """Per leaf path of one layer's parameters, the index of the GEMM whose scale it shares
    (:data:`GEMM_GROUPS`; -1: not a GEMM weight), where the active recipe gathers ZeRO-3 weights
    as FP8; None where it does not: bf16 GEMMs, rowwise (per-row and per-column scales of
    another layout than a gathered shard's), and a delayed recipe whose GEMM's history is not
    among ``paths``."""
    recipe = active()
    if recipe is None or recipe.rowwise:
        return None
    index = {p: g for g, group in enumerate(GEMM_GROUPS) for p in group}
    groups = [index.get(tuple(p), -1) for p in paths]
    if recipe.delayed:
        have = {tuple(p) for p in paths}
        if any(GEMM_HISTORIES[g] not in have for g in set(groups) if g >= 0):
            return None
    return groups if any(g >= 0 for g in groups) else None


def history_groups(paths: list[tuple[str, ...]]) -> list[int]:
    """Per leaf path of one layer's parameters, the GEMM whose amax history it is
    (:data:`GEMM_HISTORIES`), else -1."""
    index = {p: g for g, p in enumerate(GEMM_HISTORIES)}
    return [index.get(tuple(p), -1) for p in paths]


def _shard_amax(xs: list, groups: list[int], axes: tuple[str, ...]) -> jax.Array:
    """Each GEMM's weight amax ``[len(GEMM_GROUPS)]`` from its shards among ``xs``: a max over
    the shards (one small all-reduce over ``axes``)."""
    amax = jnp.zeros((len(GEMM_GROUPS),), jnp.float32)
    for x, g in zip(xs, groups, strict=True):
        if g >= 0:
            amax = amax.at[g].max(jnp.max(jnp.abs(x)).astype(jnp.float32))
    return jax.lax.pmax(amax, axes) if axes else amax


def quantize_shards(xs: list, groups: list[int], axes: tuple[str, ...],
                    scales: jax.Array | None = None) -> tuple[list, list]:  # fmt: skip
    """Each GEMM weight shard of ``xs`` (compute dtype) quantized to e4m3 with its GEMM's scale:
    ``scales`` ``[len(GEMM_GROUPS)]`` where given (a delayed recipe's, from the histories), else
    tensorwise from the amax over the shards (:func:`_shard_amax`). Returns the quantized shards
    (others as they are) and each leaf's scale (1 for the others)."""
    if scales is None:
        scales = scale_of(_shard_amax(xs, groups, axes), E4M3)
    out, per_leaf = [], []
    for x, g in zip(xs, groups, strict=True):
        s = scales[g] if g >= 0 else jnp.float32(1)
        out.append(_quantize(x, s, E4M3) if g >= 0 else x)
        per_leaf.append(s)
    return out, per_leaf


def history_scales(hists: list, history: int) -> jax.Array:
    """The weight scale ``[len(GEMM_GROUPS)]`` each delayed GEMM quantizes with, from its
    history ``hists[g]`` (None: 1, no GEMM there)."""
    return jnp.stack([jnp.float32(1) if h is None else _hist_scale(h[1], history)
                      for h in hists])  # fmt: skip


def weight_records(xs: list, groups: list[int], axes: tuple[str, ...]) -> jax.Array:
    """``[len(GEMM_GROUPS), BUCKETS]``: each GEMM's weight record for its history (the one-hot
    of the scale the whole weight needs, as :func:`_delayed_bwd` takes it), from the shards."""
    b, ok = _bucket(_shard_amax(xs, groups, axes), E4M3)
    return jax.nn.one_hot(b, BUCKETS, dtype=jnp.float32) * ok[:, None]


# ---- delayed scaling: scales from the amax of earlier steps ---------------------------------
#
# Each FP8 GEMM of a delayed recipe owns a history leaf ``[3, BUCKETS]`` (operands x, w, dy)
# in the parameter tree, so every layout's machinery carries it as it carries the weights:
# the layer scan slices it, ZeRO and the pipeline place it, checkpoints save it and restore
# it onto other layouts. Bucket ``b`` stands for the power-of-two scale ``2**(b + K_LO)``
# that current (tensorwise) scaling would give an operand (:func:`_scale`); a leaf's value at
# ``b`` is the number of steps since an operand needed that scale (``NEVER``: not within
# reach). The forward and backward quantize with the largest scale needed within the last
# ``history`` steps — no amax on the GEMM's critical path — and the backward returns, as the
# leaf's "gradient", a one-hot of the scale each operand needed in this micro-batch. Summed
# over micro-batches, layers' uses and data-parallel ranks by the ordinary gradient path (the
# union of what any rank saw, whose largest bucket is the whole batch's amax: so every layout
# keeps the same history as one device), it is folded into the ages after the optimizer
# step (:func:`advance`), which never sees these leaves as trainable.

BUCKETS = 254  # power-of-two scales 2**-126 .. 2**127: fp32's normal range
K_LO = -126
NEVER = 255.0  # an age past any history (ages are small integers: exact in bf16 too)
OPERANDS = ("x", "w", "dy")


class History(nnx.Variable):
    """An FP8 GEMM's amax history under a delayed recipe (``[3, BUCKETS]`` steps since each
    power-of-two scale was needed, per operand): not trained by gradient (:func:`advance`)."""


def history_init() -> jax.Array:
    """An empty history: no scale needed yet (the first step quantizes at scale 1)."""
    return jnp.full((len(OPERANDS), BUCKETS), NEVER, jnp.float32)


def _needed(t: jax.Array, dtype: Any, per: float = 1.0, axes: tuple[int, ...] | None = None
            ) -> jax.Array:  # fmt: skip
    """The bucket (exponent - K_LO) of the power-of-two scale current scaling gives ``t / per``
    (reduced over ``axes``, default all), and whether it has one (a finite, nonzero amax)."""
    return _bucket(jnp.max(jnp.abs(t), axis=axes).astype(jnp.float32) / per, dtype)


def _bucket(amax: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """:func:`_needed` of an amax."""
    mant, exp = jnp.frexp(amax / float(jnp.finfo(dtype).max))
    b = jnp.clip(exp - (mant == 0.5).astype(exp.dtype) - K_LO, 0, BUCKETS - 1)
    return b, (amax > 0) & jnp.isfinite(amax)


def _record(t: jax.Array, dtype: Any, per: float = 1.0, axes: tuple[int, ...] | None = None
            ) -> jax.Array:  # fmt: skip
    """One-hot ``[..., BUCKETS]`` of the scale ``t / per`` needs, reduced over ``axes`` (default
    all; zeros for an all-zero tensor)."""
    b, ok = _needed(t, dtype, per, axes)
    return jax.nn.one_hot(b, BUCKETS, dtype=jnp.float32) * ok[..., None]


def hist_bucket(age: jax.Array, history: int) -> jax.Array:
    """The largest bucket needed within the last ``history`` steps (-1: none), over the last
    axis of ``age``."""
    seen = age < history
    return jnp.max(jnp.where(seen, jnp.arange(BUCKETS), -1), axis=-1)


def _hist_scale(age: jax.Array, history: int) -> jax.Array:
    """The fp32 scale a delayed recipe quantizes with: ``2**(bucket + K_LO)``, 1 when the
    history is empty."""
    b = hist_bucket(age, history)
    return jnp.where(b >= 0, jnp.ldexp(jnp.float32(1), b + K_LO), 1.0)


def advance(age: jax.Array, counts: jax.Array) -> jax.Array:
    """The ages after a step whose summed one-hots are ``counts``: 0 where a scale was needed,
    one step older (at most :data:`NEVER`) elsewhere."""
    return jnp.where(counts > 0, 0.0, jnp.minimum(age + 1, NEVER)).astype(age.dtype)


def overflows(age: jax.Array, counts: jax.Array, history: int) -> jax.Array:
    """How many operands needed a larger scale this step than their history gave: their values
    beyond the format's range at the scale used were clipped (the count :func:`advance`'s
    step reports). An empty history quantized at scale 1 (bucket ``-K_LO``)."""
    b = hist_bucket(age, history)
    used = jnp.where(b >= 0, b, -K_LO)
    cur = jnp.max(jnp.where(counts > 0, jnp.arange(BUCKETS), -1), axis=-1)
    return jnp.sum(cur > used)


def _cotangent_scale() -> float:
    """How many times the step's mean-loss gradient a cotangent here is: the losses of the
    gradient region are each rank's own mean (the data-parallel ranks' count) over each
    micro-batch (``Rules.loss_microbatches``); 1 outside it."""
    rules = active_rules()
    n = rules.loss_microbatches if rules is not None else 1
    mesh = jax.sharding.get_abstract_mesh()
    for a in _batch_axes():
        n *= mesh.shape[a]
    return float(n)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _delayed(x, w, history, n: int, recipe: Recipe, stream: str) -> jax.Array:
    """:func:`tensordot` with delayed scaling: tensorwise formats, scales from ``history``."""
    return _delayed_fwd(x, w, history, n, recipe, stream)[0]


def _delayed_fwd(x, w, history, n, recipe, stream):
    if stream == "in":
        x = constrain(x, _STREAM)
    sx = fp8_scale(_hist_scale(history[0], recipe.history))
    sw = fp8_scale(_hist_scale(history[1], recipe.history))
    qx, qw = _quantize(x, sx, E4M3), _quantize(w, sw, E4M3)
    y = _product(qx, qw, n, stream, x.dtype, _rings(stream, x, recipe))
    return (y * (sx * sw)).astype(x.dtype), (x, w, history)


def _delayed_bwd(n, recipe, stream, res, dy):
    x, w, history = res
    g = recipe.grad_dtype
    if stream == "out":
        dy = constrain(dy, _STREAM)
    # dy is the gradient of this region's loss, ``per`` times the step's mean loss's (a
    # rank's and a micro-batch's own mean): its history holds the step's, so that every
    # layout keeps one device's (per is a power of two on the usual layouts: exact).
    per = _cotangent_scale()
    sx, sw = (_hist_scale(history[i], recipe.history) for i in range(2))
    sdy = _hist_scale(history[2], recipe.history) * per
    qx, qw, qdy = _quantize(x, sx, E4M3), _quantize(w, sw, E4M3), _quantize(dy, sdy, g)
    dx, dw = _products_bwd(qx, qw, qdy, n, stream, (x.dtype, w.dtype), _rings(stream, x, recipe))
    # The history's cotangent: the scale each operand needed here (GSPMD reduces each amax
    # over the tp/sp shards; the data-parallel ranks' one-hots are summed with the gradients).
    seen = [_record(x, E4M3), _record(w, E4M3), _record(dy, g, per)]
    seen = jnp.stack(seen).astype(history.dtype)
    return (dx * (sdy * sw)).astype(x.dtype), (dw * (sx * sdy)).astype(w.dtype), seen


_delayed.defvjp(_delayed_fwd, _delayed_bwd)


# ---- the routed experts: one GEMM per expert ------------------------------------------------


def _expert_axes() -> tuple[str, ...]:
    """The manual axes an expert's token buffer is split over: the data-parallel ones less
    ``ep``, whose ranks hold other experts (and ``pp``'s other layers)."""
    return tuple(a for a in _batch_axes() if a != "ep")


def _escale(t: jax.Array, dtype: Any, axes: tuple[int, ...], tokens: bool) -> jax.Array:
    """:func:`_scale` per expert (axis 0 kept): ``tokens``, the reduced axes include the
    expert's token rows, split over :func:`_expert_axes`."""
    return _scale(t, dtype, axes, tokens, _expert_axes)


def _edot(a, b, ca: int, cb: int, out) -> jax.Array:
    """Per-expert FP8 GEMM: batch axis 0 of both, ``a``'s axis ``ca`` against ``b``'s ``cb``."""
    return jax.lax.dot_general(a, b, (((ca,), (cb,)), ((0,), (0,))), preferred_element_type=out)


def experts(x_ExNxD: jax.Array, w_ExDxF: jax.Array, recipe: Recipe,
            history: jax.Array | None = None) -> jax.Array:  # fmt: skip
    """``einsum("end,edf->enf")``: each routed expert's GEMM in FP8 with ``recipe``; a
    tensorwise scale is per expert (its token buffer over every dp rank, its weight), a rowwise
    one per row of each expert's operands, as :func:`tensordot`'s; a delayed one per expert
    from ``history`` (``[E, 3, BUCKETS]``, the expert's amax history)."""
    if recipe.delayed:
        if history is None:
            raise ValueError(f"layout.fp8={recipe.name!r}: these experts have no amax history")
        return _experts_delayed(x_ExNxD, w_ExDxF, history, recipe)
    return _experts_current(x_ExNxD, w_ExDxF, recipe)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _experts_current(x_ExNxD: jax.Array, w_ExDxF: jax.Array, recipe: Recipe) -> jax.Array:
    """:func:`experts` with current scaling."""
    return _experts_fwd(x_ExNxD, w_ExDxF, recipe)[0]


def _experts_fwd(x, w, recipe):
    if recipe.rowwise:  # x per (expert, token), w per (expert, column)
        sx, sw = _escale(x, E4M3, (2,), False), _escale(w, E4M3, (1,), False)
        s = sx * sw  # [E, N, 1] * [E, 1, F]
    else:
        sx, sw = _escale(x, E4M3, (1, 2), True), _escale(w, E4M3, (1, 2), False)
        s = sx * sw  # [E, 1, 1]
    sx, sw = fp8_scale(sx), fp8_scale(sw)
    y = _edot(_quantize(x, sx, E4M3), _quantize(w, sw, E4M3), 2, 1, x.dtype) * s
    return y.astype(x.dtype), (x, w, sx, sw)


def _experts_bwd(recipe, res, dy):
    x, w, sx, sw = res
    g = recipe.grad_dtype
    if recipe.rowwise:
        # dx = dy·Wᵀ over F: dy per (e, n), W per (e, d); dW = xᵀ·dy over the tokens N.
        sdy_r, sw_r = _escale(dy, g, (2,), False), _escale(w, E4M3, (2,), False)
        dx = _edot(_quantize(dy, sdy_r, g), _quantize(w, sw_r, E4M3), 2, 2, x.dtype)
        dx = dx * sdy_r * jnp.swapaxes(sw_r, 1, 2)
        sx_c, sdy_c = _escale(x, E4M3, (1,), True), _escale(dy, g, (1,), True)
        dw = _edot(_quantize(x, sx_c, E4M3), _quantize(dy, sdy_c, g), 1, 1, w.dtype)
        dw = dw * jnp.swapaxes(sx_c, 1, 2) * sdy_c
    else:
        sdy = _escale(dy, g, (1, 2), True)
        qdy = _quantize(dy, sdy, g)
        dx = _edot(qdy, _quantize(w, sw, E4M3), 2, 2, x.dtype) * (sdy * sw)
        dw = _edot(_quantize(x, sx, E4M3), qdy, 1, 1, w.dtype) * (sx * sdy)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_experts_current.defvjp(_experts_fwd, _experts_bwd)


def _eh_scale(history_Ex3xB: jax.Array, i: int, h: int) -> jax.Array:
    """Per-expert delayed scales of operand ``i``, ``[E, 1, 1]``."""
    return _hist_scale(history_Ex3xB[:, i], h)[:, None, None]


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _experts_delayed(x, w, history, recipe: Recipe) -> jax.Array:
    """:func:`experts` with delayed scaling: per-expert scales from ``history``."""
    return _experts_delayed_fwd(x, w, history, recipe)[0]


def _experts_delayed_fwd(x, w, history, recipe):
    sx = fp8_scale(_eh_scale(history, 0, recipe.history))
    sw = fp8_scale(_eh_scale(history, 1, recipe.history))
    y = _edot(_quantize(x, sx, E4M3), _quantize(w, sw, E4M3), 2, 1, x.dtype) * (sx * sw)
    return y.astype(x.dtype), (x, w, history)


def _experts_delayed_bwd(recipe, res, dy):
    x, w, history = res
    g, per = recipe.grad_dtype, _cotangent_scale()  # per: as tensordot's dy (_delayed_bwd)
    sx, sw = _eh_scale(history, 0, recipe.history), _eh_scale(history, 1, recipe.history)
    sdy = _eh_scale(history, 2, recipe.history) * per
    qdy = _quantize(dy, sdy, g)
    dx = _edot(qdy, _quantize(w, sw, E4M3), 2, 2, x.dtype) * (sdy * sw)
    dw = _edot(_quantize(x, sx, E4M3), qdy, 1, 1, w.dtype) * (sx * sdy)
    # per expert: the scale its token buffer, weight and gradient needed here (the expert's
    # data-parallel ranks' one-hots are summed with its gradients)
    seen = [_record(x, E4M3, 1.0, (1, 2)), _record(w, E4M3, 1.0, (1, 2)),
            _record(dy, g, per, (1, 2))]  # fmt: skip
    return dx.astype(x.dtype), dw.astype(w.dtype), jnp.stack(seen, 1).astype(history.dtype)


_experts_delayed.defvjp(_experts_delayed_fwd, _experts_delayed_bwd)
