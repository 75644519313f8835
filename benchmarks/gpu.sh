#!/usr/bin/env bash
# GPU inference table for issue #10: timm's port compiled (torch.compile, inductor freezing, fp16,
# channels-last; the anchor) against cgavit fuse + compile and the fused Triton CGA kernel
# (cgavit.kernels), at batch 2048 (images/s) and batch 1 / 8 / 64 (ms per batch), 224 px.
#
# NOT RUN YET: it was written on a machine without a GPU, so no figure in BENCHMARKS.md comes from
# it. Needs a CUDA GPU (Ampere or Hopper), torch with triton, and timm (pip install -e '.[bench]').
# Compiles take most of the time: about 1-2 minutes per compiled path and variant on an H200
# (3 compiled paths, plus one recompile each for batch 1), so about 10 minutes for M0 and M4;
# pass --models efficientvit_m4 for half that.
#
# Usage:  benchmarks/gpu.sh [--models efficientvit_m0 efficientvit_m4] [--batch 2048]
#                           [--latency-batches 1 8 64] [--warmup 5] [--repeats 20]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
unset TRITON_INTERPRET  # the kernels must be compiled for the GPU, not interpreted
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu.sh needs a CUDA GPU')"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
exec "$PY" benchmarks/gpu_bench.py "$@"
