"""The ``jaxpar train`` flags and the config field each sets: a leaf module, read by the
train, plan, compile and inference command lines alike."""

from __future__ import annotations

from jaxpar.commands import _checks as K

# CLI flag -> dotted config field. Flags left unset keep the YAML/embedded value.
FLAGS: dict[str, tuple[str, type, str]] = {
    "steps": ("train.steps", K.positive_int, "number of optimizer steps"),
    "seed": ("train.seed", K.seed, "seed of init and data order"),
    "global_batch": ("train.global_batch", K.positive_int, "sequences per step, all devices"),
    "seq_len": ("train.seq_len", K.positive_int, "tokens per sequence"),
    "lr": ("train.lr", K.positive_float, "peak learning rate"),
    "data": ("train.data", str, "'stdlib' (embedded corpus), 'synthetic', or a .bin token file"),
    "eval_data": (
        "train.eval_data",
        str,
        "held-out .bin token file (default: the sidecar's validation file, else the last 5%%)",
    ),
    "data_dtype": ("train.data_dtype", str, "uint8 | uint16 | uint32: a .bin without sidecar"),
    "checkpoint_dir": ("train.checkpoint_dir", str, "where orbax checkpoints go (one run at a "
                       "time: locked by jaxpar.lock)"),
    "checkpoint_every": ("train.checkpoint_every", K.positive_int, "steps between checkpoints"),
    "keep_checkpoints": ("train.keep_checkpoints", K.positive_int, "complete checkpoints to keep"),
    "metrics_file": ("train.metrics_file", str, "JSONL metrics (appended)"),
    "tensorboard": ("train.tensorboard_dir", str, "also write TensorBoard scalars here"),
    "eval_every": ("train.eval_every", K.nonneg_int, "steps between held-out evaluations "
                   "(0: end only)"),
    "on_nonfinite": ("train.on_nonfinite", str, "skip | stop on a non-finite loss/gradient"),
    "max_skipped_steps": ("train.max_skipped_steps", K.nonneg_int, "divergence budget: a "
                          "skipping run stops (exit 3) when more steps diverged (default 3)"),
    "devices": ("mesh.devices", K.positive_int, "devices of the cluster (simulated on CPU)"),
    "dp": ("layout.dp", K.positive_int, "data-parallel size"),
    "tp": ("layout.tp", K.positive_int, "tensor-parallel size"),
    "pp": ("layout.pp", K.positive_int, "pipeline stages"),
    "sp": ("layout.sp", K.positive_int, "sequence/context-parallel size"),
    "ep": ("layout.ep", K.positive_int, "expert-parallel size: experts over groups of ep dp "
           "ranks (MoE models; divides dp)"),
    "zero": ("layout.zero", K.int_in(0, 3), "ZeRO stage 0-3"),
    "microbatches": ("layout.microbatches", K.positive_int, "micro-batches per step"),
    "schedule": ("layout.schedule", str, "pipeline schedule"),
    "virtual": ("layout.virtual", K.positive_int, "virtual pipeline stages per rank"),
    "pipeline_memory": ("layout.pipeline_memory", str, "fast (fused ticks) | lean (1f1b: "
                        "stashes capped at pp - rank, a longer lock step)"),
    "sp_mode": ("layout.sp_mode", str, "ulysses | ring"),
    "remat": ("layout.remat", str, "none | full | selective | offload"),
    "offload": ("layout.offload", str, "none | optimizer | params"),
    "compute_dtype": ("layout.compute_dtype", str, "float32 | bfloat16"),
    "fp8": ("layout.fp8", str, "none | tensorwise | rowwise | delayed: FP8 GEMMs in the "
            "attention projections and MLP (needs --compute-dtype bfloat16)"),
    "profile_steps": ("train.profile_steps", str, "A:B: write a jax.profiler trace of steps A..B"),
    "profile_dir": ("train.profile_dir", str, "directory of the profiler trace"),
    "init_from_hf": ("train.init_from_hf", str, "start from a Hugging Face Llama directory"),
    "export_hf": ("train.export_hf", str, "write the final weights as a Hugging Face directory"),
}  # fmt: skip
