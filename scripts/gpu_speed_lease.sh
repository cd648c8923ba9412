#!/usr/bin/env bash
# The speed work's lease (issues 48 and 49; docs/gpu_campaign.md, "The next lease"): in one or two calls of
# the device tool, from the repository root on the lent GPU, highest value per minute first:
#     PARTS="check speed bench" bash scripts/gpu_speed_lease.sh     carry: .whl wheelhouse   timeout_s: 600
#     PARTS="figure3 train" bash scripts/gpu_speed_lease.sh         (a second call, if the lease has time)
# .whl/ holds the wheels the node lacks (results/gpu/RUN.md names them) and fla-core + einops
# (`make wheelhouse WHEEL_EXTRAS=fla`); wheelhouse/ the mamba-ssm and causal-conv1d wheels built here for sm_90
# (`make mamba-wheels`, docs/offline.md). Each part runs under its own timeout (LIMIT, seconds) and packs its
# folder and log into $OUT/<part>.tgz, so a part cut short still returns what it wrote:
#   check    the campaign's check stage: `ttt-bench doctor`, the CUDA test subset (campaign.PYTEST_FILES: every
#            op's backends against its reference, TTT-Linear's training kernel on 16-bit strided activations,
#            TTT-MLP's forward, backward and decode kernels, the scan and conv on mamba-ssm / causal-conv1d,
#            fla parity) and the Triton kernels against float64 at head sizes 16-128
#   speed    make gpu-speed: the prefill kernel checked and timed at num_warps 1, 2, 4, and the training
#            kernel's fwd+bwd at each (forward, backward) launch of kernels/speed.TRAIN_LAUNCHES
#   bench    the campaign's bench stage: forms at the 125m and 1.3b head shapes (fla beside them), the 1.3b
#            block profile, the four models' prefill and decode at 125m, 1.3b prefill
#   figure3  the campaign's figure3 stage: 1.3b prefill at batch 16 to 32k, 125m decode at batch 512
#   train    the campaign's train stage: 20 bf16-mixed steps of each model at 125m (TTT-MLP on its kernels,
#            Mamba on mamba-ssm where its wheels installed): tokens/s, peak memory
# Here, afterwards: unpack each <part>.tgz into results/gpu/ (the campaign's folders: check/, speed/,
# figure3/, train/; the speed part's into speed/kernels/) and commit them with the card (gpu.txt).
# DRY=1: on a CPU, nothing installed, each part in its tiny form (the campaign's --dry, the kernels in Triton's
# interpreter): tests/test_campaign.py runs it, so the script cannot rot before a GPU arrives.
set -u
: "${OUT:?OUT is set by the device tool: the folder whose files come back}"
PARTS=${PARTS:-check speed bench}
PY=${PY:-python3}
declare -A LIMIT=([check]=150 [speed]=300 [bench]=200 [figure3]=150 [train]=170)
T0=$(date +%s)
W=${LEASE_WORK:-/tmp/lease}
mkdir -p "$W"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
DRY=${DRY:-}
wheels=$(ls .whl/*.whl wheelhouse/mamba_ssm-*.whl wheelhouse/causal_conv1d-*.whl 2> /dev/null)
if [ -n "$DRY" ]; then
  export TRITON_INTERPRET=1
elif [ -n "$wheels" ]; then
  # shellcheck disable=SC2086  # one word per wheel
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $wheels > "$W/install.log" 2>&1 || { tail -5 "$W/install.log"; exit 3; }
  export PYTHONPATH=/tmp/site
fi
[ -n "$DRY" ] || "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >> "$W/install.log" \
  2>&1 || { tail -20 "$W/install.log"; exit 4; }
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
echo "install $(( $(date +%s) - T0 )) s"

for part in $PARTS; do
  if [ -z "${LIMIT[$part]:-}" ]; then
    echo "unknown part $part: check, speed, bench, figure3 or train"
    continue
  fi
  if [ "$part" = speed ] && [ -n "$DRY" ]; then
    timeout -k 10 "${LIMIT[$part]}" "$PY" -m ttt_bench.kernels.speed --dry --out "$W/speed" --warmup 0 \
      --repeats 1 > "$W/speed.log" 2>&1
  elif [ "$part" = speed ]; then
    timeout -k 10 "${LIMIT[$part]}" bash scripts/gpu_speed.sh "$W/speed" > "$W/speed.log" 2>&1
  else
    timeout -k 10 "${LIMIT[$part]}" "$PY" -m ttt_bench.campaign --stage "$part" --out "$W/$part" \
      --work "$W/work" --force ${DRY:+--dry} > "$W/$part.log" 2>&1
  fi
  rc=$?
  tar czf "$OUT/$part.tgz" -C "$W" "$part" "$part.log" 2> /dev/null
  echo "$part rc=$rc (124: timed out) at $(( $(date +%s) - T0 )) s"
done
ls -la "$OUT"
echo "total $(( $(date +%s) - T0 )) s"
