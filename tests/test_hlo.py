"""Collective accounting from compiled HLO, on 8 simulated CPU devices (set by conftest).

Expected bytes are computed from the shapes each program gives a device, never copied from
output. Kinds are asserted where the CPU lowering is known (jax 0.10.2): shard_map's psum,
all_gather, psum_scatter, all_to_all and ppermute each survive as the matching HLO collective
(psum_scatter stays a reduce-scatter inside shard_map; GSPMD's own reductions may instead be an
all-reduce + dynamic-slice, see test_gspmd_reduction_uses_mesh_axes_groups).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.analysis.hlo import collective_bytes, compiled_memory
from jaxpar.analysis.hlo_text import replica_groups

F32 = 4
X_SHAPE = (8, 16)


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices: see tests/conftest.py")
    return jax.make_mesh((2, 2, 2), ("dp", "sp", "tp"), axis_types=(AxisType.Auto,) * 3)


def _report(mesh, body, in_spec, out_spec, x=None):
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False)
    x = jnp.ones(X_SHAPE, jnp.float32) if x is None else x
    return collective_bytes(jax.jit(fn).lower(x).compile(), mesh)


def _only(report):
    assert len(report.stats) == 1, report.to_dict()
    (((kind, axes), stat),) = report.stats.items()
    return kind, axes, stat


def test_psum_over_tp_is_one_all_reduce_on_tp(mesh):
    r = _report(mesh, lambda a: lax.psum(a, "tp"), P("dp"), P("dp"))
    kind, axes, s = _only(r)
    size = (X_SHAPE[0] // 2) * X_SHAPE[1] * F32  # local block of a dp-sharded array
    assert (kind, axes, s.count) == ("all-reduce", ("tp",), 1)
    assert s.bytes == size
    assert s.wire_bytes == pytest.approx(2 * (2 - 1) / 2 * size)


def test_psum_over_two_axes_groups_both(mesh):
    r = _report(mesh, lambda a: lax.psum(a, ("sp", "tp")), P("dp"), P("dp"))
    kind, axes, s = _only(r)
    size = (X_SHAPE[0] // 2) * X_SHAPE[1] * F32
    assert (kind, axes) == ("all-reduce", ("sp", "tp"))
    assert r.collectives[0].group_size == 4
    assert s.wire_bytes == pytest.approx(2 * 3 / 4 * size)


def test_all_gather_counts_output_size(mesh):
    r = _report(mesh, lambda a: lax.all_gather(a, "dp", tiled=True), P("dp"), P())
    kind, axes, s = _only(r)
    full = X_SHAPE[0] * X_SHAPE[1] * F32
    assert (kind, axes) == ("all-gather", ("dp",))
    assert s.bytes == full
    assert s.wire_bytes == pytest.approx(full / 2)


def test_psum_scatter_is_reduce_scatter_on_cpu(mesh):
    r = _report(mesh, lambda a: lax.psum_scatter(a, "tp", tiled=True), P(), P("tp"))
    kind, axes, s = _only(r)
    full = X_SHAPE[0] * X_SHAPE[1] * F32  # replicated input: each device reduces all of it
    assert (kind, axes) == ("reduce-scatter", ("tp",))
    assert s.bytes == full
    assert s.wire_bytes == pytest.approx(full / 2)


def test_all_to_all_counts_operand(mesh):
    # CPU lowers it as a tuple all-to-all of the split pieces; their sum is the local block.
    r = _report(
        mesh, lambda a: lax.all_to_all(a, "sp", 0, 1, tiled=True), P(None, "sp"), P("sp", None)
    )
    kind, axes, s = _only(r)
    local = X_SHAPE[0] * (X_SHAPE[1] // 2) * F32
    assert (kind, axes) == ("all-to-all", ("sp",))
    assert s.bytes == local
    assert s.wire_bytes == pytest.approx(local / 2)


def test_ppermute_is_collective_permute(mesh):
    r = _report(mesh, lambda a: lax.ppermute(a, "dp", [(0, 1), (1, 0)]), P("dp"), P("dp"))
    kind, axes, s = _only(r)
    local = (X_SHAPE[0] // 2) * X_SHAPE[1] * F32
    assert (kind, axes) == ("collective-permute", ("dp",))
    assert s.bytes == s.wire_bytes == local  # every device sends its block


def test_scan_multiplies_by_trip_count(mesh):
    def body(a):
        return lax.scan(lambda c, _: (lax.psum(c, "tp") * 0.5, None), a, None, length=5)[0]

    _, axes, s = _only(_report(mesh, body, P("dp"), P("dp")))
    size = (X_SHAPE[0] // 2) * X_SHAPE[1] * F32
    assert (axes, s.ops, s.count, s.bytes) == (("tp",), 1, 5, 5 * size)


def test_nested_scans_multiply(mesh):
    def inner(c, _):
        return lax.psum(c, "tp") * 0.5, None

    def body(a):
        outer = lambda c, _: (lax.scan(inner, c, None, length=3)[0], None)  # noqa: E731
        return lax.scan(outer, a, None, length=4)[0]

    r = _report(mesh, body, P("dp"), P("dp"))
    assert _only(r)[2].count == 12
    assert r.collectives[0].trips_known and not r.unknown_trip_loops


def test_unknown_trip_count_is_flagged_not_guessed(mesh):
    def body(a):
        return lax.while_loop(lambda c: c.sum() < 100.0, lambda c: lax.psum(c, "tp"), a)

    r = _report(mesh, body, P("dp"), P("dp"))
    assert _only(r)[2].count == 1  # one trip: a lower bound
    assert r.unknown_trip_loops and not r.collectives[0].trips_known


def test_replica_groups_are_partition_ids_not_device_ids(mesh):
    # A mesh over a permuted device list: groups printed by XLA are positions in mesh.devices.
    # Read as device ids, {0,4} would be devices at positions 7 and 6, i.e. the tp axis.
    order = [7, 3, 5, 1, 6, 2, 4, 0]
    pmesh = Mesh(
        np.array(jax.devices())[order].reshape(2, 2, 2),
        ("dp", "sp", "tp"),
        axis_types=(AxisType.Auto,) * 3,
    )
    r = _report(pmesh, lambda a: lax.psum(a, "dp"), P("tp"), P("tp"))
    assert _only(r)[:2] == ("all-reduce", ("dp",))


def test_gspmd_reduction_uses_mesh_axes_groups(mesh):
    # GSPMD prints replica_groups=mesh[...] {...} with XLA's own axis names; they must map back.
    x = jax.device_put(jnp.ones(X_SHAPE), NamedSharding(mesh, P(("sp", "dp"), "tp")))
    rows = collective_bytes(jax.jit(lambda a: a.sum(0)).lower(x).compile(), mesh)
    kind, axes, s = _only(rows)
    assert (kind, axes) == ("all-reduce", ("dp", "sp"))
    assert s.bytes == X_SHAPE[1] // 2 * F32  # partial column sums of the local block
    cols = collective_bytes(jax.jit(lambda a: a.sum(1)).lower(x).compile(), mesh)
    assert _only(cols)[:2] == ("all-reduce", ("tp",))


def test_replica_group_spellings():
    assert replica_groups("replica_groups={{0,1},{2,3}}", 4) == [[0, 1], [2, 3]]
    assert replica_groups("replica_groups={}", 4) == [[0, 1, 2, 3]]
    assert replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)", 8) == [
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
    ]
    # Sub-axis of a permuted XLA mesh (printed by CPU XLA for a reshard on a (2, 4) mesh).
    # Device array d[r, k] = 4·(r//2) + 2k + r%2; 'axis_0':(2)2 is the minor factor of r.
    text = (
        "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0':(2)2}"
    )
    assert sorted(map(sorted, replica_groups(text, 8))) == [[0, 1], [2, 3], [4, 5], [6, 7]]


SYNTHETIC = """HloModule synthetic, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]{0}) parameter(0)
  %x = f32[64]{0} get-tuple-element(%p), index=1
  %ars = f32[64]{0} all-reduce-start(%x), channel_id=1, replica_groups=[4,2]<=[8], to_apply=%add
  %ard = f32[64]{0} all-reduce-done(%ars)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[64]{0}) tuple(%i, %ard)
}

%cond (p: (s32[], f32[64])) -> pred[] {
  %p = (s32[], f32[64]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%wrapped (x: bf16[32]) -> bf16[8] {
  %x = bf16[32]{0} parameter(0)
  ROOT %rs = bf16[8]{0} reduce-scatter(%x), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
}

%branch (x: f32[64]) -> f32[64] {
  %x = f32[64]{0} parameter(0)
  ROOT %ar = f32[64]{0} all-reduce(%x), replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
}

ENTRY %main (a: f32[64], y: bf16[32], k: s32[]) -> bf16[32] {
  %a = f32[64]{0} parameter(0)
  %y = bf16[32]{0} parameter(1)
  %k = s32[] parameter(2)
  %z = s32[] constant(0)
  %t = (s32[], f32[64]{0}) tuple(%z, %a)
  %w = (s32[], f32[64]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
  %ags = (bf16[32]{0}, bf16[128]{0}) all-gather-start(%y), replica_groups=[2,4]<=[8], dimensions={0}
  %agd = bf16[128]{0} all-gather-done(%ags)
  %as = ((bf16[32]{0}), bf16[8]{0}) async-start(%y), calls=%wrapped
  %ad = bf16[8]{0} async-done(%as), calls=%wrapped
  %cd = f32[64]{0} conditional(%k, %a), branch_computations={%branch}
  ROOT %cps = bf16[32]{0} collective-permute(%y), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
}
"""  # noqa: E501


def test_async_forms_loops_and_conditionals_from_text(mesh):
    m = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    r = collective_bytes(SYNTHETIC, m)
    ar = r.select("all-reduce", ("tp",))
    assert (ar.ops, ar.count, ar.bytes) == (1, 7, 7 * 64 * 4)  # start counted, done not
    ag = r.select("all-gather", ("tp",))
    assert (ag.count, ag.bytes) == (1, 32 * 2 * 4)  # bf16 output of a 4-way gather
    rs = r.select("reduce-scatter", ("tp",))  # inside async-start; async-done not counted
    assert (rs.count, rs.bytes, rs.wire_bytes) == (1, 32 * 2, 32 * 2 * 3 / 4)
    cp = r.select("collective-permute", ("tp",))
    assert cp.wire_bytes == pytest.approx(32 * 2 * 4 / 8)  # 4 of 8 partitions send
    assert r.select("all-reduce", ("dp",)).count == 1
    d = r.to_dict()
    assert d["conditional_ops"] == 1 and d["total"]["count"] == 11
    json.dumps(d)
    with pytest.raises(ValueError, match="partitions"):
        collective_bytes(SYNTHETIC, jax.make_mesh((4,), ("dp",), axis_types=(AxisType.Auto,)))


def test_compiled_memory_reports_buffers():
    c = jax.jit(lambda a: a * 2).lower(jnp.ones((32, 32), jnp.float32)).compile()
    mem = compiled_memory(c)
    assert mem["argument"] == mem["output"] == 32 * 32 * 4
    assert mem["total"] >= mem["argument"] + mem["output"] - (mem["alias"] or 0)

    class NoAnalysis:
        def memory_analysis(self):
            return None

    assert all(v is None for v in compiled_memory(NoAnalysis()).values())


def test_variadic_all_reduce_sums_operands(mesh):
    # XLA's all-reduce combiner (GPU) merges many reductions into one tuple-shaped all-reduce;
    # long operand lists carry /*index=k*/ markers.
    text = """HloModule combined, num_partitions=8

ENTRY %main (a: f32[8], b: bf16[16]) -> (f32[8], bf16[16]) {
  %a = f32[8]{0} parameter(0)
  %b = bf16[16]{0} parameter(1)
  ROOT %ar = (f32[8]{0}, /*index=1*/bf16[16]{0}) all-reduce(%a, /*index=1*/%b), replica_groups={}
}
"""
    m = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    s = collective_bytes(text, m).select("all-reduce", ("dp", "tp"))
    size = 8 * 4 + 16 * 2
    assert (s.count, s.bytes) == (1, size)
    assert s.wire_bytes == pytest.approx(2 * 7 / 8 * size)


def test_bf16_collectives_are_measured_as_compiled(mesh):
    # CPU XLA upcasts bf16 collectives to f32 (a convert feeds the all-reduce), so the measured
    # bytes are 4 per element there; a GPU compile keeps 2. The report follows the program.
    x = jnp.ones(X_SHAPE, jnp.bfloat16)
    s = _only(_report(mesh, lambda a: lax.psum(a, "tp"), P("dp"), P("dp"), x))[2]
    elements = (X_SHAPE[0] // 2) * X_SHAPE[1]
    per_elem = 4 if jax.default_backend() == "cpu" else 2
    assert s.bytes == elements * per_elem
