"""Typed run configuration: model × mesh (hardware + layout) × training, from YAML and the CLI.

A run is described by one :class:`RunConfig`. Model shapes live in ``models/*.yaml``; a cluster
and the layout on it live in ``meshes/*.yaml``; everything can be overridden from the command
line. :func:`validate` refuses a bad configuration with one line naming the field, the value
and the rule, before JAX compiles anything.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from jaxpar import typed
from jaxpar.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
MESHES_DIR = REPO_ROOT / "meshes"

AXES = ("pp", "dp", "sp", "tp")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
SP_MODES = ("ulysses", "ring")
REMAT = ("none", "full", "selective", "offload")
OFFLOAD = ("none", "optimizer", "params")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION = ("auto", "blockwise", "dense", "cudnn")
ON_NONFINITE = ("skip", "stop")
PLATFORMS = ("cpu", "gpu", "tpu")
TOKEN_DTYPES = ("uint8", "uint16", "uint32")  # token files (.bin)


@dataclass
class ModelConfig:
    """Shape of a decoder-only transformer (Llama-style block)."""

    name: str = "tiny"
    n_layers: int = 4
    d_model: int = 256
    n_heads: int = 8
    n_kv_heads: int = 4
    d_ff: int = 768
    vocab_size: int = 256
    max_seq_len: int = 256
    head_dim: int | None = None  # defaults to d_model // n_heads
    mlp: str = "swiglu"  # "swiglu" (Llama) or "gelu" (GPT-2/3 shapes)
    tied_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # How the model runs (no effect on parameter shapes; README "Attention and the layer loop").
    attention: str = "auto"  # auto | blockwise | dense | cudnn (jaxpar.model.attention)
    attention_block: int = 64  # query/key positions per tile of the blockwise kernel
    layer_unroll: int = 1  # layer loop: 1 = lax.scan, k = unrolled by k, 0 = no loop
    loss_chunk: int = 1024  # sequence positions per cross-entropy chunk ([B, chunk, V] logits)

    @property
    def hd(self) -> int:
        """Per-head dimension."""
        return self.head_dim or self.d_model // self.n_heads

    def param_count(self) -> int:
        """Exact number of parameters of the jaxpar model for this shape."""
        d, hd = self.d_model, self.hd
        attn = d * self.n_heads * hd + 2 * d * self.n_kv_heads * hd + self.n_heads * hd * d
        mlp = (3 if self.mlp == "swiglu" else 2) * d * self.d_ff
        layer = attn + mlp + 2 * d
        embed = self.vocab_size * d * (1 if self.tied_embeddings else 2)
        return self.n_layers * layer + embed + d


@dataclass
class HardwareConfig:
    """Figures of one accelerator and its links, used by the planner and MFU."""

    platform: str = "cpu"  # "cpu" or "gpu"
    device_memory_bytes: float = 16e9
    peak_flops_bf16: float = 1e12
    intra_node_bw: float = 50e9  # bytes/s per device, one direction (NVLink)
    devices_per_node: int = 8
    nics_per_node: int = 8  # network adapters a node's devices share for inter-node traffic
    nic_bw: float = 12.5e9  # bytes/s per adapter, one direction (InfiniBand/RoCE)
    hbm_bw: float = 1.0e11  # device memory bandwidth, bytes/s (memory-bound work)
    host_to_device_bw: float = 25e9  # bytes/s (PCIe) for offload
    # Sustained share of peak_flops_bf16 of a matmul whose smallest dimension is `size`:
    # [[size, share], ...] ascending (jaxpar bench --calibrate measures it).
    matmul_efficiency: list[list[float]] = field(default_factory=list)
    xla_flags: list[str] = field(default_factory=list)  # applied before JAX initialises


@dataclass
class LayoutConfig:
    """How the model is parallelised over the mesh ``pp × dp × sp × tp``."""

    dp: int = 4
    tp: int = 2
    pp: int = 1
    sp: int = 1
    zero: int = 1
    dp_shard: int = 0  # hybrid sharding: ZeRO shards over groups of this many dp ranks (0 = all)
    microbatches: int = 1  # gradient accumulation steps (or pipeline micro-batches)
    schedule: str = "1f1b"
    virtual: int = 1
    sp_mode: str = "ulysses"
    sequence_parallel: bool = False
    remat: str = "none"
    offload: str = "none"
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    reduce_dtype: str = "float32"

    @property
    def n_devices(self) -> int:
        """Devices the layout occupies."""
        return self.pp * self.dp * self.sp * self.tp

    def axis_sizes(self) -> dict[str, int]:
        """Mesh axis sizes in mesh order (pp outermost, tp innermost)."""
        return {a: getattr(self, a) for a in AXES}


@dataclass
class MeshConfig:
    """A cluster (hardware figures, device count) and the layout run on it."""

    name: str = "cpu-8"
    devices: int = 8
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    train: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields this mesh implies


@dataclass
class TrainConfig:
    """Optimisation, data and bookkeeping of a training run."""

    steps: int = 100
    seed: int = 0
    global_batch: int = 32
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    data: str = "stdlib"  # "stdlib" (embedded corpus), "synthetic", or a path to a .bin token file
    data_dtype: str = "uint16"  # token dtype of a .bin file without a sidecar
    eval_data: str | None = None  # held-out .bin (default: the sidecar's validation file)
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 1
    checkpoint_dir: str | None = None
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    resume: bool = False
    resume_or_start: bool = False  # resume if a complete checkpoint exists, else start fresh
    metrics_file: str | None = None
    on_nonfinite: str = "stop"
    # Divergence budget (see jaxpar.train.guard.Divergence): steps counted as diverged that a
    # ``skip`` run tolerates before it stops with exit 3; a finite loss above
    # divergence_factor x the run's first loss counts too (0 disables that rule).
    max_skipped_steps: int = 3
    divergence_factor: float = 2.0
    progress: bool = True
    profile_steps: str | None = None  # "A:B": jax.profiler trace of steps A..B (from 1)
    profile_dir: str | None = None  # where the trace goes (default ./jaxpar_profile)
    init_from_hf: str | None = None  # Hugging Face Llama directory to start from
    export_hf: str | None = None  # write the final weights as a Hugging Face Llama directory
    tensorboard_dir: str | None = None  # TensorBoard scalars (needs tensorboardX)
    # Test hook: at this step (1-based) the gradient of one leaf is NaN; 0 disables.
    inject_nonfinite_step: int = 0


@dataclass
class RunConfig:
    """Everything a run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @property
    def layout(self) -> LayoutConfig:
        """Shortcut to ``mesh.layout``."""
        return self.mesh.layout


# --------------------------------------------------------------------------------------------
# Loading


def _from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    """Build dataclass ``cls`` from ``data``: unknown fields refused with a suggestion, every
    value checked against its declared type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            hint = difflib.get_close_matches(str(key), known, n=1)
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise ConfigError(
                f"{where}.{key}: unknown field{extra}; known fields: {', '.join(known)}"
            )
        sub = _nested_type(known[key])
        where_key = f"{where}.{key}"
        kwargs[key] = (
            _from_dict(sub, value, where_key) if sub else typed.check(where_key, value, known[key])
        )
    return cls(**kwargs)


def _nested_type(f: dataclasses.Field) -> type | None:
    nested = {"HardwareConfig": HardwareConfig, "LayoutConfig": LayoutConfig}
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    return nested.get(t)


def _resolve(name_or_path: str, directory: Path, kind: str) -> Path:
    p = Path(name_or_path)
    if not name_or_path or "\0" in name_or_path:
        raise ConfigError(f"--{kind} {name_or_path!r}: not a name or a path")
    if p.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if not p.exists():
            raise ConfigError(f"--{kind} {name_or_path!r}: file does not exist")
        if not p.is_file():
            raise ConfigError(f"--{kind} {name_or_path!r}: not a file")
        return p
    candidate = directory / f"{name_or_path}.yaml"
    if not candidate.is_file():
        names = sorted(x.stem for x in directory.glob("*.yaml"))
        raise ConfigError(f"--{kind} {name_or_path!r}: unknown {kind}; known: {', '.join(names)}")
    return candidate


def _read_yaml(path: Path) -> dict[str, Any]:
    data = typed.read_yaml(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a YAML mapping at the top level")
    return data


# Fields a model file must set: a shape is never silently the default one.
MODEL_REQUIRED = ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size")


def load_model(name_or_path: str) -> ModelConfig:
    """Load a model shape by name (``models/NAME.yaml``) or path."""
    path = _resolve(name_or_path, MODELS_DIR, "model")
    data = _read_yaml(path)
    data.setdefault("name", path.stem)
    cfg = _from_dict(ModelConfig, data, "model")
    missing = [k for k in MODEL_REQUIRED if k not in data]
    if missing:
        raise ConfigError(
            f"{path}: model.{missing[0]}: not set; a model file must set "
            f"{', '.join(MODEL_REQUIRED)}" + (" (the file is empty)" if len(data) == 1 else "")
        )
    return cfg


def load_mesh(name_or_path: str) -> MeshConfig:
    """Load a cluster and its layout by name (``meshes/NAME.yaml``) or path."""
    path = _resolve(name_or_path, MESHES_DIR, "mesh")
    data = _read_yaml(path)
    data.setdefault("name", path.stem)
    if "devices" not in data:
        raise ConfigError(f"{path}: mesh.devices: not set; a mesh file must set its device count")
    return _from_dict(MeshConfig, data, "mesh")


def load(model: str = "tiny", mesh: str = "cpu-8") -> RunConfig:
    """Load a run configuration from a model and a mesh name; training defaults embedded.

    A mesh file may carry a ``train:`` mapping (e.g. the global batch and sequence length of a
    production layout); it overrides the embedded training defaults.
    """
    mesh_cfg = load_mesh(mesh)
    train = _from_dict(TrainConfig, dict(mesh_cfg.train), "mesh.train")
    return RunConfig(model=load_model(model), mesh=mesh_cfg, train=train)


def override(cfg: RunConfig, dotted: str, value: Any) -> None:
    """Set ``cfg.<dotted>`` (e.g. ``train.lr`` or ``layout.tp``) from a string or value.

    A string is parsed by the field's declared type; any other value is checked against it.
    Only leaf fields can be set (``-o train=5`` names the section and is refused).
    """
    parts = dotted.split(".")
    if parts[0] == "layout":
        parts = ["mesh", "layout", *parts[1:]]
    if parts[0] == "hardware":
        parts = ["mesh", "hardware", *parts[1:]]
    obj: Any = cfg
    for i, part in enumerate(parts):
        where = ".".join(parts[: i + 1])
        if not dataclasses.is_dataclass(obj):
            raise ConfigError(f"{where}: unknown field ({'.'.join(parts[:i])} is a value)")
        known = {f.name: f for f in fields(obj)}
        if part not in known:
            hint = difflib.get_close_matches(part, known, n=1)
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise ConfigError(f"{where}: unknown field{extra}")
        if i == len(parts) - 1:
            f = known[part]
            if _nested_type(f) or part in ("model", "mesh", "train") and obj is cfg:
                sub = ", ".join(x.name for x in fields(getattr(obj, part)))
                raise ConfigError(
                    f"{dotted}={value!r}: {dotted} is a section, not a value; set one of its "
                    f"fields ({dotted}.FIELD=VALUE: {sub})"
                )
            if part == "train" and obj is cfg.mesh:
                raise ConfigError(f"{dotted}: set train fields directly (train.FIELD=VALUE)")
            new = typed.from_text(value, f, dotted) if isinstance(value, str) else value
            setattr(obj, part, typed.check(dotted, new, f))
        else:
            obj = getattr(obj, part)


# --------------------------------------------------------------------------------------------
# Validation

# The fields that define a model's parameter shapes (a checkpoint must agree on all of them).
MODEL_SHAPE_FIELDS = (
    "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "head_dim", "mlp",
    "tied_embeddings",
)  # fmt: skip


# Largest value of a count (exact in float64 and far beyond any run), and tighter bounds where
# jaxpar or the planner enumerates a range of that size.
MAX_COUNT = 2**40
MAX_OF = {"mesh.devices": 2**20, "train.global_batch": 2**24, "train.seq_len": 2**24,
          "model.max_seq_len": 2**24}  # fmt: skip
MAX_SCHEDULE_ACTIONS = 2**18  # a pipeline schedule table of more takes minutes to build
MAX_SEED = 2**32 - 1  # jax.random.key and numpy's SeedSequence both take uint32 seeds


def _positive(where: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{where}={value!r}: must be a positive integer")
    if value > MAX_OF.get(where, MAX_COUNT):
        raise ConfigError(f"{where}={value}: must be at most {MAX_OF.get(where, MAX_COUNT)}")


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
        sub = _nested_type(f)
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


def _check_hardware(mesh: MeshConfig) -> None:
    _positive("mesh.devices", mesh.devices)
    hw = mesh.hardware
    _one_of("hardware.platform", hw.platform, PLATFORMS)
    for name in ("device_memory_bytes", "peak_flops_bf16", "intra_node_bw", "nic_bw", "hbm_bw",
                 "host_to_device_bw"):  # fmt: skip
        _number(f"hardware.{name}", getattr(hw, name), 0)
    _positive("hardware.devices_per_node", hw.devices_per_node)
    _positive("hardware.nics_per_node", hw.nics_per_node)
    for flag in hw.xla_flags:
        # XLA aborts the process on a malformed or unknown flag; refuse what cannot be one
        if not re.fullmatch(r"--[A-Za-z0-9_]+(=\S*)?", flag):
            raise ConfigError(f"hardware.xla_flags: {flag!r}: expected --name or --name=value")


def _check_train(t: TrainConfig) -> None:
    for name in ("steps", "global_batch", "seq_len", "eval_batches", "log_every",
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
    if t.data not in ("stdlib", "synthetic") and not Path(t.data).exists():
        raise ConfigError(
            f"train.data={t.data!r}: token file does not exist (use 'stdlib', 'synthetic' "
            "or a path to a .bin file)"
        )
    if t.eval_data is not None and not Path(t.eval_data).is_file():
        raise ConfigError(f"train.eval_data={t.eval_data!r}: token file does not exist")


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
    _positive("train.global_batch", global_batch)
    _positive("train.seq_len", seq_len)
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
    _one_of("layout.sp_mode", lay.sp_mode, SP_MODES)
    _one_of("layout.remat", lay.remat, REMAT)
    _one_of("layout.offload", lay.offload, OFFLOAD)
    for name in ("param_dtype", "compute_dtype", "reduce_dtype"):
        _one_of(f"layout.{name}", getattr(lay, name), DTYPES)
    if lay.tp > 1 and m.n_heads % lay.tp:
        raise ConfigError(f"layout.tp={lay.tp}: model.n_heads={m.n_heads} must be divisible by tp")
    if lay.tp > 1 and m.d_ff % lay.tp:
        raise ConfigError(f"layout.tp={lay.tp}: model.d_ff={m.d_ff} must be divisible by tp")
    _check_heads(m, lay)
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
    if lay.pp > 1:  # after the batch rules: micro-batches are bounded by the batch now
        _check_pipeline(lay)


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
def _schedule_refusal(kind: str, p: int, m: int, v: int) -> str | None:
    """Why the schedule library refuses (kind, p, m, v), else None (memoised: the planner asks
    for the same few hundred schedules while it searches)."""
    from jaxpar.pipeline.schedules import make_schedule

    try:
        make_schedule(kind, p, m, v)
    except ConfigError as e:
        return str(e)
    return None


def _check_pipeline(lay: LayoutConfig) -> None:
    """Schedule arguments via the schedule library's own rules (``make_schedule``)."""
    err = _schedule_refusal(lay.schedule, lay.pp, lay.microbatches, lay.virtual)
    if err:
        raise ConfigError(f"layout.{err} (pp={lay.pp})")
    # Combinations the pipeline executor does not run correctly are refused, not ignored.
    if lay.remat == "offload":
        raise ConfigError(
            "layout.remat='offload': not supported with pp > 1 (a stage's residuals wait for "
            "its backward in device-memory stash slots; use full or selective)"
        )


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-dict view of a config dataclass (for JSON output and checkpoints)."""
    return dataclasses.asdict(cfg)
