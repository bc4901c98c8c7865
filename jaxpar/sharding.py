"""Logical axis rules and ZeRO stages as PartitionSpecs.

Model code names logical axes (``batch``, ``seq``, ``embed``, ``heads``, ...); one table maps each
to mesh axes. Resolution is done here (first rule wins, no silent fallbacks) and refuses an array
whose two dimensions land on the same mesh axis.

ZeRO is a choice of shardings, not a separate code path: stage k decides which of the parameter,
gradient and optimizer-state trees get an extra ``dp`` dimension (:func:`zero_spec`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import HardwareConfig, LayoutConfig, ModelConfig

LOGICAL_AXES = (
    "batch", "seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers",
    "act_seq", "attn_seq", "attn_heads", "attn_kv_heads", "stage", "experts", "expert_bias",
    "sublayers", "fp8_operand", "fp8_bucket",
)  # fmt: skip
"""``act_seq``: the residual stream's sequence dim (``sp``, plus ``tp`` under Megatron-SP);
``seq``: the sequence dim inside a block, between column- and row-parallel matmuls (``sp``);
``attn_seq``/``attn_heads``/``attn_kv_heads``: the attention core's layout (Ulysses: full
sequence, heads over ``tp`` then ``sp``; ring and plain: as inside the block); ``stage``: the
leading ``[pp]`` slot dim of a pipeline's stage-owned embedding and head
(:mod:`jaxpar.pipeline.rest`); ``experts``: the routed-expert dim of MoE weights (``ep``);
``expert_bias``: the per-expert routing bias, replicated, never trained nor decayed
(:mod:`jaxpar.model.moe`); ``sublayers``: the dense blocks' stack inside a MoE group, under
the groups' ``layers`` (never sharded: the pipeline splits the groups); ``fp8_operand`` and
``fp8_bucket``: a delayed FP8 recipe's amax history ``[3, BUCKETS]`` per GEMM
(:mod:`jaxpar.model.fp8`), replicated, never trained nor decayed, never split by ZeRO."""

ATTENTION_MODES = ("local", "ulysses", "ring")

MeshAxes = tuple[str, ...]


@dataclass(frozen=True)
class Rules:
    """Logical axis → mesh axes. A logical axis absent from the table is replicated."""

    table: tuple[tuple[str, MeshAxes], ...]
    attention: str = "local"  # how the attention core is parallelised (ATTENTION_MODES)
    head_shards: int = 1  # devices the attention core's heads are split over (tp or tp·sp)
    tp: int = 1  # tensor-parallel degree (fused column-parallel weights are grouped by it)
    ep: int = 1  # expert-parallel degree (the routed experts' dim is split over it)
    fp8: str = "none"  # the linear layers' FP8 recipe (layout.fp8, jaxpar.model.fp8)
    fp8_history: int = 16  # steps of amax history of a delayed recipe (layout.fp8_history)
    # blocks at the start and at the end that keep bf16 GEMMs (layout.fp8_bf16_first/last)
    fp8_bf16_ends: tuple[int, int] = (0, 0)
    # Inside the gradient region (jaxpar.train.context): the micro-batches each loss there is
    # the mean over, so its cotangents are that many times the step's (jaxpar.model.fp8).
    loss_microbatches: int = 1
    # Megatron-SP's FP8 gathers and reduce-scatters as collective-matmul rings rather than
    # GSPMD's collectives at the dot (fp8_rings, jaxpar.model.fp8)
    fp8_rings: bool = False

    def lookup(self, logical: str | None) -> MeshAxes:
        """Mesh axes a logical axis maps to (first matching rule wins)."""
        if logical is None:
            return ()
        if logical not in LOGICAL_AXES:
            raise ValueError(f"logical axis {logical!r}: unknown; known: {LOGICAL_AXES}")
        for name, axes in self.table:
            if name == logical:
                return axes
        return ()

    def spec(self, logical_axes: Sequence[str | None]) -> P:
        """PartitionSpec for an array with these logical axes; raises on a mesh-axis collision."""
        used: dict[str, str] = {}
        out: list[str | tuple[str, ...] | None] = []
        for logical in logical_axes:
            axes = self.lookup(logical)
            for a in axes:
                if a in used:
                    raise ValueError(
                        f"logical axes {tuple(logical_axes)}: '{logical}' and '{used[a]}' both "
                        f"map to mesh axis '{a}'"
                    )
                used[a] = logical or ""
            out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
        return P(*out)


def fp8_rings(layout: LayoutConfig, hardware: HardwareConfig | None) -> bool:
    """Whether Megatron-SP's tp collectives of an FP8 recipe run as the collective matmul's
    rings of sends (:mod:`jaxpar.model.collective_matmul`) instead of GSPMD's FP8 all-gathers
    and reduce-scatters at the dots: where ZeRO-3's per-layer gathers and reduce-scatters cross
    nodes. XLA:GPU runs GSPMD's collectives first in, first out on one stream, so a GEMM's tp
    gather waits behind a long dp call there; a ring's sends run on the point-to-point stream
    beside it (llama3-70b dp 128 x tp 8 + SP, ZeRO-3, delayed, on h100-1024 at 8 layers: step
    0.804 -> 0.641 s, tp exposed 0.254 -> 0.050 s). Inside one node the rings' chunked FP8 GEMMs
    cost more than they hide (llama3-8b on h100-8, delayed: tp 8 + SP 0.369 -> 0.400 s; dp 2 x
    tp 4 + SP ZeRO-3 0.325 -> 0.351 s): GSPMD's collectives stay. Rowwise scales keep GSPMD's
    (each row's scale would travel with its chunk), and so does a pipeline, whose ticks run no
    rings at all (:func:`jaxpar.model.collective_matmul.axes`: a ring's permutes would meet
    other stages' branches). BENCHMARKS.md, "FP8 tp rings across nodes"."""
    if hardware is None or layout.fp8 not in ("tensorwise", "delayed") or layout.pp > 1:
        return False
    from jaxpar.distributed import zero3_across_nodes

    return layout.tp > 1 and layout.sequence_parallel and zero3_across_nodes(layout, hardware)


def rules_for(model: ModelConfig, layout: LayoutConfig,
              hardware: HardwareConfig | None = None) -> Rules:  # fmt: skip
    """The rule table of a layout (``hardware``: the mesh's, for :func:`fp8_rings`).

    Megatron TP: ``heads``, ``mlp`` and ``vocab`` on ``tp`` make QKV/MLP-up column-parallel and
    attention-out/MLP-down row-parallel, so GSPMD emits one all-reduce per pair in forward and
    one in backward. kv heads go on ``tp`` only when they divide evenly; otherwise the kv
    projections are replicated over ``tp`` and the attention core repeats kv heads up to a
    multiple of the head shards (:func:`jaxpar.model.attention.kv_repeat`), as Megatron does.

    Megatron-SP (``sequence_parallel``) puts the residual stream's ``act_seq`` on ``sp`` *and*
    ``tp``: the constraint into a column-parallel matmul (``seq`` on ``sp`` only) is an
    all-gather over ``tp``, the one out of a row-parallel matmul a reduce-scatter.

    Ulysses (``sp_mode='ulysses'``, ``sp > 1``): ``attn_seq`` unsharded and ``attn_heads`` on
    (``tp``, ``sp``), so the constraints around the attention core are all-to-alls over ``sp``
    (tp-major: a device keeps a sub-block of its TP rank's heads, nothing moves over ``tp``).
    Ring (``sp_mode='ring'``): attention stays sequence-sharded; the core is a ``shard_map``
    over ``sp`` passing K/V blocks with ``ppermute`` (:mod:`jaxpar.model.attention`).
    """
    tp, sp = layout.tp, layout.sp
    kv = ("tp",) if model.n_kv_heads % tp == 0 else ()
    act_seq: MeshAxes = ("sp", "tp") if layout.sequence_parallel and tp > 1 else ("sp",)
    if sp > 1 and layout.sp_mode == "ulysses":
        attention, attn_seq, attn_heads, shards = "ulysses", (), ("tp", "sp"), tp * sp
    else:
        attention = "ring" if sp > 1 else "local"
        attn_seq, attn_heads, shards = ("sp",), ("tp",), tp
    # Pipeline: stacked layers split over pp at rest (rank r holds layers r·L/pp ...), and the
    # slot dim of the stage-owned embedding/head (jaxpar.pipeline.rest).
    layers = (("layers", ("pp",)), ("stage", ("pp",))) if layout.pp > 1 else ()
    # Expert parallelism: routed experts over the ep sub-axis of dp (jaxpar.model.moe).
    experts = (("experts", ("ep",)),) if layout.ep > 1 else ()
    return Rules(
        (
            *layers,
            *experts,
            ("batch", dp_axes(layout)),
            ("act_seq", act_seq),
            ("seq", ("sp",)),
            ("attn_seq", attn_seq),
            ("attn_heads", attn_heads),
            ("attn_kv_heads", attn_heads),
            ("heads", ("tp",)),
            ("kv_heads", kv),
            ("mlp", ("tp",)),
            ("vocab", ("tp",)),
        ),
        attention=attention,
        head_shards=shards,
        tp=tp,
        ep=layout.ep,
        fp8=layout.fp8,
        fp8_history=layout.fp8_history,
        fp8_bf16_ends=(layout.fp8_bf16_first, layout.fp8_bf16_last),
        fp8_rings=fp8_rings(layout, hardware),
    )


# --------------------------------------------------------------------------------------------
# The active rules: a context so model code can say ``constrain(x, ("batch", "seq", "embed"))``.

_ACTIVE: contextvars.ContextVar[Rules | None] = contextvars.ContextVar("jaxpar_rules", default=None)


@contextlib.contextmanager
def use_rules(rules: Rules | None) -> Iterator[None]:
    """Activate ``rules`` for :func:`constrain` while tracing (use with ``jax.set_mesh``)."""
    token = _ACTIVE.set(rules)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_rules() -> Rules | None:
    """The rules :func:`constrain` currently uses, or None outside :func:`use_rules`."""
    return _ACTIVE.get()


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical axes; a no-op when no rules are active.

    Uses a bare PartitionSpec, resolved against the mesh set by ``jax.set_mesh``; inside the
    pipeline's ``shard_map`` (manual over ``pp``) that is the abstract mesh of the other axes.
    """
    rules = _ACTIVE.get()
    if rules is None:
        return x
    return jax.lax.with_sharding_constraint(x, rules.spec(logical_axes))


# --------------------------------------------------------------------------------------------
# ZeRO


def hybrid(layout: LayoutConfig) -> bool:
    """Hybrid sharding (FSDP HYBRID_SHARD): ZeRO shards within groups of ``dp_shard`` ranks."""
    return 0 < layout.dp_shard < layout.dp


def expert_parallel(layout: LayoutConfig) -> bool:
    """Expert parallelism: ``dp`` split into ``edp × ep``, routed experts sharded over ``ep``."""
    return layout.ep > 1


def dp_axes(layout: LayoutConfig) -> MeshAxes:
    """Mesh axes the batch is split over: ``('dp',)``; ``('dpr', 'dps')`` under hybrid
    sharding (:func:`jaxpar.devices.make_mesh` splits ``dp`` into replica groups × shards);
    ``('edp', 'ep')`` under expert parallelism (expert replicas × expert shards)."""
    if expert_parallel(layout):
        return ("edp", "ep")
    return ("dpr", "dps") if hybrid(layout) else ("dp",)


def zero_axis(layout: LayoutConfig) -> str:
    """The mesh axis ZeRO shards states over (``dps`` under hybrid sharding, ``edp`` under
    expert parallelism, else ``dp``)."""
    if expert_parallel(layout):
        return "edp"
    return "dps" if hybrid(layout) else "dp"


def zero_size(layout: LayoutConfig) -> int:
    """Number of ZeRO shards N (the ``dp_shard`` group size under hybrid sharding, ``dp/ep``
    under expert parallelism)."""
    if expert_parallel(layout):
        return layout.dp // layout.ep
    return layout.dp_shard if hybrid(layout) else layout.dp


def zero_dim(spec: P, axis: str) -> int | None:
    """Index of the dimension of ``spec`` sharded over mesh axis ``axis`` (None if none)."""
    for i, part in enumerate(spec):
        if part == axis or (isinstance(part, tuple) and axis in part):
            return i
    return None


def zero_spec(
    spec: P, shape: Sequence[int], logical_axes: Sequence[str | None], dp: int, axis: str = "dp",
    ep: int = 1,
) -> P:  # fmt: skip
    """Add ``axis`` (``dp``) to ``spec`` on the largest dimension that can take it.

    Eligible dimensions are not ``layers``/``sublayers`` (the layer scans slice them) nor an
    FP8 amax history's ``fp8_bucket`` (a few hundred bytes per GEMM, read whole), not
    already sharded, and divisible by ``dp`` times their existing shards. A tensor with no
    eligible dimension (e.g. a small norm scale) stays replicated over ``dp``; its bytes are
    negligible and :mod:`jaxpar.analysis` counts it exactly.

    An expert stack ``[E, D, F]`` takes it on its leading ``experts`` dim: alone without expert
    parallelism, beside ``ep`` (``("ep", axis)``, ep-major: an ep rank's ``E/ep`` experts are
    its ``edp`` group's shards, and ZeRO-3's gather over ``edp`` gives them back) when ``E`` is
    divisible by ``ep · dp``. ZeRO-3's per-layer reduce-scatter then writes each layer's
    gradient shard in place. On its ``D`` dim XLA:GPU kept transposed ``[D/dp, L, E, F]`` fp32
    copies of the layer-stacked gradients (Mixtral-8x7b over h100-8, dp 8, ZeRO-3: 144.0 →
    123.0 GiB per device, the planner's 123.1).
    """
    if dp == 1:
        return spec
    parts = list(spec) + [None] * (len(shape) - len(spec))
    for i, (size, logical) in enumerate(zip(shape, logical_axes, strict=True)):
        if logical == "experts" and parts[i] in ("ep", ("ep",)) and size % (ep * dp) == 0:
            parts[i] = ("ep", axis)  # beside ep: see the docstring
            return P(*parts)
    best = None
    for i, (size, logical) in enumerate(zip(shape, logical_axes, strict=True)):
        if logical in ("layers", "sublayers", "fp8_bucket") or parts[i] is not None or size % dp:
            continue
        if logical == "experts":  # the leading dim of an expert stack: see the docstring
            best = i
            break
        if best is None or size > shape[best]:
            best = i
    if best is None:
        return P(*parts)
    parts[best] = axis
    return P(*parts)


@dataclass(frozen=True)
class StageSharding:
    """Which trees ZeRO stage k shards over ``dp``."""

    params: bool
    grads: bool
    optimizer: bool

    @staticmethod
    def of(stage: int) -> StageSharding:
        """Stage 0 DDP, 1 optimizer, 2 + gradients, 3 + parameters (FSDP)."""
        return StageSharding(params=stage >= 3, grads=stage >= 2, optimizer=stage >= 1)


def param_specs(logical_tree, shape_tree, rules: Rules, dp: int, shard_dp: bool, axis: str = "dp"):
    """PartitionSpecs of a parameter-shaped tree (params, grads, or one optimizer moment);
    ``shard_dp`` adds the ZeRO axis ``axis`` of size ``dp`` (:func:`zero_spec`)."""

    def one(logical, shape):
        spec = rules.spec(logical)
        return zero_spec(spec, shape, logical, dp, axis, rules.ep) if shard_dp else spec

    return jax.tree.map(one, logical_tree, shape_tree, is_leaf=lambda x: isinstance(x, tuple))


def named(mesh, spec_tree, memory_kind: str | None = None):
    """Map a tree of PartitionSpecs to NamedShardings on ``mesh`` (in ``memory_kind``)."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s, memory_kind=memory_kind),
        spec_tree,
        is_leaf=lambda x: isinstance(x, P),
    )


def match_param_tree(tree, param_specs_tree, default: P | None = None):
    """Specs for a tree that embeds parameter-shaped subtrees (e.g. optax state).

    A leaf whose key path ends with a parameter's key path gets that parameter's spec (Adam's
    ``mu``/``nu`` mirror the params); every other leaf (step counters) gets ``default``.
    """
    flat_params = {
        _keys(path): spec
        for path, spec in jax.tree_util.tree_flatten_with_path(
            param_specs_tree, is_leaf=lambda x: isinstance(x, P)
        )[0]
    }
    longest = max((len(k) for k in flat_params), default=0)
    default = P() if default is None else default

    def pick(path, leaf):
        keys = _keys(path)
        for n in range(min(longest, len(keys)), 0, -1):
            spec = flat_params.get(keys[-n:])
            if spec is not None and len(spec) <= len(getattr(leaf, "shape", ())):
                return spec
        return default

    return jax.tree_util.tree_map_with_path(pick, tree)


def _keys(path) -> tuple[str, ...]:
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(k.name)
    return tuple(out)
