"""Checkpoint names the model puts on its values, for remat policies (:mod:`jaxpar.train.remat`).

Every weight operand of a matmul is tagged :data:`WEIGHT` at its point of use (after casts,
kv repeats and the fused QKV / gate-up concatenation), so a policy can refuse to keep weights —
or anything derived from them — between the forward and the backward: what ZeRO-3 needs, whose
gathered weights must be gathered again in the backward rather than kept.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

WEIGHT = "jaxpar_weight"
# An activation just resharded by a collective (Ulysses' all-to-alls over sp): a policy that
# recomputes data movement (ZeRO-3's, :mod:`jaxpar.train.remat`) keeps these instead, or the
# backward would run the forward's all-to-alls again.
RESHARDED = "jaxpar_resharded"
# The output of a projection whose matmul runs inside a custom VJP (jaxpar.model.layers.project):
# a policy that keeps dot outputs cannot see that dot, so it keeps this name as well.
PROJECTED = "jaxpar_projected"
# The fp32 scale of an FP8 GEMM operand (jaxpar.model.fp8): a scalar or a row vector, which every
# policy keeps so that the backward re-quantizes its operands without taking their amax again.
FP8_SCALE = "jaxpar_fp8_scale"


def weight(w: jax.Array) -> jax.Array:
    """Tag ``w`` as a weight operand (an identity in the computation)."""
    return checkpoint_name(w, WEIGHT)


def resharded(x: jax.Array) -> jax.Array:
    """Tag ``x`` as the output of a resharding collective (an identity in the computation)."""
    return checkpoint_name(x, RESHARDED)


def projected(x: jax.Array) -> jax.Array:
    """Tag ``x`` as a projection's output (an identity in the computation)."""
    return checkpoint_name(x, PROJECTED)


def fp8_scale(s: jax.Array) -> jax.Array:
    """Tag ``s`` as an FP8 operand's scale (an identity in the computation)."""
    return checkpoint_name(s, FP8_SCALE)
