#!/usr/bin/env bash
# Proves mega's GPU path on one node in minutes: bf16 dtypes, layouts, asynchronous saves with a
# killed rank and a resume (LAMB and Adam), TP overlap, flash-attn's sliding window, the self-check,
# CUDA-event timing, LAMB over NCCL. One JSON line per check on stdout; exit 1 if any check failed.
# A check that needs more GPUs than the node has prints {"check": ..., "skipped": "needs N GPUs,
# found M"} and is not a failure. What each check proves: docs/gpu.md.
#
#   bash infra/gpu-smoke.sh                     # on the GPU node, from anywhere
#   PYTHON=/opt/venv/bin/python bash infra/gpu-smoke.sh
#   bash infra/gpu-smoke.sh --cpu-dry-run       # the same steps on the CPU twin of h100-8x (no GPU)
#
# PYTHON picks the interpreter (default: the repository's .venv, else python3); GPU_SMOKE_DIR the
# working directory (default: a fresh temporary one, kept and named on stderr). The corpus is
# generated there; nothing outside it is written. Needs torch, megatron-core, hydra-core and mega's
# other runtime packages (docs/gpu.md lists them); not Prefect.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"

if [ -n "${PYTHON:-}" ]; then
  py=$PYTHON
elif [ -x .venv/bin/python ]; then
  py=.venv/bin/python
else
  py=python3
fi
dry_run=()
for arg in "$@"; do
  case "$arg" in
    --cpu-dry-run) dry_run=(--cpu-dry-run) ;;
    *) echo "gpu-smoke: unknown argument $arg (only --cpu-dry-run)" >&2; exit 2 ;;
  esac
done

export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
# Not exported here: check rank_env proves that mega's launchers put CUDA_DEVICE_MAX_CONNECTIONS=1
# (cluster.env) in every rank's environment.
unset CUDA_DEVICE_MAX_CONNECTIONS
out=${GPU_SMOKE_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-smoke.XXXXXX")}
echo "gpu-smoke: $("$py" --version 2>&1), working in $out" >&2
if [ ${#dry_run[@]} -eq 0 ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu-smoke: nvidia-smi not found: this needs a node with NVIDIA GPUs (or --cpu-dry-run)" >&2
  exit 1
fi
exec "$py" infra/gpu_smoke.py --out "$out" "${dry_run[@]}"
