"""Bytes the data-parallel reduction, the pipeline and the host transfers move per device per
step (the data-parallel totals the ``jaxpar memory`` theory reports).

Wire bytes (what a device sends; ring algorithms, ``(N−1)/N`` made explicit). Ψ = parameters one
device holds after tp and pp (:mod:`jaxpar.planner.shapes`), N the ZeRO group, k micro-batches,
``w_r``/``w_p``/``w_c`` the bytes of the reduction, parameter and compute dtypes.

* **dp** (ZeRO stage, per pp rank's own parameters): 0 — all-reduce of the gradients once per
  step, 2Ψ(N−1)/N in w_r; 1 — reduce-scatter once Ψ(N−1)/N (w_r) and all-gather of the updated
  params Ψ(N−1)/N (w_p); 2 — the reduce-scatter per micro-batch (kΨ) and the all-gather; 3 —
  per micro-batch an all-gather in the forward and again in the backward (w_c) and a
  reduce-scatter of the gradients (w_r): 3kΨ, less the second gather of the embedding and head
  tables (the embedding's backward needs no weights; the head's follows its forward). Inside a
  pipeline, stage 2 reduces the embedding/head gradients once after the schedule, and stage 3
  gathers and reduces per micro-batch only the piece a stage uses (embedding on the first,
  head on the last). Hybrid
  sharding (``dp_shard``): the same over the shard group plus an all-reduce of the shard across
  the groups once per step. Expert parallelism (MoE): ZeRO's group is ``edp = dp/ep``; the
  routed experts' gradients are reduced over ``edp`` only, the rest all-reduced over ``ep``
  too (at stage 0 everything in one all-reduce over dp, the experts over edp).
* **tp** and **sp**: per call, in :mod:`jaxpar.planner.comm` (with their latency).
* **pp**: one activation or cotangent message per send the schedule table makes.
* **host**: optimizer offload moves gradients down and params up once per step; params offload
  also fetches params per micro-batch; ``remat=offload`` sends activations down and back.
"""

from __future__ import annotations

from typing import Any

from jaxpar.analysis import theory as T
from jaxpar.analysis.theory import DTYPE_BYTES
from jaxpar.config import LayoutConfig, ModelConfig
from jaxpar.planner.shapes import param_counts
from jaxpar.planner.workload import Shape

ring = T.ring_factor


def dp_traffic(model: ModelConfig, lay: LayoutConfig) -> dict[str, Any]:
    """Data-parallel wire bytes per device per step (module docstring), by part."""
    pc = param_counts(model, lay)
    psi = float(pc.local)
    n = pc.zero_shards if lay.zero else lay.dp  # DDP: one all-reduce over all of dp
    k, r = lay.microbatches, ring(n)
    wr, wp, wc = (DTYPE_BYTES[d] for d in (lay.reduce_dtype, lay.param_dtype, lay.compute_dtype))
    saved = 0.0
    embed = float(pc.local - pc.blocks)  # embedding, head and final norm
    layers = psi - embed
    if lay.zero == 0:
        grads, params = 2 * psi * r * wr, 0.0
        if lay.ep > 1:  # an expert's gradient is whole on its owner: reduced over edp only
            experts = float(pc.experts_local)
            grads = 2 * ((psi - experts) * r + experts * ring(lay.dp // lay.ep)) * wr
    elif lay.zero == 1:
        grads, params = psi * r * wr, psi * r * wp
    elif lay.zero == 2:
        # Inside a pipeline the embedding/head gradients are reduced once, after the schedule.
        per_mb = k * layers + (embed if lay.pp > 1 else k * embed)
        grads, params = per_mb * r * wr, psi * r * wp
    elif lay.pp > 1:
        # Each micro-batch's embedding (first stage) or head (last stage) is gathered and its
        # gradient reduce-scattered in that stage's branch: the larger piece per device.
        piece = float(max(pc.local_of("embed"), pc.local_of("head")))
        grads = (k * layers + k * piece) * r * wr
        params = (2 * k * layers + k * piece) * r * wc
    else:
        grads, params = k * psi * r * wr, 2 * k * psi * r * wc
        saved = k * embed * r * wc
    groups = lay.dp // n
    if lay.ep > 1:  # experts are whole on their owner: only the rest is reduced over ep
        psi_across = psi - pc.experts_local
    else:
        psi_across = psi
    across = 2 * (psi_across / n) * ring(groups) * wr if groups > 1 else 0.0
    return {
        "psi": psi,
        "n": n,
        "ring_factor": r,
        "grad_bytes": grads,
        "param_bytes": params - saved,
        "embedding_regather_saved": saved,
        "across_groups_bytes": across,
        "total_bytes": grads + params - saved + across,
    }


def pp_message_bytes(model: ModelConfig, lay: LayoutConfig, shape: Shape) -> float:
    """Bytes of one activation (or cotangent) message between stages: ``[b, s, d]``, split over
    sp, and over tp too under Megatron-SP (the residual stream is sequence-sharded there)."""
    b = shape.microbatch_size(lay) or 1
    el = T.pp_p2p_elements(b, shape.seq // lay.sp, model.d_model, lay.tp, lay.sequence_parallel)
    return el * DTYPE_BYTES[lay.compute_dtype]


def host_traffic(
    model: ModelConfig, lay: LayoutConfig, shape: Shape, activation_bytes: float = 0.0
) -> float:
    """Host <-> device bytes per step (offload); ``activation_bytes``: what ``remat=offload``
    parks on the host per step (it comes back for the backward)."""
    pc = param_counts(model, lay)
    wp = DTYPE_BYTES[lay.param_dtype]
    out = 0.0
    if lay.offload != "none":
        out += wp * pc.held("grads") + wp * pc.held("params")
        if lay.offload == "params":
            out += wp * pc.held("params") * lay.microbatches
    if lay.remat == "offload":
        out += 2 * activation_bytes
    return out
