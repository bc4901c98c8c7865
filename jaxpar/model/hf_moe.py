"""Hugging Face Mixtral checkpoints in and out of jaxpar (the MoE half of :mod:`jaxpar.model.hf`).

A Mixtral is a Llama whose every feed-forward is a mixture of experts, so attention, norms,
embedding and head map exactly as in :mod:`jaxpar.model.hf`, only onto the MoE group stack
(``moe_layers/moe``, one group per layer: ``first_dense`` 0, ``every`` 1). The feed-forward:

==================================  ==========================  =========
HF ``model.layers.N.``                jaxpar ``moe_layers/moe/``  transform
==================================  ==========================  =========
block_sparse_moe.gate ``[E, D]``    mlp/router [N] ``[D, E]``   ``w.T``
block_sparse_moe.experts.X.w1       mlp/w_gate [N, X] ``[D,F]``  ``w.T``
block_sparse_moe.experts.X.w3       mlp/w_up [N, X] ``[D, F]``  ``w.T``
block_sparse_moe.experts.X.w2       mlp/w_down [N, X] ``[F,D]``  ``w.T``
(none)                              mlp/bias [N] ``[E]``        zeros
==================================  ==========================  =========

(each ``.weight``; HF stores ``[out, in]``: w1 and w3 ``[F, D]``, w2 ``[D, F]``).

Routing is the same function: ``transformers``' ``MixtralTopKRouter`` takes the softmax over
all experts in fp32, picks the top ``num_experts_per_tok`` and renormalises the picked
probabilities to sum 1; jaxpar's ``router: softmax`` with ``route_scale`` 1 and a zero bias
does exactly that, dropless (``capacity_factor`` 0). What Mixtral cannot hold is refused in one
line: shared experts, dense layers, a sigmoid router, a route scale, and a learned routing bias
(``bias_rate`` > 0 on export). Sliding-window attention (``sliding_window`` set) is not built.
Qwen3-MoE and DeepSeek-V3 checkpoints are refused naming what jaxpar lacks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxpar.config import ModelConfig, MoeConfig
from jaxpar.errors import ConfigError

MODEL_TYPE = "mixtral"
# model_type -> what is missing (the one-line refusal's rule)
REFUSED = {
    "qwen3_moe": "Qwen3-MoE import: not supported (q/k norm and decoder_sparse_step are not built)",
    "qwen2_moe": "Qwen2-MoE import: not supported (shared-expert gate and qkv biases not built)",
    "deepseek_v3": "DeepSeek-V3 import: not supported (multi-head latent attention is not built)",
    "deepseek_v2": "DeepSeek-V2 import: not supported (multi-head latent attention is not built)",
}
BIAS = ("moe_layers", "moe", "mlp", "bias")


def refusal(model_type: Any) -> str:
    """The rule a ``config.json`` of ``model_type`` breaks ('' for llama and mixtral)."""
    if model_type in ("llama", MODEL_TYPE):
        return ""
    return REFUSED.get(model_type, "must be 'llama' or 'mixtral'")


def config_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of a Mixtral ``config.json`` beyond the Llama ones."""
    window = hf.get("sliding_window")
    if window is not None:
        raise ConfigError(
            f"{where}: sliding_window={window!r}: sliding-window attention: not built"
        )
    experts, top_k = hf["num_local_experts"], hf["num_experts_per_tok"]
    for key, v in (("num_local_experts", experts), ("num_experts_per_tok", top_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{key}={v!r}: must be a positive integer")
    # No balancing rule: the imported model routes as the checkpoint does (-o turns one on).
    moe = MoeConfig(experts=experts, top_k=top_k, expert_ff=hf["intermediate_size"],
                    router="softmax", capacity_factor=0.0, bias_rate=0.0)  # fmt: skip
    return {"moe": moe}


def check_shape(cfg: ModelConfig) -> None:
    """Refuse a MoE model that a Mixtral cannot hold, naming the field."""
    e = cfg.moe
    rules = [
        ("shared_experts", e.shared_experts, not e.shared_experts, "Mixtral has no shared experts"),
        ("first_dense", e.first_dense, e.first_dense == 0, "Mixtral's layers are all MoE"),
        ("every", e.every, e.every == 1, "Mixtral's layers are all MoE"),
        ("router", e.router, e.router == "softmax", "Mixtral routes by softmax"),
        ("route_scale", e.route_scale, e.route_scale == 1.0, "Mixtral's gates are not scaled"),
    ]
    for field, value, ok, rule in rules:
        if not ok:
            raise ConfigError(f"model.moe.{field}={value!r}: {rule} (Hugging Face Mixtral)")


def check_export(cfg: ModelConfig) -> None:
    """Refuse, before training, a ``train.export_hf`` that Mixtral's format cannot hold."""
    check_shape(cfg)
    if cfg.moe.bias_rate:
        raise ConfigError(
            f"model.moe.bias_rate={cfg.moe.bias_rate:g}: Mixtral has no routing bias, so a "
            "learned one cannot be exported; set model.moe.bias_rate=0 (or aux_loss to balance)"
        )


def check_config(theirs: ModelConfig, cfg: ModelConfig, directory: str) -> None:
    """Refuse ``cfg`` whose experts differ from the checkpoint's (dense against MoE too)."""
    mine = (cfg.moe.experts, cfg.moe.top_k, cfg.expert_ff if cfg.moe.enabled else 0)
    other = (theirs.moe.experts, theirs.moe.top_k, theirs.expert_ff if theirs.moe.enabled else 0)
    for field, a, b in zip(("experts", "top_k", "expert_ff"), other, mine, strict=True):
        if a != b and (field == "experts" or cfg.moe.enabled):
            raise ConfigError(
                f"model.moe.{field}={b!r}: the Hugging Face config.json in {directory!r} has {a!r}"
            )
    if cfg.moe.enabled:
        check_shape(cfg)


def entries(dense: list, entry: type) -> list:
    """The Mixtral entries from the Llama ones (``dense``, :class:`jaxpar.model.hf._Entry`):
    per-layer tensors onto the MoE group stack, the dense FFN replaced by router and experts."""
    out = []
    for e in dense:
        if ".mlp." in e.hf:
            continue
        if e.stacked:
            e = dataclasses.replace(e, path=("moe_layers", "moe", *e.path[1:]))
        out.append(e)
    t = lambda w, _: np.ascontiguousarray(w.T)  # noqa: E731
    moe_l = "model.layers.{i}.block_sparse_moe."
    mlp = ("moe_layers", "moe", "mlp")
    up = lambda c: (c.expert_ff, c.d_model)  # noqa: E731
    down = lambda c: (c.d_model, c.expert_ff)  # noqa: E731
    out += [
        entry(moe_l + "gate.weight", (*mlp, "router"), lambda c: (c.moe.experts, c.d_model), t, t),
        entry(moe_l + "experts.{x}.w1.weight", (*mlp, "w_gate"), up, t, t),
        entry(moe_l + "experts.{x}.w3.weight", (*mlp, "w_up"), up, t, t),
        entry(moe_l + "experts.{x}.w2.weight", (*mlp, "w_down"), down, t, t),
    ]  # fmt: skip
    return out


def add_bias(params: dict, cfg: ModelConfig, shardings: Any) -> None:
    """The routing bias a Mixtral does not have: zeros, in its sharding (selection = scores)."""
    import jax

    shape = (cfg.moe_layers(), cfg.moe.experts)
    zeros = np.zeros(shape, np.float32)
    sharding = shardings
    for k in BIAS:
        sharding = sharding[k] if sharding is not None else None
    if sharding is None:
        value = jax.numpy.asarray(zeros)
    else:
        value = jax.make_array_from_callback(shape, sharding, lambda index: zeros[index])
    params["moe_layers"]["moe"]["mlp"]["bias"] = value


def check_bias(bias: np.ndarray) -> None:
    """Refuse exporting a nonzero routing bias (Mixtral's router has none: selection would
    change)."""
    worst = float(np.abs(bias).max()) if bias.size else 0.0
    if worst:
        raise ConfigError(
            f"moe_layers/moe/mlp/bias: max |bias| = {worst:.3g}: Mixtral has no routing bias, "
            "so these weights route unlike their export; train with model.moe.bias_rate=0"
        )


def hf_config(cfg: ModelConfig, llama: dict[str, Any]) -> dict[str, Any]:
    """A ``MixtralForCausalLM`` config.json for ``cfg`` from the Llama one."""
    out = {k: v for k, v in llama.items() if k not in ("attention_bias", "mlp_bias")}
    out.update(
        architectures=["MixtralForCausalLM"],
        model_type=MODEL_TYPE,
        intermediate_size=cfg.expert_ff,
        num_local_experts=cfg.moe.experts,
        num_experts_per_tok=cfg.moe.top_k,
        sliding_window=None,
        router_jitter_noise=0.0,
        router_aux_loss_coef=cfg.moe.aux_loss,
        output_router_logits=False,
    )
    return out
