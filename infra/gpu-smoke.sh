#!/usr/bin/env bash
# GPU smoke test of mega's NCCL/CUDA configuration path. UNVERIFIED ON A GPU: written on a CPU-only
# machine. What it runs is what the CPU tests run with only cluster.backend/cluster.device
# swapped (tests/test_backend_flags.py asserts the exact list of settings that differ).
#
#   bash infra/gpu-smoke.sh [steps]        # from anywhere; STEPS defaults to 6
#
# 1. one GPU: a few steps of GPT 1.3B (conf/model/gpt-1.3b.yaml) in bf16;
# 2. every GPU of the node: the same model with TP=2 x PP=2 x DP=N/4 when the GPU count allows
#    (TP over NVLink, batched p2p between stages, the distributed optimizer), else DP=N;
# 3. every GPU: async checkpoint saves and a restore (the distributed optimizer gathers its
#    checkpoint over megatron's gloo DP group, which GPU runs lacked before backend_flags).
# flash-attn is used (model.fused_ops=true) when it is installed. Each stage prints the JSON line of
# `python -m mega.bench ...`; the script stops at the first failure.
# GPU_SMOKE_DRY_RUN=1 GPU_SMOKE_NGPU=N prints the commands instead (the CPU tests check them).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
STEPS=${1:-6}
DRY_RUN=${GPU_SMOKE_DRY_RUN:-}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

run() {
  if [ -n "$DRY_RUN" ]; then echo "+ $*"; else "$@"; fi
}

if [ -n "$DRY_RUN" ]; then
  NGPU=${GPU_SMOKE_NGPU:-8}
else
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu-smoke: nvidia-smi not found: this needs a node with NVIDIA GPUs" >&2
    exit 1
  fi
  NGPU=$(nvidia-smi -L | grep -c '^GPU ')
  "$PY" - <<'EOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu-smoke: torch {torch.__version__} has no CUDA: install a CUDA build of torch==2.13.0")
print(f"gpu-smoke: torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
EOF
fi

common=(model=gpt-1.3b cluster=gpu-1 train.precision=bf16 parallelism.micro_batch_size=1)
if "$PY" -c "import flash_attn" >/dev/null 2>&1; then
  echo "gpu-smoke: flash-attn installed: model.fused_ops=true"
  common+=(model.fused_ops=true)
fi

echo "== 1 GPU: GPT 1.3B, $STEPS steps"
CUDA_VISIBLE_DEVICES=0 run "$PY" -m mega.bench step "${common[@]}" parallelism=single \
  parallelism.global_batch_size=8 --steps "$STEPS" --warmup 2 --json

if [ "$NGPU" -ge 4 ] && [ $((NGPU % 4)) -eq 0 ]; then
  layout=(parallelism=tp2-pp2-dp2 "parallelism.dp=$((NGPU / 4))" "parallelism.global_batch_size=$((2 * NGPU))")
else
  layout=(parallelism=single "parallelism.dp=$NGPU" "parallelism.global_batch_size=$((8 * NGPU))")
fi
echo "== $NGPU GPUs: GPT 1.3B, ${layout[*]}, $STEPS steps"
run "$PY" -m mega.bench step "${common[@]}" "${layout[@]}" --steps "$STEPS" --warmup 2 --json

if [ "$NGPU" -ge 2 ]; then
  ckpt=$(mktemp -d)
  trap 'rm -rf "$ckpt"' EXIT
  echo "== $NGPU GPUs: checkpoint saves and a restore (DP=$NGPU)"
  run "$PY" -m mega.bench checkpoint cluster=gpu-1 train.precision=bf16 parallelism=single "parallelism.dp=$NGPU" \
    "parallelism.global_batch_size=$((8 * NGPU))" --storage "file://$ckpt" --steps 12 --interval 4 --json
fi
