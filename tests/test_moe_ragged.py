"""The ragged MoE dispatch (:mod:`jaxpar.model.ragged`) against one device's padded dispatch:
loss and every gradient leaf, fp32, dropless and with a capacity (ep 4, ep 2 x tp 2,
ep 2 x dp 2 x ZeRO-3 with 2 micro-batches, ep 2 in a pipeline stage). XLA:CPU has no
``ragged-all-to-all``, so the exchange runs here through an all-gather emulation of the op's
documented semantics; for a GPU target the real op compiles (the last tests, through
``jaxpar compile``)."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_moe import _assert_close, _grads, _reference, moe_config

from jaxpar import config as C
from jaxpar.errors import ConfigError
from jaxpar.model import ragged
from jaxpar.planner import moe as MOE
from jaxpar.train import step as S


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """``lax.ragged_all_to_all`` from an all-gather: source ``i``'s rows
    ``operand_i[input_offsets_i[me] : + send_sizes_i[me]]`` land at ``output_offsets_i[me]`` of
    ``me``'s output; rows nobody writes keep ``output``'s values. Differentiable in
    ``operand`` (the all-gather's transpose is a reduce-scatter)."""
    ops = jax.lax.all_gather(operand, axis_name)  # [ep, N, D]
    io, ss, oo = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes,
                                                             output_offsets))  # fmt: skip
    rs = jax.lax.all_gather(recv_sizes, axis_name)
    me = jax.lax.axis_index(axis_name)
    ep, n = ops.shape[:2]
    # What i sends me is what I expect from i (the op's contract; checked in value).
    consistent = jnp.all(ss[:, me] == rs[me])
    r = jnp.arange(output.shape[0])[:, None]  # [R, 1]
    start, size = oo[:, me][None], ss[:, me][None]  # [1, ep]
    hit = (r >= start) & (r < start + size)  # [R, ep]
    src = jnp.clip(io[:, me][None] + r - start, 0, n - 1)
    vals = ops[jnp.arange(ep)[None], src]  # [R, ep, D]
    got = jnp.sum(jnp.where(hit[..., None], vals, 0), axis=1)
    out = jnp.where(jnp.any(hit, axis=1)[:, None], got, output)
    return jnp.where(consistent, out, jnp.nan)


@pytest.fixture
def emulated(monkeypatch):
    """The ragged exchange on CPU: the emulation in the op's place, the platform check off."""
    monkeypatch.setattr(ragged, "ragged_all_to_all", emulated_ragged_all_to_all)
    monkeypatch.setattr(C, "GPU_PLATFORMS", ("gpu", "cuda", "cpu"))


def _ragged(**kw):
    cfg = moe_config(**kw)
    cfg.model.moe = dataclasses.replace(cfg.model.moe, dispatch="ragged")
    return cfg


def test_emulation_follows_the_documented_example():
    """The emulation reproduces ``lax.ragged_all_to_all``'s docstring example (two devices)."""
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((2,), ("x",), axis_types=auto, devices=jax.devices()[:2])
    P = jax.sharding.PartitionSpec
    operand = jnp.array([[1, 2, 2], [3, 4, 0]], jnp.float32)[..., None]  # rows of width 1
    # device 0 sends [1] to itself and [2, 2] to device 1; device 1 sends [3] to 0, [4] to 1.
    io = jnp.array([[0, 1], [0, 1]], jnp.int32)
    ss = jnp.array([[1, 2], [1, 1]], jnp.int32)
    oo = jnp.array([[0, 0], [1, 2]], jnp.int32)
    rs = jnp.array([[1, 1], [2, 1]], jnp.int32)
    f = jax.shard_map(
        lambda a, b, c, d, e: emulated_ragged_all_to_all(
            a[0], jnp.zeros((4, 1)), b[0], c[0], d[0], e[0], axis_name="x")[None],
        mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False,
    )  # fmt: skip
    out = np.asarray(jax.jit(f)(operand, io, ss, oo, rs))
    np.testing.assert_array_equal(out[..., 0], [[1, 3, 0, 0], [2, 2, 4, 0]])


# ep = dp is ep4 (and ep2-tp2 beside tp); ep 2 = dp 2 alone runs in the pipeline test
# below (pp 2 x dp 2 x ep 2) and, ep 2 < dp, in the capacity test.
LAYOUTS = {
    "ep4": dict(dp=4, ep=4),
    "ep2-tp2": dict(dp=2, ep=2, tp=2),
    "ep2-dp2-zero3-mb2": dict(dp=4, ep=2, zero=3, microbatches=2),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ragged_matches_one_padded_device(name, emulated):
    """Dropless: the ragged dispatch's loss and gradients equal one device's padded ones."""
    _, loss, g = _grads(_ragged(**LAYOUTS[name]))
    ref_loss, ref = _reference()
    assert abs(loss / ref_loss - 1) < 1e-4
    _assert_close(g, ref)


def test_ragged_in_a_pipeline_stage_matches_one_device(emulated):
    """pp 2 x ep 2 under 1F1B (a backward and a forward in one tick): the ragged exchange
    inside the stages gives one padded device's loss and gradients."""
    import test_moe_pipeline as MP

    cfg = MP.moe_config(pp=2, dp=2, ep=2, microbatches=2, schedule="1f1b")
    cfg.model.moe = dataclasses.replace(cfg.model.moe, dispatch="ragged")
    _, loss, g = MP._grads(cfg)
    ref_loss, ref = MP._reference()
    assert abs(loss / ref_loss - 1) < 1e-4
    MP._assert_close(g, ref)


def test_capacity_drops_the_same_rows(emulated):
    """Capacity factor 1: the rows the capacity drops are never sent; loss and gradients equal
    one device's padded dispatch under the same capacity."""
    _, ref_loss, ref = _grads(moe_config(capacity_factor=1.0))
    _, loss, g = _grads(_ragged(capacity_factor=1.0, dp=4, ep=2, zero=1))
    assert abs(loss / ref_loss - 1) < 1e-4
    _assert_close(g, ref)


def test_ragged_exchange_refused_on_cpu():
    """Without the emulation, a ragged exchange on CPU devices is one line before compiling;
    auto picks the padded dispatch there."""
    want = r"^model.moe.dispatch='ragged': with layout.ep=2 it needs a ragged all-to-all, which "
    with pytest.raises(ConfigError, match=want + r"XLA on platform 'cpu' does not implement"):
        S.check_platform(_ragged(dp=2, ep=2), jax.devices()[:2])
    cfg = moe_config(dp=2, ep=2)
    S.check_platform(cfg, jax.devices()[:2])
    moe = cfg.model.moe
    assert not moe.ragged("cpu", 2) and moe.ragged("gpu", 2) and moe.ragged("cuda", 2)
    assert not moe.ragged("gpu", 1)  # no exchange, nothing ragged: padded


def test_receive_buffer_bound():
    """An owner's buffer holds the most rows it can get: all of every source's assignments
    (few experts per owner cannot hold more than c rows each per sequence)."""
    assert ragged.receive_rows(n_rows=64, experts=8, ep=2, rows_b=4, c=16) == 2 * 64
    assert ragged.receive_rows(n_rows=64, experts=8, ep=4, rows_b=4, c=2) == 4 * 2 * 4 * 2


MOE_YAML = """name: moe-gpu-test
n_layers: %d
d_model: 64
n_heads: 4
n_kv_heads: 2
d_ff: 128
vocab_size: 256
max_seq_len: 64
moe: {experts: 8, top_k: 2, shared_experts: 1, expert_ff: 32, first_dense: %d, dispatch: %s}
"""
DP8_EP2 = ("--dp", "8", "--ep", "2", "--pp", "1", "--microbatches", "1")
PIPELINE = ("--dp", "4", "--ep", "2", "--pp", "2", "--microbatches", "2", "--schedule", "1f1b")
# ``jaxpar compile`` once per argv in one process, each report kept: the three compiles below
# share one mesh (XLA reads its flags once per process) and one interpreter start.
_COMPILE_ALL = """
import contextlib, io, json, sys
from jaxpar.cli import main
reports = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    if rc:
        sys.exit(f"jaxpar {' '.join(argv)}: exit {rc}")
    reports.append(json.loads(out.getvalue().strip().splitlines()[-1]))
print(json.dumps(reports))
"""


@pytest.fixture(scope="module")
def gpu_reports(tmp_path_factory) -> dict:
    """``jaxpar compile`` of the MoE above for h100-8 (batch 16 x 64), in one subprocess: its
    JSON reports for the ragged (auto) and padded dispatch under dp 8 x ep 2 (3 layers, the
    first dense), and for auto in a pp 2 x dp 4 x ep 2 pipeline (4 MoE layers, 2 per stage);
    and the model files' directory."""
    from test_gpu_compile import _plugin_or_fail

    _plugin_or_fail()
    root = tmp_path_factory.mktemp("moe-gpu")
    runs = {"ragged": ("auto", DP8_EP2, 1), "padded": ("padded", DP8_EP2, 1),
            "pipeline": ("auto", PIPELINE, 0)}  # fmt: skip
    argvs = []
    for dispatch, layout, first_dense in runs.values():
        model = root / f"{dispatch}-{first_dense}.yaml"
        model.write_text(MOE_YAML % (4 - first_dense, first_dense, dispatch))
        argvs.append(["compile", "--model", str(model), "--mesh", "h100-8", *layout, "--tp", "1",
                      "--zero", "0", "--remat", "none", "--global-batch", "16", "--seq-len",
                      "64", "--json"])  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-c", _COMPILE_ALL, json.dumps(argvs)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**dict(zip(runs, reports, strict=True)), "dir": root}


def test_ragged_dispatch_compiles_for_gpu_with_its_bytes(gpu_reports):
    """On the H100 target, auto dispatches ragged: per MoE layer four ragged all-to-alls over
    ep (dispatch and combine, their transposes), each sending its whole buffer at most — the
    sorted assignments [k·b·S, D] or the owner's receive buffer [ep·min(k·b·S, E/ep·b·C), D]
    in bf16 — and no padded [E, b, C, D] all-to-all; the padded dispatch of the same model
    moves 4 · E·b·C·D per layer."""
    rag, pad = gpu_reports["ragged"], gpu_reports["padded"]
    layers, b, s, k, e, d, bf16 = 2, 16 // 8, 64, 2, 8, 64, 2
    t = k * b * s
    n_recv = ragged.receive_rows(t, e, 2, b, s)  # dropless: C = S
    kinds = rag["collectives"]["ep"]["by_kind"]
    assert kinds["ragged-all-to-all"]["count"] == 4 * layers
    # Each sends at most its buffer; wire = (ep-1)/ep of it, as a balanced exchange.
    want = layers * 2 * (t + n_recv) * d * bf16 / 2
    assert kinds["ragged-all-to-all"]["wire_bytes"] == want
    # JAX's ragged rules exchange offsets (int32) with plain all-to-alls: a few bytes each.
    assert kinds.get("all-to-all", {"wire_bytes": 0})["wire_bytes"] < 1000
    padded = pad["collectives"]["ep"]["by_kind"]
    assert "ragged-all-to-all" not in padded
    assert padded["all-to-all"]["wire_bytes"] == layers * 4 * e * b * s * d * bf16 / 2
    assert kinds["ragged-all-to-all"]["wire_bytes"] < padded["all-to-all"]["wire_bytes"] / 2
    # The planner prices the rows the ragged exchange really moves on a GPU (the kept
    # assignments, k·b·S dropless, each pass), the padded buffer on a CPU.
    model = C.load_model(str(gpu_reports["dir"] / "auto-1.yaml"))
    lay = C.LayoutConfig(dp=8, ep=2, tp=1, pp=1, microbatches=1)
    gpu, cpu = (MOE.figures(model, lay, b, s, bf16, p) for p in ("gpu", "cpu"))
    assert (gpu.dispatch, gpu.moved, cpu.dispatch, cpu.moved) == ("ragged", t, "padded", e * b * s)
    assert gpu.a2a_bytes == 4 * t * d * bf16
    assert layers * gpu.a2a_bytes <= 2 * want  # within the operands' bound (wire = half)


def test_ragged_dispatch_compiles_in_a_gpu_pipeline(gpu_reports):
    """pp 2 x dp 4 x ep 2 1F1B on the H100 target, every layer MoE: the stages' exchanges are
    ragged all-to-alls over ep (no padded buffer moves), the activations cross pp by
    collective-permute, and the compiled memory is beside the planner's."""
    rep = gpu_reports["pipeline"]
    ep = rep["collectives"]["ep"]["by_kind"]
    assert ep["ragged-all-to-all"]["count"] > 0
    assert ep.get("all-to-all", {"wire_bytes": 0})["wire_bytes"] < 1000  # offsets only
    assert rep["collectives"]["pp"]["by_kind"]["collective-permute"]["count"] > 0
    mem = rep["memory"]
    assert 0.5 < mem["ratio"] < 2.0, mem
