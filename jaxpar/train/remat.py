"""Activation rematerialisation: one table, one meaning per setting, whatever the layout.

Every layout (one device, ZeRO 0–3, tp/sp, inside a pipeline stage) reads this table, so
``--remat X`` buys the same trade everywhere:

========== ========================================================================= ==========
setting    kept between a layer's forward and its backward                           recompute
========== ========================================================================= ==========
none       every activation the backward reads                                       nothing
selective  matmul outputs; elementwise results (norms, SiLU, softmax) recomputed     elementwise
full       each layer's input only (a pipeline stage keeps its stage input)          1 forward
offload    matmul outputs, moved to ``pinned_host`` memory and back                  elementwise
========== ========================================================================= ==========

Weights are never activations. Under ZeRO-3 a layer's gathered weights (and anything derived
from them, e.g. the fused QKV matrix) must not be kept between forward and backward, or the
sharded parameters silently turn back into full ones: model code tags every weight operand of a
matmul with :data:`jaxpar.model.names.WEIGHT`, the ZeRO-3 gather tags its output too, and the
policies below never save a tagged value, so the backward gathers the weights again (the
second all-gather of FSDP). With ``none`` that is the only thing recomputed, and under
Megatron-SP the same policy keeps each column-parallel input's sequence shard rather than its
all-gathered copy (the gather is data movement): the backward gathers it again, as Megatron-LM
does (XLA:GPU, llama3-8b tp 8 + SP, 8 × 4096: 69.4 → 52.1 GiB per device, one more
all-gather per column-parallel matmul).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.model.names import FP8_SCALE, PROJECTED, WEIGHT

_offload_dots = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
_offload_projected = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[FP8_SCALE],  # an FP8 operand's scale: a scalar or a row
    names_which_can_be_offloaded=[PROJECTED],
    offload_src="device",
    offload_dst="pinned_host",
)


def _offload_dots_and_projections(prim, *args, **params):
    """``offload``: dot outputs and PROJECTED values to pinned host memory, the rest recomputed
    (JAX's offload policies return placements, not booleans, so they cannot be or-ed)."""
    if prim.name == "name" and params.get("name") in (PROJECTED, FP8_SCALE):
        return _offload_projected(prim, *args, **params)
    return _offload_dots(prim, *args, **params)


@dataclass(frozen=True)
class Remat:
    """What one ``--remat`` setting means."""

    name: str
    kept: str  # what the backward finds saved (for docs and the run summary)
    recompute_forward: bool  # whether the backward re-runs each layer's forward (B = 3F)

    def policy(self, regather: bool, stage: bool = False) -> Any:
        """The ``jax.checkpoint`` policy for a layer, or None for no checkpoint at all;
        ``regather``: gathered values (ZeRO-3's weights, Megatron-SP's inputs) are not kept,
        the backward gathers them again; ``stage``: a pipeline stage's layer, whose kept values
        stay in a stash slot per micro-batch in flight (weights' casts are recomputed too)."""
        cp = jax.checkpoint_policies
        if self.name == "none":
            if stage:
                return _save_all_but_weights_and_casts
            return _save_all_but_weights if regather else None
        if self.name == "full":
            return cp.nothing_saveable
        if self.name == "selective":
            # Dot outputs are activations; weights are dot *operands*, never outputs. The up
            # projections' dots sit inside a custom VJP: their outputs carry PROJECTED (and
            # an FP8 GEMM's operand scales FP8_SCALE: the backward re-quantizes with them).
            return cp.save_from_both_policies(
                cp.checkpoint_dots, cp.save_only_these_names(PROJECTED, FP8_SCALE)
            )
        if self.name == "offload":
            return _offload_dots_and_projections
        raise ValueError(f"layout.remat={self.name!r}: unknown")

    def wrap(
        self, pre: Callable | None = None, regather: bool = False
    ) -> Callable[[Callable], Callable] | None:
        """Wrapper of a scan body ``(x, layer_params) -> (x, None)``: apply ``pre`` (the
        ZeRO-3 gather) to the layer's params, under this setting's checkpoint policy;
        ``regather``: Megatron-SP, whose gathered inputs are recomputed like ZeRO-3's weights."""
        policy = self.policy(regather or pre is not None)
        if policy is None:
            return None

        def wrap(body):
            inner = body if pre is None else (lambda x, lp: body(x, pre(lp)))
            return jax.checkpoint(inner, prevent_cse=False, policy=policy)

        return wrap


# Data movement, which a policy may recompute for free: a weight reaches its matmul only
# through these (gather, cast, reshape, kv repeat, fused-column concatenation, transpose; the
# pipeline's zero-bubble split stops the gradient of each weight operand).
_MOVES = frozenset({
    "all_gather", "reshape", "concatenate", "broadcast_in_dim", "transpose", "squeeze",
    "expand_dims", "sharding_constraint", "copy", "copy_p", "stop_gradient",
})  # fmt: skip


def _save_all_but_weights(prim: Any, *_: Any, **params: Any) -> bool:
    """``none`` under ZeRO-3: keep every computed activation, never a weight.

    Written out because ``jax.checkpoint_policies.save_anything_except_these_names`` saves
    everything whatever the names (jax 0.10.2: it is ``lambda *_, **__: True``), and because
    naming the weights alone is not enough: the value one op upstream of a name (the gathered
    weight before its reshape, the concatenation before its constraint) would be saved in its
    place. So data movement is recomputed, the ZeRO-3 gather (a ``custom_vjp`` around an
    ``all_gather``) is re-run in the backward, and everything else is kept.
    """
    name = getattr(prim, "name", "")
    if name == "name":
        return params.get("name") != WEIGHT
    if name in _MOVES:
        return False
    if name == "custom_vjp_call":
        # the ZeRO-3 gather (an all_gather inside) and a resharding alone (the row-parallel
        # output's scatter, jaxpar.model.layers.scatter_sequence) are data movement too
        jaxpr = params.get("call_jaxpr")
        inner = {e.primitive.name for e in getattr(getattr(jaxpr, "jaxpr", jaxpr), "eqns", ())}
        return not ("all_gather" in inner or inner <= _MOVES)
    return True


def _save_all_but_weights_and_casts(prim: Any, *avals: Any, **params: Any) -> bool:
    """``none`` in a pipeline stage: :func:`_save_all_but_weights`, and every downcast (with
    the ``reduce_precision`` a checkpoint puts after it) recomputed from what it casts.

    For a weight that is the parameter itself: a plain cast is an op like any other to a
    policy, so the bf16 copy of every matmul weight was kept for the backward, in a pipeline
    once per stash slot (XLA:GPU, llama3-8b pp 4 × dp 2, GPipe over 8 micro-batches: 26 GiB of
    weights in the stash, 111.3 → 84.6 GiB per device). For an activation (a norm's bf16
    output) the fp32 value it came from, which the norm's backward keeps anyway, serves. Not
    used without a pipeline: there the weights' casts live one step, and keeping fp32 inputs
    of the downcasts instead measured +2 GiB on llama3-8b dp 8 ZeRO-3."""
    name = getattr(prim, "name", "")
    if name == "reduce_precision":
        return False
    if name == "convert_element_type" and _narrows(avals[0], params["new_dtype"]):
        return False
    return _save_all_but_weights(prim, *avals, **params)


def _narrows(aval: Any, dtype: Any) -> bool:
    """Whether casting ``aval`` to ``dtype`` narrows one float type to another."""
    src = getattr(aval, "dtype", None)
    return (src is not None and jnp.issubdtype(src, jnp.floating)
            and jnp.issubdtype(dtype, jnp.floating)
            and jnp.finfo(dtype).bits < jnp.finfo(src).bits)  # fmt: skip


TABLE: dict[str, Remat] = {
    "none": Remat("none", "every activation", False),
    "selective": Remat("selective", "matmul outputs", False),
    "full": Remat("full", "layer inputs (pipeline: stage inputs)", True),
    "offload": Remat("offload", "matmul outputs in pinned_host", False),
}


def remat_of(setting: str) -> Remat:
    """The table entry of a ``layout.remat`` value."""
    try:
        return TABLE[setting]
    except KeyError:
        raise ValueError(f"layout.remat={setting!r}: must be one of {', '.join(TABLE)}") from None
