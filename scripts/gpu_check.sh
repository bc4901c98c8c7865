#!/usr/bin/env bash
# One-GPU check of jaxpar: bench a ~1.1B Llama in bf16 (tokens/s, TFLOP/s, MFU, memory, the
# attention implementation chosen) and check 2 steps of losses against a CPU fp32 run.
# Prints one JSON object as the last line of stdout; exit 0 when every check passed.
#
#   bash scripts/gpu_check.sh          # one NVIDIA GPU, a few minutes
#   bash scripts/gpu_check.sh --dry    # CPU, tiny sizes, about a minute
#
# Needs only what `pip install -e .` installs (jax with its CUDA plugin on the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
