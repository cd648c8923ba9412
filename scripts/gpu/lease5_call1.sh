# Lease 5 (2026-11-26): the gpu profile's scaling step (Books at 34,816 bytes, the long-context claims).
# Run from the repository root on a lent GPU (the device tool's command; $OUT comes back). Moved from
# results/gpu/lease5/call1.sh (issue 51); its logs are results/gpu/leases/lease5/call1_*.log, results/gpu/RUN.md.
set -u
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >$OUT/install.log 2>&1 || { cat $OUT/install.log; exit 4; }
echo "install $(( $(date +%s) - T0 )) s"
mkdir -p /tmp/res/gpu && cp -r results/gpu/units /tmp/res/gpu/
R="python3 -m ttt_bench.reproduce --profile gpu --steps scaling --data-dir .gpudata --out /tmp/res --runs /tmp/runs"
(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader -l 15 > $OUT/smi.log 2>&1 &)
timeout -k 15 ${BUDGET:-450} $R --jobs ${JOBS:-4} > $OUT/reproduce.log 2>&1
echo "reproduce rc=$? at $(( $(date +%s) - T0 )) s"
pkill -f ttt_bench.reproduce; pkill -f joblib; pkill -f loky; sleep 2
grep -E "run [0-9]+/|val loss|failed|rror|step scaling|steps of" $OUT/reproduce.log | cut -c1-220 | tail -45
if [ ! -f /tmp/res/gpu/scaling/step.json ]; then
  timeout 90 $R --no-train >> $OUT/reproduce.log 2>&1; echo "no-train rc=$? at $(( $(date +%s) - T0 )) s"
fi
tar czf $OUT/res.tgz -C /tmp/res gpu
tar czf $OUT/runs.tgz --exclude='*.ckpt' --exclude='*.pt' -C /tmp runs
ls -la $OUT; echo "total $(( $(date +%s) - T0 )) s"
