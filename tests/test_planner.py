"""Planner: recommendations fit, given layouts are costed, memory matches compiled programs,
bad input gets a one-line answer."""

from __future__ import annotations

import json

import jax
import pytest

from jaxpar import config as C
from jaxpar.analysis.hlo import compiled_memory
from jaxpar.cli import main
from jaxpar.devices import make_mesh
from jaxpar.planner import cost_layout, plan
from jaxpar.planner import memory as M
from jaxpar.planner.pipe import figures
from jaxpar.train.step import Trainer

GIB80 = 85899345920
LAYOUT_KEYS = {"dp", "tp", "pp", "sp", "zero", "schedule", "virtual", "microbatch_size",
               "microbatches", "remat", "offload"}  # fmt: skip


def test_llama2_70b_on_a100_64_recommends_a_fitting_layout_and_costs_production():
    cfg = C.load("llama2-70b", "a100-64")
    best = plan(cfg, top=3)
    assert best["fits"] and best["memory_per_device_bytes"] <= GIB80
    mem = best["memory_breakdown_bytes"]
    assert {"params", "grads", "optimizer", "activations", "head"} <= set(mem)
    lay = best["layout"]
    assert lay["dp"] * lay["tp"] * lay["pp"] * lay["sp"] == 64
    assert len(best["alternatives"]) == 3
    assert all(a["step_time_s"] >= best["step_time_s"] for a in best["alternatives"])
    assert all(a["why"].startswith("+") for a in best["alternatives"])
    prod = cost_layout(C.load("llama2-70b", "a100-64"))  # the mesh file's own layout
    assert prod["verdict"] == "fits" and prod["layout"]["pp"] == 4
    assert prod["step_time_s"] >= best["step_time_s"]  # the search includes better layouts
    assert best["baseline"] is not None and best["baseline_note"]


def test_405b_search_is_bounded_and_flags_traps():
    cfg = C.load("llama3-405b", "h100-1024")
    out = plan(cfg, top=2)
    assert out["fits"] and 0 < out["evaluated"] <= out["costed"] < 20000
    cfg.mesh.layout = C.LayoutConfig(
        dp=32, tp=16, pp=2, zero=3, microbatches=16, schedule="1f1b", remat="full"
    )
    flags = " ".join(cost_layout(cfg)["flags"])
    assert "TP across nodes" in flags and "regathers" in flags


def test_pipe_extrapolation_matches_exact_tables():
    for kind, p, m, v in [("1f1b", 4, 40, 1), ("interleaved", 4, 48, 2), ("zbv", 4, 37, 2)]:
        a, b = figures(kind, p, m, v), figures(kind, p, m, v, exact=True)
        assert a.extrapolated and not b.extrapolated
        assert a.ticks == b.ticks and a.peak_stashes == b.peak_stashes
        assert a.bubble_fraction == pytest.approx(b.bubble_fraction, abs=1e-9)
        a, b = figures(kind, p, m, v, lockstep=False), figures(kind, p, m, v, True, False)
        assert a.bubble_fraction == pytest.approx(b.bubble_fraction, abs=1e-9)


@pytest.mark.parametrize("layout", [dict(dp=2, tp=4, zero=1), dict(dp=8, zero=1, remat="full")])
def test_predicted_memory_within_10_percent_of_compiled(make_cfg, layout):
    cfg = make_cfg(**layout)
    mesh = make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices])
    measured = compiled_memory(Trainer(cfg, mesh).compile_step())["total"]
    shape = M.Shape(cfg.train.global_batch, cfg.train.seq_len)
    stashes = figures(cfg.layout.schedule, cfg.layout.pp, cfg.layout.microbatches,
                      cfg.layout.virtual).peak_stashes  # fmt: skip
    predicted = M.memory(cfg.model, cfg.layout, shape, stashes)["total"]
    assert abs(predicted / measured - 1) < 0.10, (predicted, measured)


def _cli(capsys, *argv):
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_json_keys(capsys):
    rc, out, _ = _cli(capsys, "--model", "llama2-7b", "--mesh", "a100-8", "--json", "--top", "2")
    data = json.loads(out.strip().splitlines()[-1])
    assert rc == 0 and LAYOUT_KEYS <= set(data["layout"])
    for k in ("memory_per_device_bytes", "step_time_s", "tokens_per_s", "tflops_per_device",
              "mfu", "bubble_fraction", "alternatives", "baseline"):  # fmt: skip
        assert k in data, k
    assert all(LAYOUT_KEYS <= set(a["layout"]) for a in data["alternatives"])


def test_model_that_fits_no_layout(capsys):
    rc, out, err = _cli(capsys, "--model", "llama3-405b", "--mesh", "a100-8")
    assert rc == 1 and "NO layout fits" in out and "shortfall" in out and "Traceback" not in err
    out = plan(C.load("llama3-405b", "a100-8"))
    assert not out["fits"] and out["shortfall_bytes"] > 0 and "devices" in out["suggestion"]


def test_given_layout_not_multiplying_to_devices(capsys):
    rc, _, err = _cli(capsys, "--model", "llama2-70b", "--mesh", "a100-64", "--dp", "3",
                      "--tp", "8")  # fmt: skip
    assert rc == 2 and "must equal the device count 64" in err and len(err.splitlines()) == 1


def test_given_layout_that_does_not_fit(capsys):
    rc, out, _ = _cli(capsys, "--model", "llama2-70b", "--mesh", "a100-64", "--dp", "64")
    assert rc == 1 and "does not fit" in out


def test_mesh_without_hardware_figures(capsys, tmp_path):
    path = tmp_path / "bare.yaml"
    path.write_text("devices: 8\nhardware: {platform: gpu, peak_flops_bf16: 1.0e+15}\n")
    rc, _, err = _cli(capsys, "--model", "llama2-7b", "--mesh", str(path))
    assert rc == 2 and "hardware.device_memory_bytes missing" in err


def test_bad_schedule_for_given_layout(capsys):
    rc, _, err = _cli(capsys, "--model", "llama2-70b", "--mesh", "a100-64", "--dp", "2",
                      "--tp", "8", "--pp", "4", "--microbatches", "2")  # fmt: skip
    assert rc == 2 and "microbatches" in err


def test_layout_from_mesh_cli(capsys):
    rc, out, _ = _cli(capsys, "--model", "llama2-70b", "--mesh", "a100-64", "--layout-from-mesh")
    assert rc == 0 and "given layout: fits" in out and "interleaved v=2" in out


def test_batch_no_layout_divides(capsys):
    rc, out, _ = _cli(
        capsys, "--model", "tiny", "--mesh", "h100-1024", "--global-batch", "3", "--seq", "128"
    )
    assert rc == 1 and "NO valid layout" in out
    rc, _, err = _cli(capsys, "--model", "llama2-7b", "--mesh", "a100-8", "--global-batch", "0")
    assert rc == 2 and "train.global_batch=0" in err


def test_throughput_against_megatron_2021():
    from jaxpar.planner.published import megatron_comparison

    rows = megatron_comparison()
    assert len(rows) == 6 and all(abs(r["error"]) < 0.15 for r in rows), rows
    assert all(abs(r["params_b"] / float(r["model"][:-1]) - 1) < 0.01 for r in rows)
