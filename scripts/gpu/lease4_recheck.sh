# Lease 4: check and train stages again on the current commit (regression check after the reliability changes).
# Run from the repository root on a lent GPU (the device tool's command; $OUT comes back). Moved from
# results/gpu/recheck/lease.sh (issue 51); its outputs are results/gpu/leases/lease4/, results/gpu/RUN.md.
set -u
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >$OUT/install.log 2>&1 || { cat $OUT/install.log; exit 4; }
echo "install $(( $(date +%s) - T0 )) s"
mkdir -p /tmp/g
timeout 80 python3 -m ttt_bench.campaign --stage check --out /tmp/g --work /tmp/work 2>&1 | tee -a $OUT/campaign.log | grep -v "^\s*$" | cut -c1-300 | tail -12
echo "check done $(( $(date +%s) - T0 )) s"
timeout 170 python3 -m ttt_bench.campaign --stage train --out /tmp/g --work /tmp/work 2>&1 | tee -a $OUT/campaign.log | grep -v "^\s*$" | cut -c1-300 | tail -12
tar czf $OUT/g.tgz -C /tmp g
echo "total $(( $(date +%s) - T0 )) s"
