"""The SPMD pipeline executor: one program runs any schedule table (GPipe ... DualPipeV).

Layout of one step (``p`` ranks on mesh axis ``pp``, ``v`` chunks per rank, ``m`` micro-batches):

1. **Embedding** runs before the pipeline as ordinary GSPMD code over all devices (``jax.vjp``
   keeps its pullback); the embedded micro-batches ``[m, b, s, d]`` enter the pipeline
   replicated over ``pp``.
2. **Pipeline**: ``jax.shard_map`` manual over ``pp`` only — dp/tp/sp stay automatic inside,
   so the stage code is the same Megatron/ZeRO code as without a pipeline. One ``lax.scan``
   over the ticks of ``tables.as_arrays`` (compile time does not depend on ``m``); each tick a
   rank ``lax.switch``es on its action (idle, F, B, I, W), then every rank ``ppermute``s its
   output one hop forward and one hop backward around the ring (collective-permute over
   ``pp``), and files what arrived into the activation/cotangent slot the table names.
   Backward is explicit (:mod:`jaxpar.pipeline.stash`): never autodiff through the switch.
   The last stage runs the head and loss inside its ``F`` (its cotangent is filed into the
   stash slot, so a ``B`` can follow in the very next tick, as 1F1B wants). Weight gradients
   go to running sums per local chunk; stage 0's input cotangents are kept per micro-batch.
3. **After**: the embedding pullback takes the input cotangents (tied embeddings add the
   head's table gradient).

Layers: ``params["layers"]`` is stacked ``[L, ...]`` and sharded over ``pp`` on ``L``. Rank
``r``'s chunk ``c`` is global stage ``stages_of(r)[c]`` = layers ``[s·L/S, (s+1)·L/S)``. For one
stage per rank (GPipe, 1F1B, ZB-H1) the arrangement ``[p, v, L/(p·v)]`` is a free reshape of the
pp-sharded array; interleaved and V placements permute layers across ranks once per step (a
collective-permute of the weights and, inversely, of their gradients).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.pipeline.schedules import Schedule, make_schedule
from jaxpar.pipeline.stash import Stash, read_slot, write_if, write_slot

_ROW_KEYS = ("kind", "stage", "chunk", "mb", "in_slot", "stash_slot", "recv_act", "recv_grad")
IDLE, FWD, BWD, INP, WGT = range(5)


@dataclass(frozen=True)
class Plan:
    """A schedule and what the executor derives from it."""

    schedule: Schedule
    n_layers: int

    @staticmethod
    def make(kind: str, p: int, m: int, v: int, n_layers: int) -> Plan:
        """Build the schedule (``ConfigError`` one-liners for bad arguments)."""
        return Plan(make_schedule(kind, p, m, v), n_layers)

    @cached_property
    def arrays(self) -> dict[str, np.ndarray]:
        """Tick tables (``tables.as_arrays``)."""
        return self.schedule.as_arrays()

    @property
    def per_chunk(self) -> int:
        """Layers per virtual stage."""
        return self.n_layers // self.schedule.num_stages

    @cached_property
    def order(self) -> np.ndarray:
        """Layer index at each position of the ``[p, v, L/(p·v)]`` arrangement (flattened)."""
        s, lc = self.schedule, self.per_chunk
        stages = [st for r in range(s.p) for st in s.stages_of(r)]
        return np.array([st * lc + i for st in stages for i in range(lc)], np.int32)

    @property
    def identity(self) -> bool:
        """Whether the arrangement is a plain reshape (one stage per rank)."""
        return bool(np.all(self.order == np.arange(self.n_layers)))

    def rank_tables(self) -> dict[str, np.ndarray]:
        """Per-rank rows ``[p, T, ...]`` of the tick table (scanned over ``T`` on each rank)."""
        return {k: np.swapaxes(self.arrays[k], 0, 1).copy() for k in _ROW_KEYS}


def arrange(layers: Any, plan: Plan, specs: Any) -> Any:
    """``[L, ...] -> [p, v, L/(p·v), ...]`` in placement order, constrained to ``specs``."""
    s = plan.schedule

    def one(a, spec):
        if not plan.identity:
            a = jnp.take(
                a, plan.order, axis=0
            )  # collective-permute over pp (non-standard placement)
        a = a.reshape(s.p, s.v, plan.per_chunk, *a.shape[1:])
        return jax.lax.with_sharding_constraint(a, spec)

    return jax.tree.map(one, layers, specs)


def unarrange(grads: Any, plan: Plan) -> Any:
    """Inverse of :func:`arrange` for the layer gradients."""
    inverse = np.argsort(plan.order)

    def one(g):
        g = g.reshape(plan.n_layers, *g.shape[3:])
        return g if plan.identity else jnp.take(g, inverse, axis=0)

    return jax.tree.map(one, grads)


def stage_specs(layer_specs: Any) -> Any:
    """Spec of the arranged layers: ``pp`` on the rank dim, the rest as at rest minus ``dp``.

    Dropping ``dp`` is what ZeRO-3 needs: the constraint all-gathers a stage's weights over dp
    once per step (not once per tick inside the scan).
    """

    def one(spec: P) -> P:
        dp = ("dp", "dpr", "dps")
        rest = [None if a in dp else a for a in list(spec)[1:]]
        rest = [
            tuple(x for x in a if x not in dp) or None if isinstance(a, tuple) else a for a in rest
        ]
        return P("pp", None, None, *rest)

    return jax.tree.map(one, layer_specs, is_leaf=lambda x: isinstance(x, P))


def run_local(
    plan: Plan,
    stage_fn,
    head_loss,
    local: Any,
    rest: Any,
    x_all: jax.Array,
    tg_all: jax.Array,
    recompute: bool = False,
    reduce_each=None,
) -> tuple[jax.Array, Any, Any, jax.Array]:
    """Run the schedule on this rank; return (loss, chunk grads, ``rest`` grads, input cotangents).

    Runs inside a ``shard_map`` manual over ``pp`` (and the dp axes: gradients stay unreduced
    over dp, :mod:`jaxpar.train.grads`). ``stage_fn(chunk_params, x) -> y`` is one virtual
    stage; ``head_loss(rest, y, targets)`` the last stage's loss. ``local`` is this rank's
    ``[v, Lc, ...]`` layer tree, ``rest`` the other parameters, ``x_all`` the embedded
    micro-batches ``[m, b, s, d]`` and ``tg_all`` their targets. ``reduce_each`` (ZeRO-2)
    reduces one micro-batch's chunk gradient before it joins the (then sharded) accumulator.
    The loss and ``rest`` grads come back summed over ``pp``; the input cotangents are those of
    this rank (only stage 0's rank holds non-zero ones).
    """
    sched = plan.schedule
    p, m, num_stages = sched.p, sched.m, sched.num_stages
    n_act, n_grad = int(plan.arrays["n_act_slots"]), int(plan.arrays["n_grad_slots"])
    n_stash = int(plan.arrays["n_stash_slots"])
    me = jax.lax.axis_index("pp")
    rows = {k: jnp.asarray(a)[me] for k, a in plan.rank_tables().items()}
    reduce_each = reduce_each or (lambda g: g)

    def chunk_params(c):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, c, keepdims=False), local)

    msg0 = jnp.zeros_like(x_all[0])
    stash = Stash.probe(stage_fn, chunk_params(0), msg0, recompute)
    carry0 = {
        "act": jnp.zeros((max(n_act, 1), *msg0.shape), msg0.dtype),
        "grad": jnp.zeros((max(n_grad, 1), *msg0.shape), msg0.dtype),
        "stash": stash.empty(n_stash),
        # Cotangent of the stage output for a pending W (filed by I) or the last stage's
        # loss cotangent (filed by its F).
        "cot": jnp.zeros((n_stash, *msg0.shape), msg0.dtype),
        # Per local chunk; a ZeRO-2 shard when ``reduce_each`` scatters.
        "acc": jax.tree.map(
            lambda a: jnp.zeros((sched.v, *a.shape), a.dtype),
            jax.eval_shape(reduce_each, chunk_params(0)),
        ),
        "acc_rest": jax.tree.map(jnp.zeros_like, rest),
        "loss": jnp.zeros((), jnp.float32),
        "dx": jnp.zeros_like(x_all),
    }

    def idle(c, row):
        return c, msg0

    def fwd(c, row):
        s, j, slot = row["stage"], row["mb"], row["stash_slot"]
        x_in = jnp.where(
            s == 0,
            jax.lax.dynamic_index_in_dim(x_all, j, keepdims=False),
            jax.lax.dynamic_index_in_dim(c["act"], jnp.maximum(row["in_slot"], 0), keepdims=False),
        )
        y, res = stash.forward(chunk_params(row["chunk"]), x_in)
        c = dict(c, stash=write_slot(c["stash"], slot, res))

        def head(y):
            tg = jax.lax.dynamic_index_in_dim(tg_all, j, keepdims=False)
            f = lambda r, h: head_loss(r, h, tg) / m  # noqa: E731  mean over micro-batches
            loss, (d_rest, dy) = jax.value_and_grad(f, argnums=(0, 1))(rest, y)
            return loss, d_rest, dy

        def no_head(y):
            return jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, rest), y * 0

        loss, d_rest, dy = jax.lax.cond(s == num_stages - 1, head, no_head, y)
        return dict(
            c,
            cot=write_slot([c["cot"]], slot, [dy])[0],
            acc_rest=jax.tree.map(jnp.add, c["acc_rest"], d_rest),
            loss=c["loss"] + loss,
        ), y

    def cotangent(c, row):
        last = row["stage"] == num_stages - 1
        from_loss = read_slot([c["cot"]], row["stash_slot"])[0]
        recv = read_slot([c["grad"]], jnp.maximum(row["in_slot"], 0))[0]
        return jnp.where(last, from_loss, recv)

    def pullback(c, row):
        params = chunk_params(row["chunk"])
        return stash.pullback(params, read_slot(c["stash"], row["stash_slot"]))

    def add_grads(c, row, d_params):
        d_params = reduce_each(d_params)
        acc = jax.tree.map(
            lambda a, d: a.at[row["chunk"]].add(d.astype(a.dtype)), c["acc"], d_params
        )
        return dict(c, acc=acc)

    def input_cot(c, row, dx):
        # Stage 0's input cotangent goes to the embedding's pullback after the pipeline.
        slot = jnp.where(row["stage"] == 0, row["mb"], -1)
        return dict(c, dx=write_if(c["dx"], slot, dx))

    def bwd(c, row):
        d_params, dx = pullback(c, row)(cotangent(c, row))
        return input_cot(add_grads(c, row, d_params), row, dx), dx

    def inp(c, row):
        g = cotangent(c, row)
        _, dx = pullback(c, row)(g)
        c = dict(c, cot=write_slot([c["cot"]], row["stash_slot"], [g])[0])
        return input_cot(c, row, dx), dx

    def wgt(c, row):
        g = read_slot([c["cot"]], row["stash_slot"])[0]
        d_params, _ = pullback(c, row)(g)
        return add_grads(c, row, d_params), msg0

    # Kinds the table never uses get the idle branch: less to compile (no I/W for 1F1B).
    used = set(np.unique(plan.arrays["kind"]).tolist())
    branches = [f if k in used else idle for k, f in enumerate((idle, fwd, bwd, inp, wgt))]

    def tick(c, row):
        c, out = jax.lax.switch(row["kind"], branches, c, row)
        # Both ring directions every tick (collective-permute over pp); the receiver's
        # table says which arrival is real and where it goes.
        from_prev = jax.lax.ppermute(out, "pp", [(i, (i + 1) % p) for i in range(p)])
        from_next = (
            jax.lax.ppermute(out, "pp", [(i, (i - 1) % p) for i in range(p)])
            if p > 2
            else from_prev
        )
        act, grad = c["act"], c["grad"]
        for ch, arrived in enumerate((from_prev, from_next, out)):
            act = write_if(act, row["recv_act"][ch], arrived)
            grad = write_if(grad, row["recv_grad"][ch], arrived)
        return dict(c, act=act, grad=grad), None

    c, _ = jax.lax.scan(tick, carry0, rows)
    loss = jax.lax.psum(c["loss"], "pp")
    d_rest = jax.lax.psum(c["acc_rest"], "pp")
    return loss, c["acc"], d_rest, c["dx"]
