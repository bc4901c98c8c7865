"""The planner on mixture-of-experts models: active parameters and FLOPs, per-device memory and
the all-to-all bytes against the compiled step, ep in the search, and the CLI."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import pytest
from test_moe import _trainer, moe_config

from jaxpar import config as C
from jaxpar import validation as V
from jaxpar.analysis import theory as T
from jaxpar.analysis.hlo import collective_bytes, compiled_memory
from jaxpar.cli import main
from jaxpar.planner import footprint as M
from jaxpar.planner import moe as MOE
from jaxpar.planner import search as S
from jaxpar.planner.auto import train_flags
from jaxpar.planner.cost import step_cost
from jaxpar.planner.shapes import param_counts
from jaxpar.planner.traffic import dp_traffic

# (capacity factor, layout): dropless and capped, ZeRO 0-2, remat none/full, micro-batches.
COMPILED = {
    "ep2": (0.0, dict(dp=2, ep=2)),
    "ep4-full-remat": (0.0, dict(dp=4, ep=4, remat="full")),
    "ep2-zero1-capacity": (1.0, dict(dp=4, ep=2, zero=1)),
}
MEMORY_TOLERANCE = 0.10  # predicted total within 10% of XLA:CPU's compiled total


def test_active_parameters_and_flops_per_token():
    """Mixtral: 46.7 B parameters, 12.9 B active; FLOPs per token from the active ones."""
    m = C.load_model("mixtral-8x7b")
    assert m.param_count() == pytest.approx(46.7e9, rel=2e-3)
    assert m.active_param_count() == pytest.approx(12.9e9, rel=5e-3)
    embed = m.vocab_size * m.d_model
    attn = 12 * m.n_layers * m.n_heads * m.hd * 4096
    assert T.train_flops_per_token(m, 4096) == 6 * (m.active_param_count() - embed) + attn
    q = C.load_model("qwen3-30b-a3b")
    assert q.active_param_count() / q.param_count() == pytest.approx(3.4 / 30.5, rel=0.03)


@pytest.mark.parametrize("name", list(COMPILED))
def test_memory_and_all_to_all_against_the_compiled_step(name):
    """Per-tensor counts equal the trainer's shard shapes (experts over ep, ZeRO over edp);
    the predicted total is within the tolerance of the compiled one; the predicted all-to-all
    bytes (buffer and wire) are what the HLO moves over ep, the data-parallel reduction's wire
    bytes within 1% of the HLO's (the loss and metric reductions are not counted)."""
    cf, layout = COMPILED[name]
    cfg = moe_config(capacity_factor=cf, **layout)
    lay, shape = cfg.layout, M.Shape(cfg.train.global_batch, cfg.train.seq_len)
    tr = _trainer(cfg)
    pc = param_counts(cfg.model, lay)
    flat = jax.tree_util.tree_flatten_with_path(tr.abstract_params)[0]
    for (path, leaf), sharding in zip(flat, jax.tree.leaves(tr.param_shardings), strict=True):
        key = "/".join(str(k.key) for k in path)
        assert pc.tensors[key][1] == math.prod(sharding.shard_shape(leaf.shape)), key
    assert pc.experts_local * lay.ep == sum(
        t[0] for k, t in pc.tensors.items() if k.startswith("moe_layers/moe/mlp/w_")
    )
    compiled = tr.compile_step()
    predicted = M.memory(cfg.model, lay, shape)["total"]
    assert abs(predicted / compiled_memory(compiled)["total"] - 1) < MEMORY_TOLERANCE

    a2a = collective_bytes(compiled, tr.mesh).select(kind="all-to-all", axes={"ep"})
    rows = shape.microbatch_size(lay)
    fig = MOE.figures(cfg.model, lay, rows, shape.seq, 4, "cpu")  # the padded dispatch
    assert fig.capacity == (shape.seq if cf == 0 else math.ceil(cf * 2 * shape.seq / 8))
    assert a2a.bytes == fig.a2a_bytes * cfg.model.moe_layers() * lay.microbatches > 0
    # the data-parallel reduction (ZeRO over edp, the non-expert rest over ep too)
    rep = collective_bytes(compiled, tr.mesh)
    dp_wire = sum(st.wire_bytes for (kind, ax), st in rep.stats.items()
                  if kind != "all-to-all" and ax and set(ax) <= {"edp", "ep"})  # fmt: skip
    assert dp_traffic(cfg.model, lay)["total_bytes"] == pytest.approx(dp_wire, rel=0.01)
    # Priced on H100s as if they ran this (padded) program: their figures, a CPU's dispatch.
    hw = dataclasses.replace(C.load_mesh("h100-8").hardware, platform="cpu")
    ep_term = [c for c in step_cost(cfg.model, hw, lay, shape).comm if c.name == "ep_comm"]
    assert [c.bytes for c in ep_term] == [a2a.wire_bytes]


@pytest.mark.parametrize(
    "model,mesh,batch,seq",
    [
        ("mixtral-8x7b", "h100-8", 16, 8192),
        ("qwen3-30b-a3b", "h100-8", 16, 4096),
        ("deepseek-v3", "h100-1024", 1024, 4096),
    ],  # fmt: skip
)
def test_search_offers_fitting_ep_layouts_the_trainer_accepts(model, mesh, batch, seq):
    cfg = C.load(model, mesh)
    cfg.train.global_batch, cfg.train.seq_len = batch, seq
    shape = M.Shape(batch, seq)
    found = list(S.candidates(cfg.model, cfg.mesh.hardware, cfg.mesh.devices, shape))
    with_ep = [c for c in found if c.layout.ep > 1]
    assert with_ep and all(c.fits for c in found)
    # pp x ep where every block is in a MoE group (Mixtral, Qwen3); never with DeepSeek-V3's
    # dense first blocks
    pipelined = [c for c in with_ep if c.layout.pp > 1]
    assert bool(pipelined) == (cfg.model.moe.first_dense == 0)
    for c in with_ep:
        lay = c.layout
        assert lay.sp == 1 and lay.dp % lay.ep == 0 == cfg.model.moe.experts % lay.ep
        assert not 0 < lay.dp_shard < lay.dp
        V.check_layout(cfg.model, lay, batch, seq, cfg.mesh.devices)
        assert any(t.name == "ep_comm" and t.bytes > 0 for t in c.cost.comm)


def test_auto_layout_picks_ep_where_it_pays():
    """DeepSeek-V3 with a capacity factor on 1024 H100s: the all-to-all of a capped buffer is
    cheaper than ZeRO-3 gathering 256 experts per layer, so the pick has ep > 1; its train
    flags carry --ep."""
    cfg = C.load("deepseek-v3", "h100-1024")
    cfg.model.moe.capacity_factor = 1.25
    cfg.train.global_batch, cfg.train.seq_len = 1024, 4096
    shape = M.Shape(1024, 4096)
    found = S.candidates(cfg.model, cfg.mesh.hardware, cfg.mesh.devices, shape)
    best = min(found, key=lambda c: c.step_time)
    assert best.layout.ep > 1
    assert best.step_time < min(
        c.step_time
        for c in S.candidates(cfg.model, cfg.mesh.hardware, 1024, shape)
        if c.layout.ep == 1
    )
    flags = train_flags(C.load("tiny-moe", "cpu-8"), 1, "tiny-moe", "cpu-8")
    assert "--ep" in flags


def test_plan_and_memory_agree_and_show_active_parameters(capsys):
    argv = ["--model", "tiny-moe", "--dp", "4", "--ep", "4", "--pp", "1", "--seq", "64",
            "--json"]  # fmt: skip
    assert main(["memory", *argv, "--microbatch-size", "2"]) == 0
    mem = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["plan", "--mesh", "cpu-8", "--devices", "4", "--global-batch", "8", *argv]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    planned = json.loads(out[-1])
    assert "B active" in out[0] and planned["layout"]["ep"] == 4
    assert mem["memory_per_device_bytes"] == planned["memory_per_device_bytes"] > 0
    model = C.load_model("tiny-moe")
    for m in (mem["moe"], planned["moe"]):
        assert m["params_active"] == model.active_param_count() < m["params_total"]
        assert m["capacity"] == 64 and m["dispatch_slots"] == 8 * 2 * 64


def test_plan_refuses_an_ep_the_trainer_refuses(capsys):
    argv = ["plan", "--model", "tiny-moe", "--mesh", "cpu-8", "--dp", "4", "--ep", "3",
            "--pp", "1", "--devices", "4"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "layout.ep=3" in err[0]
