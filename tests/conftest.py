"""Tests run on 8 simulated CPU devices, set once before JAX initialises."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# No persistent compilation cache: on XLA CPU (jaxlib 0.10.2) a multi-device pipeline program
# loaded from it beside the same program compiled in the process deadlocked in a collective's
# rendezvous, or returned a wrong loss, within a few repeats (1F1B then interleaved v 1, pp 2:
# the same HLO; 12 of 12 clean with the cache off). It saved about a minute of suite time.
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

# glibc's allocator as it comes, here and in the CLI children: the suite compiles far more than
# it steps, and the one malloc arena of jaxpar.hostmem (every jaxpar CPU run's default: no page
# faults on each step's temporaries) slows XLA's multi-threaded compile by about a quarter
# (8.1 s against 6.3 s for the issue-13 step). tests/test_hostmem.py checks the kept mode.
os.environ.setdefault("JAXPAR_HOST_ALLOCATOR", "system")

# Tests compile far more than they run, and XLA's CPU compile time is mostly LLVM's: its
# backend at -O0 compiles the suite's programs about 40% faster (test_grad_path's two heaviest
# cases: 51 s against 30 s). The optimized HLO — every sharding, collective, copy and buffer the
# tests inspect — is the same text at either level (checked on a dp 2 x tp 2 x pp 2 ZeRO-3
# step); only the machine code is slower, which tiny test shapes do not feel. Children the
# tests start get these flags from ``TEST_XLA_FLAGS`` (some replace XLA_FLAGS wholesale).
#
# And XLA:CPU's classic elemental emitters for its fusions in place of the MLIR fusion
# emitters (the default on jaxlib 0.10.2), which compile faster (tests/test_zero.py's ZeRO-2
# case 10.9 -> 8.6 s, the two FP8 MoE cases 40.5 -> 29.3 s). Unlike the level above this
# changes the optimized HLO: XLA:CPU fuses less with them (a dp 2 x tp 2 x pp 2 ZeRO-3 step:
# 395 fusions and 134 copies against 466 and 150); the collectives are the same. Only where
# the installed jaxlib knows the flag: XLA aborts on one it does not.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def _jaxlib_knows(flag: str) -> bool:
    """Whether the installed jaxlib's XLA names ``flag`` (read from its shared library, without
    importing JAX: XLA_FLAGS must be set before it initialises)."""
    import importlib.util
    import mmap
    from pathlib import Path

    spec = importlib.util.find_spec("jaxlib")
    for lib in Path(spec.origin).parent.glob("*.so") if spec and spec.origin else ():
        with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(flag.encode()) >= 0:
                return True
    return False


# What a test that reads XLA:CPU's fusions and copies passes to ``compile(...)`` to inspect
# the program jaxpar's CPU users get (the default emitters), not the suite's.
DEFAULT_CPU_FUSION: dict = {}
if _jaxlib_knows("xla_cpu_use_fusion_emitters"):
    TEST_XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"
    DEFAULT_CPU_FUSION = {"xla_cpu_use_fusion_emitters": True}
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from jaxpar import config as C  # noqa: E402

# The test model, once: small_config uses it, and MODEL_YAML is its model file for the
# subprocess tests that run the CLI.
TEST_MODEL = dict(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256,
                  max_seq_len=64)  # fmt: skip
MODEL_YAML = "name: test\n" + "".join(f"{k}: {v}\n" for k, v in TEST_MODEL.items())


def small_config(**layout) -> C.RunConfig:
    """A run small enough to compile and step in about a second on 2 cores."""
    cfg = C.load("tiny", "cpu-8")
    cfg.model = C.ModelConfig(name="test", **TEST_MODEL)
    cfg.train.global_batch = 16
    cfg.train.seq_len = 32
    cfg.train.steps = 5
    cfg.train.warmup_steps = 2
    cfg.train.eval_every = 0
    cfg.train.progress = False
    cfg.layout.dp, cfg.layout.tp, cfg.layout.pp, cfg.layout.microbatches = 1, 1, 1, 1
    cfg.layout.remat = "none"  # the cpu-8 default recomputes; tests choose remat explicitly
    for k, v in layout.items():
        setattr(cfg.layout, k, v)
    cfg.mesh.devices = cfg.layout.n_devices
    return cfg


@pytest.fixture
def make_cfg():
    """Factory of small run configs: ``make_cfg(dp=8)``."""
    return small_config


# The slowest files first. ``--dist loadfile`` hands each worker one file at a time, by default
# in descending order of test count, which left two-test files like test_install.py (two
# minutes) to the end, one worker finishing them while the other sat idle. Ordered by their
# measured time (heaviest first; unlisted files follow in collection order), the last files
# handed out are the short ones. A stale list only costs balance, never a test.
SLOW_FIRST = (
    "test_docs.py", "test_attention.py", "test_gpu_compile.py", "test_pipeline.py", "test_fp8.py",
    "test_fp8_delayed.py",
    "test_moe_ragged.py", "test_moe.py", "test_grad_path.py", "test_moe_pipeline.py",
    "test_survive.py", "test_harden.py", "test_install.py", "test_tpsp.py", "test_zero.py",
    "test_planner.py", "test_pods.py", "test_plan_verify.py",
    "test_reliability.py", "test_planner_moe.py", "test_moe_decode.py", "test_notebook.py",
    "test_gpu_remat.py",
    "test_planner_auto.py", "test_train.py", "test_vocab_pad.py", "test_data_e2e.py",
    "test_gpu_timing.py", "test_decode.py", "test_pipeline_grads.py", "test_hf.py",
    "test_hostmem.py", "test_fuzz.py", "test_pipeline_gpu_sends.py", "test_bench.py",
    "test_flag_checks.py", "test_loop.py", "test_kept_and_true.py", "test_generate_hf.py",
    "test_schedules.py", "test_prepare.py", "test_hf_moe.py", "test_tokens.py",
    "test_fuzz_files.py",
)  # fmt: skip


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file
