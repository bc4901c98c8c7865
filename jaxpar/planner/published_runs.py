"""The published runs the cost model is checked against: one :class:`Run` per row of a table
someone published, with its source (data only; :mod:`jaxpar.planner.published` costs them).

Where a source leaves a layout detail open the row's ``note`` says what was assumed. A row's
step time is the published one, or derived from the published throughput with the source's
own FLOP count (stated in the note).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from jaxpar.analysis.theory import train_flops_per_token
from jaxpar.config import LayoutConfig, ModelConfig
from jaxpar.planner.frameworks import EAGER_PASSES, Executor

MEGATRON_2021 = Executor("Megatron-LM 2021", attention="dense", score_bytes=5.0, lockstep=False)
MEGATRON_2022 = Executor("Megatron-LM 2022 (SP + selective)", attention="dense",
                         score_bytes=5.0, lockstep=False)  # fmt: skip
# DeepSpeed's pipeline engine sends and receives with blocking point-to-point calls: a stage
# waits for its neighbour at every exchange, so its ticks run in lock step.
DEEPSPEED_2022 = Executor("Megatron-DeepSpeed", attention="dense", score_bytes=5.0,
                          lockstep=True)  # fmt: skip
NEMO_2024 = Executor("NeMo 24.09/24.11", attention="blockwise", lockstep=False, overlap_tp=1.0,
                     overlap_p2p=True, overlap_param_gather=True)  # fmt: skip
TORCHTITAN = Executor("torchtitan FSDP2 (eager)", attention="blockwise", lockstep=False,
                      elementwise_passes=EAGER_PASSES)  # fmt: skip
MAXTEXT = Executor("MaxText (JAX)", attention="blockwise", lockstep=False)
META_2024 = Executor("Meta Llama 3 stack", attention="blockwise", lockstep=False, overlap_p2p=True)

SRC_MEGATRON = "Narayanan et al., SC 2021, Table 1 (TFLOP/s per GPU, recompute counted)"
SRC_SP = "Korthikanti et al., 2022 (arXiv 2205.05198), Tables 3 and 5 (MFU)"
SRC_MTNLG = "Smith et al., 2022 (MT-NLG, arXiv 2201.11990), Table 1 (iteration time)"
SRC_DGXC = "NVIDIA/dgxc-benchmarking@143b90dd {} (BF16 table, training step time)"
SRC_BLOOM = ("bigscience-workshop/bigscience@00327f8c train/tr11-176B-ml/README.md "
             "(iteration 85376 log line)")  # fmt: skip
SRC_TITAN = "pytorch/torchtitan@04133643 docs/performance.md (64 A100 80GB, WPS per GPU)"
SRC_TITAN_H100 = ("pytorch/torchtitan@31a17bfd benchmarks/llama3_h100_202412_torchtitan.md "
                  "(TPS/GPU, FSDP rows without torch.compile)")  # fmt: skip
SRC_LLAMA3 = "Dubey et al., 2024 (The Llama 3 Herd of Models), Table 4 (TFLOPs/GPU)"


def gpt(name: str, layers: int, d: int, heads: int, vocab: int = 51200, seq: int = 2048,
        kv: int = 0, ff: int = 0, mlp: str = "gelu", tied: bool = True) -> ModelConfig:  # fmt: skip
    """A GPT-style shape (Llama-style with ``mlp='swiglu'``)."""
    return ModelConfig(name=name, n_layers=layers, d_model=d, n_heads=heads,
                       n_kv_heads=kv or heads, d_ff=ff or 4 * d, vocab_size=vocab,
                       max_seq_len=seq, mlp=mlp, tied_embeddings=tied)  # fmt: skip


def llama(name: str, layers, d, heads, kv, ff, vocab, seq) -> ModelConfig:
    """A Llama shape."""
    return gpt(name, layers, d, heads, vocab, seq, kv, ff, "swiglu", tied=False)


LLAMA3_8B = llama("llama3.1-8b", 32, 4096, 32, 8, 14336, 128256, 8192)
LLAMA3_70B = llama("llama3.1-70b", 80, 8192, 64, 8, 28672, 128256, 8192)
LLAMA2_70B = llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096)
LLAMA3_405B = llama("llama3.1-405b", 126, 16384, 128, 16, 53248, 128256, 8192)
GPT3_175B = gpt("gpt3-175b", 96, 12288, 96)


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
    hardware: dict = field(default_factory=dict)  # departures from the mesh file

    @property
    def seq(self) -> int:
        """Sequence length."""
        return self.model.max_seq_len

    def tokens_per_s_per_gpu(self, step_time: float) -> float:
        """Throughput of a step of ``step_time`` seconds."""
        return self.global_batch * self.seq / step_time / self.gpus


def layout(gpus, tp=1, pp=1, cp=1, v=1, mbs=1, gbs=1, remat="none", zero=1, dp_shard=0,
           schedule="interleaved", sp_mode="ring") -> LayoutConfig:  # fmt: skip
    """A published layout in jaxpar's terms (bf16 compute, fp32 reductions)."""
    dp = gpus // (tp * pp * cp)
    if v == 1 and schedule == "interleaved":
        schedule = "1f1b"
    return LayoutConfig(dp=dp, tp=tp, pp=pp, sp=cp, zero=zero, dp_shard=dp_shard,
                        microbatches=gbs // (dp * mbs), schedule=schedule if pp > 1 else "1f1b",
                        virtual=v if pp > 1 else 1, sp_mode=sp_mode,
                        sequence_parallel=tp > 1, remat=remat, compute_dtype="bfloat16",
                        reduce_dtype="float32")  # fmt: skip


def _no_sp(lay: LayoutConfig) -> LayoutConfig:
    """Megatron tensor parallelism without sequence parallelism (before 2022)."""
    return dataclasses.replace(lay, sequence_parallel=False)


def _megatron(name, heads, d, layers, tp, pp, gpus, batch, tflops, v=2) -> Run:
    model = gpt(name, layers, d, heads)
    s, vocab = 2048, 51200
    # The paper's FLOPs per step, counting the recomputed forward: 96·B·s·l·h²(1 + s/6h +
    # V/16lh); its TFLOP/s per GPU is that over time and GPUs.
    flops = 96 * batch * s * layers * d * d * (1 + s / (6 * d) + vocab / (16 * layers * d))
    lay = _no_sp(layout(gpus, tp, pp, v=v, gbs=batch, remat="full", zero=0))
    return Run(f"GPT {name}", SRC_MEGATRON, "a100-8", model, gpus, lay, batch,
               flops / (tflops * 1e12 * gpus), MEGATRON_2021,
               f"{tflops:g} TFLOP/s per GPU; assumed: micro-batch 1, {v} virtual stages with a "
               "pipeline, no ZeRO, no sequence parallelism (2021)")  # fmt: skip


def _korthikanti(name, heads, d, layers, tp, pp, gpus, batch, mfu) -> Run:
    model = gpt(name, layers, d, heads)
    s, vocab = 2048, 51200
    # The paper's model FLOPs (no recompute): 72·B·s·l·h²(1 + s/6h + V/12lh).
    flops = 72 * batch * s * layers * d * d * (1 + s / (6 * d) + vocab / (12 * layers * d))
    lay = layout(gpus, tp, pp, gbs=batch, remat="selective", zero=0, schedule="1f1b")
    return Run(f"GPT {name} (SP + selective)", SRC_SP, "a100-8", model, gpus, lay, batch,
               flops / (mfu * 312e12 * gpus), MEGATRON_2022,
               f"MFU {mfu:.1%}; assumed: micro-batch 1, non-interleaved 1F1B")  # fmt: skip


def _mtnlg(nodes: int, secs: float) -> Run:
    gpus = nodes * 8
    return Run(f"MT-NLG 530B ({gpus} GPUs)", SRC_MTNLG, "a100-8",
               gpt("mt-nlg-530b", 105, 20480, 128), gpus,
               _no_sp(layout(gpus, tp=8, pp=35, gbs=1920, remat="full", zero=1,
                             schedule="1f1b")), 1920, secs, DEEPSPEED_2022,
               f"{nodes} DGX A100 nodes, TP 8 × PP 35, no sequence parallelism (2021); assumed: "
               "micro-batch 1, ZeRO-1, full recompute")  # fmt: skip


def _titan_a100(name, model, mbs, remat, tps) -> Run:
    return Run(f"torchtitan {name}", SRC_TITAN, "a100-8", model, 64,
               layout(64, gbs=64 * mbs, mbs=mbs, remat=remat, zero=3), 64 * mbs,
               mbs * model.max_seq_len / tps, TORCHTITAN,
               f"{tps:g} tokens/s per GPU, FSDP2 over 64, local batch {mbs}, {remat} AC",
               )  # fmt: skip


def _titan_h100(gpus: int, tps: float) -> Run:
    return Run(f"torchtitan Llama 3.1 8B FSDP ({gpus} H100)", SRC_TITAN_H100, "h100-8",
               LLAMA3_8B, gpus, layout(gpus, gbs=2 * gpus, mbs=2, remat="selective", zero=3),
               2 * gpus, 2 * 8192 / tps, TORCHTITAN,
               f"{tps:,.0f} TPS/GPU, local batch 2, selective AC, eager; Grand Teton H100 "
               "(HBM2e 96 GB, 2.4 TB/s, 500 W)",
               {"hbm_bw": 2.4e12, "device_memory_bytes": 96e9})  # fmt: skip


def _dgxc(file, name, model, gpus, secs, gbs, note, **kw) -> Run:
    return Run(
        f"{name} ({gpus} GPUs)",
        SRC_DGXC.format(file),
        "h100-8",
        model,
        gpus,
        layout(gpus, gbs=gbs, **kw),
        gbs,
        secs,
        NEMO_2024,
        note,
    )


def _maxtext(gpus: int, secs: float) -> Run:
    shard = min(gpus, 128)
    return Run(f"MaxText Llama 2 70B ({gpus} GPUs)", SRC_DGXC.format("maxtext/README_70b.md"),
               "h100-8", LLAMA2_70B, gpus,
               layout(gpus, mbs=2, gbs=2 * gpus, zero=3, remat="selective",
                      dp_shard=shard if shard < gpus else 0),
               2 * gpus, secs, MAXTEXT,
               f"FSDP {shard}{f' × DP {gpus // shard}' if shard < gpus else ''}, MBS 2 (JAX, "
               "XLA on GPU); assumed: remat saving matmul outputs")  # fmt: skip


def _llama3(gpus: int, dp: int, per_dp: int, tflops: float) -> Run:
    # 126 layers over 16 stages: the busiest stage holds 8 (the first and last hold fewer),
    # so the stage is costed as 128/16; the step from the paper's TFLOPs with 6Ψ + 12·l·h·s.
    costed = dataclasses.replace(LLAMA3_405B, n_layers=128)
    batch = dp * per_dp
    secs = batch * 8192 * train_flops_per_token(LLAMA3_405B, 8192) / (tflops * 1e12 * gpus)
    return Run(f"Llama 3 405B ({gpus} GPUs)", SRC_LLAMA3, "h100-8", costed, gpus,
               layout(gpus, tp=8, pp=16, v=2, gbs=batch, remat="none", zero=1), batch, secs,
               META_2024,
               f"{tflops:g} TFLOPs/GPU, TP 8 × PP 16 × DP {dp}, {per_dp} sequences per DP "
               "rank; assumed: micro-batch 1, 2 virtual stages, no recompute")  # fmt: skip


def _runs_a100() -> list[Run]:
    out = [
        _megatron("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137.0),
        _megatron("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138.0),
        _megatron("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142.0),
        _megatron("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135.0),
        _megatron("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138.0),
        _megatron("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140.0),
        _megatron("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148.0),
        _megatron("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155.0),
        _megatron("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163.0, v=1),
        _megatron("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163.0),
        _korthikanti("22B", 64, 6144, 48, 8, 1, 8, 4, 0.415),
        _korthikanti("175B", 96, 12288, 96, 8, 8, 64, 64, 0.514),
        _korthikanti("530B", 128, 20480, 105, 8, 35, 280, 280, 0.560),
        _korthikanti("1T", 160, 25600, 128, 8, 64, 512, 512, 0.563),
        _mtnlg(280, 60.1),
        _mtnlg(350, 50.2),
        _mtnlg(420, 44.4),
        Run("BLOOM 176B", SRC_BLOOM, "a100-8",
            # 70 blocks over 12 stages, the tied embeddings counted as a block at each end:
            # the busiest stage holds 6 blocks, so the stage is costed as 72/12.
            gpt("bloom-176b", 72, 14336, 112, vocab=250880), 384,
            _no_sp(layout(384, tp=4, pp=12, mbs=2, gbs=2048, remat="full", zero=1,
                          schedule="1f1b")),
            2048, 104.70, DEEPSPEED_2022,
            "ZeRO-1 (BF16 optimizer), DeepSpeed 1F1B pipeline, full recompute; 4 × 100 Gb/s "
            "Omni-Path per node", {"nics_per_node": 4, "nic_bw": 12.5e9}),
        _titan_a100("Llama 3 8B", llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192), 1,
                    "selective", 2973),
        _titan_a100("Llama 3 70B", llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
                    1, "full", 331),
        _titan_a100("Llama 2 13B", llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
                    2, "none", 2162),
        _titan_a100("Llama 2 70B", LLAMA2_70B, 2, "full", 353),
    ]  # fmt: skip
    return out


def _runs_h100() -> list[Run]:
    gpt3 = "nemo_megatron/README_175b.md"
    l8, l70, l405 = (f"llama3.1/README_{s}.md" for s in ("8b", "70b", "405b"))
    out = [_titan_h100(8, 5762), _titan_h100(128, 5605)]
    for gpus, secs in ((128, 8.91), (256, 8.95), (512, 9.09), (1024, 9.01), (2048, 9.02)):
        out.append(_dgxc(gpt3, "NeMo GPT-3 175B", GPT3_175B, gpus, secs, 2 * gpus,
                         "TP 4, PP 8, VP 12, MBS 1; assumed: no recompute, distributed "
                         "optimizer", tp=4, pp=8, v=12, zero=1))  # fmt: skip
    for gpus, secs in ((8, 12.91), (16, 13.00), (32, 13.05), (64, 13.08), (128, 13.10)):
        out.append(_dgxc(l8, "NeMo Llama 3.1 8B", LLAMA3_8B, gpus, secs, 16 * gpus,
                         "TP 1, PP 1, CP 2, MBS 1, GA 32", cp=2, zero=1))  # fmt: skip
    for gpus, secs in ((64, 14.72), (256, 14.8), (1024, 14.92), (2048, 14.98)):
        out.append(
            _dgxc(
                l70,
                "NeMo Llama 3.1 70B",
                LLAMA3_70B,
                gpus,
                secs,
                2 * gpus,
                "TP 4, PP 4, CP 2, VP 5, MBS 1",
                tp=4,
                pp=4,
                cp=2,
                v=5,
                zero=1,
            )
        )
    for gpus, secs in ((576, 17.20), (1152, 17.52), (2304, 17.62)):
        out.append(_dgxc(l405, "NeMo Llama 3.1 405B", LLAMA3_405B, gpus, secs, gpus * 252 // 576,
                         "TP 8, PP 9, CP 2, VP 7, MBS 1; the recipe's 16 query groups", tp=8,
                         pp=9, cp=2, v=7, zero=1))  # fmt: skip
    for gpus, secs in ((64, 6.999), (256, 7.153), (512, 7.091), (2048, 7.066)):
        out.append(_maxtext(gpus, secs))
    out += [_llama3(8192, 64, 32, 430.0), _llama3(16384, 128, 16, 400.0)]
    return out


RUNS: tuple[Run, ...] = (*_runs_a100(), *_runs_h100())
# Chosen before the fit, one TP+PP and one ZeRO-3 run per GPU generation; every other row is
# held out.
FITTED = (
    "GPT 76.1B",
    "torchtitan Llama 3 8B",
    "NeMo GPT-3 175B (128 GPUs)",
    "torchtitan Llama 3.1 8B FSDP (8 H100)",
)
