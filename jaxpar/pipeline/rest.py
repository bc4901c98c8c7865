"""How a layout stores the model at rest, and the conversions to canonical form.

The canonical form is what the model builds and what checkpoints, Hugging Face weights and
inference hold. A layout whose ``tp`` does not divide the vocabulary stores a padded one
(below); a pipeline layout (``pp > 1``) stores two more things differently, so that a train
step moves no weights and sums no gradient over ``pp``:

* **Layers in placement order.** ``params["layers"]`` (a MoE model's groups ``moe_layers``:
  :meth:`~jaxpar.config.ModelConfig.stack`) is stacked ``[L, ...]`` and sharded over ``pp`` on
  ``L``, in the placement order of the layout's schedule (:func:`layer_order`): rank ``r``'s
  rows are its chunks in ascending stage order. The arrangement ``[p, v, L/(p·v), ...]``
  the executor reads is then a free reshape of the pp-sharded array for every schedule
  (interleaved and V placements included).
* **Stage-owned leaves.** The embedding is used only on the rank of the first stage, the head
  (final norm and output projection) only on the rank of the last. Replicated over ``pp``,
  every rank would hold both and their gradients would be all-reduced over ``pp`` once a step
  so that every copy takes the same update (measured on the tiny model, interleaved v = 2:
  525 kB, 17-22% on top of the pipeline's messages). At rest each such leaf is ``[pp, ...]``
  instead, sharded over ``pp`` on the new leading dim (logical axis ``stage``): the slot of
  its owner rank is live, the others hold zeros. A rank holds one slot of each (the bytes it
  held replicated) and the gradient stays on the rank that computed it: no ``pp`` collective.
  Zero slots stay zero under the optimizer (zero gradient, zero moments, decay of zero) and add
  nothing to the gradient norm. With tied embeddings the table is read by both ends, so it
  stays replicated and its gradient is summed over ``pp`` (:class:`PipelineRun`).
* **A padded vocabulary.** The vocabulary dim (on ``tp``) of the embedding table ``[V, D]``
  and the output projection ``[D, V]`` is padded with zeros to
  :meth:`~jaxpar.config.ModelConfig.padded_vocab` when ``tp`` does not divide ``V`` (JAX
  shards only evenly; GPT-2's 50257 at any tp > 1), as Megatron-LM pads it. The padded logits
  are masked out of the softmax (:func:`jaxpar.model.llama.cross_entropy`), so the padded
  rows get zero gradients and stay zero under AdamW, and the losses and the true rows'
  gradients are the unpadded model's. The canonical form keeps the true ``V`` (its sharding
  without ``tp`` on that dim): a checkpoint written at one tp restores at any other.

Every tree shaped like the params converts the same way (a whole state, optimizer moments,
gradients): a leaf's role is decided by the first dict key on its path that is ``layers`` or an
owned key, and by the last two (:data:`VOCAB_LEAVES`) for the padding.
Conversions run under ``jit`` with the target's shardings; they move data over ``pp`` (a take
of the stack, a broadcast of an owner's slot) and run only where the form is visible, never in
a step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.pipeline.generators import placement_for

if TYPE_CHECKING:
    from jaxpar.config import LayoutConfig, ModelConfig

STAGE_AXIS = "stage"  # logical axis of an owned leaf's leading [pp] dim (rule: -> pp)
# The leaves with a vocabulary dim (dict keys at the end of their path) and that dim, canonical.
VOCAB_LEAVES = {("embed", "table"): 0, ("head", "w_out"): 1}


def layer_order(layout: LayoutConfig, n_layers: int) -> np.ndarray | None:
    """Canonical layer index at each position of the stack at rest; None when the two orders
    agree (no pipeline, or one stage per rank)."""
    if layout.pp <= 1:
        return None
    place = placement_for(layout.schedule, layout.pp, layout.virtual)
    lc = n_layers // len(place)
    stages = [s for r in range(layout.pp) for s, q in enumerate(place) if q == r]
    order = np.array([s * lc + i for s in stages for i in range(lc)], np.int32)
    return None if np.all(order == np.arange(n_layers)) else order


def _param_key(path: tuple, keys: frozenset) -> str | None:
    """The first dict key on a leaf's path that names a top-level parameter in ``keys``: in
    the params, in a state ``{"params", "opt", ...}`` and in trees that mirror the params
    (Adam's ``mu``/``nu`` sit under tuple and attribute keys)."""
    return next((k.key for k in path if isinstance(k, jax.tree_util.DictKey) and k.key in keys),
                None)  # fmt: skip


@dataclass(frozen=True)
class RestLayout:
    """The form at rest of one layout (module docstring); :meth:`of` builds it."""

    pp: int
    order: np.ndarray | None  # canonical layer at each stack position; None: canonical
    owners: tuple[tuple[str, int], ...]  # (top-level param key, the pp rank that owns it)
    stack: str = "layers"  # the top-level key of the stack split over pp (ModelConfig.stack)
    vocab: tuple[int, int] = (0, 0)  # (true, padded) vocabulary when padded; (0, 0): not

    @staticmethod
    def of(layout: LayoutConfig, model: ModelConfig) -> RestLayout:
        """The embedding owned by the first stage's rank (unless tied), the head by the last's;
        the vocabulary padded to :meth:`~jaxpar.config.ModelConfig.padded_vocab`."""
        stack, n = model.stack()
        padded = model.padded_vocab(layout.tp)
        vocab = (model.vocab_size, padded) if padded != model.vocab_size else (0, 0)
        if layout.pp <= 1:
            return RestLayout(1, None, (), stack, vocab)
        place = placement_for(layout.schedule, layout.pp, layout.virtual)
        owners = (("head", place[-1]),)
        if not model.tied_embeddings:
            owners = (("embed", place[0]), *owners)
        return RestLayout(layout.pp, layer_order(layout, n), owners, stack, vocab)

    @property
    def identity(self) -> bool:
        """Whether the form at rest is the canonical one."""
        return self.order is None and not self.owners and not self.vocab[0]

    def owner(self, key: str) -> int | None:
        """The rank that owns top-level param ``key`` (None: not stage-owned)."""
        return dict(self.owners).get(key)

    def _map(self, tree: Any, layers: Callable, owned: Callable, is_leaf=None,
             vocab: Callable | None = None, to_rest: bool = True) -> Any:  # fmt: skip
        """``layers`` on the stack's leaves, ``owned(x, rank)`` on stage-owned ones and
        ``vocab(x, dim)`` (``dim``: the vocabulary dim in canonical form) on padded ones: the
        padding applied before the owner's slot ``to_rest``, after it otherwise."""
        keys = frozenset((self.stack, *dict(self.owners)))

        def one(path, x):
            key = _param_key(path, keys)
            if key == self.stack:
                return layers(x)
            r = self.owner(key) if key is not None else None
            dim = _vocab_dim(path) if vocab is not None and self.vocab[0] else None
            if dim is not None and to_rest:
                x = vocab(x, dim)
            x = x if r is None else owned(x, r)
            return x if dim is None or to_rest else vocab(x, dim)

        return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_leaf)

    # ---- values (traced under jit) ----------------------------------------------------------

    def to_rest(self, tree: Any) -> Any:
        """Canonical -> at rest: the layer stacks taken into placement order; each owned leaf
        put in its owner's slot of a ``[pp, ...]`` stack of zeros."""

        def slot(x, r):
            return jnp.zeros((self.pp, *x.shape), x.dtype).at[r].set(x)

        def pad(x, dim):
            widths = [(0, 0)] * x.ndim
            widths[dim] = (0, self.vocab[1] - self.vocab[0])
            return jnp.pad(x, widths)

        return self._map(tree, lambda x: _take(x, self.order), slot, vocab=pad)

    def to_canonical(self, tree: Any) -> Any:
        """At rest -> canonical: the inverse of :meth:`to_rest` (the owner's slot, the true
        vocabulary)."""
        inverse = None if self.order is None else np.argsort(self.order)

        def cut(x, dim):
            return jax.lax.slice_in_dim(x, 0, self.vocab[0], axis=dim)

        return self._map(tree, lambda x: _take(x, inverse), lambda x, r: x[r], vocab=cut,
                         to_rest=False)  # fmt: skip

    # ---- shapes, shardings, logical axes ----------------------------------------------------

    def rest_shapes(self, tree: Any) -> Any:
        """ShapeDtypeStructs of :meth:`to_rest` of ``tree`` (owned and padded leaves without a
        sharding)."""

        def pad(x, dim):
            shape = list(x.shape)
            shape[dim] = self.vocab[1]
            return jax.ShapeDtypeStruct(tuple(shape), x.dtype)

        return self._map(
            tree, lambda x: x, lambda x, r: jax.ShapeDtypeStruct((self.pp, *x.shape), x.dtype),
            vocab=pad,
        )  # fmt: skip

    def rest_logical(self, logical: Any) -> Any:
        """Logical axes at rest: owned leaves lead with :data:`STAGE_AXIS`."""
        return self._map(logical, lambda ax: ax, lambda ax, r: (STAGE_AXIS, *ax),
                         is_leaf=lambda x: isinstance(x, tuple))  # fmt: skip

    def shardings(self, shardings: Any, to: str) -> Any:
        """``NamedSharding``s of a tree converted ``to`` ``"rest"`` or ``"canonical"``: an
        owned leaf gains (loses) ``pp`` on its leading dim, a padded one ``tp`` on its
        vocabulary dim (the true vocabulary is not a multiple of tp); the others keep theirs."""
        return self._map(shardings, lambda s: s, lambda s, r: _owned_sharding(s, to),
                         vocab=lambda s, dim: _vocab_sharding(s, dim, to),
                         to_rest=to == "rest")  # fmt: skip

    def canonical_abstract(self, abstract: Any) -> Any:
        """ShapeDtypeStructs with shardings of the canonical form of an at-rest tree (e.g. a
        checkpoint's restore target)."""

        def owned(x, r):
            s = _owned_sharding(x.sharding, "canonical")
            return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=s)

        def cut(x, dim):
            shape = list(x.shape)
            shape[dim] = self.vocab[0]
            s = _vocab_sharding(x.sharding, dim, "canonical")
            return jax.ShapeDtypeStruct(tuple(shape), x.dtype, sharding=s)

        return self._map(abstract, lambda x: x, owned, vocab=cut, to_rest=False)


def _owned_sharding(s: NamedSharding, to: str) -> NamedSharding:
    """An owned leaf's sharding at rest (``pp`` on a new leading dim) or canonical (without)."""
    spec = P("pp", *s.spec) if to == "rest" else P(*tuple(s.spec)[1:])
    return NamedSharding(s.mesh, spec, memory_kind=s.memory_kind)


def _vocab_dim(path: tuple) -> int | None:
    """The canonical vocabulary dim of a leaf whose path ends in :data:`VOCAB_LEAVES`."""
    keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
    return VOCAB_LEAVES.get(keys[-2:])


def _vocab_sharding(s: NamedSharding, dim: int, to: str) -> NamedSharding:
    """A padded leaf's sharding: ``tp`` on its vocabulary dim at rest, not in canonical form
    (the true vocabulary does not split evenly over tp)."""
    spec = list(s.spec) + [None] * (dim + 1 - len(s.spec))
    spec[dim] = "tp" if to == "rest" else None
    return NamedSharding(s.mesh, P(*spec), memory_kind=s.memory_kind)


def _take(x: Any, index: np.ndarray | None) -> Any:
    return x if index is None or not getattr(x, "ndim", 0) else jnp.take(x, index, axis=0)
