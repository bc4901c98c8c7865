"""jaxpar compile: the train step compiled for GPU pods by XLA:GPU on this CPU machine.

The compiles run ``jaxpar compile`` in a subprocess (XLA reads ``XLA_FLAGS`` once per process,
and the mesh's GPU flags must be there before the GPU compiler starts). They need the jax CUDA
plugin, which the ``test`` extra installs (``jax[cuda12-local]``): without it these tests fail
saying so, they are not skipped.
"""

import dataclasses
import functools
import json
import os
import pickle
import subprocess
import sys

import pytest
from conftest import MODEL_YAML

from jaxpar import config as C
from jaxpar.cli import cpu_unless_gpu, main
from jaxpar.errors import ConfigError
from jaxpar.gpu import saved
from jaxpar.gpu import targets as T

GPU_MESHES = ("a100-8", "a100-40gb-8", "a100-64", "h100-8", "h100-1024", "h200-8")
PLUGIN = T.Plugin("jax_cuda12_plugin", "0", (12, 9), (9, 8, 0))  # for tests that compile nothing


def _plugin_or_fail() -> None:
    if T.plugin() is None:
        pytest.fail("the jax CUDA plugin is missing: pip install -e '.[test]' installs it")


def _compile(tmp_path, *flags: str, check: bool = True) -> subprocess.CompletedProcess:
    model = tmp_path / "model.yaml"
    model.write_text(MODEL_YAML)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "jaxpar.cli", "compile", "--model", str(model),
           "--global-batch", "8", "--seq-len", "64", *flags]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _report(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_gpu_mesh_names_its_target():
    """Each GPU mesh file names a kind whose proto carries its published figures, and its
    devices divide into nodes; bad kinds and topologies are refused in one line."""
    seen = set()
    for name in GPU_MESHES:
        mesh = C.load_mesh(name)
        t = T.target_for(mesh, PLUGIN)
        seen.add(t.spec.kind)
        assert t.hosts * t.per_host == mesh.devices and t.per_host <= mesh.hardware.devices_per_node
        text = t.config_text
        major, minor = t.spec.compute_capability
        assert f"major: {major} minor: {minor}" in text
        assert f"core_count: {t.spec.core_count}" in text and 'platform_name: "CUDA"' in text
        assert "dnn_version_info { major: 9 minor: 8 patch: 0 }" in text
    assert seen == set(T.KINDS)
    assert T.target_for(C.load_mesh("a100-64"), PLUGIN).topology == "1x8x8"
    mesh = C.load_mesh("h100-8")
    bad = dataclasses.replace(mesh, hardware=dataclasses.replace(mesh.hardware, gpu="b300"))
    with pytest.raises(ConfigError, match=r"hardware.gpu='b300': unknown GPU kind; known: a100"):
        T.target_for(bad, PLUGIN)
    with pytest.raises(ConfigError, match=r"mesh.devices=12: must divide into nodes of .*=8"):
        T.target_for(dataclasses.replace(mesh, devices=12), PLUGIN)
    with pytest.raises(ConfigError, match="needs a GPU mesh file"):
        T.target_for(C.load_mesh("cpu-8"), PLUGIN)


def test_missing_plugin_says_what_to_install(monkeypatch):
    monkeypatch.setattr(T, "PLUGINS", (("jaxpar_no_such_plugin", "none"),))
    with pytest.raises(ConfigError, match=r"not installed; install it with pip install "
                       r"'jax-cuda12-plugin==.*' 'jax-cuda12-pjrt==.*'"):  # fmt: skip
        T.require_plugin()


def test_cli_runs_on_cpu_without_a_driver():
    _plugin_or_fail()
    env: dict[str, str] = {}
    cpu_unless_gpu(env)
    assert env == (
        {} if os.path.exists("/proc/driver/nvidia/version") else {"JAX_PLATFORMS": "cpu"}
    )
    kept = {"JAX_PLATFORMS": "cuda"}
    cpu_unless_gpu(kept)
    assert kept == {"JAX_PLATFORMS": "cuda"}


def test_unknown_xla_flag_refused_before_compiling(tmp_path):
    """XLA would abort the process on it; jaxpar names it in one line first."""
    _plugin_or_fail()
    mesh = tmp_path / "pod.yaml"
    text = (C.MESHES_DIR / "h100-8.yaml").read_text()
    mesh.write_text(
        text.replace("  xla_flags:\n", "  xla_flags:\n    - --xla_gpu_no_such_flag=1\n")
    )
    proc = _compile(tmp_path, "--mesh", str(mesh), "--tp", "2", "--dp", "4", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "jaxpar compile: error: hardware.xla_flags: '--xla_gpu_no_such_flag=1': not a flag of "
        "the installed jax_cuda12_plugin's XLA"
    ]


def test_compile_3d_layout_on_h100_node(tmp_path):
    """pp 2 x dp 2 x tp 2 in bf16 on an 8-GPU target: cuDNN attention in the program, the
    collectives asynchronous, memory and per-axis bytes beside the planner's. The vocabulary
    is GPT-2's 50257, which tp does not divide (issue 48: IndivisibleError): padded at rest to
    50432 (a multiple of 128 * tp), each tp shard of the tables 25216 rows."""
    _plugin_or_fail()
    hlo = tmp_path / "step.hlo"
    out = _report(_compile(tmp_path, "--mesh", "h100-8", "--pp", "2", "--dp", "2", "--tp", "2",
                           "--zero", "1", "--microbatches", "4", "-o", "model.vocab_size=50257",
                           "--hlo", str(hlo), "--json"))  # fmt: skip
    assert "f32[25216,64]" in hlo.read_text()  # a tp shard of the padded embedding
    assert out["target"]["device_kind"] == "NVIDIA H100 80GB HBM3"
    assert out["attention"]["chosen"] == "cudnn"
    calls = out["attention"]["in_program"]
    assert calls.get("__cudnn$fmhaSoftmax", 0) > 0 and calls.get("__cudnn$fmhaSoftmaxBackward", 0)
    ov = out["overlap"]
    assert ov["asynchronous"] == ov["collectives"] > 0 and 0 < ov["synchronous"] < ov["collectives"]
    assert 0.0 < ov["exposed_share"] < 1.0
    mem = out["memory"]
    assert mem["total"] == mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
    assert 0.5 < mem["ratio"] < 2.5 and mem["fits"]
    axes = out["collectives"]
    for axis in ("dp", "tp", "pp"):
        assert axes[axis]["wire_bytes"] > 0 and 0.8 < axes[axis]["ratio"] < 1.25, axes[axis]
    assert out["xla_flags"]["effective"]
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in out["xla_flags"]["applied"]


def _mid_model(tmp_path):
    """The test model at 8 layers of width 512 (context 512), as a model file."""
    model = tmp_path / "mid.yaml"
    text = MODEL_YAML
    for old, new in (("n_layers: 4", "n_layers: 8"), ("d_model: 64", "d_model: 512"),
                     ("n_heads: 4", "n_heads: 8"), ("d_ff: 128", "d_ff: 1024"),
                     ("max_seq_len: 64", "max_seq_len: 512")):  # fmt: skip
        text = text.replace(old, new)
    model.write_text(text)
    return model


# tp 8 + Megatron-SP: its ratio (the same bound, 1.12) is the last assertion of
# test_sequence_parallel_compiles_to_collective_matmul, which compiles that layout.
@pytest.mark.parametrize("layout,axis,high", [
    (("--dp", "2", "--tp", "1", "--sp", "4"), "sp", 1.12),
    (("--model", "llama3-8b", "-o", "model.n_layers=4", "--seq-len", "2048", "--dp", "4",
      "--tp", "2", "--sequence-parallel", "--zero", "3", "--remat", "selective",
      "--microbatches", "2"), "tp", 1.25),
])  # fmt: skip
def test_sequence_layouts_move_what_the_planner_counts(tmp_path, layout, axis, high):
    """Megatron-SP and Ulysses wire bytes near the planner's on an 8-GPU target.

    The model has 8 layers of width 512, so the embedding's and head's few collectives weigh
    little (1.08 and 1.04 measured). Megatron-SP: the norm's output is pinned to the sequence
    shard before the gather (without that constraint 0.89x), and the planner counts the
    backward's second gather of the inputs (without it 1.35x). Ulysses: the planner counts the
    weight gradients' all-reduce over sp, per layer in the compute dtype (without it 4.1x).
    In a micro-batch loop (llama3-8b, 4 layers, whose 128k-vocabulary head adds its share:
    1.18) the backward gathers each row-parallel output's cotangent once (twice before,
    1.38x)."""
    _plugin_or_fail()
    model = _mid_model(tmp_path)
    out = _report(_compile(tmp_path, "--model", str(model), "--mesh", "h100-8", "--seq-len",
                           "512", "--pp", "1", *layout, "--json"))  # fmt: skip
    got = out["collectives"][axis]
    assert 0.95 < got["ratio"] < high, got


def test_sequence_parallel_compiles_to_collective_matmul(tmp_path):
    """tp 8 + Megatron-SP on an 8-GPU target (8 layers of width 512): the all-gathers into the
    column-parallel matmuls and the reduce-scatters out of the row-parallel ones are rings of
    collective-permutes over tp (jaxpar.model.collective_matmul), 4 rings a layer forward and
    6 backward of tp - 1 sends each (two of which XLA may combine), every one asynchronous and
    nearly all with a matmul scheduled between its start and done; the only activation
    all-gathers over tp left are the head's."""
    _plugin_or_fail()
    import jax

    from jaxpar.analysis.hlo_gpu import async_collectives
    from jaxpar.devices import make_mesh

    model = _mid_model(tmp_path)
    hlo = tmp_path / "step.hlo"
    out = _report(_compile(tmp_path, "--model", str(model), "--mesh", "h100-8", "--seq-len",
                           "512", "--pp", "1", "--dp", "1", "--tp", "8", "--sequence-parallel",
                           "--hlo", str(hlo), "--json"))  # fmt: skip
    lay = dataclasses.replace(C.load_mesh("h100-8").layout, dp=1, tp=8, pp=1, sp=1)
    items = async_collectives(hlo.read_text(), make_mesh(lay, jax.devices()[:8]))
    ring = [it for it in items if it.kind == "collective-permute" and it.axes == ("tp",)]
    # 10 rings a layer, of 7 sends; XLA may combine the two sends of a column-parallel
    # backward step (same source and target) into one
    assert 8 * 8 * 7 <= sum(it.count for it in ring) <= 8 * 10 * 7
    assert all(it.asynchronous and not it.sync for it in ring)
    ring_bytes = sum(it.wire_bytes for it in ring)
    beside_matmul = sum(it.wire_bytes for it in ring if it.flops_between > 0)
    assert beside_matmul > 0.8 * ring_bytes, (beside_matmul, ring_bytes)
    gathers = [it for it in items if it.kind == "all-gather" and it.axes == ("tp",)]
    assert gathers and all(it.count < 8 for it in gathers)  # none per layer: the head's
    tp = out["collectives"]["tp"]
    assert tp["by_kind"]["collective-permute"]["wire_bytes"] > 0.7 * tp["wire_bytes"]
    assert 0.95 < tp["ratio"] < 1.12, tp  # the same bytes as the gathers and scatters


def test_zero3_layer_collectives_run_beside_matmuls(tmp_path):
    """ZeRO-3 over dp 8 on an 8-GPU target (8 layers of width 512, 2 micro-batches): every
    all-gather and reduce-scatter of the layer loops is asynchronous and has a matmul scheduled
    between its start and done (the pipelined gather of layer i + 1 beside layer i's matmuls,
    the reduce-scatter beside the backward's); only the embedding's and head's, before the
    first layer and after the last, may be exposed."""
    _plugin_or_fail()
    import jax

    from jaxpar.analysis.hlo_gpu import async_collectives
    from jaxpar.devices import make_mesh

    model = _mid_model(tmp_path)
    hlo = tmp_path / "step.hlo"
    _compile(tmp_path, "--model", str(model), "--mesh", "h100-8", "--seq-len", "512",
             "--global-batch", "16", "--pp", "1", "--dp", "8", "--tp", "1", "--zero", "3",
             "--microbatches", "2", "--hlo", str(hlo), "--json")  # fmt: skip
    lay = dataclasses.replace(C.load_mesh("h100-8").layout, dp=8, tp=1, pp=1, sp=1)
    items = async_collectives(hlo.read_text(), make_mesh(lay, jax.devices()[:8]))
    layer = [it for it in items if it.axes == ("dp",) and it.count > 1
             and it.kind in ("all-gather", "reduce-scatter")]  # fmt: skip
    assert {it.kind for it in layer} == {"all-gather", "reduce-scatter"}
    # 8 layers, 2 micro-batches: a gather forward, a gather and a reduce-scatter backward each
    assert sum(it.count for it in layer) >= 2 * 8 * 3 * 0.75
    for it in layer:
        assert it.asynchronous and not it.sync and it.flops_between > 0, it


def test_layout_flags_go_with_their_layouts():
    """The mesh files' pipelined all-gather serves ZeRO-3's weight gathers, two collectives in
    flight the collective matmul's backward (tp > 1 + SP, bf16 GEMMs) and ZeRO-3 across nodes;
    other layouts start XLA without them (jaxpar.distributed.run_xla_flags)."""
    from jaxpar.distributed import run_xla_flags

    mesh = C.load_mesh("h100-8")
    hw = mesh.hardware
    gather = "--xla_gpu_enable_pipelined_all_gather=true"
    overlap = "--xla_gpu_experimental_parallel_collective_overlap_limit=4"
    assert {gather, overlap} <= set(hw.xla_flags)
    for zero in (0, 1, 2, 3):
        for tp, sp, recipe in ((1, False, "none"), (8, False, "none"), (8, True, "none"),
                               (8, True, "tensorwise")):  # fmt: skip
            lay = dataclasses.replace(mesh.layout, zero=zero, tp=tp, sequence_parallel=sp,
                                      fp8=recipe)  # fmt: skip
            got = run_xla_flags(hw, lay)
            assert (gather in got) == (zero == 3)
            assert (overlap in got) == (tp > 1 and sp and recipe == "none")  # one node
            assert set(hw.xla_flags) - set(got) <= {gather, overlap}
    assert run_xla_flags(hw) == list(hw.xla_flags)
    # ZeRO-3 over more ranks than a node holds (a100-64: 8 a node)
    pod = C.load_mesh("a100-64")
    for dp, zero, want in ((8, 3, False), (16, 3, True), (16, 1, False)):
        lay = dataclasses.replace(pod.layout, dp=dp, tp=1, sp=1, zero=zero,
                                  sequence_parallel=False)  # fmt: skip
        assert (overlap in run_xla_flags(pod.hardware, lay)) == want, (dp, zero)


def test_zero3_across_nodes_keeps_its_scatters_beside_compute(tmp_path):
    """llama3-70b's layer shape (4 layers) on h100-1024, dp 1024 ZeRO-3 with full recompute:
    the run starts with four collectives in flight, and every reduce-scatter of the layers'
    gradients has compute between its start and done. With one in flight (XLA's default) the
    backward waited on one right after starting it, and seven gathers ran synchronously:
    27% of the wire bytes exposed against 13% at two (BENCHMARKS.md, "Two collectives in flight for
    ZeRO-3 across nodes")."""
    _plugin_or_fail()
    out = _report(_compile(tmp_path, "--model", "llama3-70b", "-o", "model.n_layers=4",
                           "--mesh", "h100-1024", "--global-batch", "1024", "--seq-len",
                           "8192", "--dp", "1024", "--tp", "1", "--pp", "1", "--zero", "3",
                           "--remat", "full", "--microbatches", "1", "--json"))  # fmt: skip
    limit = "--xla_gpu_experimental_parallel_collective_overlap_limit=4"
    assert limit in out["xla_flags"]["applied"]
    ov = out["overlap"]
    scatters = [c for c in ov["async_collectives"] if c["kind"] == "reduce-scatter"]
    assert scatters and all(c["flops_between"] > 0 for c in scatters), scatters
    assert ov["synchronous"] <= 1 and ov["exposed_share"] < 0.2, ov["exposed_share"]


def test_tp_with_microbatches_keeps_one_forward(tmp_path):
    """tp 8 + SP, ZeRO-1, 2 micro-batches (llama3-8b, 4 layers): with XLA:GPU's pipelined
    all-gather the compiled step held a second copy of a micro-batch's forward (1.31x the
    planner's memory, tp bytes 1.68x); the layout runs without that flag: 1.00x, 1.15x."""
    _plugin_or_fail()
    out = _report(_compile(tmp_path, "--model", "llama3-8b", "-o", "model.n_layers=4",
                           "--mesh", "h100-8", "--seq-len", "2048", "--dp", "1", "--tp", "8",
                           "--sequence-parallel", "--pp", "1", "--zero", "1", "--remat",
                           "selective", "--microbatches", "2", "--json"))  # fmt: skip
    assert out["xla_flags"]["withheld"] == ["--xla_gpu_enable_pipelined_all_gather=true"]
    assert 0.9 < out["memory"]["ratio"] < 1.1, out["memory"]
    assert out["collectives"]["tp"]["ratio"] < 1.25, out["collectives"]["tp"]


@pytest.mark.parametrize("zero,d_model", [(0, 256), (3, 512)])
def test_weight_heavy_model_memory_within_10_percent(tmp_path, zero, d_model):
    """Models whose weights outweigh their activations, over 8 GPUs. DDP (d 256): the
    non-finite guard on the update (a select on GPU targets) leaves no second params + moments
    in the temporaries (a cond there made it 1.47x the planner); each layer's gradient is
    all-reduced inside the backward's layer loop (DPReduction.reduces_in_backward), most of
    those bytes with a matmul between start and done (none when the stacked gradient was
    reduced after the loop), one layer's gradient in flight in the planner's figure. ZeRO-3
    (d 512): the layer in flight, its gathered bf16 weights and its fp32 gradient before the
    reduce-scatter, is in the planner's figure (without it 1.57x)."""
    _plugin_or_fail()
    import jax

    from jaxpar.analysis.hlo_gpu import async_collectives
    from jaxpar.devices import make_mesh

    model = tmp_path / "wide.yaml"
    model.write_text(
        MODEL_YAML.replace("d_model: 64", f"d_model: {d_model}").replace(
            "d_ff: 128", f"d_ff: {4 * d_model}"
        )
    )
    hlo = tmp_path / "step.hlo"
    out = _report(_compile(tmp_path, "--model", str(model), "--mesh", "h100-8", "--dp", "8",
                           "--tp", "1", "--pp", "1", "--zero", str(zero), "--hlo", str(hlo),
                           "--json"))  # fmt: skip
    mem = out["memory"]
    assert 0.9 < mem["ratio"] < 1.1, mem
    if zero == 0:
        assert mem["temp"] < mem["argument"], mem
        assert out["layout"]["dp_reduction"] == "all_reduce_per_layer"
        lay = dataclasses.replace(C.load_mesh("h100-8").layout, dp=8, tp=1, pp=1, sp=1)
        items = async_collectives(hlo.read_text(), make_mesh(lay, jax.devices()[:8]))
        reduces = [it for it in items if it.kind == "all-reduce" and it.axes == ("dp",)]
        total = sum(it.wire_bytes * it.count for it in reduces)
        beside = sum(it.wire_bytes * it.count for it in reduces if it.flops_between > 0)
        assert len(reduces) > 2 and beside > 0.5 * total, reduces


def test_compile_zero3_saves_and_loads(tmp_path):
    """ZeRO-3 over dp 8: the gathers and reduce-scatters asynchronous; --save writes the
    executable once (a second --save into the file is refused) and --load checks it here."""
    _plugin_or_fail()
    exe = tmp_path / "step.jaxpar"
    layout = ("--dp", "8", "--tp", "1", "--pp", "1", "--zero", "3")
    out = _report(_compile(tmp_path, "--mesh", "a100-8", *layout, "--save", str(exe), "--json"))
    assert out["attention"]["chosen"] == "cudnn" and out["attention"]["in_program"]
    dp = out["collectives"]["dp"]
    kinds = dp["by_kind"]
    assert kinds["all-gather"]["count"] > 0 and kinds["reduce-scatter"]["count"] > 0
    assert 0.8 < dp["ratio"] < 1.25 and 0.5 < out["memory"]["ratio"] < 2.5
    assert out["saved"]["bytes"] == exe.stat().st_size > 0
    again = _compile(tmp_path, "--mesh", "a100-8", *layout, "--save", str(exe), check=False)
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"jaxpar compile: error: argument --save: '{exe}': file exists; refusing to overwrite it"
    ]
    data = exe.read_bytes()  # the real file, cut and altered: refused before unpickling
    flip = data[:-9] + bytes([data[-9] ^ 1]) + data[-8:]
    for name, bad in (("cut", data[: len(data) // 2]), ("flip", flip)):
        (tmp_path / name).write_bytes(bad)
        with pytest.raises(ConfigError, match=r"damaged: .* do not match its sha256"):
            saved.read(tmp_path / name)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])
    )
    cmd = [sys.executable, "-m", "jaxpar.cli", "compile", "--load", str(exe), "--json"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["target"]["gpu"] == "a100-sxm4-80gb" and got["executables"] == 1
    assert got["arguments"] > 10 and len(got["sha256"]) == 64
    assert got["format"] == "jaxpar-gpu-executable/2" and len(got["file_sha256"]) == 64
    assert got["loaded"] is os.path.exists("/proc/driver/nvidia/version")


def _grads(cfg):
    """Loss and gradients of the layout from its own initial params, on stdlib rows."""
    import jax
    import numpy as np

    from jaxpar.data import Batches, load_corpus
    from jaxpar.devices import make_mesh
    from jaxpar.train.step import Trainer

    tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices]))
    t = cfg.train
    batch = Batches(load_corpus("stdlib", 256), t.global_batch, t.seq_len, seed=3)
    loss, g = tr.grads(tr.init_state(0)["params"], batch.global_array(0, tr.batch_sharding))
    return float(loss), jax.tree.map(np.asarray, g)


@functools.cache
def _one_device_grads():
    """The one-device reference, once for both ZeRO stages below."""
    from conftest import small_config

    return _grads(small_config(dp=1))


@pytest.mark.parametrize("zero,k", [(0, 1), (2, 2), (3, 2)])
def test_per_leaf_collectives_match_single_device(monkeypatch, zero, k):
    """The GPU targets' ZeRO form, run on CPU devices (reduce.packed_collectives false): one
    gather and one reduce-scatter per leaf, not one per layer or gradient, and each layer's
    gradient reduced inside the backward's layer scan (DPReduction.reduces_in_backward):
    all-reduced at stage 0 with one micro-batch, reduce-scattered in each of two micro-batches'
    backwards at stage 2; ZeRO-3 with two micro-batches reduces in its gathers' transposes.
    Loss and every gradient leaf of dp 4 x tp 2 equal one device's."""
    import jax
    import numpy as np
    from conftest import small_config

    from jaxpar.train import reduce

    ref_loss, ref = _one_device_grads()
    calls, layers = [], []
    monkeypatch.setattr(reduce, "packed_collectives", lambda: calls.append(1) or False)
    in_backward = reduce.DPReduction.reduced_in_backward
    monkeypatch.setattr(reduce.DPReduction, "reduced_in_backward",
                        lambda self, *a: layers.append(a[0]) or in_backward(self, *a))  # fmt: skip
    loss, g = _grads(small_config(dp=4, tp=2, zero=zero, microbatches=k))
    assert calls  # the per-leaf form ran
    assert set(layers) == ({"layers"} if zero == 2 or zero < 3 and k == 1 else set()), layers
    assert abs(loss / ref_loss - 1) < 1e-5
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6), g, ref)


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_guarded_update_keeps_the_state_when_not_finite(platform):
    """Both forms of the optimizer's non-finite guard (the select XLA:GPU gets, the cond XLA:CPU
    gets), run on CPU: the update where the flag is true, the old state bit for bit where not."""
    import types

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpar.train.step import guarded

    state = {"p": jnp.arange(4.0), "m": jnp.ones((2, 2))}
    device = types.SimpleNamespace(platform=platform)

    def update(s):
        return jax.tree.map(lambda a: a * 2 + jnp.nan, s)  # a NaN that must not leak

    for ok in (True, False):
        got = jax.jit(lambda o, s: guarded(o, update, s, device))(jnp.asarray(ok), state)
        want = update(state) if ok else state
        jax.tree.map(np.testing.assert_array_equal, got, want)


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_load_refuses_a_damaged_or_foreign_file_in_one_line(tmp_path, capsys):
    """Issue 48: ``--load`` of a damaged or hand-made file ended in a traceback or loaded it
    silently. A saved file is a format line, a sha256 of the rest and a JSON header: anything
    else is refused in one line, exit 2, before any unpickling (no plugin needed)."""
    target = {"gpu": "h100-sxm5-80gb", "topology": "1x1x8", "compute_capability": "9.0",
              "plugin": "jax_cuda12_plugin 0", "cuda": "12.9", "cudnn": "9.8.0"}  # fmt: skip
    good = saved.encode({"jax": "0"}, target, {"model": "tiny"}, b"body")
    marker = tmp_path / "code-ran"
    flipped = bytearray(good)
    flipped[good.index(b"tiny")] ^= 1  # one bit of the header
    files = {
        "empty": (b"", "empty file, not a jaxpar GPU executable"),
        "text": (b"hello\n", "not a jaxpar GPU executable (its first line is not"),
        "pickle": (pickle.dumps(_RunsCode(marker)), "its first line is not"),  # the old format
        "future": (good.replace(b"/2\n", b"/9\n", 1), "format 'jaxpar-gpu-executable/9'"),
        "nosum": (good.replace(b"sha256:", b"md5:", 1), "its second line is not the sha256"),
        "cut": (good[:-1], "damaged: its contents"),
        "flipped": (bytes(flipped), "damaged: its contents"),
        "header": (saved.encode({}, {"gpu": 1}, {}, b""), "its header: TypeError"),
        "body": (good, "its body: "),  # checksummed and well-formed, but not jaxpar's body
        "dir": (None, "cannot read it: Is a directory"),
        "missing": (None, "cannot read it: No such file or directory"),
    }
    for name, (data, message) in files.items():
        path = tmp_path / name
        if name == "dir":
            path.mkdir()
        elif data is not None:
            path.write_bytes(data)
        assert main(["compile", "--load", str(path)]) == 2, name
        out = capsys.readouterr()
        assert out.out == "" and len(out.err.strip().splitlines()) == 1, (name, out.err)
        assert out.err.startswith(f"jaxpar compile: error: --load='{path}': "), out.err
        assert message in out.err, (name, out.err)
    assert not marker.exists()  # the foreign pickle was never unpickled


def test_outputs_are_checked_before_anything_compiles(tmp_path, capsys, monkeypatch):
    """Issue 48: ``--save``/``--hlo`` targets were checked only after compiling, and
    ``--save X --hlo X`` was accepted. Each output must be a new file in an existing directory
    and no two the same file, refused in one line before the step is built."""
    from jaxpar.commands import compile as compile_cmd

    monkeypatch.chdir(tmp_path)
    (tmp_path / "old").write_text("x")
    (tmp_path / "d").mkdir()
    monkeypatch.setattr(compile_cmd, "build_config", lambda args: pytest.fail("it compiled"))
    same = "the same file as --save; each output needs its own file"
    load = "--load='y': checks a saved executable and compiles nothing;"
    cases = [
        (["--save", "old"], "argument --save: 'old': file exists; refusing to overwrite it"),
        (["--hlo", "d"], "argument --hlo: 'd': is a directory, expected a file path"),
        (["--save", "no/x"], "argument --save: 'no/x': directory 'no' does not exist"),
        (["--hlo", ""], "argument --hlo: '': not a file path"),
        (["--save", "x", "--hlo", "x"], f"--hlo='x': {same}"),
        (["--save", "x", "--hlo", "./d/../x"], f"--hlo='./d/../x': {same}"),
        (["--save", "t.json", "--trace", "t.json"], f"--trace='t.json': {same}"),
        (["--load", "y", "--save", "x"], f"{load} --save does not apply to it"),
        (["--load", "y", "--dp", "2"], f"{load} --dp does not apply to it"),
    ]
    for flags, message in cases:
        assert main(["compile", "--mesh", "h100-8", *flags]) == 2, flags
        out = capsys.readouterr()
        assert out.err.splitlines() == [f"jaxpar compile: error: {message}"], (flags, out.err)
    assert sorted(os.listdir(tmp_path)) == ["d", "old"]  # nothing written
