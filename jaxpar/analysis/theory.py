"""Closed forms from the literature: ZeRO's model states, Korthikanti's activations, Megatron,
Ulysses and ring traffic per layer, FLOPs per token, the pipeline bubble.

Pure Python (no JAX). These are the papers' figures, kept to check against (tests reproduce the
published tables). What jaxpar's own program holds and sends — per tensor as the trainer shards
it, per remat policy as its block saves residuals, per ZeRO stage as its gradient path reduces —
is :mod:`jaxpar.planner` (shapes, memory, traffic, cost), which reuses the per-layer traffic
formulas below. Notation: Ψ parameters, N (or ``n``) data-parallel size, t tensor-parallel
size, p pipeline stages, m micro-batches, v virtual stages per rank, P sequence-parallel size,
s sequence length, b micro-batch size, h hidden size, a attention heads, l layers.
Sources:

* ZeRO — Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", SC 2020 (Table 1; §7 communication).
* Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022
  (Table 2: activation memory per layer).
* Megatron-LM — Shoeybi et al. 2019 (TP all-reduces); Narayanan et al. 2021 (pipeline bubble,
  interleaved schedule).
* DeepSpeed-Ulysses — Jacobs et al. 2023 (all-to-all volume); Ring Attention — Liu et al. 2023.
* PaLM — Chowdhery et al. 2022, App. B (FLOPs per token with attention; MFU).
"""

from __future__ import annotations

import math

from jaxpar.config import ModelConfig

GB = 1e9  # the ZeRO paper's GB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_K = 12  # ZeRO's K: fp32 master params, Adam m and v (4 + 4 + 4 bytes per parameter)


# --------------------------------------------------------------------------------------------
# Model states


def zero_model_states(psi: float, n: int, stage: int, k: float = ADAM_K) -> dict[str, float]:
    """Model-state bytes per device in the ZeRO paper's convention (mixed-precision Adam).

    bf16 params 2Ψ, bf16 grads 2Ψ, optimizer KΨ (K = 12: fp32 master, m, v). Stage 1 divides
    the optimizer by N, stage 2 also the grads, stage 3 also the params:
    DDP (2+2+K)Ψ = 16Ψ; ZeRO-1 4Ψ + KΨ/N; ZeRO-2 2Ψ + (2+K)Ψ/N; ZeRO-3 (4+K)Ψ/N.
    ZeRO Table 1, Ψ = 7.5e9, N = 64: 120, 31.4, 16.6, 1.88 GB.
    """
    _check_stage(stage)
    params = 2 * psi / (n if stage >= 3 else 1)
    grads = 2 * psi / (n if stage >= 2 else 1)
    opt = k * psi / (n if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


def _check_stage(stage: int) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero stage={stage!r}: must be 0, 1, 2 or 3")


# --------------------------------------------------------------------------------------------
# Activations


def activation_bytes_per_layer(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    cp: int = 1,
    flash: bool = False,
    bytes_per_value: int = 2,
) -> float:
    """Activation bytes of one transformer layer on one device (Korthikanti et al., Table 2).

    16-bit activations (1-byte dropout masks): no parallelism sbh(34 + 5as/h); TP without SP
    sbh(10 + 24/t + 5as/(ht)); TP+SP sbh(34/t + 5as/(ht)). Selective recompute (attention core
    recomputed, its 5as/h term gone): sbh(10 + 24/t), with SP sbh·34/t. Full recompute keeps
    the layer input, 2sbh (2sbh/t with SP, where the residual stream is sequence-sharded).
    ``flash`` drops the 5as/h score term (attention kernels that never store scores).
    ``cp`` (context-parallel ``sp`` size) divides the total: Ulysses holds s/cp tokens and a/cp
    heads' s×s scores; for ring attention the score term is an upper bound.
    ``bytes_per_value`` rescales from the paper's 2 bytes (e.g. 4 for fp32, approximate: masks
    stay 1 byte in reality).
    """
    sbh = s * b * h
    score = 0.0 if flash else 5 * a * s / h
    if recompute == "full":
        base = 2 / t if sequence_parallel else 2.0
    elif recompute == "selective":
        base = 34 / t if sequence_parallel else 10 + 24 / t
    elif recompute in ("none", "offload"):
        base = (34 / t if sequence_parallel else 10 + 24 / t) + score / t
    else:
        raise ValueError(f"recompute={recompute!r}: must be none, selective, full or offload")
    return sbh * base / cp * bytes_per_value / 2


# --------------------------------------------------------------------------------------------
# Communication (elements unless named *_bytes; per device)


def ring_factor(n: int) -> float:
    """(n−1)/n: the share of a buffer each device sends in a ring all-gather/reduce-scatter."""
    return (n - 1) / n


def tp_comm_elements_per_layer(
    b: int, s: int, h: int, t: int, sequence_parallel: bool = False, recompute: str = "none"
) -> dict[str, float]:
    """Megatron TP traffic per layer per micro-batch (forward + backward), per device.

    Without SP: 4 all-reduces (2 forward: after attention-out and MLP-down; 2 backward: the
    conjugate ones at the column-parallel inputs) of a b·s·h buffer, each 2·bsh·(t−1)/t
    → 8·bsh·(t−1)/t; a full recompute adds the first forward all-reduce again (the second's
    result is dead in the backward) → 10·bsh·(t−1)/t. With SP each all-reduce becomes
    reduce-scatter + all-gather (bsh·(t−1)/t apiece), and the backward all-gathers the two
    column-parallel inputs again for their weight gradients (Megatron-LM's choice, which
    jaxpar's remat policies make too: the sequence-sharded input is kept, not the gathered
    one): 6 all-gathers and 4 reduce-scatters → 10·bsh·(t−1)/t; under a full recompute the
    forward's four calls are repeated instead of the two gathers → 12·bsh·(t−1)/t.
    """
    one = b * s * h * ring_factor(t)
    full = recompute == "full"
    if sequence_parallel:
        ops = {"all-gather": 6, "reduce-scatter": 6 if full else 4}
        return {"ops": ops, "elements": sum(ops.values()) * one}
    ops = {"all-reduce": 5 if full else 4}
    return {"ops": ops, "elements": 2 * ops["all-reduce"] * one}


def ulysses_comm_elements_per_layer(
    tokens: int, h: int, p: int, kv_dim: int | None = None
) -> dict[str, float]:
    """DeepSpeed-Ulysses all-to-all traffic per layer per device (``tokens`` = b·s).

    Forward: 4 all-to-alls (q, k, v from sequence- to head-sharded; the output back), each
    holding tokens·h/P elements per device → 4·tokens·h/P (paper: 4Nh/P per link); backward
    the same again. ``kv_dim`` (n_kv_heads·head_dim under GQA) shrinks the k and v messages.
    ``elements`` is the held (operand) volume; ``wire`` multiplies by (P−1)/P.
    """
    kv = h if kv_dim is None else kv_dim
    fwd = (2 * h + 2 * kv) * tokens / p
    return {"forward": fwd, "backward": fwd, "elements": 2 * fwd, "wire": 2 * fwd * ring_factor(p)}


def ring_attention_comm_elements_per_layer(
    tokens: int, kv_dim: int, p: int, backward_kv_pass: bool = True
) -> dict[str, float]:
    """Ring-attention traffic per layer per device (``tokens`` = b·s, ``kv_dim`` = kv width).

    Forward: each device passes its K and V blocks (tokens/P × kv_dim each) P−1 times
    → 2·(P−1)·tokens·kv_dim/P. Backward: implementations that recompute (flash/ring kernels)
    circulate K, V and the dK, dV accumulators: twice the forward. Without that second K/V pass
    (``backward_kv_pass=False``: autodiff through the ring keeps the received blocks as
    residuals, as jaxpar's :func:`jaxpar.model.attention.ring_attention` does) only dK, dV go
    back around: the same as the forward.
    """
    fwd = 2 * (p - 1) * tokens * kv_dim / p
    bwd = 2 * fwd if backward_kv_pass else fwd
    return {"forward": fwd, "backward": bwd, "elements": fwd + bwd}


def pp_p2p_elements(b: int, s: int, h: int, t: int = 1, sequence_parallel: bool = False) -> float:
    """Elements a stage boundary carries per micro-batch each way (activations forward,
    their gradients backward): b·s·h, or b·s·h/t per device when the residual stream is
    sequence-sharded over tp (Megatron SP)."""
    return b * s * h / (t if sequence_parallel else 1)


# --------------------------------------------------------------------------------------------
# FLOPs and MFU


def matmul_params(model: ModelConfig) -> int:
    """Parameters that take part in one token's matmuls: all but the input embedding (a
    gather); with tied embeddings the shared matrix counts once, as the head. A MoE model
    counts its active parameters (``top_k`` routed experts, the shared ones, the router)."""
    untied_embed = 0 if model.tied_embeddings else model.vocab_size * model.d_model
    return model.active_param_count() - untied_embed


def forward_flops_per_token(model: ModelConfig, seq: int) -> float:
    """2Ψ + 4·l·h·s (PaLM App. B, forward third): Ψ = :func:`matmul_params`, h = heads·head_dim;
    attention counted as non-causal (QKᵀ and AV, 2·2·h·s per layer per token)."""
    return 2 * matmul_params(model) + 4 * model.n_layers * model.n_heads * model.hd * seq


def train_flops_per_token(model: ModelConfig, seq: int) -> float:
    """6Ψ + 12·l·h·s (PaLM App. B): forward + backward (2×) model FLOPs per token, excluding
    recomputation (so MFU, not HFU)."""
    return 3 * forward_flops_per_token(model, seq)


def mfu(tokens_per_s: float, flops_per_token: float, n_devices: int, peak: float) -> float:
    """Model FLOPs utilisation: tokens/s · FLOPs/token ÷ (devices · peak FLOP/s per device)."""
    return tokens_per_s * flops_per_token / (n_devices * peak)


# --------------------------------------------------------------------------------------------
# Pipeline bubble


def bubble_fraction(p: int, m: int, schedule: str = "1f1b", v: int = 1) -> float:
    """Idle share of a pipeline step (Narayanan et al. 2021).

    GPipe and 1F1B: (p−1)/(m+p−1) — both have bubble (p−1)/m of the ideal time; 1F1B only
    lowers in-flight activations. Interleaved 1F1B: (p−1)/(v·m+p−1). Zero-bubble and DualPipe
    figures come from the schedule library's tables.
    """
    if schedule in ("gpipe", "1f1b"):
        v = 1
    elif schedule != "interleaved":
        raise ValueError(f"schedule={schedule!r}: use the schedule library's statistics")
    return (p - 1) / (v * m + p - 1)


def bubble_overhead(p: int, m: int, schedule: str = "1f1b", v: int = 1) -> float:
    """Bubble relative to the ideal (bubble-free) time: (p−1)/m, interleaved (p−1)/(v·m)."""
    f = bubble_fraction(p, m, schedule, v)
    return f / (1 - f) if f < 1 else math.inf
