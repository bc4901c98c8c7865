"""Per-device memory and data-parallel traffic of a layout: theory next to the compiled program.

:func:`theory` gives the ZeRO paper's convention (mixed-precision Adam, 2 + 2 + 12 bytes per
parameter) and what jaxpar itself stores (:func:`jaxpar.analysis.theory.stored_model_states`).
:func:`measure` compiles the real train step and reads XLA's per-device memory analysis and the
collectives of the optimized HLO. :func:`dp_comm_theory` states the data-parallel traffic a
ZeRO stage should have in jaxpar's implementation (:mod:`jaxpar.train.reduce`).
"""

from __future__ import annotations

from typing import Any

from jaxpar.analysis import theory as T
from jaxpar.config import LayoutConfig, ModelConfig, RunConfig


def theory(
    layout: LayoutConfig,
    model: ModelConfig | None = None,
    params: float | None = None,
    seq: int = 2048,
    microbatch_size: int = 1,
) -> dict[str, Any]:
    """Per-device bytes: ZeRO convention at the top level, jaxpar's storage under ``stored``.

    With only ``params`` (Ψ) the ZeRO figures use Ψ/(tp·pp) per device and no activations or
    ``stored`` block can be computed (they need the model's shape).
    """
    if model is None and params is None:
        raise ValueError("theory needs a model or a parameter count")
    psi = float(params if model is None else model.param_count())
    nz = layout.dp_shard if 0 < layout.dp_shard < layout.dp else layout.dp
    if model is not None:
        psi_local = float(T.param_shard_count(model, layout)["local"])
    else:
        psi_local = psi / (layout.tp * layout.pp)
    z = T.zero_model_states(psi_local, nz, layout.zero)
    out: dict[str, Any] = {
        "params_count": psi,
        "params_per_device": psi_local,
        "zero_shards": nz,
        "model_states_bytes": z["total"],
        "params_bytes": z["params"],
        "grads_bytes": z["grads"],
        "optimizer_bytes": z["optimizer"],
        "activations_bytes": None,
        "stored": None,
    }
    if model is not None:
        act = T.activation_bytes(
            model, layout, seq, microbatch_size, bytes_per_value=T.DTYPE_BYTES[layout.compute_dtype]
        )
        out["activations_bytes"] = act
        st = T.stored_model_states(model, layout)
        out["stored"] = {
            "model_states_bytes": st["total"],
            "params_bytes": st["params"],
            "grads_bytes": st["grads"],
            "optimizer_bytes": st["optimizer"],
            "activations_bytes": act,
            "at_rest_bytes": st["params"] + st["optimizer"],
        }
    return out


def dp_comm_theory(cfg: RunConfig) -> dict[str, float]:
    """Data-parallel traffic per device per step in jaxpar's ZeRO implementation, in bytes on
    the wire (ring algorithms; ``ring`` = (N−1)/N made explicit).

    Ψ = parameters per device after tp/pp, N = dp (ZeRO group), k = micro-batches, w = bytes
    of the reduction dtype (grads) and of the parameter dtype (params):

    * stage 0: all-reduce of the grads once per step: 2Ψ·ring;
    * stage 1: reduce-scatter once + all-gather of the updated params: 2Ψ·ring;
    * stage 2: reduce-scatter per micro-batch + all-gather: (k + 1)Ψ·ring (2Ψ at k = 1);
    * stage 3: per micro-batch, all-gather in forward and again in backward (remat) and a
      reduce-scatter: 3kΨ·ring — less the second gather of the embedding and head tensors,
      listed as ``embedding_regather_saved``: the input embedding's backward needs no weights,
      and the head's backward follows its forward in one computation, where XLA reuses the
      forward's gather (measured on jax 0.10.2, CPU).

    Hybrid sharding adds an all-reduce of the shard across the dp/dp_shard groups.
    """
    from jaxpar.analysis.theory import DTYPE_BYTES, param_shard_count

    lay, m = cfg.layout, cfg.model
    c = param_shard_count(m, lay)
    psi = float(c["local"])
    n = c["zero_shards"] if lay.zero else lay.dp  # DDP: one all-reduce over all of dp
    k = lay.microbatches
    ring = (n - 1) / n
    wr, wp = DTYPE_BYTES[lay.reduce_dtype], DTYPE_BYTES[lay.param_dtype]
    wc = DTYPE_BYTES[lay.compute_dtype]
    saved = 0.0
    if lay.zero == 0:
        grads, params = 2 * psi * ring * wr, 0.0
    elif lay.zero in (1, 2):
        reduces = 1 if lay.zero == 1 else k
        grads, params = reduces * psi * ring * wr, psi * ring * wp
    else:
        t = c["tensors"]
        embed = float(sum(t[x]["local"] for x in ("embed", "head", "final_norm") if x in t))
        grads = k * psi * ring * wr
        params = 2 * k * psi * ring * wc
        saved = k * embed * ring * wc
    groups = lay.dp // n
    across = 0.0
    if groups > 1:  # hybrid: all-reduce of each gradient shard over the replica groups
        across = 2 * (psi / n) * (groups - 1) / groups * wr
    return {
        "psi": psi,
        "n": n,
        "ring_factor": ring,
        "grad_bytes": grads,
        "param_bytes": params - saved,
        "embedding_regather_saved": saved,
        "across_groups_bytes": across,
        "total_bytes": grads + params - saved + across,
    }


def dp_axes_of(mesh: Any) -> set[str]:
    """The data-parallel mesh axes (``dp``, or ``dpr``/``dps`` under hybrid sharding)."""
    return {a for a in mesh.axis_names if a.startswith("dp")}


def comm_report(compiled: Any, mesh: Any) -> dict[str, Any]:
    """Collective bytes per (kind, axes) of a compiled step, plus the data-parallel subtotal
    (collectives whose groups vary only along dp axes; wire bytes per device per step)."""
    from jaxpar.analysis.hlo import collective_bytes

    rep = collective_bytes(compiled, mesh)
    out = rep.to_dict()
    dp = dp_axes_of(mesh)
    wire = sum(s.wire_bytes for (_, ax), s in rep.stats.items() if ax and set(ax) <= dp)
    held = sum(s.bytes for (_, ax), s in rep.stats.items() if ax and set(ax) <= dp)
    out["dp_wire_bytes"] = wire
    out["dp_bytes"] = held
    return out


def measure(cfg: RunConfig, devices: Any = None, comm: bool = True) -> dict[str, Any]:
    """Compile the real train step for ``cfg`` (nothing runs) and report XLA's per-device
    memory (``argument``, ``output``, ``temp``, ...), the model states it holds at rest
    (``state_bytes`` = arguments − the batch shard) and, with ``comm``, the collectives."""
    import jax
    import numpy as np

    from jaxpar.analysis.hlo import compiled_memory
    from jaxpar.devices import make_mesh
    from jaxpar.train.step import Trainer

    devices = list(devices if devices is not None else jax.devices())[: cfg.layout.n_devices]
    mesh = make_mesh(cfg.layout, devices)
    tr = Trainer(cfg, mesh)
    compiled = tr.compile_step()
    mem = compiled_memory(compiled)
    batch_rows = cfg.train.global_batch // cfg.layout.dp
    batch = batch_rows * (cfg.train.seq_len + 1) * np.dtype(np.int32).itemsize
    on_host = mem.get("host_argument") or 0
    out: dict[str, Any] = dict(mem)
    out["batch_bytes"] = batch
    out["state_bytes"] = (mem["argument"] or 0) + on_host - batch
    out["device_state_bytes"] = (mem["argument"] or 0) - batch
    if comm:
        out["comm"] = comm_report(compiled, mesh)
    return out
