#!/usr/bin/env bash
# TTT-Linear's Triton kernels on a GPU node (issue 48, point 2: kernels/ttt_linear_prefill.py, and the training
# kernel's launches, kernels/ttt_linear.py), in one command of at most 9 minutes, with the node's python3 (torch and Triton; GPU_SPEED_PYTHON to choose another), nothing
# installed, no network:
#     bash scripts/gpu_speed.sh [DIR]            or: make gpu-speed [GPU_SPEED_DIR=DIR]
# DIR: where the results go (default $OUT, the device tool's folder, else /tmp/ttt-gpu-speed):
#   gpu.txt             the GPU, its clocks and the torch / Triton versions
#   prefill_check.csv   the kernel against float64 PyTorch on the GPU: every candidate num_warps (1, 2, 4 and
#                       the default) in bf16, the default launch in tf32 and float32; poisoned outputs
#   prefill_speed.csv   the chunk kernel (old_kernel; old_path: with the layer's conversions around it) vs the
#                       prefill kernel at num_warps 1, 2, 4, at the 125m (12 x 64) and 1.3b (32 x 64) head
#                       shapes, batch 16, contexts 2k and 8k, bf16: median of 7 CUDA-event timings after 2
#                       warm-up calls (kernels/speed.py says what each column is)
#   train_speed.csv     the chunk kernel's fwd+bwd (tf32, every gradient) at the 125m and 1.3b head shapes,
#                       batch 8 x 2k, at its default launch and each (forward, backward) num_warps of
#                       TRAIN_LAUNCHES, checked against the default; beside it the PyTorch dual form
#   check.log, speed.log, train.log  their output; the table at the end of speed.log
# Each stage runs under its own timeout; the exit status is 0 when both ran and every check passed.
set -u
cd "$(dirname "$0")/.." || exit 2
DIR=${1:-${OUT:-/tmp/ttt-gpu-speed}}
PY=${GPU_SPEED_PYTHON:-python3}  # not PY: make passes its own PY (a Python version) on
mkdir -p "$DIR" || exit 2
T0=$(date +%s)
export PYTHONUNBUFFERED=1
# kernels/ installs as ttt_bench.kernels; uninstalled, it imports from the repository root as `kernels`
MOD=kernels.speed
if timeout 30 "$PY" -c "import ttt_bench.kernels.speed" 2> /dev/null; then
  MOD=ttt_bench.kernels.speed
fi
timeout 15 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv 2>&1 | tee "$DIR/gpu.txt"
timeout 30 "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())" 2>&1 | tee -a "$DIR/gpu.txt"
timeout 200 "$PY" -m "$MOD" --stage check --out "$DIR" 2>&1 | tee "$DIR/check.log"
CHECK=${PIPESTATUS[0]}
timeout 160 "$PY" -m "$MOD" --stage speed --out "$DIR" 2>&1 | tee "$DIR/speed.log"
SPEED=${PIPESTATUS[0]}
timeout 120 "$PY" -m "$MOD" --stage train --out "$DIR" 2>&1 | tee "$DIR/train.log"
TRAIN=${PIPESTATUS[0]}
echo "gpu_speed: check rc=$CHECK, speed rc=$SPEED, train rc=$TRAIN (124: timed out), $(( $(date +%s) - T0 )) s;" \
  "results in $DIR"
[ "$CHECK" = 0 ] && [ "$SPEED" = 0 ] && [ "$TRAIN" = 0 ]
