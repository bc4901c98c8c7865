"""The jitted train step: shardings per ZeRO stage, accumulation, precision, remat, bad numbers.

State is a plain dict ``{"params", "opt", "step"}``. :class:`Trainer` derives every sharding from
the model's logical axes and the layout, builds the optimizer, and compiles one step with
explicit in/out shardings and donated state.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import sharding as shd
from jaxpar.config import RunConfig, TrainConfig
from jaxpar.errors import ConfigError
from jaxpar.model import Model, fp8, ragged
from jaxpar.model.moe import balance
from jaxpar.pipeline.rest import STAGE_AXIS, RestLayout
from jaxpar.train import programs
from jaxpar.train.grads import GradContext, loss_grads_stats, mean_loss, microbatch_split
from jaxpar.train.guard import inject_nonfinite
from jaxpar.train.reduce import DPReduction
from jaxpar.validation import check_fp8_device
from jaxpar.xla_limit import MemoryLimit, compile_within

State = dict[str, Any]
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def lr_schedule(t: TrainConfig) -> optax.Schedule:
    """Linear warm-up to ``lr`` then cosine decay to ``lr * min_lr_ratio`` at ``steps``."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=t.lr,
        warmup_steps=t.warmup_steps,
        decay_steps=max(t.steps, t.warmup_steps + 1),
        end_value=t.lr * t.min_lr_ratio,
    )


def make_optimizer(t: TrainConfig, logical_axes: Any) -> optax.GradientTransformation:
    """AdamW with global-norm clipping; no weight decay on norm scales."""
    decay_mask = jax.tree.map(
        lambda ax: bool(set(ax) - {"layers", "sublayers", STAGE_AXIS, "embed", "expert_bias"}),
        logical_axes,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask),
    )


def guarded(ok: jax.Array, update: Callable[[Any], Any], state: Any, device: Any) -> Any:
    """``update(state)`` where ``ok``, else ``state`` unchanged, in the form that writes the
    donated state in place on ``device``'s platform.

    XLA:CPU writes a ``lax.cond``'s outputs into the donated buffers, but of a ``where`` over
    the new state it copies every AdamW moment first (the select keeps the old moment live
    beside the update writing its buffer). XLA:GPU does the reverse: the cond's outputs are
    a second whole state in temporaries, copied into the donated buffers afterwards (llama3-8b
    DDP over 8 H100s: 20 GiB more per device than the select, which fuses into the update).
    """
    if device.platform in ("gpu", "cuda"):
        return jax.tree.map(lambda new, old: jnp.where(ok, new, old), update(state), state)
    return jax.lax.cond(ok, update, lambda s: s, state)


def host_memory_kind(devices) -> str | None:
    """``pinned_host`` when the devices can address it, else None."""
    kinds = {m.kind for m in devices[0].addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else None


def check_platform(cfg: RunConfig, devices) -> None:
    """Refuse, before compiling, host offload on a platform without a ``pinned_host`` memory
    kind, a ragged MoE exchange where XLA has no ragged all-to-all, and an FP8 recipe on a GPU
    without FP8 tensor cores."""
    lay = cfg.layout
    platform = devices[0].platform
    if cfg.model.moe.enabled:
        ragged.check(cfg.model.moe, lay.ep, platform)
    cc = getattr(devices[0], "compute_capability", None)  # "9.0" on a CUDA device
    if lay.fp8 != "none" and isinstance(cc, str) and re.fullmatch(r"\d+\.\d+", cc):
        check_fp8_device(lay.fp8, platform, capability=tuple(map(int, cc.split("."))))
    if host_memory_kind(devices) is not None:
        return
    for name, value in (("offload", lay.offload), ("remat", lay.remat)):
        if value not in ("none", "full", "selective"):
            raise ConfigError(
                f"layout.{name}={value!r}: platform {platform!r} has no pinned_host memory kind"
            )


__all__ = ["Trainer", "microbatch_split", "make_optimizer", "lr_schedule"]


class Trainer:
    """Shardings, optimizer and compiled step for a run on ``mesh``."""

    def __init__(self, cfg: RunConfig, mesh, model: Model | None = None):
        self.cfg, self.mesh = cfg, mesh
        lay = cfg.layout
        self.model = model or Model(cfg.model, fp8_history=lay.fp8 == "delayed")
        check_platform(cfg, mesh.devices.flat)
        self.rules = shd.rules_for(cfg.model, lay, cfg.mesh.hardware)
        # Pipelines store the model in their own form at rest (layer stack in placement order,
        # stage-owned embedding and head: jaxpar.pipeline.rest); checkpoints, Hugging Face
        # weights and inference see the canonical form (:meth:`convert`).
        self.rest = RestLayout.of(lay, cfg.model)
        self.logical = self.rest.rest_logical(self.model.logical_axes())
        # A delayed FP8 recipe's amax histories (jaxpar.model.fp8): parameter leaves that the
        # optimizer never moves; their "gradients" are the scales each step needed.
        self.fp8_histories = jax.tree.map(
            lambda ax: "fp8_bucket" in ax, self.logical, is_leaf=lambda x: isinstance(x, tuple)
        )
        self.param_dtype = DTYPES[lay.param_dtype]
        self.abstract_params = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, self.param_dtype),
            self.rest.rest_shapes(self.model.abstract()),
        )
        shapes = jax.tree.map(lambda a: a.shape, self.abstract_params)
        stage = shd.StageSharding.of(lay.zero)
        zaxis, zsize = shd.zero_axis(lay), shd.zero_size(lay)
        spec = lambda shard: shd.param_specs(  # noqa: E731
            self.logical, shapes, self.rules, zsize, shard, zaxis
        )
        self.param_specs = spec(stage.params)
        # The *reduced* gradient is reduce-scattered from stage 1 on (it only feeds the
        # optimizer's shard); stages 1 and 2 differ in the accumulator (train/reduce.py).
        self.grad_specs = spec(stage.optimizer)
        self.moment_specs = spec(stage.optimizer)
        self.compute_dtype = DTYPES[lay.compute_dtype]
        self.grad_ctx = GradContext(
            model=self.model,
            layout=lay,
            rules=self.rules,
            reduction=DPReduction.of(lay, spec(True)),
            abstract=self.abstract_params,
            compute_dtype=self.compute_dtype,
        )
        self.tx = make_optimizer(cfg.train, self.logical)
        opt_abstract = jax.eval_shape(self.tx.init, self.abstract_params)
        self.opt_specs = shd.match_param_tree(opt_abstract, self.moment_specs)
        self.state_specs = {"params": self.param_specs, "opt": self.opt_specs, "step": P()}
        # Host offload: the optimizer state (and params) rest in pinned_host memory and are
        # moved to the device inside the step (host->device and back: PCIe, not collectives).
        host = "pinned_host" if lay.offload != "none" else None
        self.state_shardings = {
            "params": shd.named(mesh, self.param_specs, host if lay.offload == "params" else None),
            "opt": shd.named(mesh, self.opt_specs, host),
            "step": NamedSharding(mesh, P()),
        }
        self.device_shardings = shd.named(mesh, self.state_specs)
        # Tokens [B, S+1]: rows over dp; sequence sharding happens on activations inside.
        self.batch_sharding = NamedSharding(mesh, P(shd.dp_axes(lay), None))
        self._step = jax.jit(
            self._step_fn,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, None),
            donate_argnums=(0,),
        )
        self._compiled = None
        self.memory_limit: MemoryLimit | None = None  # set by compile_step
        self._eval = jax.jit(
            self._eval_fn, in_shardings=(self.device_shardings["params"], self.batch_sharding)
        )
        self._init = jax.jit(self._init_fn, out_shardings=self.state_shardings)

    @property
    def dp_reduction(self) -> str:
        """The data-parallel reduction the step compiles (e.g. ``reduce_scatter_once``)."""
        lay = self.cfg.layout
        with jax.set_mesh(self.mesh):  # the target's platform decides (reduces_in_backward)
            return self.grad_ctx.reduction.compiled_name(lay.microbatches, lay.pp)

    @property
    def param_shardings(self):
        """NamedShardings of the parameters at rest."""
        return self.state_shardings["params"]

    def abstract_state(self) -> State:
        """ShapeDtypeStructs with shardings of the whole state (checkpoint restore target)."""
        # The key is made inside the traced function: made eagerly it would run on the mesh's
        # devices, which a compile-only GPU target (jaxpar.gpu) cannot execute on.
        shapes = jax.eval_shape(lambda: self._init_fn(jax.random.key(0)))
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            shapes,
            self.state_shardings,
        )

    # ---- traced functions -------------------------------------------------------------------

    def _init_fn(self, key: jax.Array) -> State:
        params = jax.tree.map(lambda x: x.astype(self.param_dtype), self.model.init(key))
        params = self.rest.to_rest(params)
        return {"params": params, "opt": self.tx.init(params), "step": jnp.zeros((), jnp.int32)}

    def loss_fn(self, params, batch_BxT) -> jax.Array:
        """Mean loss of one batch with params at rest, no gradient (evaluation): with a
        pipeline its forward-only schedule (:func:`jaxpar.train.grads.mean_loss`)."""
        return mean_loss(self.grad_ctx, params, batch_BxT)

    def grads_fn(self, params, batch_BxT) -> tuple[jax.Array, Any]:
        """Mean loss and gradients over the batch (:func:`jaxpar.train.grads.loss_and_grads`:
        one mechanism for every layout); gradients in the optimizer's sharding."""
        loss, grads, _ = self._grads_stats(params, batch_BxT)
        return loss, grads

    def _grads_stats(self, params, batch_BxT):
        """:meth:`grads_fn` and the MoE statistics of the batch (None for a dense model)."""
        loss, grads, stats = loss_grads_stats(self.grad_ctx, params, batch_BxT)
        grads = jax.lax.with_sharding_constraint(grads, shd.named(self.mesh, self.grad_specs))
        return loss, grads, stats

    def _step_fn(self, state: State, batch_BxT: jax.Array):
        if self.cfg.layout.offload != "none":
            # Host -> device copies of the offloaded trees; the out_shardings move them back.
            state = {
                "params": jax.device_put(state["params"], self.device_shardings["params"]),
                "opt": jax.device_put(state["opt"], self.device_shardings["opt"]),
                "step": state["step"],
            }
        params, opt = state["params"], state["opt"]
        loss, grads, stats = self._grads_stats(params, batch_BxT)
        # Delayed FP8: the histories' summed one-hots leave the gradients here, before the
        # norm, the clipping and the optimizer (a zero gradient: AdamW leaves them as they are).
        hist = self.fp8_histories
        seen = jax.tree.map(lambda h, g: g if h else 0.0, hist, grads)
        grads = jax.tree.map(lambda h, g: jnp.zeros_like(g) if h else g, hist, grads)
        if self.cfg.train.inject_nonfinite_step:  # test hook, see jaxpar.train.guard
            grads = inject_nonfinite(
                grads, state["step"] + 1 == self.cfg.train.inject_nonfinite_step
            )
        # One sum of squares per leaf gives both the global norm and the per-leaf finite flags
        # that let the loop name the non-finite leaves in its diagnostic: a leaf's sum is finite
        # iff its elements are, unless their squares overflow float32, in which case the norm
        # is infinite too and the step is skipped as well.
        sq = jax.tree.map(lambda g: jnp.sum(jnp.square(g)), grads)
        gnorm = jnp.sqrt(sum(jax.tree.leaves(sq)))
        # A non-finite loss or gradient never reaches the state: the update is skipped here and
        # the loop applies the user's policy (skip or stop) from the flag.
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)

        def update(params_opt):
            p, o = params_opt
            updates, new_o = self.tx.update(grads, o, p)
            new_p = optax.apply_updates(p, updates)
            # each history one step older, 0 where this step needed that scale (fp8.advance)
            new_p = jax.tree.map(lambda h, n, a, c: fp8.advance(a, c) if h else n,
                                 hist, new_p, p, seen)  # fmt: skip
            return new_p, new_o

        new_params, new_opt = guarded(ok, update, (params, opt), self.mesh.devices.flat[0])
        new_state = {"params": new_params, "opt": new_opt, "step": state["step"] + 1}
        leaf_ok = jax.tree.map(jnp.isfinite, sq)
        lr = lr_schedule(self.cfg.train)(state["step"])
        metrics = {"loss": loss, "grad_norm": gnorm, "lr": lr, "finite": ok, "leaf_finite": leaf_ok}
        if self.cfg.layout.fp8 == "delayed":
            h = self.cfg.layout.fp8_history
            clipped = jax.tree.map(lambda on, a, c: fp8.overflows(a, c, h) if on else 0,
                                   hist, params, seen)  # fmt: skip
            metrics["fp8_overflow"] = sum(jax.tree.leaves(clipped))
        if stats is not None:  # MoE: the balancing bias moves by this step's expert load
            new_state["params"], moe_metrics = balance(
                self.cfg.model.moe, new_params, stats, ok, self.rest.order
            )
            metrics.update(moe_metrics)
        return new_state, metrics

    def _eval_fn(self, params, batch_BxT) -> jax.Array:
        return self.loss_fn(params, batch_BxT)

    # ---- public, run under the mesh and the rules -------------------------------------------

    def _ctx(self):
        import contextlib

        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(shd.use_rules(self.rules))
        return stack

    def convert(self, tree: Any, to: str) -> Any:
        """A state, params or gradient tree (in this trainer's shardings) in form ``to``:
        ``"canonical"`` (what checkpoints, Hugging Face weights and inference hold) or
        ``"rest"`` (this layout's form at rest, :mod:`jaxpar.pipeline.rest`). The identity
        unless a pipeline permutes the layers or owns the embedding/head."""
        if self.rest.identity:
            return tree
        fn = {"canonical": self.rest.to_canonical, "rest": self.rest.to_rest}[to]
        source = jax.tree.map(lambda x: x.sharding, tree)
        target = self.rest.shardings(source, to)
        device = lambda t: jax.tree.map(lambda s: s.with_memory_kind("device"), t)  # noqa: E731
        with self._ctx():
            moved = jax.device_put(tree, device(source))  # offloaded trees: on the device here
            out = jax.jit(fn, out_shardings=device(target))(moved)
            return jax.device_put(out, target)

    def canonical_abstract_state(self) -> State:
        """:meth:`abstract_state` in canonical form: a checkpoint's restore target (read it,
        then :meth:`convert` it to ``"rest"``)."""
        return self.rest.canonical_abstract(self.abstract_state())

    @property
    def canonical_param_shardings(self):
        """Shardings of the parameters in canonical form (loading weights written elsewhere;
        :meth:`convert` them to ``"rest"``)."""
        return self.rest.shardings(self.param_shardings, "canonical")

    def init_state(self, seed: int) -> State:
        """Fresh state, created directly in its shardings (identical values on any layout); the
        init program is compiled once per process (:mod:`jaxpar.train.programs`)."""
        key = jax.random.key(seed)
        with self._ctx():
            lowered = self._init.lower(key)
            return programs.compiled(programs.key(lowered, self.mesh), lowered.compile)(key)

    def step(self, state: State, batch: jax.Array) -> tuple[State, dict[str, jax.Array]]:
        """One optimizer step; ``state`` is donated."""
        return self.compile_step()(state, batch)

    def eval_loss(self, params, batch: jax.Array) -> jax.Array:
        """Mean loss of ``params`` on a batch (no update)."""
        with self._ctx():
            if self.cfg.layout.offload == "params":
                params = jax.device_put(params, self.device_shardings["params"])
            return self._eval(params, batch)

    def grads(self, params, batch: jax.Array):
        """Loss and gradients with the step's shardings (for equivalence tests)."""
        with self._ctx():
            fn = jax.jit(
                self.grads_fn,
                in_shardings=(self.device_shardings["params"], self.batch_sharding),
            )
            return fn(params, batch)

    def compile_step(self):
        """The compiled step (compiled once, and once per process for the same program:
        :mod:`jaxpar.train.programs`; also used for memory and collective analysis)."""
        if self._compiled is not None:
            return self._compiled
        with self._ctx():
            abstract = self.abstract_state()
            batch = jax.ShapeDtypeStruct(
                (self.cfg.train.global_batch, self.cfg.train.seq_len + 1),
                jnp.int32,
                sharding=self.batch_sharding,
            )
            lowered = self._step.lower(abstract, batch)
            # XLA:GPU's memory limit: the mesh's, or XLA's default where the program compiled
            # under the mesh's does not fit the device (jaxpar.xla_limit)
            from jaxpar.planner.search import usable

            hw = self.cfg.mesh.hardware
            limits = (usable(hw), hw.device_memory_bytes)
            self._compiled, self.memory_limit = programs.compiled(
                programs.key(lowered, self.mesh, *limits), lambda: compile_within(lowered, *limits)
            )
        return self._compiled
