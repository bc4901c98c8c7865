"""Per-device parameter counts from the model's own descriptor and the trainer's sharding rules.

The model declares every parameter once (:meth:`jaxpar.model.Model.abstract` for shapes,
:meth:`~jaxpar.model.Model.logical_axes` for axes); :func:`jaxpar.sharding.rules_for` and
:func:`jaxpar.sharding.zero_spec` turn them into the PartitionSpecs the trainer compiles with.
This module applies the same two functions to the same descriptor and divides each dimension by
the mesh axes its spec names, so the counts are those of the compiled program by construction:
a new parameter, a changed rule (kv heads replicated when tp does not divide them, vocabulary on
tp, layers on pp) or a ZeRO placement that leaves a small tensor replicated shows up here
without a second hand-written list of shapes.

Counts are elements per device, three per tensor: ``full`` (the whole tensor), ``local`` (after
tp/pp: what a data-parallel rank holds without ZeRO) and ``sharded`` (after ZeRO's extra split
over the ZeRO group as well).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

from jaxpar.config import MODEL_SHAPE_FIELDS, LayoutConfig, ModelConfig, MoeConfig


@dataclass(frozen=True)
class ParamCounts:
    """Elements of each parameter tensor on the most loaded device."""

    tensors: dict[str, tuple[int, int, int]]  # path -> (full, local, sharded)
    zero_shards: int  # N: devices a ZeRO shard is split over (dp, or dp_shard when hybrid)
    stage: int

    @cached_property
    def full(self) -> int:
        """Parameters of the whole model."""
        return sum(t[0] for t in self.tensors.values())

    @cached_property
    def local(self) -> int:
        """Parameters one data-parallel rank holds without ZeRO (after tp and pp)."""
        return sum(t[1] for t in self.tensors.values())

    @cached_property
    def sharded(self) -> int:
        """Parameters of one ZeRO shard."""
        return sum(t[2] for t in self.tensors.values())

    def held(self, state: str) -> int:
        """Elements of ``state`` ('params', 'grads' or 'optimizer', per moment) one device
        stores at rest: ZeRO shards the optimizer from stage 1, gradients from 2, params at 3."""
        first = {"optimizer": 1, "grads": 2, "params": 3}[state]
        return self.sharded if self.stage >= first else self.local

    @cached_property
    def blocks(self) -> int:
        """Local elements of the decoder blocks: the dense stack and the MoE stack."""
        return self.local_of("layers") + self.local_of("moe_layers")

    @cached_property
    def experts_local(self) -> int:
        """Local elements of the routed experts (sharded over ep, reduced over edp only)."""
        return sum(t[1] for k, t in self.tensors.items() if _routed(k))

    @cached_property
    def experts_sharded(self) -> int:
        """Elements of the routed experts in one ZeRO shard."""
        return sum(t[2] for k, t in self.tensors.items() if _routed(k))

    def local_of(self, prefix: str) -> int:
        """Local elements of the tensors whose path starts with ``prefix`` (e.g. 'layers')."""
        memo = self.__dict__.setdefault("_local_of", {})  # the search asks thousands of times
        if prefix not in memo:
            memo[prefix] = sum(t[1] for k, t in self.tensors.items() if k.startswith(prefix))
        return memo[prefix]


def zero_shards(layout: LayoutConfig) -> int:
    """Number of ZeRO shards N (the ``dp_shard`` group under hybrid sharding, else dp)."""
    from jaxpar.sharding import zero_size

    return zero_size(layout)


MOE_SHAPE_FIELDS = ("experts", "top_k", "shared_experts", "expert_ff", "first_dense", "every")


def shape_key(model: ModelConfig) -> tuple:
    """The model's shape fields (the config's one list of them) and its MoE section's shape
    fields last: equal keys, equal params."""
    moe = tuple(getattr(model.moe, f) for f in MOE_SHAPE_FIELDS)
    return (*(getattr(model, f) for f in MODEL_SHAPE_FIELDS), moe)


def _model_of(key: tuple) -> ModelConfig:
    moe = MoeConfig(**dict(zip(MOE_SHAPE_FIELDS, key[-1], strict=True)))
    return ModelConfig(**dict(zip(MODEL_SHAPE_FIELDS, key[:-1], strict=True)), moe=moe)


def _routed(path: str) -> bool:
    """Whether ``path`` is a routed expert's weight (``moe_layers/moe/mlp/w_*``: the leading
    dims are layers then experts; the shared expert lives under ``mlp/shared``)."""
    return path.startswith("moe_layers/") and "/mlp/w_" in path and "/shared/" not in path


@lru_cache(maxsize=64)
def _descriptor(key: tuple) -> tuple[tuple[str, tuple[int, ...], tuple], ...]:
    """(path, shape, logical axes) of every parameter, from :class:`jaxpar.model.Model`."""
    import jax

    from jaxpar.model import Model

    model = Model(_model_of(key))
    shapes = jax.tree_util.tree_flatten_with_path(model.abstract())[0]
    axes = jax.tree.leaves(model.logical_axes(), is_leaf=lambda x: isinstance(x, tuple))
    return tuple(
        ("/".join(str(k.key) for k in path), tuple(leaf.shape), tuple(ax))
        for (path, leaf), ax in zip(shapes, axes, strict=True)
    )


def _mesh_sizes(layout: LayoutConfig) -> dict[str, int]:
    from jaxpar.sharding import hybrid

    sizes = {"pp": layout.pp, "dp": layout.dp, "sp": layout.sp, "tp": layout.tp}
    if layout.ep > 1:  # dp folded as edp × ep (jaxpar.devices.make_mesh)
        sizes.update(edp=layout.dp // layout.ep, ep=layout.ep)
    elif hybrid(layout):
        sizes.update(dps=layout.dp_shard, dpr=layout.dp // layout.dp_shard)
    return sizes


def _split(shape: tuple[int, ...], spec, sizes: dict[str, int]) -> int:
    """Elements of one device's shard of ``shape`` under PartitionSpec ``spec`` (ceil: GSPMD
    pads an uneven split)."""
    n = 1
    parts = list(spec) + [None] * (len(shape) - len(spec))
    for dim, part in zip(shape, parts, strict=True):
        axes = () if part is None else (part,) if isinstance(part, str) else tuple(part)
        n *= math.ceil(dim / math.prod(sizes[a] for a in axes))
    return n


@lru_cache(maxsize=4096)
def _counts(key: tuple, tp: int, pp: int, dp: int, dp_shard: int, zero: int, ep: int = 1):
    from jaxpar import sharding as shd

    model = _model_of(key)
    # sp shards activations only: no parameter names a sequence axis
    lay = LayoutConfig(tp=tp, pp=pp, dp=dp, sp=1, dp_shard=dp_shard, zero=zero, ep=ep)
    rules = shd.rules_for(model, lay)
    sizes = _mesh_sizes(lay)
    nz, zaxis = shd.zero_size(lay), shd.zero_axis(lay)
    tensors = {}
    for path, shape, logical in _descriptor(key):
        # The vocabulary dim as the layout stores it: padded when tp does not divide it
        # (ModelConfig.padded_vocab; jaxpar.pipeline.rest), the trainer's shape at rest.
        shape = tuple(model.padded_vocab(tp) if ax == "vocab" else n
                      for n, ax in zip(shape, logical, strict=True))  # fmt: skip
        spec = rules.spec(logical)
        zspec = shd.zero_spec(spec, shape, logical, nz, zaxis, rules.ep)
        tensors[path] = (math.prod(shape), _split(shape, spec, sizes), _split(shape, zspec, sizes))
    return ParamCounts(tensors, nz, zero)


def param_counts(model: ModelConfig, layout: LayoutConfig) -> ParamCounts:
    """Per-tensor element counts on one device under ``layout`` (memoised: the search asks
    for the same few thousand combinations many times)."""
    lay = layout
    return _counts(shape_key(model), lay.tp, lay.pp, lay.dp, lay.dp_shard, lay.zero, lay.ep)
