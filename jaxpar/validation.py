"""The rules a run configuration must meet, checked before JAX compiles anything.

:func:`validate` is the one entry point a run goes through: :func:`check_values` (types and
per-field rules of the model, hardware and training settings) and :func:`check_layout` (the
layout against the model, the batch and the device count: divisibility, heads, schedule
arguments, combinations the executor refuses). Every refusal is one :class:`ConfigError` line
naming the field, its value and the rule.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

from jaxpar import config, typed
from jaxpar.config import (
    ATTENTION,
    AXES,
    DISPATCHES,
    DTYPES,
    OFFLOAD,
    ON_NONFINITE,
    PIPELINE_MEMORY,
    PLATFORMS,
    REMAT,
    ROUTERS,
    SCHEDULES,
    SP_MODES,
    TOKEN_DTYPES,
    LayoutConfig,
    MeshConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
    nested_type,
)  # fmt: skip
from jaxpar.errors import ConfigError

# Largest value of a count (exact in float64 and far beyond any run), and tighter bounds where
# jaxpar or the planner enumerates a range of that size.
MAX_COUNT = 2**40
MAX_OF = {"mesh.devices": 2**20, "train.global_batch": 2**24, "train.seq_len": 2**24,
          "model.max_seq_len": 2**24}  # fmt: skip
# Sizes that JAX passes to XLA as int32 (a Python int past it is an OverflowError while
# tracing): token ids (so the vocabulary, padded included), the layer loop's trip count, and
# the tokens of a step (the loss sums over them).
INT32_MAX = 2**31 - 1
MAX_OF.update({"model.vocab_size": INT32_MAX, "model.n_layers": INT32_MAX})
MAX_SCHEDULE_ACTIONS = 2**18  # a pipeline schedule table of more takes minutes to build
MAX_SEED = 2**32 - 1  # jax.random.key and numpy's SeedSequence both take uint32 seeds


def _positive(where: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{where}={value!r}: must be a positive integer")
    if value > MAX_OF.get(where, MAX_COUNT):
        why = " (int32 in the compiled step)" if MAX_OF.get(where) == INT32_MAX else ""
        raise ConfigError(f"{where}={value}: must be at most {MAX_OF.get(where, MAX_COUNT)}{why}")


def _at_least_0(where: str, value: Any, note: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value > MAX_COUNT:
        raise ConfigError(f"{where}={value!r}: must be an integer in 0..{MAX_COUNT}{note}")


def _number(where: str, value: Any, lo: float, hi: float = math.inf, lo_open=True, hi_open=True):
    """A finite number in the interval (open or closed at each end)."""
    ok = typed.finite(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        left, right = "(" if lo_open else "[", ")" if hi_open else "]"
        rule = (
            "a positive finite number"
            if (lo, lo_open, hi) == (0, True, math.inf)
            else (f"a finite number in {left}{lo:g}, {hi:g}{right}")
        )
        raise ConfigError(f"{where}={value!r}: must be {rule}")


def _one_of(where: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{where}={value!r}: must be one of {', '.join(allowed)}")


def _path(where: str, value: Any) -> None:
    if value is not None and (not value or "\0" in value):
        raise ConfigError(f"{where}={value!r}: must be a non-empty path")


def check_types(obj: Any, where: str) -> None:
    """Every field of the config dataclass ``obj`` (recursively) holds its declared type; an
    int in a float field is widened in place."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        sub = nested_type(f)
        if sub is not None:
            if not isinstance(value, sub):
                raise ConfigError(f"{where}.{f.name}: expected a mapping of {sub.__name__} fields")
            check_types(value, f"{where}.{f.name}")
        else:
            setattr(obj, f.name, typed.check(f"{where}.{f.name}", value, f))


def check_values(cfg: RunConfig) -> None:
    """Types and per-field rules of the model, the hardware and the training settings (not
    the layout: :func:`validate` checks it against the model and the device count)."""
    for part, name in ((cfg.model, "model"), (cfg.mesh, "mesh"), (cfg.train, "train")):
        if not dataclasses.is_dataclass(part):
            raise ConfigError(f"{name}={part!r}: expected a mapping of fields")
        check_types(part, name)
    _check_model(cfg.model)
    _check_hardware(cfg.mesh)
    _check_train(cfg.train)


def _check_model(m: ModelConfig) -> None:
    if not m.name:
        raise ConfigError("model.name='': must be a non-empty name")
    for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size",
                 "max_seq_len"):  # fmt: skip
        _positive(f"model.{name}", getattr(m, name))
    if m.head_dim is not None:
        _positive("model.head_dim", m.head_dim)
    for name in ("rope_theta", "norm_eps", "init_std"):
        _number(f"model.{name}", getattr(m, name), 0)
    _one_of("model.mlp", m.mlp, ("swiglu", "gelu"))
    _one_of("model.attention", m.attention, ATTENTION)
    for name in ("attention_block", "loss_chunk"):
        _positive(f"model.{name}", getattr(m, name))
    unroll = m.layer_unroll
    if not isinstance(unroll, int) or isinstance(unroll, bool) or unroll < 0:
        raise ConfigError(
            f"model.layer_unroll={m.layer_unroll!r}: must be 0 (all layers unrolled) or a "
            "positive number of layers per loop iteration"
        )
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads}: must divide model.n_heads={m.n_heads}")
    if m.head_dim is None and m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model={m.d_model}: must be divisible by n_heads={m.n_heads}")
    if m.hd % 2:
        raise ConfigError(f"model.head_dim={m.hd}: must be even for rotary embeddings")
    _check_moe(m)


def _check_moe(m: ModelConfig) -> None:
    """The ``model.moe`` section: expert counts, routing and which layers are MoE."""
    e = m.moe
    _at_least_0("model.moe.experts", e.experts, " (0: a dense model)")
    if not e.enabled:
        return
    _positive("model.moe.top_k", e.top_k)
    if e.top_k > e.experts:
        raise ConfigError(
            f"model.moe.top_k={e.top_k}: must be at most model.moe.experts={e.experts}"
        )
    _at_least_0("model.moe.shared_experts", e.shared_experts)
    _at_least_0("model.moe.expert_ff", e.expert_ff, " (0: model.d_ff)")
    _one_of("model.moe.router", e.router, ROUTERS)
    _one_of("model.moe.dispatch", e.dispatch, DISPATCHES)
    _number("model.moe.route_scale", e.route_scale, 0)
    for name in ("bias_rate", "aux_loss"):
        _number(f"model.moe.{name}", getattr(e, name), 0, lo_open=False)
    if e.capacity_factor != 0:
        _number("model.moe.capacity_factor", e.capacity_factor, 0, lo_open=False)
        if e.capacity_factor < 1:
            raise ConfigError(
                f"model.moe.capacity_factor={e.capacity_factor:g}: must be 0 (dropless) or >= 1 "
                f"(below 1 the experts cannot hold the top_k*tokens/experts assignments of a "
                f"balanced router)"
            )
    _at_least_0("model.moe.first_dense", e.first_dense)
    _positive("model.moe.every", e.every)
    moe_span = m.n_layers - e.first_dense
    if moe_span < e.every or moe_span % e.every:
        raise ConfigError(
            f"model.moe.every={e.every}: must divide the n_layers - first_dense = "
            f"{m.n_layers}-{e.first_dense} = {moe_span} layers after the dense ones (and fit them)"
        )
    if m.mlp != "swiglu":
        raise ConfigError(f"model.mlp={m.mlp!r}: MoE experts are SwiGLU; set model.mlp=swiglu")


def _check_moe_layout(m: ModelConfig, lay: LayoutConfig) -> None:
    """Expert parallelism and the layouts MoE runs on (checked with the layout rules)."""
    e = m.moe
    _positive("layout.ep", lay.ep)
    if lay.ep > 1 and not e.enabled:
        raise ConfigError(
            f"layout.ep={lay.ep}: expert parallelism needs a MoE model (model.moe.experts > 0)"
        )
    if lay.ep > 1 and lay.dp % lay.ep:
        raise ConfigError(
            f"layout.ep={lay.ep}: must divide layout.dp={lay.dp} (experts are sharded over "
            f"groups of ep data-parallel ranks)"
        )
    if not e.enabled:
        return
    if e.experts % lay.ep:
        raise ConfigError(
            f"layout.ep={lay.ep}: model.moe.experts={e.experts} must be divisible by ep"
        )
    if lay.pp > 1 and e.first_dense:
        # A stage holds whole MoE groups (the pipeline's unit): dense blocks ahead of the first
        # group would make stage 0 a different program.
        raise ConfigError(
            f"model.moe.first_dense={e.first_dense}: with layout.pp={lay.pp} the pipeline "
            "stages hold MoE groups only; dense blocks before the first group are not "
            "supported with pp>1 (set model.moe.first_dense=0)"
        )
    if lay.pp > 1 and m.moe_layers() % (lay.pp * lay.virtual):
        raise ConfigError(
            f"layout.pp={lay.pp}: the {m.moe_layers()} MoE groups (model.n_layers/model.moe."
            f"every) must be divisible by pp*virtual={lay.pp}*{lay.virtual}"
        )
    if lay.sp > 1:
        raise ConfigError(f"layout.sp={lay.sp}: model.moe with sp>1: not supported yet")
    if lay.ep > 1 and 0 < lay.dp_shard < lay.dp:
        raise ConfigError(
            f"layout.dp_shard={lay.dp_shard}: hybrid sharding with layout.ep={lay.ep}: not "
            "supported yet"
        )
    if lay.tp > 1 and m.expert_ff % lay.tp:
        raise ConfigError(
            f"layout.tp={lay.tp}: the expert FFN width {m.expert_ff} must be divisible by tp"
        )


def check_dispatch(moe, ep: int, platform: str) -> None:
    """A ragged MoE exchange needs XLA's ragged all-to-all, which only GPU targets compile
    (the trainer checks its devices' platform, ``--dry-run`` the platform the run will use:
    :func:`jaxpar.preflight.check_platform`)."""
    # config.GPU_PLATFORMS read when called (tests/test_moe_ragged.py widens it to emulate)
    ragged = moe.dispatch == "ragged"
    if moe.enabled and ep > 1 and ragged and platform not in config.GPU_PLATFORMS:
        raise ConfigError(
            f"model.moe.dispatch='ragged': with layout.ep={ep} it needs a ragged all-to-all, "
            f"which XLA on platform {platform!r} does not implement (GPU targets only); use "
            "'padded' or 'auto'"
        )


def check_curve(where: str, curve: Any) -> None:
    """A matmul efficiency curve ``[[size, share], ...]``: finite sizes >= 1 ascending, shares
    in (0, 1]; empty means not measured (the planner refuses it where it needs one)."""
    ok = isinstance(curve, list) and all(
        isinstance(p, list) and len(p) == 2 and all(typed.finite(x) for x in p)
        and p[0] >= 1 and 0 < p[1] <= 1 for p in curve
    )  # fmt: skip
    if not ok or [p[0] for p in curve] != sorted(p[0] for p in curve):
        raise ConfigError(
            f"{where}={curve!r}: must be [[size, share], ...] with sizes >= 1 ascending and "
            "shares in (0, 1]"
        )


def _check_hardware(mesh: MeshConfig) -> None:
    _positive("mesh.devices", mesh.devices)
    hw = mesh.hardware
    _one_of("hardware.platform", hw.platform, PLATFORMS)
    for name in ("device_memory_bytes", "peak_flops_bf16", "intra_node_bw", "nic_bw", "hbm_bw",
                 "host_to_device_bw"):  # fmt: skip
        _number(f"hardware.{name}", getattr(hw, name), 0)
    _number("hardware.peak_flops_fp8", hw.peak_flops_fp8, 0, lo_open=False)  # 0: no FP8
    _positive("hardware.devices_per_node", hw.devices_per_node)
    _positive("hardware.nics_per_node", hw.nics_per_node)
    check_curve("hardware.matmul_efficiency", hw.matmul_efficiency)
    for name in ("intra_node_latency_s", "inter_node_latency_s"):  # None: NCCL's figures
        if getattr(hw, name) is not None:
            _number(f"hardware.{name}", getattr(hw, name), 0, lo_open=False)
    for flag in hw.xla_flags:
        # XLA aborts the process on a malformed or unknown flag; refuse what cannot be one
        if not re.fullmatch(r"--[A-Za-z0-9_]+(=\S*)?", flag):
            raise ConfigError(f"hardware.xla_flags: {flag!r}: expected --name or --name=value")


def _check_train(t: TrainConfig) -> None:
    for name in ("steps", "global_batch", "seq_len", "eval_batches",
                 "checkpoint_every", "keep_checkpoints"):  # fmt: skip
        _positive(f"train.{name}", getattr(t, name))
    for name, note in (("warmup_steps", ""), ("eval_every", " (0: only at the end)"),
                       ("inject_nonfinite_step", " (0 disables)"),
                       ("max_skipped_steps", " (0: stop at the first)")):  # fmt: skip
        _at_least_0(f"train.{name}", getattr(t, name), note)
    if not 0 <= t.seed <= MAX_SEED:
        raise ConfigError(f"train.seed={t.seed}: must be an integer in 0..{MAX_SEED}")
    _number("train.lr", t.lr, 0)
    _number("train.min_lr_ratio", t.min_lr_ratio, 0, 1, lo_open=False, hi_open=False)
    _number("train.weight_decay", t.weight_decay, 0, lo_open=False)
    for name in ("b1", "b2"):
        _number(f"train.{name}", getattr(t, name), 0, 1, lo_open=False)
    _number("train.grad_clip", t.grad_clip, 0)
    if t.divergence_factor != 0:
        _number("train.divergence_factor", t.divergence_factor, 1)
    _one_of("train.on_nonfinite", t.on_nonfinite, ON_NONFINITE)
    _one_of("train.data_dtype", t.data_dtype, TOKEN_DTYPES)
    for name in ("checkpoint_dir", "metrics_file", "profile_dir", "init_from_hf", "export_hf",
                 "tensorboard_dir"):  # fmt: skip
        _path(f"train.{name}", getattr(t, name))
    if not t.data or "\0" in t.data:
        raise ConfigError(f"train.data={t.data!r}: must be 'stdlib', 'synthetic' or a path")
    from jaxpar.profiling import parse_steps

    parse_steps(t.profile_steps, t.steps)


def validate(cfg: RunConfig, n_devices: int | None = None) -> None:
    """Refuse a bad configuration with one line naming the field, value and rule.

    ``n_devices``, when given, is the number of devices the run will use; the layout must
    multiply to it exactly.
    """
    check_values(cfg)
    m, lay, t = cfg.model, cfg.layout, cfg.train
    if t.seq_len > m.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len}: must be <= model.max_seq_len={m.max_seq_len}"
        )
    check_layout(m, lay, t.global_batch, t.seq_len, n_devices)
    check_fp8_device(lay.fp8, cfg.mesh.hardware.platform, cfg.mesh.hardware.gpu)
    if t.init_from_hf and t.resume:
        raise ConfigError(
            f"train.init_from_hf={t.init_from_hf!r}: conflicts with train.resume=True (the "
            "checkpoint already holds the weights); drop one of them (--resume-or-start "
            "starts from the weights only when there is no checkpoint)"
        )
    if m.moe.enabled and t.export_hf:  # Mixtral's format (train.init_from_hf: hf.check_config)
        from jaxpar.model.hf_moe import check_export

        check_export(m)
    if t.data not in ("stdlib", "synthetic") and (why := typed.not_a_file(Path(t.data))):
        raise ConfigError(
            f"train.data={t.data!r}: token file {why} (use 'stdlib', 'synthetic' or a path to "
            "a .bin file)"
        )
    if t.eval_data is not None and (why := typed.not_a_file(Path(t.eval_data))):
        raise ConfigError(f"train.eval_data={t.eval_data!r}: token file {why}")


def check_layout(
    m: ModelConfig,
    lay: LayoutConfig,
    global_batch: int,
    seq_len: int,
    n_devices: int | None = None,
) -> None:
    """The layout rules of :func:`validate` (raises :class:`ConfigError`): axis sizes, ZeRO,
    heads and layers against tp/sp/pp, the batch and sequence against the data and sequence
    shards, and the schedule. The planner draws its candidates through this same predicate."""
    check_sizes(m, global_batch, seq_len)
    for a in AXES:
        _positive(f"layout.{a}", getattr(lay, a))
    if n_devices is not None and lay.n_devices != n_devices:
        raise ConfigError(
            f"layout pp*dp*sp*tp={lay.pp}*{lay.dp}*{lay.sp}*{lay.tp}={lay.n_devices}: "
            f"must equal the device count {n_devices}"
        )
    _positive("layout.microbatches", lay.microbatches)
    _positive("layout.virtual", lay.virtual)
    if lay.zero not in (0, 1, 2, 3):
        raise ConfigError(f"layout.zero={lay.zero!r}: ZeRO stage must be 0, 1, 2 or 3")
    if lay.dp_shard < 0 or (lay.dp_shard and lay.dp % lay.dp_shard):
        raise ConfigError(
            f"layout.dp_shard={lay.dp_shard!r}: must be 0 (shard over all of dp) or divide "
            f"layout.dp={lay.dp}"
        )
    _one_of("layout.schedule", lay.schedule, SCHEDULES)
    _one_of("layout.pipeline_memory", lay.pipeline_memory, PIPELINE_MEMORY)
    _one_of("layout.sp_mode", lay.sp_mode, SP_MODES)
    _one_of("layout.remat", lay.remat, REMAT)
    _one_of("layout.offload", lay.offload, OFFLOAD)
    for name in ("param_dtype", "compute_dtype", "reduce_dtype"):
        _one_of(f"layout.{name}", getattr(lay, name), DTYPES)
    if lay.tp > 1 and m.n_heads % lay.tp:
        raise ConfigError(f"layout.tp={lay.tp}: model.n_heads={m.n_heads} must be divisible by tp")
    if lay.tp > 1 and m.d_ff % lay.tp:
        raise ConfigError(f"layout.tp={lay.tp}: model.d_ff={m.d_ff} must be divisible by tp")
    # A vocabulary tp does not divide is padded, not refused (ModelConfig.padded_vocab).
    if m.padded_vocab(lay.tp) > INT32_MAX:
        raise ConfigError(
            f"layout.tp={lay.tp}: model.vocab_size={m.vocab_size} padded to a multiple of "
            f"128*tp is {m.padded_vocab(lay.tp)}: must be at most {INT32_MAX} (token ids are "
            "int32)"
        )
    _check_heads(m, lay)
    _check_moe_layout(m, lay)
    check_fp8(m, lay)
    if m.n_layers % (lay.pp * lay.virtual):
        raise ConfigError(
            f"model.n_layers={m.n_layers}: must be divisible by pp*virtual="
            f"{lay.pp}*{lay.virtual}={lay.pp * lay.virtual}"
        )
    if global_batch % lay.dp:
        raise ConfigError(
            f"train.global_batch={global_batch}: must be divisible by layout.dp={lay.dp}"
        )
    per_dp = global_batch // lay.dp
    if per_dp % lay.microbatches:
        raise ConfigError(
            f"layout.microbatches={lay.microbatches}: must divide the per-dp-rank batch "
            f"global_batch/dp={per_dp}"
        )
    if seq_len % (lay.sp * lay.tp if lay.sequence_parallel else lay.sp):
        div = lay.sp * lay.tp if lay.sequence_parallel else lay.sp
        raise ConfigError(
            f"train.seq_len={seq_len}: must be divisible by the sequence shards ({div})"
        )
    _check_ragged_slots(m, lay, global_batch, seq_len)
    if lay.pp > 1:  # after the batch rules: micro-batches are bounded by the batch now
        _check_pipeline(lay)


def check_sizes(m: ModelConfig, global_batch: int, seq_len: int) -> None:
    """The workload's products that the compiled step counts or indexes with int32 (a Python
    int past it wraps or fails while tracing), whatever the layout (the planner checks them
    before its search): the tokens of a step (the loss sums over them) and, for a MoE model
    (:mod:`jaxpar.model.moe`, :mod:`jaxpar.model.ragged`), the routed assignments, tokens ×
    top_k (queue positions, the ragged sort and exchange, the dropped count), and a
    sequence's dispatch slots, experts × capacity (the padded buffer's slot index)."""
    _positive("train.global_batch", global_batch)
    _positive("train.seq_len", seq_len)
    if global_batch * seq_len > INT32_MAX:
        raise ConfigError(
            f"train.global_batch={global_batch}: global_batch*seq_len={global_batch}*{seq_len}="
            f"{global_batch * seq_len} tokens per step: must be at most {INT32_MAX} (int32 in "
            "the compiled step)"
        )
    e = m.moe
    if not e.enabled:
        return
    assignments = global_batch * seq_len * e.top_k
    if assignments > INT32_MAX:
        raise ConfigError(
            f"model.moe.top_k={e.top_k}: global_batch*seq_len*top_k={global_batch}*{seq_len}*"
            f"{e.top_k}={assignments} routed assignments per step: must be at most "
            f"{INT32_MAX} (int32 in the compiled step)"
        )
    c = e.capacity(seq_len)
    if e.experts * c > INT32_MAX:
        raise ConfigError(
            f"model.moe.experts={e.experts}: experts*capacity={e.experts}*{c}="
            f"{e.experts * c} dispatch slots per sequence: must be at most {INT32_MAX} (int32 "
            "slot indices in the compiled step)"
        )


def _check_ragged_slots(m: ModelConfig, lay: LayoutConfig, global_batch: int, seq_len: int):
    """A ragged exchange (``dispatch`` ragged, or auto on a GPU target, with ep > 1) indexes
    the owner's slots of all its rows at once: experts × a dp rank's rows × capacity, int32."""
    e = m.moe
    if not e.enabled or lay.ep == 1 or e.dispatch == "padded":
        return
    rows, c = global_batch // lay.dp, e.capacity(seq_len)
    if e.experts * rows * c > INT32_MAX:
        raise ConfigError(
            f"layout.ep={lay.ep}: with model.moe.dispatch={e.dispatch!r} the exchange can be "
            f"ragged, which indexes experts*rows*capacity={e.experts}*{rows}*{c}="
            f"{e.experts * rows * c} slots (rows: global_batch/dp={global_batch}/{lay.dp}): "
            f"must be at most {INT32_MAX} (int32 slot indices in the compiled step; "
            "model.moe.dispatch=padded indexes one sequence's)"
        )


def check_fp8(m: ModelConfig, lay: LayoutConfig) -> None:
    """``layout.fp8``: a known recipe, on bf16 compute."""
    from jaxpar.model.fp8 import NAMES

    _one_of("layout.fp8", lay.fp8, NAMES)
    ends = (("layout.fp8_bf16_first", lay.fp8_bf16_first),
            ("layout.fp8_bf16_last", lay.fp8_bf16_last))  # fmt: skip
    for name, n in ends:
        _at_least_0(name, n)
        if n and lay.fp8 == "none":
            raise ConfigError(f"{name}={n}: keeps blocks in bf16 under an FP8 recipe; "
                              "layout.fp8 is 'none'")  # fmt: skip
        if n and lay.pp > 1:
            raise ConfigError(f"{name}={n}: not supported with a pipeline yet (layout.pp="
                              f"{lay.pp}); every block runs FP8 there")  # fmt: skip
    if lay.fp8_bf16_first + lay.fp8_bf16_last >= m.n_layers > 0 and lay.fp8 != "none":
        raise ConfigError(
            f"layout.fp8_bf16_first + layout.fp8_bf16_last = "
            f"{lay.fp8_bf16_first + lay.fp8_bf16_last}: must leave at least one of the "
            f"{m.n_layers} blocks in FP8"
        )
    if lay.fp8 == "none":
        return
    try:  # a MoE model's ends fall on group boundaries
        m.bf16_spans(lay.fp8_bf16_first, lay.fp8_bf16_last)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if lay.compute_dtype != "bfloat16":
        raise ConfigError(
            f"layout.fp8={lay.fp8!r}: needs layout.compute_dtype='bfloat16' (FP8 GEMMs replace "
            f"the bf16 ones), not {lay.compute_dtype!r}"
        )
    if lay.fp8 == "delayed":
        from jaxpar.model.fp8 import NEVER

        h = lay.fp8_history
        if not isinstance(h, int) or isinstance(h, bool) or not 1 <= h < NEVER:
            raise ConfigError(
                f"layout.fp8_history={h!r}: must be an integer in 1..{int(NEVER) - 1} (steps of "
                "amax history a delayed FP8 scale covers)"
            )


# Compute capability of the first NVIDIA GPUs with FP8 tensor cores (Ada sm_89, Hopper sm_90).
FP8_MIN_CC = (8, 9)


def check_fp8_device(recipe: str, platform: str, gpu: str | None = None,
                     capability: tuple[int, int] | None = None) -> None:  # fmt: skip
    """Refuse an FP8 recipe on a GPU without FP8 tensor cores (``gpu``: a mesh file's kind,
    ``capability``: a live device's). Emulating there would run slower than bf16 for the same
    numerics, so it is refused; the CPU emulates (tests, laptops: the numerics, not the speed)."""
    if recipe == "none" or platform not in config.GPU_PLATFORMS:
        return
    if capability is None and gpu:
        from jaxpar.gpu.targets import GpuSpec

        capability = GpuSpec.load(gpu).compute_capability
    if capability is not None and tuple(capability) < FP8_MIN_CC:
        where = f"hardware.gpu={gpu!r}" if gpu else "this GPU"
        raise ConfigError(
            f"layout.fp8={recipe!r}: {where} (compute capability "
            f"{'.'.join(map(str, capability))}) has no FP8 tensor cores (needs 8.9+: H100, "
            "H200, L40S); use layout.fp8='none'"
        )


def _check_heads(m: ModelConfig, lay: LayoutConfig) -> None:
    """Heads as tensor and sequence parallelism split them (Megatron TP, Ulysses, GQA)."""
    ulysses = lay.sp > 1 and lay.sp_mode == "ulysses"
    shards = lay.tp * lay.sp if ulysses else lay.tp
    if ulysses and m.n_heads % shards:
        raise ConfigError(
            f"layout.sp={lay.sp}: Ulysses splits model.n_heads={m.n_heads} over tp*sp="
            f"{lay.tp}*{lay.sp}={shards}, which must divide it (or use --sp-mode ring)"
        )
    # kv heads need no rule of their own: when query heads split over the shards, repeating
    # each kv head n_heads/n_kv_heads times (i.e. MHA) splits too, and
    # jaxpar.model.attention.kv_repeat picks the smallest repeat that does.


@functools.lru_cache(maxsize=4096)
def _schedule_refusal(kind: str, p: int, m: int, v: int, memory: str = "fast") -> str | None:
    """Why the schedule library refuses (kind, p, m, v, memory), else None (memoised: the
    planner asks for the same few hundred schedules while it searches)."""
    from jaxpar.pipeline.schedules import make_schedule

    try:
        make_schedule(kind, p, m, v, memory)
    except ConfigError as e:
        return str(e)
    return None


def _check_pipeline(lay: LayoutConfig) -> None:
    """Schedule arguments via the schedule library's own rules (``make_schedule``)."""
    err = _schedule_refusal(lay.schedule, lay.pp, lay.microbatches, lay.virtual,
                            lay.pipeline_memory)  # fmt: skip
    if err:
        raise ConfigError(f"layout.{err} (pp={lay.pp})")
    # Combinations the pipeline executor does not run correctly are refused, not ignored.
    if lay.remat == "offload":
        raise ConfigError(
            "layout.remat='offload': not supported with pp > 1 (a stage's residuals wait for "
            "its backward in device-memory stash slots; use full or selective)"
        )
