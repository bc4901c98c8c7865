"""Published large training runs with their full layouts, costed by the planner's own model.

Each :class:`Run` is one row of a table someone published: model shape, GPU kind and count,
TP/PP/DP/context-parallel/virtual stages, micro-batch and global batch, recompute and ZeRO,
the framework (an :class:`~jaxpar.planner.executor.Executor`: attention kernel, asynchronous
pipeline, overlapped collectives) and the measured throughput, with its source. The planner
predicts each row's step time with exactly the cost model ``jaxpar plan`` uses, on the
hardware section of the repository's mesh file for that GPU kind; the three constants the
model has — the matmul-efficiency roofline's ``share_max`` (fitted) and ``kappa`` in
:mod:`jaxpar.planner.hardware`, ``ELEMENTWISE_PASSES`` in :mod:`jaxpar.planner.cost` (both
set, see :func:`fit`) — were chosen on the rows in :data:`FITTED` only; every other row is
held out.

Where a source leaves a layout detail open the row states the assumption (``assumed``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from dataclasses import dataclass, field

from jaxpar import config as C
from jaxpar.config import HardwareConfig, LayoutConfig, ModelConfig
from jaxpar.planner import hardware as HWM
from jaxpar.planner.cost import ELEMENTWISE_PASSES, step_cost
from jaxpar.planner.executor import Executor
from jaxpar.planner.memory import Shape

MEGATRON_2021 = Executor("Megatron-LM 2021", attention="dense", score_bytes=5.0, lockstep=False)
DEEPSPEED_2022 = Executor("Megatron-DeepSpeed 2022", attention="dense", score_bytes=5.0,
                          lockstep=False)  # fmt: skip
NEMO_2024 = Executor("NeMo 24.09/24.11", attention="blockwise", lockstep=False, overlap_tp=1.0)
TORCHTITAN = Executor("torchtitan FSDP2", attention="blockwise", lockstep=False)
MAXTEXT = Executor("MaxText (JAX)", attention="blockwise", lockstep=False)

SRC_MEGATRON = "Narayanan et al., SC 2021, Table 1 (TFLOP/s per GPU, recompute counted)"
SRC_DGXC = "NVIDIA/dgxc-benchmarking@143b90dd {} (BF16 table, training step time)"
SRC_BLOOM = ("bigscience-workshop/bigscience@00327f8c train/tr11-176B-ml/README.md "
             "(iteration 85376 log line)")  # fmt: skip
SRC_TITAN = "pytorch/torchtitan@04133643 docs/performance.md (64 A100 80GB, WPS per GPU)"


def _gpt(name: str, layers: int, d: int, heads: int, vocab: int = 51200, seq: int = 2048,
         kv: int = 0, ff: int = 0, mlp: str = "gelu", tied: bool = True):  # fmt: skip
    return ModelConfig(name=name, n_layers=layers, d_model=d, n_heads=heads,
                       n_kv_heads=kv or heads, d_ff=ff or 4 * d, vocab_size=vocab,
                       max_seq_len=seq, mlp=mlp, tied_embeddings=tied)  # fmt: skip


def _llama(name: str, layers, d, heads, kv, ff, vocab, seq) -> ModelConfig:
    return _gpt(name, layers, d, heads, vocab, seq, kv, ff, "swiglu", tied=False)


@dataclass(frozen=True)
class Run:
    """One published run: layout, framework, measured step time and where it comes from."""

    name: str
    source: str
    mesh: str  # the repository mesh file whose hardware section describes the GPU
    model: ModelConfig
    gpus: int
    layout: LayoutConfig
    global_batch: int
    step_time_s: float  # measured (or derived from the published throughput, see `note`)
    executor: Executor
    note: str = ""
    hardware: dict = field(default_factory=dict)  # departures from the mesh file (the NICs)

    @property
    def seq(self) -> int:
        """Sequence length."""
        return self.model.max_seq_len

    def tokens_per_s_per_gpu(self, step_time: float) -> float:
        """Throughput of a step of ``step_time`` seconds."""
        return self.global_batch * self.seq / step_time / self.gpus


def _layout(gpus, tp=1, pp=1, cp=1, v=1, mbs=1, gbs=1, remat="none", zero=1, dp_shard=0,
            schedule="interleaved", sp_mode="ring") -> LayoutConfig:  # fmt: skip
    dp = gpus // (tp * pp * cp)
    return LayoutConfig(dp=dp, tp=tp, pp=pp, sp=cp, zero=zero, dp_shard=dp_shard,
                        microbatches=gbs // (dp * mbs), schedule=schedule if pp > 1 else "1f1b",
                        virtual=v if pp > 1 else 1, sp_mode=sp_mode,
                        sequence_parallel=tp > 1, remat=remat, compute_dtype="bfloat16",
                        reduce_dtype="float32")  # fmt: skip


def _megatron(name, heads, d, layers, tp, pp, gpus, batch, tflops) -> Run:
    model = _gpt(name, layers, d, heads)
    s, v = 2048, 51200
    # The paper's FLOPs per step, counting the recomputed forward: 96·B·s·l·h²(1 + s/6h +
    # V/16lh); its TFLOP/s per GPU is that over time and GPUs.
    flops = 96 * batch * s * layers * d * d * (1 + s / (6 * d) + v / (16 * layers * d))
    lay = _layout(gpus, tp, pp, v=2, gbs=batch, remat="full", zero=0)
    lay = dataclasses.replace(lay, sequence_parallel=False)
    return Run(f"GPT {name}", SRC_MEGATRON, "a100-8", model, gpus, lay, batch,
               flops / (tflops * 1e12 * gpus), MEGATRON_2021,
               f"{tflops:g} TFLOP/s per GPU; assumed: micro-batch 1, 2 virtual stages, no ZeRO, "
               "no sequence parallelism (2021)")  # fmt: skip


RUNS: tuple[Run, ...] = (
    _megatron("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135.0),
    _megatron("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138.0),
    _megatron("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140.0),
    _megatron("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148.0),
    _megatron("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155.0),
    _megatron("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163.0),
    Run(
        "BLOOM 176B",
        SRC_BLOOM,
        "a100-8",
        # 70 blocks over 12 stages, the tied embeddings counted as a block at each end: the
        # busiest stage holds 6 blocks, so the stage is costed as 72/12.
        _gpt("bloom-176b", 72, 14336, 112, vocab=250880),
        384,
        _layout(384, tp=4, pp=12, mbs=2, gbs=2048, remat="full", zero=1, schedule="1f1b"),
        2048,
        104.70,
        DEEPSPEED_2022,
        "ZeRO-1 (BF16 optimizer), DeepSpeed 1F1B pipeline, full recompute; 4 × 100 Gb/s "
        "Omni-Path per node",
        {"nics_per_node": 4, "nic_bw": 12.5e9},
    ),
    Run(
        "torchtitan Llama 3 8B",
        SRC_TITAN,
        "a100-8",
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
        64,
        _layout(64, gbs=64, remat="selective", zero=3),
        64,
        8192 / 2973,
        TORCHTITAN,
        "2973 tokens/s per GPU, FSDP2 over 64, local batch 1, selective op AC; assumed: "
        "8 × 200 Gb/s per node",
    ),
    Run(
        "torchtitan Llama 3 70B",
        SRC_TITAN,
        "a100-8",
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
        64,
        _layout(64, gbs=64, remat="full", zero=3),
        64,
        8192 / 331,
        TORCHTITAN,
        "331 tokens/s per GPU, FSDP2 over 64, local batch 1, full AC",
    ),
    Run(
        "torchtitan Llama 2 13B",
        SRC_TITAN,
        "a100-8",
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
        64,
        _layout(64, gbs=128, mbs=2, remat="none", zero=3),
        128,
        2 * 4096 / 2162,
        TORCHTITAN,
        "2162 tokens/s per GPU, FSDP2 over 64, local batch 2, no AC",
    ),
    Run(
        "torchtitan Llama 2 70B",
        SRC_TITAN,
        "a100-8",
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
        64,
        _layout(64, gbs=128, mbs=2, remat="full", zero=3),
        128,
        2 * 4096 / 353,
        TORCHTITAN,
        "353 tokens/s per GPU, FSDP2 over 64, local batch 2, full AC",
    ),
    Run(
        "NeMo GPT-3 175B (128 GPUs)",
        SRC_DGXC.format("nemo_megatron/README_175b.md"),
        "h100-8",
        _gpt("gpt3-175b", 96, 12288, 96),
        128,
        _layout(128, tp=4, pp=8, v=12, gbs=256, zero=1),
        256,
        8.309,
        NEMO_2024,
        "TP 4, PP 8, VP 12, MBS 1; assumed: no recompute, distributed optimizer",
    ),
    Run(
        "NeMo GPT-3 175B (2048 GPUs)",
        SRC_DGXC.format("nemo_megatron/README_175b.md"),
        "h100-8",
        _gpt("gpt3-175b", 96, 12288, 96),
        2048,
        _layout(2048, tp=4, pp=8, v=12, gbs=4096, zero=1),
        4096,
        8.49,
        NEMO_2024,
        "weak scaling of the 128-GPU row",
    ),
    Run(
        "NeMo Llama 3.1 8B",
        SRC_DGXC.format("llama3.1/README_8b.md"),
        "h100-8",
        _llama("llama3.1-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
        8,
        _layout(8, cp=2, gbs=128, zero=1),
        128,
        12.91,
        NEMO_2024,
        "TP 1, PP 1, CP 2, MBS 1, GA 32 on 8 GPUs",
    ),
    Run(
        "NeMo Llama 3.1 70B (64 GPUs)",
        SRC_DGXC.format("llama3.1/README_70b.md"),
        "h100-8",
        _llama("llama3.1-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
        64,
        _layout(64, tp=4, pp=4, cp=2, v=5, gbs=128, zero=1),
        128,
        14.72,
        NEMO_2024,
        "TP 4, PP 4, CP 2, VP 5, MBS 1",
    ),
    Run(
        "NeMo Llama 3.1 70B (2048 GPUs)",
        SRC_DGXC.format("llama3.1/README_70b.md"),
        "h100-8",
        _llama("llama3.1-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
        2048,
        _layout(2048, tp=4, pp=4, cp=2, v=5, gbs=4096, zero=1),
        4096,
        14.98,
        NEMO_2024,
        "weak scaling of the 64-GPU row",
    ),
    Run(
        "NeMo Llama 3.1 405B (576 GPUs)",
        SRC_DGXC.format("llama3.1/README_405b.md"),
        "h100-8",
        _llama("llama3.1-405b", 126, 16384, 128, 16, 53248, 128256, 8192),
        576,
        _layout(576, tp=8, pp=9, cp=2, v=7, gbs=252, zero=1),
        252,
        17.20,
        NEMO_2024,
        "TP 8, PP 9, CP 2, VP 7, MBS 1; the recipe's 16 query groups",
    ),
    Run(
        "NeMo Llama 3.1 405B (2304 GPUs)",
        SRC_DGXC.format("llama3.1/README_405b.md"),
        "h100-8",
        _llama("llama3.1-405b", 126, 16384, 128, 16, 53248, 128256, 8192),
        2304,
        _layout(2304, tp=8, pp=9, cp=2, v=7, gbs=1008, zero=1),
        1008,
        17.62,
        NEMO_2024,
        "weak scaling of the 576-GPU row",
    ),
    Run(
        "NeMo Nemotron-4 340B",
        SRC_DGXC.format("nemotron/README_340b.md"),
        "h100-8",
        _gpt("nemotron4-340b", 96, 18432, 96, vocab=256000, seq=4096, kv=8, tied=False),
        128,
        _layout(128, tp=8, pp=8, v=12, gbs=32, zero=1),
        32,
        4.61,
        NEMO_2024,
        "TP 8, PP 8, VP 12, MBS 1, GA 16; squared-ReLU MLP costed as two matrices",
    ),
    Run(
        "MaxText Llama 2 70B",
        SRC_DGXC.format("maxtext/README_70b.md"),
        "h100-8",
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
        64,
        _layout(64, mbs=2, gbs=128, zero=3, remat="selective"),
        128,
        6.999,
        MAXTEXT,
        "FSDP 64, MBS 2 (JAX, XLA on GPU); assumed: remat saving matmul outputs",
    ),
)
FITTED = ("GPT 76.1B", "torchtitan Llama 3 8B", "NeMo GPT-3 175B (128 GPUs)")


@dataclass(frozen=True)
class Fit:
    """The cost model's three constants (``share_max`` fitted, the others set)."""

    share_max: float = HWM.ROOFLINE_SHARE_MAX
    kappa: float = HWM.ROOFLINE_KAPPA
    elementwise_passes: float = ELEMENTWISE_PASSES


@functools.lru_cache(maxsize=16)
def _mesh_hardware(name: str) -> HardwareConfig:
    return C.load_mesh(name).hardware


def run_hardware(run: Run, fit: Fit | None = None) -> HardwareConfig:
    """The mesh file's hardware for ``run`` (its curve regenerated from ``fit`` when given)."""
    hw = dataclasses.replace(_mesh_hardware(run.mesh), **run.hardware)
    if fit is not None:
        curve = HWM.roofline_curve(hw.peak_flops_bf16, hw.hbm_bw, fit.share_max, fit.kappa)
        hw = dataclasses.replace(hw, matmul_efficiency=curve)
    return hw


def predict(run: Run, fit: Fit | None = None) -> dict:
    """Predicted vs published throughput of one row (``error`` = predicted/published − 1)."""
    hw = run_hardware(run, fit)
    passes = (fit or Fit()).elementwise_passes
    cost = step_cost(run.model, hw, run.layout, Shape(run.global_batch, run.seq), run.executor,
                     elementwise_passes=passes)  # fmt: skip
    t = cost.step_time
    return {
        "name": run.name,
        "source": run.source,
        "gpu": run.mesh.split("-")[0].upper(),
        "gpus": run.gpus,
        "framework": run.executor.name,
        "layout": _layout_text(run.layout),
        "published_tokens_per_s_per_gpu": run.tokens_per_s_per_gpu(run.step_time_s),
        "predicted_tokens_per_s_per_gpu": run.tokens_per_s_per_gpu(t),
        "published_step_s": run.step_time_s,
        "predicted_step_s": t,
        "error": run.step_time_s / t - 1,
        "fitted": run.name in FITTED,
        "terms": dict(cost.terms),
        "note": run.note,
    }


def _layout_text(lay: LayoutConfig) -> str:
    parts = [f"tp{lay.tp}", f"pp{lay.pp}"] + ([f"v{lay.virtual}"] if lay.pp > 1 else [])
    parts += [f"cp{lay.sp}"] if lay.sp > 1 else []
    parts += [f"dp{lay.dp}", f"ZeRO-{lay.zero}", f"m{lay.microbatches}", f"remat {lay.remat}"]
    return " ".join(parts)


def comparison(fit: Fit | None = None) -> list[dict]:
    """Every row, predicted."""
    return [predict(r, fit) for r in RUNS]


def summary(rows: list[dict]) -> dict:
    """Median absolute error and share within 20%, fitted and held-out rows apart."""
    out = {}
    for key, sel in (("fitted", True), ("held_out", False)):
        errs = [abs(r["error"]) for r in rows if r["fitted"] == sel]
        out[key] = {
            "rows": len(errs),
            "median_abs_error": statistics.median(errs) if errs else math.nan,
            "within_20pct": sum(e <= 0.20 for e in errs) / len(errs) if errs else math.nan,
            "max_abs_error": max(errs) if errs else math.nan,
        }
    return out


def fit() -> tuple[Fit, list[dict]]:
    """Fit ``share_max`` on the :data:`FITTED` rows only (least squares of log throughput,
    0.40–0.90 in steps of 0.01); ``kappa`` = 1 (a matmul of smallest dimension g does about g
    FLOPs per byte it moves, so g/(g + ridge) is the roofline's smooth form) and two
    elementwise passes (each saved activation written once and read once) are set, not fitted:
    with all three free, three rows cannot tell the size dependence from the level and the
    fit runs to a flat curve. Returns the fit and its comparison over every row."""
    fitted = [r for r in RUNS if r.name in FITTED]
    best = None
    for i in range(51):
        f = Fit(share_max=round(0.40 + 0.01 * i, 2))
        loss = sum(math.log1p(predict(r, f)["error"]) ** 2 for r in fitted)
        if best is None or loss < best[0]:
            best = (loss, f)
    assert best is not None
    return best[1], comparison(best[1])
