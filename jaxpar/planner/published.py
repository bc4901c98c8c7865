"""Published large-scale training results, costed by the planner (throughput validation).

Source: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021, Table 1 (GPT models, sequence 2048, vocabulary 51,200, A100-80GB,
DGX nodes with 8 × 200 Gb/s HDR InfiniBand, interleaved 1F1B, full activation recomputation).
Their TFLOP/s per GPU count recomputation — 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) per step —
so the comparison uses the same formula on the planner's predicted step time.

The rows used (name, heads, hidden, layers, tp, pp, GPUs, global batch, TFLOP/s per GPU); the
529.6B row (pp = 35) is left out. Param counts recomputed from these shapes match the table's.
The planner's two efficiency constants were fitted on the 18.4B, 76.1B and 310.1B rows; the
39.1B, 145.6B and 1008B rows are held out. Unknown to us and assumed: micro-batch size 1,
2 virtual stages per rank, fp32 gradient reduction, no ZeRO.
"""

from __future__ import annotations

from jaxpar.config import HardwareConfig, LayoutConfig, ModelConfig
from jaxpar.planner import memory as M
from jaxpar.planner import search as S

MEGATRON_2021 = (
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135.0),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138.0),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140.0),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148.0),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155.0),
    ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163.0),
)
FITTED = ("18.4B", "76.1B", "310.1B")
A100 = HardwareConfig(
    platform="gpu",
    device_memory_bytes=85899345920,
    peak_flops_bf16=312e12,
    intra_node_bw=300e9,
    inter_node_bw=25e9,
    devices_per_node=8,
    host_to_device_bw=25e9,
)
SEQ, VOCAB = 2048, 51200


def megatron_comparison() -> list[dict]:
    """Predicted vs published TFLOP/s per GPU for each row (``error`` = predicted/published − 1)."""
    out = []
    for name, a, h, layers, tp, pp, n, batch, published in MEGATRON_2021:
        model = ModelConfig(name=name, n_layers=layers, d_model=h, n_heads=a, n_kv_heads=a,
                            d_ff=4 * h, vocab_size=VOCAB, max_seq_len=SEQ, mlp="gelu",
                            tied_embeddings=True)  # fmt: skip
        dp = n // (tp * pp)
        lay = LayoutConfig(dp=dp, tp=tp, pp=pp, sp=1, zero=0, microbatches=batch // dp,
                           schedule="interleaved", virtual=2 if pp > 1 else 1, remat="full",
                           compute_dtype="bfloat16")  # fmt: skip
        c = S.evaluate(model, A100, lay, M.Shape(batch, SEQ), lockstep=False)
        flops = 96 * batch * SEQ * layers * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * layers * h))
        predicted = flops / c.step_time / n / 1e12
        out.append({
            "model": name, "params_b": model.param_count() / 1e9, "tp": tp, "pp": pp, "dp": dp,
            "gpus": n, "batch": batch, "published_tflops": published,
            "predicted_tflops": predicted, "error": predicted / published - 1,
            "fitted": name in FITTED, "step_time_s": c.step_time, "bubble": c.bubble,
            "terms": dict(c.cost.terms),
        })  # fmt: skip
    return out
