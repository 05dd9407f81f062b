#!/usr/bin/env bash
# Compare parallelism.tp_overlap backends (none, ring, symm_mem, te) on one GPU node: decoder
# forward+backward time per backend and the difference of outputs/gradients from none; JSON last.
# UNVERIFIED: written on a CPU-only machine (docs/overlap.md). Extra arguments go to
# mega.bench.tp_overlap (--block parallel, --backends none,ring, --seq 8192, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-$(nvidia-smi -L | wc -l)}"
# Transformer Engine userbuffers (and megatron's SP overlap) need kernels issued in order.
export CUDA_DEVICE_MAX_CONNECTIONS=1
exec .venv/bin/torchrun --standalone --nproc-per-node "$NPROC" -m mega.bench.tp_overlap "$@"
