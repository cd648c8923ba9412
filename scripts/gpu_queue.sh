#!/usr/bin/env bash
# One item of the GPU queue on a lent GPU (docs/gpu_campaign.md, "How a call runs an item"). Run from the
# repository root on the device machine as the device tool's command:
#     bash scripts/gpu_queue.sh [ITEM|next]        carry: .whl .gpudata .gpuruns     timeout_s: 600
# It installs the wheels the node lacks (.whl/, results/gpu/RUN.md names them) and the toolkit, then
# `python -m ttt_bench.campaign --stage queue`: the item's step trained for at most 380 s, what finished
# tabulated there (100 s at most), everything packed into $OUT (at most 7 files; the tool brings 8 back).
# Here, afterwards: python -m ttt_bench.campaign --unpack <files_at>, then commit results/gpu/<step>/.
set -u
ITEM=${1:-next}
T0=$(date +%s)
: "${OUT:?OUT is set by the device tool: the folder whose files come back}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 4; }
echo "install $(( $(date +%s) - T0 )) s"
python3 -m ttt_bench.campaign --stage queue --item list
# GPU utilisation and memory every 15 s: whether the runs sharing the GPU saturate it (the queue's jobs)
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 15 > "$OUT/smi.log" 2>&1 &
SMI=$!
python3 -m ttt_bench.campaign --stage queue --item "$ITEM" --data-dir .gpudata --runs /tmp/runs --work /tmp/work \
  --resume .gpuruns --pack "$OUT"
RC=$?
kill "$SMI" 2> /dev/null
ls -la "$OUT"
echo "queue rc=$RC, total $(( $(date +%s) - T0 )) s"
exit $RC
