"""Collective matmul: Megatron-SP's tp all-gather and reduce-scatter as rings of
``ppermute`` interleaved with partial matmuls (Wang et al., "Overlap Communication with
Dependent Computation via Decomposition in Large Deep Learning Models", ASPLOS 2023).

Under Megatron sequence parallelism the residual stream is sharded on the sequence over ``tp``.
A column-parallel matmul (QKV, gate/up) needs the whole sequence: an all-gather of ``x`` over
``tp`` and then the matmul, which cannot start before the gather ends. A row-parallel one
(attention out, MLP down) makes partial sums over the whole sequence and reduce-scatters them.
Decomposed, each becomes ``tp`` matmuls of one sequence chunk each and ``tp - 1`` sends to the
next rank of a ring, where every send is independent of the matmul beside it, so XLA's
scheduler runs them at once (the GPU program's collective-permutes have a matmul in their
window, :mod:`jaxpar.analysis.hlo_gpu`):

* :func:`column_parallel` (all-gather → matmul): step ``i`` multiplies the chunk that came from
  rank ``r - i`` while passing it on to ``r + 1``; the products land in their sequence slot.
* :func:`row_parallel` (matmul → reduce-scatter): an accumulator for chunk ``k`` starts at rank
  ``k + 1`` and travels the ring, each rank adding its partial product for ``k``; after
  ``tp - 1`` sends rank ``r`` holds the sum for its own chunk ``r``.

Their VJPs are the same two rings the other way round, written out (``jax.custom_vjp``) so that
the backward keeps only the sequence *shard* of a column-parallel input (the ring passes it
again for the weight gradient, as the gathered path regathers it): the backward of
:func:`column_parallel` is a reduce-scatter ring of ``dy·Wᵀ`` beside a ring of ``x`` chunks, the
backward of :func:`row_parallel` one ring of ``dy`` chunks giving ``dh`` into their slots. The
chunks a backward ring brings are written into one gathered buffer and ``dW`` is one matmul
over the whole sequence after the ring, as Megatron's weight-gradient GEMM waits for its
all-gather: summed chunk by chunk instead, every ring step would add a partial ``dW`` (the
size of the weight shard, fp32) into an accumulator, ``tp`` passes of the weight gradient
through device memory per matmul per micro-batch.
Wire bytes equal the all-gather's and reduce-scatter's ((tp - 1)/tp of the full activation per
ring); each ring holds two chunk buffers in flight besides its output.

Each ring runs in a ``jax.shard_map`` manual over the residual stream's sequence axes
(``act_seq``: ``tp``, and ``sp`` when it is > 1: a weight's gradient is then summed over ``sp``
by the map's transpose, as GSPMD sums it without the ring) on the mesh that is active (inside the
step's manual dp region, on what remains of it); other axes keep their GSPMD shardings.
``dW`` is accumulated in fp32 inside its matmul; the reduce-scatter's accumulator is the
compute dtype, as NCCL's ring reduces in the dtype it sends.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.sharding import active_rules

TP = "tp"


def axes(seq_len: int) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """``(act_seq, seq)`` mesh axes when the active rules put the residual stream's sequence on
    ``tp`` (Megatron-SP, tp > 1) and a sequence of ``seq_len`` splits evenly over them; else
    None (no collective matmul: the gathered path, e.g. a decode step of one token)."""
    rules = active_rules()
    if rules is None or rules.tp <= 1:
        return None
    act, seq = rules.lookup("act_seq"), rules.lookup("seq")
    if TP not in act:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TP not in mesh.axis_names or TP in mesh.manual_axes:
        return None
    if "pp" in mesh.manual_axes:
        # Inside a pipeline's ticks each rank runs its own branch of the tick's conditionals,
        # and one ring's collective-permute spans the tp groups of every pp rank: XLA:CPU meets
        # all its devices in one rendezvous, so ranks in different branches met the wrong
        # permutes (tp 2 + SP x pp 2 lost 5.583-5.605 against one device's 5.641). GSPMD's
        # all-gathers and reduce-scatters there stay within each tp group.
        return None
    if seq_len % math.prod(mesh.shape[a] for a in act):
        return None
    # Size-1 axes stay automatic: manual, a weight's gradient would be summed over one device
    # (an all-reduce of nothing in the HLO).
    return tuple(a for a in act if mesh.shape[a] > 1), tuple(a for a in seq if mesh.shape[a] > 1)


def column_parallel(x_BxSxD: jax.Array, w_DxN: jax.Array, ax) -> jax.Array:
    """``tensordot(x, w, 1)`` with ``x`` sequence-sharded over ``ax[0]`` (``act_seq``) and
    ``w``'s axis 1 on ``tp``: the output has the sequence on ``ax[1]`` (``seq``) and axis 2 on
    ``tp``. The all-gather of ``x`` is a ring overlapped with the chunk matmuls."""
    act, seq = ax
    t = jax.sharding.get_abstract_mesh().shape[TP]
    rest = (None,) * (w_DxN.ndim - 2)
    fn = jax.shard_map(
        partial(_ag_matmul, t=t),
        in_specs=(P(None, act, None), P(None, TP, *rest)),
        out_specs=P(None, seq or None, TP, *rest),
        axis_names=set(act),
        check_vma=False,
    )
    return fn(x_BxSxD, w_DxN)


def row_parallel(h: jax.Array, w: jax.Array, n: int, ax) -> jax.Array:
    """``tensordot(h, w, n)`` (``h``'s axes 2.. against ``w``'s first ``n``; ``h``'s axis 2 and
    ``w``'s axis 0 on ``tp``: partial sums) reduce-scattered onto the sequence shards
    (``act_seq``), as a ring overlapped with the chunk matmuls."""
    act, seq = ax
    t = jax.sharding.get_abstract_mesh().shape[TP]
    fn = jax.shard_map(
        partial(_matmul_rs, n=n, t=t),
        in_specs=(
            P(None, seq or None, TP, *(None,) * (h.ndim - 3)),
            P(TP, *(None,) * (w.ndim - 1)),
        ),
        out_specs=P(None, act, None),
        axis_names=set(act),
        check_vma=False,
    )
    return fn(h, w)


# ---- the rings, on one device's blocks (inside the shard_map) -------------------------------
#
# Every ring step ends in an optimization barrier over what the next step's matmuls read and
# what this step's produced. Without it XLA:GPU's dot merger joins the ring's independent
# chunk matmuls (they share the weight) into one matmul of the concatenated chunks, which must
# wait for every send: the ring's sends then run back to back, synchronous, before one big
# matmul (llama3-8b tp 8 + SP on h100-8: 1.5 of the 4.7 GB of sends exposed that way). With it
# step i + 1's matmuls and sends start when step i's matmul and send are both done: each send
# runs beside one chunk's matmul.


def _send(x: jax.Array, t: int) -> jax.Array:
    """``x`` to the next rank of the tp ring (and the previous rank's in return)."""
    return jax.lax.ppermute(x, TP, [(j, (j + 1) % t) for j in range(t)])


def _chunk(a: jax.Array, k, t: int) -> jax.Array:
    """Sequence chunk ``k`` (traced) of ``a`` ``[B, t·c, ...]``: ``[B, c, ...]``."""
    c = a.shape[1] // t
    return jax.lax.dynamic_slice_in_dim(a, k * c, c, axis=1)


def _gathered(x: jax.Array, t: int) -> jax.Array:
    """Zeros the shape of ``x`` ``[B, c, ...]`` gathered over the ring: ``[B, t·c, ...]``."""
    return jnp.zeros((x.shape[0], t * x.shape[1], *x.shape[2:]), x.dtype)


def _place(out: jax.Array, y: jax.Array, k) -> jax.Array:
    """``y`` ``[B, c, ...]`` written into sequence chunk ``k`` of ``out``."""
    return jax.lax.dynamic_update_slice_in_dim(out, y, k * y.shape[1], axis=1)


def _dw(a: jax.Array, b: jax.Array) -> jax.Array:
    """``aᵀ·b`` over batch and sequence (axes 0, 1), accumulated in fp32."""
    return jnp.tensordot(a, b, axes=((0, 1), (0, 1)), preferred_element_type=jnp.float32)


def _add(acc, x):
    return x if acc is None else acc + x


_barrier = jax.lax.optimization_barrier


def _gather_apply(x: jax.Array, t: int, f, out_shape, dtype, keep: bool = False):
    """The all-gather ring: ``f(chunk_from_rank_k)`` placed in slot ``k`` for every ``k``. With
    ``keep``, the chunks themselves are placed too (the gathered ``x``, for a backward's ``dW``
    after the ring); else None in its place."""
    r = jax.lax.axis_index(TP)
    out = jnp.zeros(out_shape, dtype)
    full = _gathered(x, t) if keep else None
    cur = x
    for i in range(t):
        k = (r - i) % t  # cur came from rank k
        nxt = _send(cur, t) if i < t - 1 else None  # in flight during this chunk's matmuls
        out = _place(out, f(cur), k)
        if keep:
            full = _place(full, cur, k)
        if nxt is not None:
            nxt, out, full = _barrier((nxt, out, full))
        cur = nxt
    return out, full


def _scatter_reduce(t: int, part, operand):
    """The reduce-scatter ring: ``Σ_ranks part(operand, r)`` for this rank's chunk ``r``, where
    ``part(operand, k)`` is this rank's partial product for sequence chunk ``k``."""
    r = jax.lax.axis_index(TP)
    acc = part(operand, (r - 1) % t)
    for i in range(1, t):
        acc, operand = _barrier((acc, operand))
        # acc travels while this rank multiplies its next chunk
        acc = _send(acc, t) + part(operand, (r - 1 - i) % t)
    return acc


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ag_matmul(x, w, t):
    b, c = x.shape[:2]
    shape = (b, t * c, *w.shape[1:])
    return _gather_apply(x, t, lambda xc: jnp.tensordot(xc, w, 1), shape, x.dtype)[0]


def _ag_matmul_fwd(x, w, t):
    return _ag_matmul(x, w, t), (x, w)


def _ag_matmul_bwd(t, res, dy):
    """dx: ``Σ_ranks dy[chunk r]·Wᵀ`` (a reduce-scatter ring) beside a ring of ``x`` chunks
    gathered into the whole ``x``; dW: ``xᵀ·dy``, one matmul after the rings. Both rings'
    sends of step ``i`` run beside its ``dx`` matmul."""
    x, w = res
    axes = (tuple(range(2, dy.ndim)), tuple(range(1, w.ndim)))
    acc, dw = _ag_bwd_local(x, w, dy, t, lambda d, w: jnp.tensordot(d, w, axes), _dw)
    return acc.astype(x.dtype), dw.astype(w.dtype)


def _ag_bwd_local(x, w, dy, t: int, dx_of, dw_of):
    """:func:`_ag_matmul_bwd`'s rings with the caller's products: ``dx_of(dy chunk, w)`` for
    the reduce-scatter ring's partial sums, ``dw_of(whole x, dy)`` after the rings."""
    r = jax.lax.axis_index(TP)
    full = _gathered(x, t)
    cur, acc = x, None
    for i in range(t):
        k = (r - i) % t  # cur came from rank k
        nxt = _send(cur, t) if i < t - 1 else None
        sent = _send(acc, t) if i else None
        full = _place(full, cur, k)
        acc = _add(sent, dx_of(_chunk(dy, (r - 1 - i) % t, t), w))
        if nxt is not None:
            nxt, acc, full, dy = _barrier((nxt, acc, full, dy))
        cur = nxt
    return acc, dw_of(full, dy)


_ag_matmul.defvjp(_ag_matmul_fwd, _ag_matmul_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul_rs(h, w, n, t):
    return _scatter_reduce(t, lambda hh, k: jnp.tensordot(_chunk(hh, k, t), w, n), h)


def _matmul_rs_fwd(h, w, n, t):
    return _matmul_rs(h, w, n, t), (h, w)


def _matmul_rs_bwd(n, t, res, dy):
    """``dh[chunk k] = dy_k·Wᵀ`` with ``dy_k`` (rank ``k``'s) arriving round an all-gather ring
    that also gathers the whole ``dy``; ``dW = hᵀ·dy``, one matmul after the ring."""
    h, w = res
    last = tuple(range(n, w.ndim))

    def dh(dyc):
        return jnp.tensordot(dyc, w, (tuple(range(2, dyc.ndim)), last)).astype(h.dtype)

    out, dy_full = _gather_apply(dy, t, dh, h.shape, h.dtype, keep=True)
    return out, _dw(h, dy_full).astype(w.dtype)


_matmul_rs.defvjp(_matmul_rs_fwd, _matmul_rs_bwd)


# ---- the rings with the caller's products (FP8 GEMMs, jaxpar.model.fp8) ---------------------
#
# The same rings, called from inside another VJP rule on operands the caller prepared (FP8
# values quantized on their sequence shard): no VJP of their own. Each takes ``ax`` from
# :func:`axes`; a weight gradient is summed over the sequence axes other than tp here (the
# custom VJPs above get that sum from their map's transpose).


def _rest(n: int) -> tuple:
    return (None,) * n


def _map(fn, in_specs, out_specs, act):
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=set(act),
                         check_vma=False)  # fmt: skip


def _sum_seq(dw: jax.Array, act: tuple[str, ...]) -> jax.Array:
    others = tuple(a for a in act if a != TP)
    return jax.lax.psum(dw, others) if others else dw


def gather_products(x, w, ax, product, dtype) -> jax.Array:
    """A column-parallel product of sequence-sharded ``x`` ``[B, S, D]`` (on ``act``) and
    ``w`` (axis 1 on tp): ``product(x chunk, w block)`` for every chunk of the all-gather
    ring, in ``dtype``, the output laid out as :func:`column_parallel`'s."""
    act, seq = ax
    t, rest = jax.sharding.get_abstract_mesh().shape[TP], _rest(w.ndim - 2)

    def local(x, w):
        shape = (x.shape[0], t * x.shape[1], *w.shape[1:])
        return _gather_apply(x, t, lambda xc: product(xc, w), shape, dtype)[0]

    return _map(local, (P(None, act, None), P(None, TP, *rest)),
                P(None, seq or None, TP, *rest), act)(x, w)  # fmt: skip


def gather_products_bwd(x, w, dy, ax, dx_of, dw_of) -> tuple[jax.Array, jax.Array]:
    """The backward of :func:`gather_products` with the caller's products: ``dx`` as the
    reduce-scatter ring of ``dx_of(dy chunk, w block)`` back onto ``x``'s sequence shards,
    ``dW = dw_of(whole x, dy)`` with ``x`` gathered by a ring beside it."""
    act, seq = ax
    t, rest = jax.sharding.get_abstract_mesh().shape[TP], _rest(w.ndim - 2)

    def local(x, w, dy):
        dx, dw = _ag_bwd_local(x, w, dy, t, dx_of, dw_of)
        return dx, _sum_seq(dw, act)

    specs = (P(None, act, None), P(None, TP, *rest), P(None, seq or None, TP, *rest))
    return _map(local, specs, (specs[0], specs[1]), act)(x, w, dy)


def scatter_products(h, w, ax, product) -> jax.Array:
    """A row-parallel product of ``h`` (axis 2 on tp) and ``w`` (axis 0 on tp):
    ``product(h chunk, w block)`` partial sums reduce-scattered by the ring onto the
    sequence shards (``act``), in the products' dtype."""
    act, seq = ax
    t = jax.sharding.get_abstract_mesh().shape[TP]

    def local(h, w):
        return _scatter_reduce(t, lambda hh, k: product(_chunk(hh, k, t), w), h)

    return _map(local, (P(None, seq or None, TP, *_rest(h.ndim - 3)), P(TP, *_rest(w.ndim - 1))),
                P(None, act, None), act)(h, w)  # fmt: skip


def scatter_products_bwd(h, w, dy, ax, dh_of, dw_of, dtype) -> tuple[jax.Array, jax.Array]:
    """The backward of :func:`scatter_products` with the caller's products: ``dy``
    (sequence-sharded) gathered by a ring, ``dh_of(dy chunk, w block)`` placed in each chunk's
    slot of ``dh`` (in ``dtype``), then ``dW = dw_of(h, whole dy)``."""
    act, seq = ax
    t = jax.sharding.get_abstract_mesh().shape[TP]

    def local(h, w, dy):
        dh, full = _gather_apply(dy, t, lambda c: dh_of(c, w), h.shape, dtype, keep=True)
        return dh, _sum_seq(dw_of(h, full), act)

    specs = (P(None, seq or None, TP, *_rest(h.ndim - 3)), P(TP, *_rest(w.ndim - 1)),
             P(None, act, None))  # fmt: skip
    return _map(local, specs, (specs[0], specs[1]), act)(h, w, dy)
