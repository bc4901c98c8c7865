"""A zero-bubble schedule's split backward finds every weight matmul of a layer.

``I`` computes the input gradient and the gradients of parameters no weight matmul reads (the
norm scales); ``W`` computes each weight matmul's ``aᵀ·dy``. The model's column-parallel
projections (fused QKV, fused gate/up) run through ``project``, a custom VJP around one dot:
once missed, their weight gradients were computed in ``I`` and ``W`` added zeros to their
accumulators (compiled for h100-8, llama3-8b ZB-V: 87 ms a step of such adds per rank). The
equivalence of the gradients is tests/test_pipeline.py's.
"""

from unittest import mock

import jax
import jax.numpy as jnp
from conftest import small_config
from test_pipeline import tiny, trainer_of

from jaxpar.pipeline import split as S


def test_i_computes_only_the_leaves_no_weight_matmul_reads():
    tr = trainer_of(tiny(small_config, pp=2, schedule="zb-h1", microbatches=4))
    made = []
    init = S.SplitLayer.__init__

    def kept(self, *args):
        init(self, *args)
        made.append(self)

    batch = jax.ShapeDtypeStruct((16, 17), jnp.int32, sharding=tr.batch_sharding)
    with tr._ctx(), mock.patch.object(S.SplitLayer, "__init__", kept):
        jax.eval_shape(tr.grads_fn, tr.abstract_params, batch)
    assert made
    layer = tr.abstract_params["layers"]
    names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(layer)]
    for sl in made:
        in_i = {n for n, i in zip(names, sl.input_grad_mask, strict=True) if i}
        assert in_i and all("norm" in n for n in in_i), in_i
        # QKV, the output projection, gate/up and down: four weight matmuls
        assert len(sl.dots) == 4


def test_a_custom_vjp_counts_as_a_dot_only_around_one():
    from jaxpar.model.layers import project

    x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5))
    (one,) = jax.make_jaxpr(project)(x, w).jaxpr.eqns
    assert S._is_dot(one)

    @jax.custom_vjp
    def scaled(a, b):
        return 2 * jnp.tensordot(a, b, 1)

    scaled.defvjp(lambda a, b: (scaled(a, b), (a, b)), lambda r, g: (None, None))
    (two,) = jax.make_jaxpr(scaled)(x, w).jaxpr.eqns
    assert two.primitive.name == "custom_vjp_call" and not S._is_dot(two)
