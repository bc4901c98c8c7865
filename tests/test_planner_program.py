"""The planner's kernels for jaxpar's own program on a GPU are the time model's (issue 46 item 5);
the published frameworks keep the ceiling fitted on their runs."""

from __future__ import annotations

import dataclasses

import pytest

from jaxpar import config as C
from jaxpar.gpu import costs
from jaxpar.planner import cost as CO
from jaxpar.planner.activations import block_residuals
from jaxpar.planner.frameworks import PROGRAM_BYTES, for_model, for_target
from jaxpar.planner.hardware import matmul_efficiency
from jaxpar.planner.published_runs import RUNS, TORCHTITAN
from jaxpar.planner.shapes import param_counts
from jaxpar.planner.workload import Shape


def _setup(**layout):
    cfg = C.load("llama3-8b", "h100-8")
    lay = dataclasses.replace(cfg.layout, **{"dp": 8, "tp": 1, "pp": 1, "zero": 1, **layout})
    hw = cfg.mesh.hardware
    return cfg.model, hw, lay, Shape(8 * lay.microbatches, 4096)


def test_jaxpar_on_a_gpu_runs_at_the_time_models_ceiling_published_runs_at_the_fitted_one():
    model, hw, lay, shape = _setup()
    ex = for_target(hw, for_model(model))
    assert ex.kernels == "published" and ex.program_bytes
    # a large matmul: Bekman's measured H100 maximum (794.5 of 989 TFLOP/s), not the fitted 0.62
    assert CO.matmul_share(hw, 8192, ex) == pytest.approx(794.5 / 989)
    assert CO.matmul_share(hw, 8192, ex) == costs.matmul_share(hw, 8192)
    fitted = CO.matmul_share(hw, 8192, TORCHTITAN)
    assert fitted == matmul_efficiency(hw, 8192) and fitted < 0.65
    lt = CO.layer_time(model, hw, lay, shape, ex)
    assert lt.efficiency == pytest.approx(794.5 / 989, rel=0.02)
    # a flash backward is 2.5 forwards (jaxpar.gpu.costs), on top of twice the layer's forward
    assert lt.backward_extra == pytest.approx(0.5 * lt.attention)
    # a published framework's executor is left as it is: its fitted ceiling describes its runs
    assert for_target(hw, TORCHTITAN) is TORCHTITAN
    assert all(not r.executor.follows_model for r in RUNS)
    # on a CPU mesh nothing changes (no GPU program to price)
    cpu = C.load("tiny", "cpu-8").mesh.hardware
    assert for_target(cpu, for_model(model)).kernels == "fitted"


def test_memory_bound_terms_by_hand():
    model, hw, lay, shape = _setup()
    ex = for_target(hw, for_model(model))
    # the layer's memory-bound forward: 7.05 / 3 passes over its saved activations, HBM peak
    lt = CO.layer_time(model, hw, lay, shape, ex)
    res = block_residuals(model, lay, 4096, "blockwise", "none")
    act = res.bytes(4096, 2) - res.weights * 2
    assert lt.compute - lt.matmul == pytest.approx(7.05 / 3 * act / hw.hbm_bw)
    # the weights: ZeRO-1 over dp 8, one micro-batch: 5.23 + 44.35 bytes per local parameter
    # of the blocks and the head, less the optimizer's 30 bytes on an eighth of them
    pc = param_counts(model, lay)
    n = 32 * 218_112_000 + 525_336_576 + 4096  # the layers, the head and its norm
    assert pc.blocks + pc.local_of("head") == n
    want = n * (5.23 + 44.35 - 30 / 8) / hw.hbm_bw
    assert CO.weight_work(model, lay, hw.hbm_bw, ex) == pytest.approx(want)
    assert 0.10 < want < 0.13  # seconds on an H100
    # four micro-batches: the loop's bytes once, the micro-batch's four times
    lay4 = dataclasses.replace(lay, microbatches=4)
    want4 = n * (5.23 + 4 * 44.35 + 20.54 - 30 / 8) / hw.hbm_bw
    assert CO.weight_work(model, lay4, hw.hbm_bw, ex) == pytest.approx(want4)
    # ZeRO-3: 0.30 + 12.41 per parameter (the gathered bf16 weights, the gradient shards)
    lay3 = dataclasses.replace(lay, zero=3)
    want3 = n * (0.30 + 12.41 - 30 / 8) / hw.hbm_bw
    assert CO.weight_work(model, lay3, hw.hbm_bw, ex) == pytest.approx(want3)
    # a dp group of one device shards nothing: ZeRO-1 is priced as ZeRO-0
    lay1 = dataclasses.replace(lay, dp=1, tp=8, sequence_parallel=True)
    n1 = param_counts(model, lay1).blocks + param_counts(model, lay1).local_of("head")
    want1 = n1 * (33.27 + 44.35 - 30) / hw.hbm_bw
    assert CO.weight_work(model, lay1, hw.hbm_bw, ex) == pytest.approx(want1)
    # pipelines price their ticks' weight work instead; other executors none of it
    assert CO.weight_work(model, dataclasses.replace(lay, pp=2), hw.hbm_bw, ex) == 0.0
    assert CO.weight_work(model, lay, hw.hbm_bw, TORCHTITAN) == 0.0
    # the step carries it as its own term
    terms = CO.step_cost(model, hw, lay, shape, ex).terms
    assert terms["weights"] == pytest.approx(want)
    assert PROGRAM_BYTES.weight_bytes(2) == PROGRAM_BYTES.weight_bytes(1)


def test_pipeline_sp_transposes_only_with_more_than_one_sequence():
    """Inside a pipeline's ticks Megatron-SP's GSPMD gathers land [b, s, d] sequence-major; with
    b > 1 XLA transposes them (PROGRAM_BYTES.sp_transpose_passes of the gathered hidden
    state), at b = 1 the layouts coincide and only pipe_sp_act_passes remain."""
    model, hw, lay, _ = _setup(dp=1, tp=4, pp=2, microbatches=4, sequence_parallel=True)
    ex = for_target(hw, for_model(model))
    res = block_residuals(model, lay, 4096, "blockwise", "none")
    act, d = res.bytes(4096, 2) - res.weights * 2, model.d_model
    one = CO.layer_time(model, hw, lay, Shape(4, 4096), ex)
    assert one.compute - one.matmul == pytest.approx(
        PROGRAM_BYTES.pipe_sp_act_passes / 3 * act / hw.hbm_bw
    )
    two = CO.layer_time(model, hw, lay, Shape(8, 4096), ex)  # two sequences a micro-batch
    hidden = 2 * 4096 * d * 2  # the gathered [2, 4096, d] in bf16
    assert two.compute - two.matmul == pytest.approx(
        (PROGRAM_BYTES.pipe_sp_act_passes / 3 * 2 * act
         + PROGRAM_BYTES.sp_transpose_passes / 3 * hidden) / hw.hbm_bw)  # fmt: skip
    # the rings (no pipeline) and FP8's GSPMD operands keep their own passes, no transposes
    ring = CO.layer_time(model, hw, dataclasses.replace(lay, pp=1), Shape(8, 4096), ex)
    assert ring.compute - ring.matmul == pytest.approx(
        PROGRAM_BYTES.sp_act_passes / 3 * 2 * act / hw.hbm_bw
    )


@pytest.mark.parametrize("remat", ["selective", "full"])
def test_recompute_moves_fewer_activation_passes(remat):
    """Without recompute the forward writes each residual into the layer stack and the
    backward reads it back; under selective or full recompute a layer moves
    PROGRAM_BYTES.unsaved_passes fewer passes, the recompute's own memory-bound work
    included (full recompute re-runs the kernels only)."""
    model, hw, lay, shape = _setup()
    ex = for_target(hw, for_model(model))
    res = block_residuals(model, lay, 4096, "blockwise", "none")
    act = res.bytes(4096, 2) - res.weights * 2
    lt = CO.layer_time(model, hw, dataclasses.replace(lay, remat=remat), shape, ex)
    unsaved = PROGRAM_BYTES.unsaved_passes(remat)
    assert 0 < unsaved < PROGRAM_BYTES.act_passes
    assert lt.compute - lt.matmul == pytest.approx(
        (PROGRAM_BYTES.act_passes - unsaved) / 3 * act / hw.hbm_bw
    )
    if remat == "full":
        # the kernels again, less the two dead projections; no memory-bound work
        assert lt.attention < lt.recompute < lt.matmul
    # the FP8 rings (ZeRO-3 across nodes of 4): their own passes, the same fewer
    rl = dataclasses.replace(lay, dp=2, tp=4, zero=3, sequence_parallel=True, fp8="delayed",
                             remat=remat)  # fmt: skip
    nodes = dataclasses.replace(hw, devices_per_node=4)
    from jaxpar import sharding
    from jaxpar.planner import fp8 as F8

    assert sharding.fp8_rings(rl, nodes)
    ring = CO.layer_time(model, nodes, rl, Shape(2, 4096), ex)
    res4 = block_residuals(model, rl, 4096, "blockwise", "none")
    act4 = res4.bytes(4096, 2) - res4.weights * 2
    quant = F8.quant_bytes(model, rl, 4096)
    assert ring.compute - ring.matmul == pytest.approx(
        ((PROGRAM_BYTES.fp8_ring_act_passes - unsaved) / 3 * act4 + quant) / hw.hbm_bw
    )
    # a MoE layer keeps the passes measured without recompute
    moe = C.load_model("mixtral-8x7b")
    lm = dataclasses.replace(lay, remat=remat)
    a = CO.layer_time(moe, hw, lm, shape, ex)
    b = CO.layer_time(moe, hw, dataclasses.replace(lm, remat="none"), shape, ex)
    assert a.compute == pytest.approx(b.compute)
