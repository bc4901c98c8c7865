"""What an FP8 recipe (``layout.fp8``, :mod:`jaxpar.model.fp8`) changes in the planner's step.

* **GEMMs**: the four weight matmuls of a layer, forward and backward, run on the FP8 tensor cores
  (all but the blocks ``layout.fp8_bf16_first``/``last`` keep in bf16: a layer's GEMMs and
  quantization are priced as the share :func:`share` of FP8 ones, the rest bf16's): their FLOPs at
  ``peak_flops_fp8`` × the same share of peak the mesh file's curve gives a bf16 matmul of that size
  (the published ceilings agree: 1550 of 1979 TFLOP/s FP8 against 794.5 of 989 bf16 on the H100 SXM,
  78% and 80%: :mod:`jaxpar.gpu.costs`). A GPU without ``peak_flops_fp8`` (the CPU emulates; an A100
  is refused) prices them as bf16.
* **Quantization** (memory-bound): the forward quantizes the four activation inputs (the
  residual stream on its sequence shard under Megatron-SP) and the four weights every
  micro-batch; the backward's (its incoming gradients, the saved inputs again) is in the
  planner's 2 × forward. Bytes per bf16 element quantized, by recipe (:data:`QUANT_BYTES`),
  measured on the compiled program: one layer's memory-bound bytes with the recipe less
  bf16's, ZeRO-3 over dp 8 on h100-8 at llama3-8b's layer shape, 2 and 4 layers
  (``scripts/calibrate_program_bytes.py``, ``quant_measured_over_priced`` × the 5 bytes first
  assumed: an amax read, then a read and an FP8 write). Tensorwise 3.06: XLA fuses the cast
  with its neighbours more than that count; delayed 2.58: no amax before the cast, the
  history's amax taken beside it; rowwise 7.51: each operand quantized along both axes
  (per row for one GEMM, per column for the other).
* **Megatron-SP's gathers move FP8**: the column-parallel inputs (forward, and again for the
  weight gradients) and the row-parallel outputs' gradients are gathered as FP8, one byte per
  element; the reduce-scatters stay in the compute dtype. Rowwise gathers a row-parallel
  output's gradient twice (quantized per row for ``dx``, per column for ``dW``). The
  collective matmul's rings are not used under FP8 (GSPMD places the gathers), so none of
  the tp calls hide behind a ring.
* **Amax collectives** (:func:`amax_calls`): small all-reduces (max) per layer and micro-batch,
  latency-bound and on the critical path (each GEMM waits for its operand's scale).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpar.config import HardwareConfig, LayoutConfig, ModelConfig
from jaxpar.planner.activations import kv_heads_local

# HBM bytes per bf16 element quantized, by recipe (module docstring; 2026-12-07)
QUANT_BYTES = {"tensorwise": 3.06, "delayed": 2.58, "rowwise": 7.51}
SCALE_BYTES = 4.0  # an fp32 scale


def on(lay: LayoutConfig) -> bool:
    """Whether ``lay`` runs FP8 GEMMs."""
    return lay.fp8 != "none"


def share(model: ModelConfig, lay: LayoutConfig) -> float:
    """Share of the blocks whose GEMMs run in FP8: (L − first − last) / L, where the first and
    last ``layout.fp8_bf16_first``/``last`` blocks keep bf16 GEMMs (:mod:`jaxpar.model.llama`
    traces them with the recipe off); 0 without a recipe. Their tp calls stay priced as the
    FP8 blocks' (the bf16 blocks' rings and bf16 gathers are not priced apart)."""
    if not on(lay):
        return 0.0
    n = max(1, model.n_layers)
    return max(0.0, n - lay.fp8_bf16_first - lay.fp8_bf16_last) / n


def gemm_peak(hw: HardwareConfig, lay: LayoutConfig) -> float:
    """The peak a layer's weight matmuls run against: FP8's where the recipe is on and the
    GPU has FP8 tensor cores, else bf16's."""
    return hw.peak_flops_fp8 if on(lay) and hw.peak_flops_fp8 else hw.peak_flops_bf16


def gather_bytes(lay: LayoutConfig, compute_bytes: float) -> float:
    """Bytes per element of Megatron-SP's tp all-gathers: 1 under FP8 (the values gathered
    are FP8), else the compute dtype's."""
    return 1.0 if on(lay) else compute_bytes


def zero3_gather_bytes(model: ModelConfig, lay: LayoutConfig, compute_bytes: float) -> float:
    """Bytes per element of ZeRO-3's per-layer weight all-gathers: a dense model under
    tensorwise or delayed scaling gathers its FP8 blocks' GEMM weights as e4m3, one byte
    (:mod:`jaxpar.model.fp8`, ``GEMM_GROUPS``; the norm scales, a few thousandths of a
    block, are counted with them); rowwise, the bf16 end blocks and a MoE model's groups
    gather the compute dtype. A MoE model is priced at the compute dtype throughout, though
    its dense prefix blocks (``moe.first_dense``) do gather FP8: a few blocks' gathers priced
    high."""
    if lay.fp8 not in ("tensorwise", "delayed") or model.moe.enabled:
        return compute_bytes
    return compute_bytes - (compute_bytes - 1.0) * share(model, lay)


def quant_bytes(model: ModelConfig, lay: LayoutConfig, tokens: float) -> float:
    """HBM bytes one layer's forward moves quantizing its GEMM operands for one micro-batch
    on one device (``tokens``: the micro-batch's local tokens, before Megatron-SP's split),
    averaged over the blocks (:func:`share`: bf16 ends quantize nothing)."""
    if not on(lay):
        return 0.0
    t, d = lay.tp, model.d_model
    q, kv = model.n_heads * model.hd / t, kv_heads_local(model, lay) * model.hd
    ff = model.d_ff / t * (2 if model.mlp == "swiglu" else 1)
    stream = tokens / (t if lay.sequence_parallel else 1)  # the residual stream's shard
    acts = 2 * stream * d + tokens * q + tokens * model.d_ff / t
    weights = d * (q + 2 * kv) + q * d + d * ff + model.d_ff / t * d
    return QUANT_BYTES[lay.fp8] * (acts + weights) * share(model, lay)


@dataclass(frozen=True)
class AmaxCalls:
    """The scale all-reduces (max) of one layer and micro-batch over one group."""

    fwd: int = 0
    bwd: int = 0
    bytes: float = SCALE_BYTES  # per call


def amax_calls(model: ModelConfig, lay: LayoutConfig, tokens: float) -> dict[str, AmaxCalls]:
    """Scale all-reduces per layer and micro-batch by group, ``"dp"`` (the explicit ``pmax``
    over the data-parallel rows) and ``"tp"`` (GSPMD's max over a tp-split operand), as
    :mod:`jaxpar.model.fp8` makes them:

    * **tensorwise** — dp: each activation input (4, forward) and incoming gradient (4,
      backward); tp: the operands split over tp, forward the four weights, the attention
      output and the FFN activation (and the two stream inputs under SP), backward the
      column-parallel outputs' gradients (and the two stream gradients under SP); scalars.
    * **rowwise** — dp: the weight-gradient GEMMs' per-column scales of their two operands
      (8, backward, vectors of the feature width); tp: the rows whose contraction is split over
      tp (forward: the row-parallel inputs and weights; backward: the column-parallel
      gradients and weights, and under SP the stream operands' columns).
    * **delayed** — scales come from the amax history; the backward takes each operand's amax
      for it, off the GEMMs' path: tp only, the operands split over tp (the four weights, the
      row-parallel inputs, the column-parallel outputs' gradients; under SP the stream inputs
      and gradients). Their one-hots reach the history with the gradients (no dp call)."""
    if not on(lay):
        return {}
    sp_ = lay.sequence_parallel and lay.tp > 1
    out: dict[str, AmaxCalls] = {}
    if lay.fp8 == "delayed":
        if lay.tp > 1:
            out["tp"] = AmaxCalls(0, 4 + 2 + 2 + (4 if sp_ else 0))
    elif lay.fp8 == "tensorwise":
        if lay.dp > 1:
            out["dp"] = AmaxCalls(4, 4)
        if lay.tp > 1:
            out["tp"] = AmaxCalls(4 + 2 + (2 if sp_ else 0), 2 + (2 if sp_ else 0))
    else:
        row = SCALE_BYTES * tokens
        if lay.dp > 1:
            out["dp"] = AmaxCalls(0, 8, SCALE_BYTES * model.d_model)
        if lay.tp > 1:
            out["tp"] = AmaxCalls(4, 4 + (4 if sp_ else 0), row)
    return out
