"""Tensor and sequence parallelism measured: per-layer collectives and activation memory.

:func:`measure` compiles a layout's loss-and-gradient function (no optimizer, so compiled
temporaries are activations and their gradients) and reads the collectives that run inside the
layer scans (``trips == n_layers``: once per layer, forward or backward; the backward is told
by ``transpose(`` in the op name). :func:`expected_per_layer` states what theory says for the
same shapes (:mod:`jaxpar.analysis.theory`): Megatron TP ``8·b·s·h·(t−1)/t`` wire elements per
layer, Ulysses ``(2h + 2·kv)·b·s/P`` per direction (``4·N·h/P`` for MHA), ring
``2·(P−1)·b·s·kv/P`` per direction.

CPU notes (jax 0.10.2): GSPMD's reduce-scatter out of a row-parallel matmul under Megatron-SP is
lowered as an all-reduce of the full buffer followed by a local slice; :func:`tp_wire_bytes`
therefore prices an all-reduce that stands for a reduce-scatter at (t−1)/t of its operand (what a
reduce-scatter moves), which is what GPU XLA emits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxpar.analysis import theory
from jaxpar.analysis.hlo import collective_bytes, compiled_memory
from jaxpar.config import RunConfig

F32 = 4


@dataclass
class LayerComm:
    """Collectives of one layer (per device), by (kind, axes, pass) with pass 'fwd'/'bwd'."""

    ops: dict[tuple[str, tuple[str, ...], str], int] = field(default_factory=dict)
    bytes: dict[tuple[str, tuple[str, ...], str], float] = field(default_factory=dict)

    def get(self, kind: str, axes: tuple[str, ...], phase: str | None = None) -> tuple[int, float]:
        """(ops, bytes) of ``kind`` over exactly ``axes``, one pass or both."""
        phases = ("fwd", "bwd") if phase is None else (phase,)
        keys = [(kind, axes, p) for p in phases]
        return sum(self.ops.get(k, 0) for k in keys), sum(self.bytes.get(k, 0.0) for k in keys)

    def to_dict(self) -> list[dict[str, Any]]:
        """JSON-ready rows."""
        return [
            {"kind": k, "axes": list(a), "pass": p, "ops": self.ops[(k, a, p)], "bytes": b}
            for (k, a, p), b in sorted(self.bytes.items())
        ]


def per_layer(report, n_layers: int, min_bytes: float = 0.0) -> LayerComm:
    """Collectives that run once per layer (inside a layer scan), per device per layer.

    ``min_bytes`` drops small ones (e.g. norm-scale gradients all-reduced over sequence shards).
    """
    out = LayerComm()
    for c in report.collectives:
        if c.trips != n_layers or c.bytes < min_bytes:
            continue
        key = (c.kind, c.axes, "bwd" if "transpose(" in c.op_name else "fwd")
        out.ops[key] = out.ops.get(key, 0) + 1
        out.bytes[key] = out.bytes.get(key, 0.0) + c.bytes
    return out


def tp_wire_bytes(layer: LayerComm, t: int) -> float:
    """Wire bytes of one layer's activation collectives over ``tp`` (forward + backward).

    All-reduce 2·(t−1)/t of its operand; all-gather (t−1)/t of its output; an all-reduce next
    to all-gathers (Megatron-SP on CPU) stands for a reduce-scatter: (t−1)/t of its operand; a
    collective-permute (a step of Megatron-SP's collective matmul ring,
    :mod:`jaxpar.model.collective_matmul`) its operand.
    """
    ring = (t - 1) / t
    _, ag = layer.get("all-gather", ("tp",))
    _, ar = layer.get("all-reduce", ("tp",))
    _, rs = layer.get("reduce-scatter", ("tp",))
    _, cp = layer.get("collective-permute", ("tp",))
    ar_factor = 1.0 if ag else 2.0  # with SP the all-reduces are reduce-scatters in disguise
    return ag * ring + rs * ring + ar * ring * ar_factor + cp


def expected_per_layer(cfg: RunConfig) -> dict[str, float]:
    """Theory's per-layer bytes per device (fp32) for this run's shapes."""
    m, lay, t = cfg.model, cfg.layout, cfg.train
    b, s, h = t.global_batch // lay.dp // lay.microbatches, t.seq_len, m.d_model
    out: dict[str, float] = {}
    if lay.tp > 1:
        # TP collectives act on the tokens a device holds: s/sp of the sequence.
        tp = theory.tp_comm_elements_per_layer(
            b, s // lay.sp, h, lay.tp, lay.sequence_parallel, lay.remat
        )
        out["tp_wire_bytes"] = tp["elements"] * F32
    if lay.sp > 1:
        from jaxpar.model.attention import kv_repeat  # noqa: PLC0415

        # Per device: b·s tokens of its dp rank, heads within its tp rank (h/tp, kv/tp).
        shards = lay.tp * lay.sp if lay.sp_mode == "ulysses" else lay.tp
        kv_heads = m.n_kv_heads * (kv_repeat(m.n_heads, m.n_kv_heads, shards) or 1)
        kv = kv_heads * m.hd // lay.tp
        if lay.sp_mode == "ulysses":
            q = m.n_heads * m.hd // lay.tp
            u = theory.ulysses_comm_elements_per_layer(b * s, q, lay.sp, kv)
            out["all_to_all_bytes"] = u["elements"] * F32
        else:
            r = theory.ring_attention_comm_elements_per_layer(
                b * s, kv, lay.sp, backward_kv_pass=False
            )
            out["permute_bytes"] = r["elements"] * F32
    return out


def measure(cfg: RunConfig, devices) -> dict[str, Any]:
    """Compile the loss-and-gradient function of ``cfg`` on ``devices`` and report
    ``temp_bytes`` (compiled temporaries per device), ``layer`` (:class:`LayerComm`),
    ``report`` (the whole :class:`~jaxpar.analysis.hlo.CollectiveReport`) and ``compiled``."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxpar.devices import make_mesh  # noqa: PLC0415
    from jaxpar.train.step import Trainer  # noqa: PLC0415

    mesh = make_mesh(cfg.layout, devices)
    tr = Trainer(cfg, mesh)
    params = jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
        tr.abstract_params,
        tr.param_shardings,
    )
    batch = jax.ShapeDtypeStruct(
        (cfg.train.global_batch, cfg.train.seq_len + 1), jnp.int32, sharding=tr.batch_sharding
    )
    with tr._ctx():
        compiled = jax.jit(tr.grads_fn).lower(params, batch).compile()
    report = collective_bytes(compiled, mesh)
    return {
        "temp_bytes": compiled_memory(compiled)["temp"],
        "layer": per_layer(report, cfg.model.n_layers),
        "report": report,
        "compiled": compiled,
        "trainer": tr,
    }
