"""What JAX's ``unreduced`` partition specs compile to, against jaxpar's explicit dp reduction.

jaxpar reduces per-micro-batch gradients over dp inside a ``shard_map`` (jaxpar/train/reduce.py).
JAX also offers typed unreduced values: parameters placed with ``P(..., reduced={'dp'})`` get
gradients typed ``{U:dp}`` (unreduced over dp), which accumulate over micro-batches without
communication; a final ``reshard`` to a dp-sharded spec should then be one reduce-scatter per
gradient (ZeRO-1/2's collective). This script compiles a two-matmul toy (dp 4 × tp 2, 4
micro-batches accumulated in a scan) both ways and prints, as one JSON object:

* ``explicit_axes``: with every mesh axis Explicit — the gradient and accumulator types, and the
  collectives of the compiled step (kind, count, bytes);
* ``mixed_axes``: dp Explicit, tp Auto (jaxpar's layout: tp stays with the compiler) — whether
  it compiles, and the error if not;
* ``shard_map``: the same step in jaxpar's explicit form (per-device blocks, the accumulated
  gradient psum_scattered over dp) — its collectives.

Run: ``python scripts/bench_unreduced.py`` (8 simulated CPU devices, seconds).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxpar.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxpar.analysis.hlo import collective_bytes  # noqa: E402

D, F, B, K = 64, 128, 16, 4


def _loss(w1, w2, x):
    h = jnp.tanh(x @ w1)  # column-parallel over tp
    y = jnp.einsum("bf,fd->bd", h, w2, out_sharding=P("dp", None))  # row-parallel: psum over tp
    return jnp.mean(y**2)


def _loss_local(w1, w2, x):
    """The same loss on one device's blocks (manual over dp and tp)."""
    h = jnp.tanh(x @ w1)
    y = jax.lax.psum(h @ w2, "tp")
    return jnp.mean(y**2)


def _report(compiled, mesh) -> dict:
    """Collectives of the compiled step: per kind and mesh axes, executions and bytes."""
    rep = collective_bytes(compiled, mesh).to_dict()
    return {
        f"{e['kind']} over {','.join(e['axes']) or '-'}": {"count": e["count"], "bytes": e["bytes"]}
        for e in rep["entries"]
    }


def unreduced(types: tuple[AxisType, AxisType]) -> dict:
    mesh = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=types)
    out: dict = {}
    with jax.set_mesh(mesh):
        w1 = jax.device_put(jnp.ones((D, F)), NamedSharding(mesh, P(None, "tp", reduced={"dp"})))
        w2 = jax.device_put(jnp.ones((F, D)), NamedSharding(mesh, P("tp", None, reduced={"dp"})))
        xs = jax.device_put(jnp.ones((K, B, D)), NamedSharding(mesh, P(None, "dp", None)))

        def step(w1, w2, xs):
            grad = jax.grad(_loss, argnums=(0, 1))
            g0 = grad(w1, w2, xs[0])
            out["grad_types"] = [str(jax.typeof(g)) for g in g0]

            def body(acc, x):
                return jax.tree.map(jnp.add, acc, grad(w1, w2, x)), None

            acc, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, g0), xs)
            out["accumulator_types"] = [str(jax.typeof(a)) for a in acc]
            # ZeRO-1/2: each dp rank keeps its shard of the reduced gradient
            return (
                jax.sharding.reshard(acc[0], P("dp", "tp")),
                jax.sharding.reshard(acc[1], P("tp", "dp")),
            )

        try:
            out["collectives"] = _report(jax.jit(step).lower(w1, w2, xs).compile(), mesh)
            out["compiles"] = True
        except Exception as e:  # noqa: BLE001 - the point is to record what fails
            out["compiles"] = False
            out["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
    return out


def explicit_shard_map() -> dict:
    mesh = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Explicit, AxisType.Auto))
    with jax.set_mesh(mesh):
        w1 = jax.device_put(jnp.ones((D, F)), NamedSharding(mesh, P(None, "tp")))
        w2 = jax.device_put(jnp.ones((F, D)), NamedSharding(mesh, P("tp", None)))
        xs = jax.device_put(jnp.ones((K, B, D)), NamedSharding(mesh, P(None, "dp", None)))

        def local(w1, w2, xs):
            grad = jax.grad(_loss_local, argnums=(0, 1))

            def body(acc, x):
                return jax.tree.map(jnp.add, acc, grad(w1, w2, x)), None

            zeros = (jnp.zeros_like(w1), jnp.zeros_like(w2))
            acc, _ = jax.lax.scan(body, zeros, xs)  # unreduced over dp: no communication
            return (
                jax.lax.psum_scatter(acc[0], "dp", scatter_dimension=0, tiled=True),
                jax.lax.psum_scatter(acc[1], "dp", scatter_dimension=1, tiled=True),
            )

        fn = jax.shard_map(
            local,
            in_specs=(P(None, "tp"), P("tp", None), P(None, "dp")),
            out_specs=(P("dp", "tp"), P("tp", "dp")),
            axis_names={"dp", "tp"},
            check_vma=False,
        )
        return {"collectives": _report(jax.jit(fn).lower(w1, w2, xs).compile(), mesh)}


def main() -> None:
    result = {
        "jax": jax.__version__,
        "shape": {"d": D, "f": F, "batch": B, "microbatches": K, "mesh": "dp 4 x tp 2"},
        "explicit_axes": unreduced((AxisType.Explicit, AxisType.Explicit)),
        "mixed_axes": unreduced((AxisType.Explicit, AxisType.Auto)),
        "shard_map": explicit_shard_map(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
