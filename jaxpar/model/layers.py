"""The Llama block in Flax NNX: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Each parameter is declared once, here, with its shape, initializer and logical axes
(``nnx.Param(..., logical_axes=...)``); the abstract tree, the shardings and the init all derive
from these declarations. Activation constraints name logical axes too; the active
:class:`jaxpar.sharding.Rules` turn them into mesh axes (and so into collectives).

Shape suffixes: B batch, S sequence, D model width, H query heads, K kv heads, G = H/K query
heads per kv head, Dh head dim, F FFN width.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model import collective_matmul as cm
from jaxpar.model import fp8
from jaxpar.model.attention import core as attention_core
from jaxpar.model.attention import kv_repeat, resolve, ring_attention, target, ulysses
from jaxpar.model.names import projected, resharded, weight
from jaxpar.sharding import active_rules, constrain

# An attention core ``(q [B,S,H,Dh], k [B,S,K,Dh], v) -> o [B,S,H,Dh]`` that replaces the
# block's own (the decode path attends over a KV cache with it: jaxpar.generate).
Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def gather_sequence(x_BxSxD: jax.Array) -> jax.Array:
    """The residual-stream value ``x`` with its sequence whole over tp, for a column-parallel
    matmul: under Megatron-SP one all-gather over tp of the compute-dtype shard, else a no-op.

    The first constraint keeps ``x``'s producer (the norm's cast to the compute dtype) on the
    sequence shard. Without it GSPMD propagates the gathered layout up through the cast and
    gathers the fp32 norm output instead: twice the bytes (XLA:GPU, llama3-8b tp 8 + SP: an
    ``f32[8,512,4096]`` all-gather in front of every column-parallel matmul of the forward).
    """
    x_BxSxD = constrain(x_BxSxD, ("batch", "act_seq", "embed"))
    return constrain(x_BxSxD, ("batch", "seq", "embed"))


@jax.custom_vjp
def scatter_sequence(y_BxSxD: jax.Array) -> jax.Array:
    """A row-parallel matmul's output onto the residual stream's layout: under Megatron-SP a
    reduce-scatter over tp, else the all-reduce of the partial sums (no-op without tp).

    Its backward gathers the cotangent once, explicitly, for both matmuls that read it (``dx``
    and ``dW``). Differentiated by JAX the cotangent keeps the sequence-sharded layout and
    GSPMD gathers it for each consumer, which XLA merges only sometimes: in a micro-batch loop
    (XLA:GPU, llama3-8b dp 4 x tp 2 + SP, 2 micro-batches) each layer's backward gathered
    both cotangents twice, 8 all-gathers a layer instead of 6."""
    return constrain(y_BxSxD, ("batch", "act_seq", "embed"))


def _scatter_fwd(y):
    return scatter_sequence(y), None


def _scatter_bwd(_, dy):
    return (constrain(dy, ("batch", "seq", "embed")),)


scatter_sequence.defvjp(_scatter_fwd, _scatter_bwd)


@jax.custom_vjp
def project(x_BxSxD: jax.Array, w_DxN: jax.Array) -> jax.Array:
    """``x``'s last axis contracted with ``w``'s first (``w`` may have more output axes): the
    column-parallel up projections (QKV, gate/up), with the weight gradient taken as
    ``xᵀ·dy``.

    Differentiated by JAX, ``dW`` is ``dyᵀ·x`` laid out back, and XLA:CPU transposes the wide
    operand ``dy`` ([B·S, N], N up to 6·D for gate/up) to feed its matmul; contracting ``x``
    first transposes ``x`` ([B·S, D]) instead, fused into the norm that made it, so the step
    copies the narrow operand rather than the wide one. Gradients are the same products (fp32
    rounding)."""
    return jnp.tensordot(x_BxSxD, w_DxN, 1)


def _project_fwd(x, w):
    return project(x, w), (x, w)


def _project_bwd(res, dy):
    x, w = res
    lead = tuple(range(x.ndim - 1))  # batch and sequence
    # dx: dy's output axes against w's (on tp: partial sums, one all-reduce as before).
    dx = jnp.tensordot(dy, w, axes=(tuple(range(x.ndim - 1, dy.ndim)), tuple(range(1, w.ndim))))
    # dW = xᵀ·dy over batch and sequence (on dp: partial sums, reduced as before).
    return dx, jnp.tensordot(x, dy, axes=(lead, lead))


project.defvjp(_project_fwd, _project_bwd)


def column_parallel(x_BxSxD: jax.Array, w_DxN: jax.Array, matmul=project,
                    history: jax.Array | None = None) -> jax.Array:  # fmt: skip
    """A column-parallel matmul of the residual stream ``x`` (``w``'s axis 1 on tp):
    :func:`gather_sequence` then :func:`project`; under Megatron-SP (tp > 1) the collective
    matmul instead (:func:`jaxpar.model.collective_matmul.column_parallel`: the all-gather as a
    ring of sends, each beside the matmul of the chunk that arrived before it). ``matmul``:
    the plain product used without it (the GELU MLP's is JAX's own, whose residuals the
    planner's remat terms count).

    Under an FP8 recipe (``layout.fp8``) the product is :func:`jaxpar.model.fp8.tensordot`,
    which quantizes ``x`` on its sequence shard and gathers the FP8 values (Megatron-SP's
    all-gather at half the bytes: GSPMD's at the dot, or the ring where ZeRO-3 crosses nodes,
    :func:`jaxpar.sharding.fp8_rings`); ``history``: its amax
    history under a delayed recipe."""
    if (recipe := fp8.active()) is not None:
        return fp8.tensordot(x_BxSxD, w_DxN, 1, recipe, "in", history)
    ax = cm.axes(x_BxSxD.shape[1])
    if ax is None:
        return matmul(gather_sequence(x_BxSxD), w_DxN)
    # Keeps x's producer (the norm's cast) on the sequence shard, as in gather_sequence. The
    # ring's matmuls sit inside a custom VJP: the selective policy keeps its output by name (as
    # the plain path's dot output), or the backward would re-run the ring.
    x_BxSxD = constrain(x_BxSxD, ("batch", "act_seq", "embed"))
    return projected(cm.column_parallel(x_BxSxD, w_DxN, ax))


def row_parallel(h: jax.Array, w: jax.Array, n: int, history: jax.Array | None = None
                 ) -> jax.Array:  # fmt: skip
    """A row-parallel matmul ``tensordot(h, w, n)`` (``h``'s axis 2 and ``w``'s axis 0 on tp)
    onto the residual stream's layout: :func:`scatter_sequence` of the partial sums; under
    Megatron-SP (tp > 1) the collective matmul instead
    (:func:`jaxpar.model.collective_matmul.row_parallel`: the reduce-scatter as a ring whose
    accumulator travels while each rank multiplies its next chunk). Under an FP8 recipe the
    product is :func:`jaxpar.model.fp8.tensordot`, reduce-scattered at its dot and its
    cotangent gathered as FP8 (its output named, as the ring's, for the policies that keep dot
    outputs: its dot is inside a VJP); ``history``: its amax history under a delayed
    recipe."""
    if (recipe := fp8.active()) is not None:
        return projected(fp8.tensordot(h, w, n, recipe, "out", history))
    ax = cm.axes(h.shape[1])
    if ax is None:
        return scatter_sequence(jnp.tensordot(h, w, n))
    # The ring's matmuls sit inside a custom VJP: the selective policy keeps the (reduced,
    # sequence-sharded) output only by this name, as it keeps the plain path's dot output;
    # unkept, the backward re-ran the forward ring (tp bytes 1.18 -> 1.28x the planner's).
    return projected(cm.row_parallel(h, w, n, ax))


def _histories(module: nnx.Module, names: tuple[str, ...]) -> None:
    """One amax history per FP8 GEMM of ``module`` (``layout.fp8='delayed'``), as attributes
    ``fp8_<name>``: ``[3, BUCKETS]`` leaves in the parameter tree (:mod:`jaxpar.model.fp8`)."""
    for name in names:
        hist = fp8.History(fp8.history_init(), logical_axes=("fp8_operand", "fp8_bucket"))
        setattr(module, f"fp8_{name}", hist)


def _history(module: nnx.Module, name: str) -> jax.Array | None:
    """The amax history of ``module``'s GEMM ``name``, None without one."""
    hist = getattr(module, f"fp8_{name}", None)
    return None if hist is None else hist[...]


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> jax.Array:
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


class RMSNorm(nnx.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019); statistics in fp32."""

    def __init__(self, d: int, eps: float):
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32), logical_axes=("embed",))
        self.eps = eps

    def __call__(self, x_BxSxD: jax.Array) -> jax.Array:
        x32 = x_BxSxD.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * inv * self.scale[...]).astype(x_BxSxD.dtype)


def rotary_tables(positions: np.ndarray, half: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """``sin, cos`` of the float32 rotary angles ``[..., half]``, evaluated in float64 at trace
    time (constants of the program), rounded to float32."""
    freq = theta ** (-np.arange(half, dtype=np.float32) / half)
    angle = (np.asarray(positions).astype(np.float32)[..., None] * freq).astype(np.float64)
    return np.sin(angle).astype(np.float32), np.cos(angle).astype(np.float32)


def rope(
    x_BxSxNxDh: jax.Array, positions: jax.Array | np.ndarray, theta: float, max_len: int
) -> jax.Array:
    """Rotary position embedding (Su et al. 2021), half-split convention (as in Llama/HF).

    ``positions`` is ``[S]`` (shared by the batch) or ``[B, S]`` (per row: left-padded prompts
    when decoding), below ``max_len``. The sin/cos tables are always constants of the program
    (:func:`rotary_tables`): for positions known when tracing (a NumPy array: training and
    evaluation) exactly those rows, for traced ones (decoding) rows gathered from the table of
    all ``max_len`` positions, so a decoded token is rotated as in training. Computed in the
    program instead, XLA fuses sin and cos into the rotation and evaluates them once per element
    of q and k: at 1024 positions and head dim 64 the rotation took 9.4 ms against 1.8 ms
    (forward; 20.6 against 3.8 ms for its gradient) on CPU, and its float32 sin/cos put the
    rotation up to 2.5e-4 off the float64 tables' at those positions."""
    half = x_BxSxNxDh.shape[-1] // 2
    if isinstance(positions, np.ndarray):
        sin, cos = rotary_tables(positions, half, theta)
    else:
        sin_t, cos_t = rotary_tables(np.arange(max_len), half, theta)
        sin, cos = jnp.asarray(sin_t)[positions], jnp.asarray(cos_t)[positions]
    # [S, half] or [B, S, half] -> [B or 1, S, 1, half]
    sin, cos = (t.reshape((1,) * (3 - t.ndim) + t.shape)[:, :, None] for t in (sin, cos))
    x1, x2 = jnp.split(x_BxSxNxDh.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxSxNxDh.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention; QKV column-parallel, output row-parallel over ``tp``.

    ``__call__`` is :meth:`qkv` → :meth:`core` → :meth:`out`; a decode path with a KV cache
    calls :meth:`qkv` and :meth:`out` around its own core.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, fp8_history: bool = False):
        d, h, k, dh, std = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.hd, cfg.init_std
        self.wq = nnx.Param(
            _normal(rngs, (d, h, dh), std), logical_axes=("embed", "heads", "head_dim")
        )
        self.wk = nnx.Param(
            _normal(rngs, (d, k, dh), std), logical_axes=("embed", "kv_heads", "head_dim")
        )
        self.wv = nnx.Param(
            _normal(rngs, (d, k, dh), std), logical_axes=("embed", "kv_heads", "head_dim")
        )
        # Scaled init of the residual projections (GPT-2): std / sqrt(2 * layers).
        out_std = std / (2 * cfg.n_layers) ** 0.5
        self.wo = nnx.Param(
            _normal(rngs, (h, dh, d), out_std), logical_axes=("heads", "head_dim", "embed")
        )
        self.theta = cfg.rope_theta
        self.max_len = cfg.max_seq_len  # rows of the rotary tables
        self.attention, self.block = cfg.attention, cfg.attention_block
        if fp8_history:  # layout.fp8='delayed': the QKV and output GEMMs' amax histories
            _histories(self, ("qkv", "out"))

    def __call__(
        self, x_BxSxD: jax.Array, positions_S: jax.Array, attend: Attend | None = None
    ) -> jax.Array:
        """``out(core(qkv(x)))``; ``attend(q, k, v)`` replaces the core (e.g. a KV cache)."""
        q, k, v = self.qkv(x_BxSxD, positions_S)
        if attend is not None:
            o_BxSxHxDh = attend(q, k, v)
        else:
            o_BxSxHxDh = self.core(q, k, v)
        return self.out(o_BxSxHxDh)

    def qkv(
        self, x_BxSxD: jax.Array, positions_S: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Projections with rotary embeddings applied: q ``[B, S, H, Dh]``, k and v
        ``[B, S, K·r, Dh]`` (kv heads repeated r times, :func:`kv_repeat`, when fewer than the
        head shards), in the projection layout (seq on sp, heads on tp). ``positions_S`` may
        be ``[B, S]`` (see :func:`rope`)."""
        dt = x_BxSxD.dtype
        b, s, _ = x_BxSxD.shape
        h, kvh, dh = self.wq.shape[1], self.wk.shape[1], self.wq.shape[2]
        rules = active_rules()
        tp, shards = (rules.tp, rules.head_shards) if rules else (1, 1)
        r = kv_repeat(h, kvh, shards)
        if r is None:  # config validation refuses this before tracing
            raise ValueError(f"{kvh} kv heads cannot be split over {shards} head shards")
        # GQA with fewer kv heads than head shards: repeat the kv *weights* (Megatron's kv
        # replication) so kv heads split like query heads; their gradients sum over the copies
        # (an all-reduce over tp of a [D, K, Dh] weight gradient when wk is replicated).
        wk, wv = (jnp.repeat(w[...], r, axis=1) for w in (self.wk, self.wv))
        # One fused QKV matmul (weights grouped per TP rank), so the backward sums the q, k and
        # v contributions to dx locally and all-reduces once over tp, not three times. Into it
        # the residual stream's `act_seq` (on tp too under Megatron-SP) becomes `seq` (sp only):
        # with SP a collective matmul (the all-gather overlapped), else a plain one.
        w = _fused_columns([self.wq[...], wk, wv], tp, dt, ("embed", "heads", None, "head_dim"))
        y = constrain(projected(column_parallel(x_BxSxD, w, history=_history(self, "qkv"))),
                      ("batch", "seq", "heads", None, "head_dim"))  # fmt: skip
        nq, nk = h // tp, kvh * r // tp
        q, k, v = (
            t.reshape(b, s, -1, dh) for t in jnp.split(y, (nq, nq + nk), axis=3)
        )  # heads on tp: a local split, no collective
        # Pin q, k, v to the projection layout (seq on sp, heads on tp) so that the attention
        # core's constraints are the only reshards (one all-to-all each under Ulysses).
        layout = ("batch", "seq", "heads", "head_dim")
        q = constrain(rope(q, positions_S, self.theta, self.max_len), layout)
        k = constrain(rope(k, positions_S, self.theta, self.max_len), layout)
        return q, k, constrain(v, layout)

    def out(self, o_BxSxHxDh: jax.Array) -> jax.Array:
        """The row-parallel output projection ``[B, S, H, Dh] -> [B, S, D]``."""
        o_BxSxHxDh = constrain(o_BxSxHxDh, ("batch", "seq", "heads", "head_dim"))
        rules = active_rules()
        if rules is not None and rules.attention == "ulysses":
            # Ulysses' all-to-all back to sequence shards is this constraint (GSPMD places it
            # here, not inside attention.ulysses: tagging there measured 48 all-to-alls per step
            # instead of 32), so its tag follows it: kept, not re-run, in the backward.
            # Elsewhere the constraint moves nothing and the core's output is kept already.
            o_BxSxHxDh = resharded(o_BxSxHxDh)
        # Row-parallel: contracting the tp-sharded heads gives partial sums -> one all-reduce
        # over tp (a reduce-scatter onto the sequence shards under Megatron-SP, overlapped
        # with the matmul as a collective matmul).
        wo = weight(self.wo[...].astype(o_BxSxHxDh.dtype))
        return row_parallel(o_BxSxHxDh, wo, 2, _history(self, "out"))

    def implementation(self, dtype, head_dim: int) -> str:
        """The attention implementation this layer runs (:func:`attention.resolve`)."""
        rules = active_rules()
        mode = rules.attention if rules else "local"
        on_nvidia, platform = target()  # the mesh's devices: a GPU target compiles cuDNN's
        return resolve(self.attention, on_nvidia, dtype, head_dim, mode, platform)

    def core(self, q_BxSxHxDh: jax.Array, k_BxSxKxDh: jax.Array, v_BxSxKxDh: jax.Array):
        """Causal attention of the layout's parallel form (local, Ulysses or ring) with the
        implementation ``model.attention`` resolves to."""
        rules = active_rules()
        impl = self.implementation(q_BxSxHxDh.dtype, q_BxSxHxDh.shape[-1])
        if rules is not None and rules.attention == "ring":
            return ring_attention(q_BxSxHxDh, k_BxSxKxDh, v_BxSxKxDh, "sp", self.block)
        return ulysses(attention_core(impl, self.block))(q_BxSxHxDh, k_BxSxKxDh, v_BxSxKxDh)


def _fused_columns(ws: list[jax.Array], tp: int, dt, logical: tuple) -> jax.Array:
    """Column-parallel weights ``[D, N_i, ...]`` (N_i on tp) fused per TP rank into
    ``[D, tp, Σ N_i/tp, ...]``: a local concatenation, no collective."""
    parts = [w.reshape(w.shape[0], tp, w.shape[1] // tp, *w.shape[2:]) for w in ws]
    return weight(constrain(jnp.concatenate(parts, axis=2).astype(dt), logical))


class MLP(nnx.Module):
    """SwiGLU (Shazeer 2020) or GELU feed-forward; up column-parallel, down row-parallel."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, d_ff: int | None = None,
                 fp8_history: bool = False):  # fmt: skip
        d, f, std = cfg.d_model, d_ff or cfg.d_ff, cfg.init_std
        self.kind = cfg.mlp
        if cfg.mlp == "swiglu":
            self.w_gate = nnx.Param(_normal(rngs, (d, f), std), logical_axes=("embed", "mlp"))
        self.w_up = nnx.Param(_normal(rngs, (d, f), std), logical_axes=("embed", "mlp"))
        self.w_down = nnx.Param(
            _normal(rngs, (f, d), std / (2 * cfg.n_layers) ** 0.5), logical_axes=("mlp", "embed")
        )
        if fp8_history:  # layout.fp8='delayed': the up and down GEMMs' amax histories
            _histories(self, ("up", "down"))

    def __call__(self, x_BxSxD: jax.Array, gathered: bool = False) -> jax.Array:
        """``gathered``: ``x`` already has its whole sequence (a MoE block's shared experts,
        which read the router's gathered input): plain column-parallel matmuls on it."""
        dt = x_BxSxD.dtype

        # Column-parallel: the all-gather over tp under Megatron-SP overlapped with the matmul
        # (collective matmul, see Attention), else a plain matmul.
        def up(x, w, matmul=project):
            if not gathered:
                return column_parallel(x, w, matmul, _history(self, "up"))
            if (recipe := fp8.active()) is not None:  # FP8 GEMM on the gathered input
                return fp8.tensordot(gather_sequence(x), w, 1, recipe, "", _history(self, "up"))
            return matmul(gather_sequence(x), w)

        if self.kind == "swiglu":
            # Gate and up fused per TP rank: one matmul, one backward all-reduce over tp.
            rules = active_rules()
            tp = rules.tp if rules else 1
            w = _fused_columns([self.w_gate[...], self.w_up[...]], tp, dt, ("embed", "mlp", None))
            gu = constrain(projected(up(x_BxSxD, w)), ("batch", "seq", "mlp", None))
            gate, up_ = jnp.split(gu, 2, axis=3)
            b, s, _ = x_BxSxD.shape
            h_BxSxF = (jax.nn.silu(gate) * up_).reshape(b, s, -1)
        else:
            h_BxSxF = jax.nn.gelu(up(x_BxSxD, weight(self.w_up[...].astype(dt)), jnp.matmul))
        h_BxSxF = constrain(h_BxSxF, ("batch", "seq", "mlp"))
        # Row-parallel: all-reduce over tp (under SP a reduce-scatter onto sequence shards,
        # overlapped with the matmul as a collective matmul).
        return row_parallel(h_BxSxF, weight(self.w_down[...].astype(dt)), 1, _history(self, "down"))
