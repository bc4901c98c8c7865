"""Typed run configuration: model × mesh (hardware + layout) × training, from YAML and the CLI.

A run is described by one :class:`RunConfig`. Model shapes live in ``models/*.yaml``; a cluster
and the layout on it live in ``meshes/*.yaml``; everything can be overridden from the command
line. :func:`jaxpar.validation.validate` refuses a bad configuration with one line naming the
field, the value and the rule, before JAX compiles anything.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from jaxpar import typed
from jaxpar.errors import ConfigError, JaxparWarning

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
MESHES_DIR = REPO_ROOT / "meshes"

AXES = ("pp", "dp", "sp", "tp")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
PIPELINE_MEMORY = ("fast", "lean")  # jaxpar.pipeline.generators: fused ticks, or capped stashes
SP_MODES = ("ulysses", "ring")
REMAT = ("none", "full", "selective", "offload")
OFFLOAD = ("none", "optimizer", "params")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION = ("auto", "blockwise", "dense", "cudnn", "native")
ON_NONFINITE = ("skip", "stop")
PLATFORMS = ("cpu", "gpu", "tpu")
TOKEN_DTYPES = ("uint8", "uint16", "uint32")  # token files (.bin)
ROUTERS = ("softmax", "sigmoid")  # MoE router scores: Mixtral / Qwen (softmax), DeepSeek-V3
DISPATCHES = ("auto", "padded", "ragged")  # MoE token dispatch (jaxpar.model.moe, .ragged)
VOCAB_PAD = 128  # a padded vocabulary is a multiple of VOCAB_PAD * tp (ModelConfig.padded_vocab)
GPU_PLATFORMS = ("gpu", "cuda")  # platforms whose XLA compiles a ragged all-to-all


@dataclass
class MoeConfig:
    """Mixture of experts in the feed-forward of some blocks (``experts`` 0: a dense model).

    Layers ``0 .. first_dense-1`` are dense; after them every ``every``-th layer is MoE (groups
    of ``every - 1`` dense blocks then one MoE block). Routed experts are SwiGLU FFNs of width
    ``expert_ff``; ``shared_experts`` of that width run on every token (DeepSeek, Qwen).
    ``capacity_factor`` 0 routes without dropping; c > 0 caps each expert at
    ``ceil(c * top_k * S / experts)`` assignments per sequence (GShard's priority: every
    token's first choice before any second choice, then by position).
    """

    experts: int = 0
    top_k: int = 2
    shared_experts: int = 0
    expert_ff: int = 0  # 0: model.d_ff
    first_dense: int = 0
    every: int = 1
    router: str = "softmax"  # ROUTERS; selected scores are normalised to sum 1 either way
    route_scale: float = 1.0  # gates scaled after normalisation (DeepSeek-V3: 2.5)
    capacity_factor: float = 0.0
    bias_rate: float = 1e-3  # auxiliary-loss-free balancing step (0 disables the bias rule)
    aux_loss: float = 0.0  # Switch-style load-balancing loss coefficient (0: none)
    # DISPATCHES: the padded [E, B·C, D] buffer (every platform), or the ragged rows sorted by
    # expert (a ragged all-to-all; the exchange needs XLA:GPU); auto: ragged on GPU targets,
    # padded elsewhere. Both route, drop and compute the same values.
    dispatch: str = "auto"

    def ragged(self, platform: str, ep: int) -> bool:
        """Whether tokens are dispatched ragged on ``platform`` with ``ep`` expert-parallel
        ranks: the one rule the trainer and the planner share (``auto``: on GPU targets;
        with ``ep = 1`` there is no exchange and nothing is ragged)."""
        if ep <= 1:
            return False
        return self.dispatch == "ragged" or (self.dispatch == "auto" and platform in GPU_PLATFORMS)

    def capacity(self, seq_len: int) -> int:
        """Slots per expert per sequence: ``S`` dropless, else ``ceil(c·k·S/E)`` (at most S)."""
        if self.capacity_factor == 0:
            return seq_len
        return min(seq_len, math.ceil(self.capacity_factor * self.top_k * seq_len / self.experts))

    @property
    def enabled(self) -> bool:
        """Whether the model has routed experts."""
        return self.experts > 0


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
    # How the model runs (no effect on parameter shapes; docs/reference.md, "Model options").
    attention: str = "auto"  # auto | native | blockwise | dense | cudnn (model.attention)
    attention_block: int = 64  # query/key positions per tile of the blockwise kernel
    layer_unroll: int = 1  # layer loop: 1 = lax.scan, k = unrolled by k, 0 = no loop
    loss_chunk: int = 1024  # sequence positions per cross-entropy chunk ([B, chunk, V] logits)
    moe: MoeConfig = field(default_factory=MoeConfig)

    def __post_init__(self):
        if isinstance(self.moe, dict):  # ModelConfig(**asdict(...)) round trips
            self.moe = MoeConfig(**self.moe)

    @property
    def hd(self) -> int:
        """Per-head dimension."""
        return self.head_dim or self.d_model // self.n_heads

    def padded_vocab(self, tp: int) -> int:
        """Rows of the embedding table (columns of the output projection) a layout of tensor
        parallelism ``tp`` stores: ``vocab_size`` when tp divides it, else the next multiple of
        ``VOCAB_PAD * tp`` (Megatron-LM's make-vocab-size-divisible-by, e.g. GPT-2's 50257 at
        tp 8: 51200), so that every tp rank holds an equal slice of whole 128-column tiles.
        The padded logits are masked out of the softmax (:func:`jaxpar.model.llama.
        cross_entropy`) and checkpoints, Hugging Face weights and inference keep the true
        vocabulary (:mod:`jaxpar.pipeline.rest`): every layout computes the same losses."""
        v = self.vocab_size
        if tp <= 1 or v % tp == 0:
            return v
        step = VOCAB_PAD * tp
        return -(-v // step) * step

    def param_count(self) -> int:
        """Exact number of parameters of the jaxpar model for this shape."""
        d, hd = self.d_model, self.hd
        attn = d * self.n_heads * hd + 2 * d * self.n_kv_heads * hd + self.n_heads * hd * d
        mlp = (3 if self.mlp == "swiglu" else 2) * d * self.d_ff
        layer = attn + mlp + 2 * d
        embed = self.vocab_size * d * (1 if self.tied_embeddings else 2)
        total = self.n_layers * layer + embed + d
        if self.moe.enabled:  # MoE layers swap their FFN for router, bias and experts
            e = self.moe
            ffns = e.experts + e.shared_experts
            moe_ffn = d * e.experts + e.experts + 3 * d * self.expert_ff * ffns
            total += self.moe_layers() * (moe_ffn - mlp)
        return total

    def active_param_count(self) -> int:
        """Parameters one token's forward reads (top_k routed experts of each MoE layer)."""
        if not self.moe.enabled:
            return self.param_count()
        unused = 3 * self.d_model * self.expert_ff * (self.moe.experts - self.moe.top_k)
        return self.param_count() - self.moe_layers() * unused

    @property
    def expert_ff(self) -> int:
        """FFN width of one expert (``moe.expert_ff``, or ``d_ff`` when 0)."""
        return self.moe.expert_ff or self.d_ff

    def moe_layers(self) -> int:
        """Number of MoE blocks (0 for a dense model)."""
        if not self.moe.enabled:
            return 0
        return max(self.n_layers - self.moe.first_dense, 0) // self.moe.every

    def stack(self) -> tuple[str, int]:
        """The layer stack a pipeline splits into stages: its top-level parameter key and its
        length (a MoE model's groups, ``moe_layers``; a dense model's ``layers``)."""
        if self.moe.enabled:
            return "moe_layers", self.moe_layers()
        return "layers", self.n_layers

    def bf16_spans(self, first: int, last: int) -> dict[str, tuple[int, int]]:
        """Per layer stack (``layers``; a MoE model's ``moe_layers`` too), how many of its
        entries at the start and at the end keep bf16 GEMMs when the model's first ``first``
        and last ``last`` blocks do (``layout.fp8_bf16_first``/``last``). A MoE group is one
        entry of ``moe_layers``, so an end inside the groups must fall on a group boundary:
        ``ValueError`` naming the layer counts that do."""
        if not self.moe.enabled:
            return {"layers": (first, last)}
        pre, every, groups = self.moe.first_dense, self.moe.every, self.moe_layers()
        into_first, into_last = max(0, first - pre), min(last, groups * every)
        if into_first % every:
            raise ValueError(
                f"layout.fp8_bf16_first={first}: must end on a MoE group boundary: at most "
                f"model.moe.first_dense={pre} blocks, or {pre} plus a multiple of "
                f"model.moe.every={every}"
            )
        if into_last % every:
            raise ValueError(
                f"layout.fp8_bf16_last={last}: must start on a MoE group boundary: a multiple "
                f"of model.moe.every={every} (the last {groups * every} blocks are {groups} "
                f"MoE groups)"
            )
        spans = {"moe_layers": (into_first // every, into_last // every)}
        if pre:
            spans["layers"] = (min(first, pre), max(0, last - groups * every))
        return spans

    def dense_prefix(self) -> int:
        """Dense blocks before the first MoE group (all of them for a dense model)."""
        return self.moe.first_dense if self.moe.enabled else self.n_layers


@dataclass
class HardwareConfig:
    """Figures of one accelerator and its links, used by the planner and MFU."""

    platform: str = "cpu"  # "cpu" or "gpu"
    gpu: str | None = None  # GPU kind of a GPU pod (jaxpar.gpu.targets.KINDS): its compile target
    device_memory_bytes: float = 16e9
    peak_flops_bf16: float = 1e12
    # Dense FP8 tensor-core peak (FLOP/s); 0: the device has none (layout.fp8 priced by the
    # planner only where it is set: jaxpar.model.fp8)
    peak_flops_fp8: float = 0.0
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
    # Per-step latency of a collective over NVLink and over the network (NCCL ring/Simple
    # hop, seconds); None: the planner takes NCCL's figures and says so (planner.collectives).
    intra_node_latency_s: float | None = None
    inter_node_latency_s: float | None = None


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
    # "fast": fused ticks at the asynchronous makespan (1F1B rank r stashes 2(p-1-r));
    # "lean": stashes capped at p - r, a longer lock step (1F1B only).
    pipeline_memory: str = "fast"
    sp_mode: str = "ulysses"
    sequence_parallel: bool = False
    remat: str = "none"
    offload: str = "none"
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    reduce_dtype: str = "float32"
    # FP8 GEMMs of the attention projections and the MLP (jaxpar.model.fp8): "none",
    # "tensorwise" or "rowwise" (current scaling), "delayed" (scales from an amax history in the
    # parameter tree); needs compute_dtype bfloat16.
    fp8: str = "none"
    # Steps of amax history a delayed recipe's scales cover (1..254).
    fp8_history: int = 16
    # The first and the last blocks that keep bf16 GEMMs under an FP8 recipe (as Megatron's
    # num-layers-at-start/end-in-bf16).
    fp8_bf16_first: int = 0
    fp8_bf16_last: int = 0
    # Expert parallelism folded onto dp: routed experts sharded over groups of `ep` consecutive
    # dp ranks (jaxpar.model.moe); everything else stays data-parallel over them.
    ep: int = 1

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
    force: bool = False  # replace outputs jaxpar did not write (metrics file, export_hf) whole
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

# Fields that are no longer read, per section: an old file or ``-o`` that sets one still runs,
# with one warning line, since the field never changed what a run did.
REMOVED_FIELDS: dict[str, dict[str, str]] = {
    "TrainConfig": {
        "log_every": "every step writes one metrics record (the field was never read)",
    },
}


class ConfigWarning(JaxparWarning):
    """A configuration sets a field that is no longer read."""


def _removed(cls: type, key: str, where: str) -> bool:
    """Warn (one line) and return True when ``key`` is a removed field of ``cls``."""
    why = REMOVED_FIELDS.get(cls.__name__, {}).get(key)
    if why is not None:
        warnings.warn(f"{where}: no longer a field, ignored: {why}; remove it", ConfigWarning,
                      stacklevel=3)  # fmt: skip
    return why is not None


def _from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    """Build dataclass ``cls`` from ``data``: unknown fields refused with a suggestion, every
    value checked against its declared type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known and _removed(cls, str(key), f"{where}.{key}"):
            continue
        if key not in known:
            hint = difflib.get_close_matches(str(key), known, n=1)
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise ConfigError(
                f"{where}.{key}: unknown field{extra}; known fields: {', '.join(known)}"
            )
        sub = nested_type(known[key])
        where_key = f"{where}.{key}"
        kwargs[key] = (
            _from_dict(sub, value, where_key) if sub else typed.check(where_key, value, known[key])
        )
    return cls(**kwargs)


def nested_type(f: dataclasses.Field) -> type | None:
    nested = {c.__name__: c for c in (HardwareConfig, LayoutConfig, MoeConfig)}
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
    production layout); it overrides the embedded training defaults. The sequence length is
    :func:`default_seq_len`: no longer than the model's context.
    """
    mesh_cfg = load_mesh(mesh)
    train = _from_dict(TrainConfig, dict(mesh_cfg.train), "mesh.train")
    cfg = RunConfig(model=load_model(model), mesh=mesh_cfg, train=train)
    cfg.train.seq_len = default_seq_len(cfg)
    return cfg


def default_seq_len(cfg: RunConfig) -> int:
    """The sequence length of a run that states none: the mesh file's ``train.seq_len`` (else
    the embedded default), cut to ``model.max_seq_len`` when the model's context is shorter
    (gpt3-175b's 2048 on a mesh planned at 8192). A stated length is never cut: above the
    model's context it is refused (:func:`jaxpar.validation.validate`)."""
    seq = cfg.mesh.train.get("seq_len", TrainConfig.seq_len)
    limit = cfg.model.max_seq_len
    if isinstance(limit, int) and not isinstance(limit, bool) and 1 <= limit < seq:
        return limit  # a bad max_seq_len is left to its own refusal
    return seq


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
        if part not in known and i == len(parts) - 1 and _removed(type(obj), part, dotted):
            return
        if part not in known:
            hint = difflib.get_close_matches(part, known, n=1)
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise ConfigError(f"{where}: unknown field{extra}")
        if i == len(parts) - 1:
            f = known[part]
            if nested_type(f) or part in ("model", "mesh", "train") and obj is cfg:
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


# The fields that define a model's parameter shapes (a checkpoint must agree on all of them).
MODEL_SHAPE_FIELDS = (
    "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "head_dim", "mlp",
    "tied_embeddings",
)  # fmt: skip


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-dict view of a config dataclass (for JSON output and checkpoints)."""
    return dataclasses.asdict(cfg)
