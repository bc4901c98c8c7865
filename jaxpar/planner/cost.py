"""Step-time cost model of one layout: each term stated, in seconds per optimizer step.

Terms (per device, the busiest pipeline rank; ``L`` layers, ``m`` micro-batches of ``b``
sequences of ``s`` tokens per dp rank, ``h`` = d_model):

* ``compute``: model FLOPs of this device's share (``theory.train_flops_per_token`` × tokens ÷
  devices) ÷ (peak × efficiency). The efficiency depends on the size of the device's local
  matmuls: ``EFF_MAX · g / (g + EFF_HALF)`` with ``g`` the smallest of the tokens per micro-batch
  (b·s/sp) and the local weight widths (h, heads·hd/tp, d_ff/tp).
* ``recompute``: ``remat=full`` repeats the forward of every layer (1/3 of the layers' train
  FLOPs), ``selective`` the attention core (4·h·s FLOPs per token per layer forward).
* ``tp_comm``: Megatron's 4 all-reduces per layer per micro-batch of b·s·h (``theory.
  tp_comm_elements_per_layer``), 6 with full recompute (the forward ones run again), in the
  compute dtype, on the intra-node link (inter-node when tp·sp spans nodes: flagged). Not
  overlapped (they sit between dependent matmuls).
* ``sp_comm``: Ulysses all-to-alls (``theory.ulysses_comm_elements_per_layer``, wire volume) or
  ring-attention K/V passes, on the link the sp·tp group spans.
* ``pp_p2p``: one exchange per lock-step tick of b·s·h (÷ tp with sequence parallelism) values,
  each way, on the link between stages (inter-node when a stage spans a node or more).
* ``bubble``: (compute + recompute + tp + sp) × (makespan/busy − 1) from the schedule library's
  lock-step table (jaxpar's executor runs it in lock step).
* ``dp_comm``: gradient reduction 2Ψ(N−1)/N (ZeRO-3: 3Ψ; inside a pipeline ZeRO-3 regathers
  each micro-batch: (2m+1)Ψ) in ``reduce_dtype`` bytes over the dp group's link; ``DP_OVERLAP``
  of the backward compute hides it (ZeRO-3's gathers also overlap the forward). Only the
  excess is exposed.
* ``offload``: optimizer offload moves grads down and params up once per step (4Ψ + 4Ψ bytes
  of the local shard) over the host link; params offload also fetches params per micro-batch.

The links: a group is intra-node when its devices are contiguous in the mesh order
(pp, dp, sp, tp) within one node (stride × size ≤ devices_per_node), inter-node otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxpar.analysis import theory as T
from jaxpar.config import HardwareConfig, LayoutConfig, ModelConfig
from jaxpar.planner.memory import Shape

EFF_MAX = 0.70  # best sustained share of peak (fitted: see BENCHMARKS.md, Megatron rows)
EFF_HALF = 384  # local matmul dimension at which efficiency is half of EFF_MAX (fitted)
DP_OVERLAP = 0.8  # share of the backward (and, for ZeRO-3, forward) that can hide dp traffic


@dataclass
class Cost:
    """Step time by term (seconds), traffic by link (bytes per device per step), flags."""

    terms: dict[str, float]
    traffic: dict[str, float]
    efficiency: float
    flags: list[str] = field(default_factory=list)

    @property
    def step_time(self) -> float:
        """Sum of the exposed terms."""
        return sum(self.terms.values())


def link_of(hw: HardwareConfig, stride: int, size: int) -> str:
    """``intra`` when a group of ``size`` devices ``stride`` apart sits in one node."""
    return "intra" if size == 1 or stride * size <= hw.devices_per_node else "inter"


def _bw(hw: HardwareConfig, link: str) -> float:
    return hw.intra_node_bw if link == "intra" else hw.inter_node_bw


def efficiency(model: ModelConfig, lay: LayoutConfig, tokens_per_mb: float) -> float:
    """Share of peak the device's local matmuls sustain (see the module docstring)."""
    g = min(
        tokens_per_mb,
        model.d_model,
        model.n_heads * model.hd / lay.tp,
        model.d_ff / lay.tp,
    )
    return EFF_MAX * g / (g + EFF_HALF)


def step_cost(
    model: ModelConfig,
    hw: HardwareConfig,
    lay: LayoutConfig,
    shape: Shape,
    makespan_over_busy: float = 1.0,
    ticks: int = 1,
) -> Cost:
    """Cost terms of ``lay`` (pipeline figures from :mod:`jaxpar.planner.pipe`)."""
    b = shape.microbatch_size(lay) or 1
    s, h, m = shape.seq, model.d_model, lay.microbatches
    n = lay.n_devices
    cdt, rdt = T.DTYPE_BYTES[lay.compute_dtype], T.DTYPE_BYTES[lay.reduce_dtype]
    layers = model.n_layers / lay.pp
    tokens_mb = b * s / lay.sp
    eff = efficiency(model, lay, tokens_mb)
    flops = T.train_flops_per_token(model, s) * shape.global_batch * s / n
    compute = flops / (hw.peak_flops_bf16 * eff)
    layer_flops = (flops - 6 * model.vocab_size * h * shape.global_batch * s / n) / 3
    if lay.remat == "full":
        recompute = layer_flops / (hw.peak_flops_bf16 * eff)
    elif lay.remat == "selective":
        attn = 4 * model.n_layers * h * s * shape.global_batch * s / n
        recompute = attn / (hw.peak_flops_bf16 * eff)
    else:
        recompute = 0.0
    flags: list[str] = []
    traffic = {"intra": 0.0, "inter": 0.0, "host": 0.0}

    tp_comm = 0.0
    if lay.tp > 1:
        link = link_of(hw, 1, lay.tp)
        per = T.tp_comm_elements_per_layer(b, s // lay.sp, h, lay.tp, lay.sequence_parallel)
        factor = 1.5 if lay.remat == "full" else 1.0
        nbytes = per["elements"] * factor * cdt * layers * m
        traffic[link] += nbytes
        tp_comm = nbytes / _bw(hw, link)
        if link == "inter":
            flags.append(f"TP across nodes: tp={lay.tp} > {hw.devices_per_node} devices per node")

    sp_comm = 0.0
    if lay.sp > 1:
        link = link_of(hw, lay.tp, lay.sp)
        kv = model.n_kv_heads * model.hd
        if lay.sp_mode == "ring":
            el = T.ring_attention_comm_elements_per_layer(b * s, kv // max(1, lay.tp), lay.sp)
            elements = el["elements"]
        else:
            el = T.ulysses_comm_elements_per_layer(b * s, h // lay.tp, lay.sp, kv // lay.tp or 1)
            elements = el["wire"]
        nbytes = elements * cdt * layers * m
        traffic[link] += nbytes
        sp_comm = nbytes / _bw(hw, link)
        if link == "inter":
            flags.append(f"sequence parallelism across nodes: sp·tp={lay.sp * lay.tp}")

    busy = compute + recompute + tp_comm + sp_comm
    bubble = busy * (makespan_over_busy - 1.0)

    pp_p2p = 0.0
    if lay.pp > 1:
        link = link_of(hw, lay.dp * lay.sp * lay.tp, lay.pp)
        per = T.pp_p2p_elements(b, s // lay.sp, h, lay.tp, lay.sequence_parallel) * cdt
        nbytes = 2 * per * ticks
        traffic[link] += nbytes
        pp_p2p = nbytes / _bw(hw, link)

    dp_comm = 0.0
    if lay.dp > 1:
        link = link_of(hw, lay.sp * lay.tp, lay.dp)
        psi = T.param_shard_count(model, lay)["local"]
        elements = T.dp_comm_elements(psi, lay.dp, lay.zero)
        if lay.zero == 3 and lay.pp > 1:
            elements = (2 * m + 1) * psi * T.ring_factor(lay.dp)
            flags.append(
                f"ZeRO-3 inside a pipeline regathers the params every micro-batch "
                f"({2 * m + 1}Ψ instead of 3Ψ per step)"
            )
        nbytes = elements * rdt
        traffic[link] += nbytes
        hide = DP_OVERLAP * (compute + recompute) * (1.0 if lay.zero == 3 else 2 / 3)
        dp_comm = max(0.0, nbytes / _bw(hw, link) - hide)

    offload = 0.0
    if lay.offload != "none":
        shard = T.param_shard_count(model, lay)
        nbytes = 4 * shard["grads"] + 4 * shard["params"]
        if lay.offload == "params":
            nbytes += 4 * shard["params"] * m
        traffic["host"] += nbytes
        offload = nbytes / hw.host_to_device_bw
    if lay.remat == "offload":
        # activations go to host in the forward and come back for the backward
        from jaxpar.planner.memory import layer_bytes

        nbytes = 2 * layer_bytes(model, lay, s, b) * layers * m
        traffic["host"] += nbytes
        offload += nbytes / hw.host_to_device_bw

    terms = {
        "compute": compute,
        "recompute": recompute,
        "tp_comm": tp_comm,
        "sp_comm": sp_comm,
        "bubble": bubble,
        "pp_p2p": pp_p2p,
        "dp_comm": dp_comm,
        "offload": offload,
    }
    return Cost(terms, traffic, eff, flags)
