"""The collective matmul's backward rings (jaxpar.model.collective_matmul) on 4 CPU devices:
their gradients equal the gathered path's, and each weight's gradient is one matmul over the
whole sequence after the ring, not one per ring step summed in fp32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.model import collective_matmul as cm

T = 4  # tp ranks
B, S, D, N = 2, 16, 8, 12  # batch, sequence (whole), model width, output width (whole)


def _mesh():
    return jax.make_mesh(
        (T,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:T]
    )


def _dots(jaxpr) -> list:
    """The dot_general equations of ``jaxpr`` and of every jaxpr nested in it."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(eqn)
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    out += _dots(getattr(sub, "jaxpr", sub))
    return out


def _data():
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (B, S, D), jnp.float32)
    w = jax.random.normal(k[1], (D, N), jnp.float32)
    dy = jax.random.normal(k[2], (B, S, N), jnp.float32)
    return x, w, dy


def _column_bwd(x, w, dy):
    """The column-parallel VJP in a shard_map over tp: x sequence-sharded, w and dy
    column-sharded."""
    return jax.shard_map(
        lambda x, w, dy: cm._ag_matmul_bwd(T, (x, w), dy),
        mesh=_mesh(),
        in_specs=(P(None, "tp"), P(None, "tp"), P(None, None, "tp")),
        out_specs=(P(None, "tp"), P(None, "tp")),
        check_vma=False,
    )(x, w, dy)


def _row_bwd(h, w, dy):
    """The row-parallel VJP: h's last dim and w's first on tp, dy sequence-sharded."""
    return jax.shard_map(
        lambda h, w, dy: cm._matmul_rs_bwd(1, T, (h, w), dy),
        mesh=_mesh(),
        in_specs=(P(None, None, "tp"), P("tp"), P(None, "tp")),
        out_specs=(P(None, None, "tp"), P("tp")),
        check_vma=False,
    )(h, w, dy)


def test_column_parallel_backward_equals_the_gathered_path():
    x, w, dy = _data()
    dx, dw = jax.jit(_column_bwd)(x, w, dy)
    _, ref = jax.vjp(lambda x, w: jnp.tensordot(x, w, 1), x, w)
    rdx, rdw = ref(dy)
    np.testing.assert_allclose(dx, rdx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, rdw, rtol=1e-5, atol=1e-5)


def test_row_parallel_backward_equals_the_gathered_path():
    x, w, dy = _data()
    h = dy  # [B, S, N]: the row-parallel input, contracted against w.T [N, D]
    wt, dout = w.T, x  # output [B, S, D]
    dh, dw = jax.jit(_row_bwd)(h, wt, dout)
    _, ref = jax.vjp(lambda h, w: jnp.tensordot(h, w, 1), h, wt)
    rdh, rdw = ref(dout)
    np.testing.assert_allclose(dh, rdh, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, rdw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["column", "row"])
def test_weight_gradient_is_one_matmul_after_the_ring(which):
    """t chunk matmuls for the input's gradient (one per ring step) and one for the weight's,
    contracting the whole local sequence: summed chunk by chunk, the weight gradient would
    take t matmuls and t - 1 fp32 adds of its whole shard."""
    x, w, dy = _data()
    if which == "column":
        jaxpr = jax.make_jaxpr(_column_bwd)(x, w, dy)
    else:
        jaxpr = jax.make_jaxpr(_row_bwd)(dy, w.T, x)
    dots = _dots(jaxpr.jaxpr)
    assert len(dots) == T + 1, [d.outvars[0].aval.shape for d in dots]
    # the weight's: contracts batch and the whole sequence, fp32 out
    weight = [d for d in dots if d.params["dimension_numbers"][0][0] == (0, 1)]
    assert len(weight) == 1
    assert weight[0].invars[0].aval.shape[1] == S  # the gathered sequence, not a chunk
    assert weight[0].outvars[0].aval.dtype == jnp.float32
