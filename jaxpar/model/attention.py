"""The attention core (dense, blockwise, native or cuDNN) and its sequence-parallel forms.

A core is a function ``(q [B, S, H, Dh], k [B, S, K, Dh], v) -> o [B, S, H, Dh]``: causal,
grouped-query (H = K·G), on whatever heads and full sequences the caller's sharding leaves
local. ``model.attention`` picks it (:func:`resolve`):

* ``native`` (:func:`jaxpar.model.native.flash_attention`): the same math as a C++ XLA:CPU
  kernel threaded over (batch row, kv head) pairs; CPU, fp32, head dim 16/32/64/128, built on
  first use with the machine's C++ compiler. ``auto`` takes it on CPU in fp32.
* ``blockwise`` (:func:`jaxpar.model.flash.blockwise_attention`): flash-style tiles with a
  custom backward; memory linear in the sequence, masked tiles skipped. The default where
  neither ``cudnn`` nor ``native`` applies (and ring attention's kernel).
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``, cuDNN's fused flash
  attention; NVIDIA GPUs, bf16/fp16, head dim a multiple of 8 up to 128. ``auto`` takes it
  wherever it applies.
* ``dense``: the textbook form (fp32 softmax over materialised ``[B, K, G, S, S]`` scores): the
  reference the other two are tested against.

Parallel forms (``Rules.attention``):

* Megatron TP/SP: the heads of q/k/v are sharded over ``tp`` by the projections' constraints,
  and GSPMD partitions the core along them (each device runs the core on its heads).
* Ulysses (DeepSpeed-Ulysses, Jacobs et al. 2023): :func:`ulysses` constrains q/k/v from
  sequence-sharded to head-sharded (``attn_seq``/``attn_heads``); GSPMD turns each constraint
  into an all-to-all over ``sp``; the core runs on full sequences of ``H/(tp·sp)`` heads, and
  the output constraint is the all-to-all back.
* Ring (Liu et al. 2023): :func:`ring_attention` is a ``jax.shard_map`` manual over ``sp`` only
  (``dp``/``tp`` stay with GSPMD; it nests inside the pipeline's ``shard_map`` over ``pp``).
  Each device keeps its query block and passes its K/V block around the ring with
  ``ppermute``, folding each into the blockwise kernel's online softmax. With a contiguous
  sequence layout rank ``r`` at step ``i`` holds the block of rank ``r − i``: step 0 is the
  causal diagonal, steps ``1..r`` are fully visible, later ones fully masked and skipped with
  ``lax.cond``. Its backward is custom too: it recomputes each step's tiles from the saved
  q, o and log-sum-exp and the K/V blocks received in the forward (kept, so there is no second
  K/V pass) and sends dK/dV back around the ring once (fp32, P − 1 reverse permutes of two
  tensors, as autodiff would): no scores are stored.

GQA: kv heads fewer than the head shards are repeated (:func:`kv_repeat`; the layer repeats the
kv projection weights, head k → k·r … k·r + r − 1) so that each device's query heads find their
kv head locally; query head h of group size G uses repeated head h // (G/r), i.e. head h // G,
and the gradient of a repeated head sums over its copies.

Shape suffixes: B batch, S sequence, H query heads, K kv heads, G = H/K, Dh head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.config import ATTENTION as IMPLEMENTATIONS
from jaxpar.config import RunConfig
from jaxpar.errors import ConfigError
from jaxpar.model import flash, native
from jaxpar.model.names import resharded
from jaxpar.sharding import active_rules, constrain

Core = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def kv_repeat(n_heads: int, n_kv_heads: int, shards: int) -> int | None:
    """Smallest ``r`` with ``n_kv_heads·r`` divisible by ``shards`` and ``r`` dividing the group
    size ``n_heads/n_kv_heads``, so that kv heads split as evenly as query heads; None if none.
    """
    group = n_heads // n_kv_heads
    for r in range(1, group + 1):
        if group % r == 0 and (n_kv_heads * r) % shards == 0:
            return r
    return None


# --------------------------------------------------------------------------------------------
# Choosing the implementation


def nvidia(device: jax.Device) -> bool:
    """Whether ``device`` is an NVIDIA GPU (the only place cuDNN attention runs)."""
    if device.platform != "gpu":
        return False
    client = getattr(device, "client", None)
    version = str(getattr(client, "platform_version", "")).lower()
    return "rocm" not in version and "hip" not in version


def target() -> tuple[bool, str]:
    """``(nvidia, platform)`` of the devices the program being traced is for: the active mesh's
    (a compile-only GPU target's, :mod:`jaxpar.gpu`, while the process runs on the CPU), else the
    default backend's. ``auto`` chooses from this, not from where the process runs."""
    dev = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if dev is None:
        device = jax.devices()[0]
        return nvidia(device), device.platform
    kind = str(dev.device_kind).lower()
    # An abstract device has no client to ask for ROCm; AMD's device kinds name their maker.
    on_nvidia = dev.platform in ("gpu", "cuda") and not kind.startswith(("amd", "radeon"))
    return on_nvidia, "gpu" if dev.platform == "cuda" else dev.platform


def cudnn_applies(on_nvidia: bool, dtype, head_dim: int) -> bool:
    """cuDNN flash attention's envelope: NVIDIA GPU, bf16/fp16, head dim ≤ 128 and ≡ 0 mod 8."""
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return on_nvidia and half and head_dim % 8 == 0 and head_dim <= 128


def resolve(
    setting: str, on_nvidia: bool, dtype, head_dim: int, mode: str = "local",
    platform: str | None = None,
) -> str:  # fmt: skip
    """The implementation ``model.attention = setting`` runs as; a forced one the platform,
    dtype or parallel form cannot run is refused in one line naming both. ``platform``: the
    device's (``"cpu"`` admits the native kernel; None: not known, so not admitted)."""
    if setting not in IMPLEMENTATIONS:
        allowed = ", ".join(IMPLEMENTATIONS)
        raise ConfigError(f"model.attention={setting!r}: must be one of {allowed}")
    fits = cudnn_applies(on_nvidia, dtype, head_dim)
    if mode == "ring":
        if setting in ("dense", "cudnn", "native"):
            raise ConfigError(
                f"model.attention={setting!r}: ring attention (layout.sp_mode='ring') runs the "
                "blockwise kernel; use auto or blockwise"
            )
        return "blockwise"
    why_not_native = (
        native.applies(platform, dtype, head_dim) if platform else "the platform is not known"
    )
    if setting == "auto":
        if fits:
            return _with_cudnn_library(setting)
        return "native" if why_not_native is None and native.usable() else "blockwise"
    if setting == "native":
        why = why_not_native or native.unavailable()
        if why is not None:
            raise ConfigError(f"model.attention='native': {why}")
    if setting == "cudnn" and not fits:
        where = "an NVIDIA GPU" if on_nvidia else "no NVIDIA GPU"
        raise ConfigError(
            f"model.attention='cudnn': needs an NVIDIA GPU, bfloat16/float16 compute and a head "
            f"dim that is a multiple of 8 up to 128; this run has {where}, compute dtype "
            f"{jnp.dtype(dtype).name} and head dim {head_dim}"
        )
    return _with_cudnn_library(setting) if setting == "cudnn" else setting


# What provides the cuDNN library where no NVIDIA software is installed: the version range the
# jax CUDA plugin's own ``with-cuda`` extra asks for (jaxpar's ``gpu-aot`` extra installs it).
CUDNN_PACKAGE = "nvidia-cudnn-cu12>=9.8,<10"


def cudnn_library_missing() -> str | None:
    """Why jax cannot load the cuDNN library, or None when it can. jax asks the library for its
    version when it traces cuDNN attention (``check_cudnn_version``), GPU or not: a deviceless
    compile for a GPU target needs the library too, the jax CUDA plugin alone does not carry it."""
    try:
        from jax._src.lib import cuda_versions  # the plugin's version queries; None without one
    except ImportError:  # a jax that moved it: let jax's own check speak at trace time
        return None
    if cuda_versions is None:
        return "the jax CUDA plugin is not installed"
    try:
        cuda_versions.cudnn_get_version()
    except RuntimeError as e:  # "cuDNN not found."
        return str(e).rstrip(".") or "cuDNN not found"
    return None


def _with_cudnn_library(setting: str) -> str:
    """``"cudnn"`` once the library is loadable; otherwise one line saying what to install."""
    why = cudnn_library_missing()
    if why is not None:
        raise ConfigError(
            f"model.attention={setting!r}: resolves to cuDNN attention, whose library jax cannot "
            f"load ({why}); install it with pip install '{CUDNN_PACKAGE}' (jaxpar's gpu-aot "
            "extra), or choose -o model.attention=blockwise"
        )
    return "cudnn"


def implementation_for(cfg: RunConfig, device: jax.Device) -> str:
    """The implementation a run uses on ``device`` (its compute dtype, head dim, parallel
    form); raises :class:`ConfigError` for a forced one it cannot run."""
    lay = cfg.layout
    mode = "ring" if lay.sp > 1 and lay.sp_mode == "ring" else "local"
    return resolve(
        cfg.model.attention, nvidia(device), lay.compute_dtype, cfg.model.hd, mode, device.platform
    )


def core(implementation: str, block: int) -> Core:
    """The causal core of a resolved implementation (``blockwise`` tiles of ``block``)."""
    if implementation == "blockwise":
        return partial(flash.blockwise_attention, block=block)
    if implementation == "cudnn":
        return cudnn_attention
    if implementation == "dense":
        return causal_attention
    if implementation == "native":
        return native.flash_attention
    raise ValueError(f"attention implementation {implementation!r}: not resolved")


def cudnn_attention(q_BxSxHxDh: jax.Array, k_BxSxKxDh: jax.Array, v_BxSxKxDh: jax.Array):
    """cuDNN's fused causal attention, per device under active sharding rules.

    jax partitions the cuDNN call with ``custom_partitioning``, whose rule reads a
    ``NamedSharding``'s spec and fails on the ``GSPMDSharding`` that operands carry inside the
    step's ``shard_map`` (manual over dp and pp, tp left to GSPMD). A ``shard_map`` over the
    axes that shard q, k and v (batch over dp, heads over tp) runs it on local shards instead:
    the same program, with no collective, since each device has its heads' full sequences.
    """
    fn = partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
    rules = active_rules()
    if rules is None:
        return fn(q_BxSxHxDh, k_BxSxKxDh, v_BxSxKxDh)
    q_spec = rules.spec(("batch", "attn_seq", "attn_heads", "head_dim"))
    kv_spec = rules.spec(("batch", "attn_seq", "attn_kv_heads", "head_dim"))
    # Every axis still automatic, size 1 or replicated too: the partitioner runs the rule
    # (and fails) for any of them.
    mesh = jax.sharding.get_abstract_mesh()
    axes = set(mesh.axis_names) - set(getattr(mesh, "manual_axes", ()))
    if not axes:
        return fn(q_BxSxHxDh, k_BxSxKxDh, v_BxSxKxDh)
    sharded = jax.shard_map(
        fn, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec, axis_names=axes,
        check_vma=False,
    )  # fmt: skip
    return sharded(q_BxSxHxDh, k_BxSxKxDh, v_BxSxKxDh)


def causal_attention(q_BxSxHxDh: jax.Array, k_BxSxKxDh: jax.Array, v_BxSxKxDh: jax.Array):
    """Dense softmax attention with a causal mask, grouped-query, softmax in fp32."""
    b, s, h, dh = q_BxSxHxDh.shape
    kvh = k_BxSxKxDh.shape[2]
    q_BxSxKxGxDh = q_BxSxHxDh.reshape(b, s, kvh, h // kvh, dh)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", q_BxSxKxGxDh, k_BxSxKxDh).astype(jnp.float32)
    logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits * dh**-0.5, flash.NEG)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_BxSxKxDh.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v_BxSxKxDh)
    return out.reshape(b, s, h, dh)


# --------------------------------------------------------------------------------------------
# Ulysses


def ulysses(core_fn: Core) -> Core:
    """Run ``core_fn`` on full sequences of head shards: sequence-sharded -> head-sharded is an
    all-to-all over ``sp`` per tensor (and back for the output). Without sp: no-ops."""

    def run(q_BxSxHxDh, k_BxSxKxDh, v_BxSxKxDh):
        # Tagged `resharded`: a policy that recomputes data movement keeps these instead of
        # running the all-to-alls again in the backward (jaxpar.train.remat).
        heads, kv_heads = (
            ("batch", "attn_seq", "attn_heads", "head_dim"),
            ("batch", "attn_seq", "attn_kv_heads", "head_dim"),
        )
        q_BxSxHxDh = resharded(constrain(q_BxSxHxDh, heads))
        k_BxSxKxDh = resharded(constrain(k_BxSxKxDh, kv_heads))
        v_BxSxKxDh = resharded(constrain(v_BxSxKxDh, kv_heads))
        o_BxSxHxDh = core_fn(q_BxSxHxDh, k_BxSxKxDh, v_BxSxKxDh)
        # And back (all-to-all over sp) in the caller's constraint to `seq`.
        return constrain(o_BxSxHxDh, heads)

    return run


# --------------------------------------------------------------------------------------------
# Ring attention


def _ring_setup(q, k, v, block):
    bl = flash.Blocks.of(q.shape[1], block)
    qb = flash.q_blocks(flash.scaled(q), k.shape[2], bl)
    return bl, qb, flash.kv_blocks(k, bl), flash.kv_blocks(v, bl)


def _shift(x: jax.Array, axis: str, p: int, rank: jax.Array, by: int) -> jax.Array:
    """Rank ``r``'s ``x`` to rank ``r + by`` (mod ``p``) of ``axis``.

    A collective-permute, except inside a pipeline (``pp`` manual): there ranks of different
    pipeline stages run different branches at once, and XLA's CPU runtime meets every
    collective-permute over the devices of *all* its pairs (every sp group of every stage; all
    of them share one channel id), so the ring of one stage would wait for, or swap buffers
    with, another stage's. An all-to-all is grouped per sp group and is met by that group
    alone: the block goes in the slot of rank ``r + by``, zeros in the others (the same wire
    bytes at ``p = 2``, ``p - 1`` times them beyond).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if "pp" not in mesh.manual_axes or mesh.shape.get("pp", 1) == 1:
        return jax.lax.ppermute(x, axis, [(i, (i + by) % p) for i in range(p)])
    slots_PxX = jnp.zeros((p, *x.shape), x.dtype).at[(rank + by) % p].set(x)
    got_PxX = jax.lax.all_to_all(slots_PxX, axis, 0, 0)  # got[i]: what rank i sent here
    return got_PxX[(rank - by) % p]


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ring_local(q_BxCxHxDh, k_BxCxKxDh, v_BxCxKxDh, axis: str, block: int):
    """Per-device body of :func:`ring_attention` (inside ``shard_map`` manual over ``axis``)."""
    return _ring_fwd(q_BxCxHxDh, k_BxCxKxDh, v_BxCxKxDh, axis, block)[0]


def _ring_fwd(q, k, v, axis, block):
    p, rank = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    bl, qb, kb, vb = _ring_setup(q, k, v, block)
    # Step 0: the diagonal block, causally masked.
    state = flash.forward(qb, kb, vb, bl, causal=True)
    # Each step sends the K/V block one rank up the ring (collective-permute over `axis`).
    kv, held = (kb, vb), []
    for step in range(1, p):
        kv = jax.tree.map(lambda x: _shift(x, axis, p, rank, 1), kv)
        held.append(kv)
        # Held block comes from rank − step: visible iff step <= rank, else fully masked.
        state = jax.lax.cond(
            step <= rank,
            lambda st, kv_: flash.forward(qb, kv_[0], kv_[1], bl, causal=False, state=st),
            lambda st, kv_: st,
            state,
            kv,
        )
    ob, lse = flash.finish(state)
    ob = ob.astype(q.dtype)
    return flash.q_unblocks(ob, bl), (qb, kb, vb, tuple(held), ob, lse)


def _ring_bwd(axis, block, res, do_BxCxHxDh):
    qb, kb, vb, held, ob, lse = res
    p, rank = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    c = do_BxCxHxDh.shape[1]
    bl = flash.Blocks.of(c, block)
    dob = flash.q_blocks(do_BxCxHxDh, kb.shape[2], bl)
    delta = jnp.sum(dob.astype(jnp.float32) * ob.astype(jnp.float32), axis=-1)
    zeros = partial(jnp.zeros_like, dtype=jnp.float32)  # varying over `axis` like x
    dq, dkv = zeros(qb), (zeros(kb), zeros(vb))
    # Latest step first: the gradient of the block held at step i is summed into the one sent
    # back to rank − 1, which held the same block at step i − 1 (autodiff's order, by hand).
    for step in range(p - 1, 0, -1):
        kv = held[step - 1]
        gq, gk, gv = jax.lax.cond(
            step <= rank,
            lambda kv_: flash.backward(qb, kv_[0], kv_[1], dob, lse, delta, bl, causal=False),
            lambda kv_: (zeros(qb), zeros(kb), zeros(vb)),
            kv,
        )
        dq = dq + gq
        # The forward ring's transpose: one rank down.
        dkv = jax.tree.map(lambda x: _shift(x, axis, p, rank, -1), (dkv[0] + gk, dkv[1] + gv))
    gq, gk, gv = flash.backward(qb, kb, vb, dob, lse, delta, bl, causal=True)
    return (
        flash.scaled(flash.q_unblocks(dq + gq, bl)).astype(qb.dtype),
        flash.kv_unblocks(dkv[0] + gk, c).astype(kb.dtype),
        flash.kv_unblocks(dkv[1] + gv, c).astype(vb.dtype),
    )


_ring_local.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(
    q_BxSxHxDh: jax.Array,
    k_BxSxKxDh: jax.Array,
    v_BxSxKxDh: jax.Array,
    axis: str = "sp",
    block: int = 64,
) -> jax.Array:
    """Causal attention with the sequence sharded over mesh axis ``axis`` (contiguous blocks).

    Runs as ``jax.shard_map`` manual over ``axis`` alone on the mesh set by ``jax.set_mesh``
    (inside another ``shard_map``, on what remains of it), so other mesh axes keep their GSPMD
    shardings (heads over ``tp``, batch over ``dp``) inside the ring. ``block``: tile size of
    the blockwise kernel within each device's sequence block.
    """
    spec = P(None, axis, None, None)
    fn = jax.shard_map(
        lambda q, k, v: _ring_local(q, k, v, axis, block),
        in_specs=(spec, spec, spec),
        out_specs=spec,
        axis_names={axis},
    )
    return fn(q_BxSxHxDh, k_BxSxKxDh, v_BxSxKxDh)
