# Lease 5, second call: TF finetune at 34,816 bytes (its pretraining at 1,024 again: the first call's checkpoints stayed there).
# Run from the repository root on a lent GPU (the device tool's command; $OUT comes back). Moved from
# results/gpu/lease5/call2.sh (issue 51); its log is results/gpu/leases/lease5/call2_reproduce.log, results/gpu/RUN.md.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >$OUT/install.log 2>&1 || { cat $OUT/install.log; exit 4; }
sed -i 's/books_methods: \[transformer, ttt_linear_m, mamba\]/books_methods: [transformer]/; s/matched_methods: \[ttt_linear_m\]/matched_methods: []/' conf/sweep/scaling.yaml
mkdir -p /tmp/runs/scaling /tmp/res/gpu && cp -r .gpudata/runs/* /tmp/runs/scaling/ && cp -r results/gpu/units /tmp/res/gpu/
R="python3 -m ttt_bench.reproduce --profile gpu --steps scaling --data-dir .gpudata --out /tmp/res --runs /tmp/runs"
timeout -k 10 ${BUDGET:-200} $R --jobs 3 > $OUT/reproduce2.log 2>&1
echo "reproduce rc=$? at $(( $(date +%s) - T0 )) s"
grep -E "run [0-9]+/|val loss|failed|rror" $OUT/reproduce2.log | cut -c1-200 | tail -20
tar czf $OUT/runs2.tgz --exclude='*.ckpt' --exclude='*.pt' -C /tmp runs
echo "total $(( $(date +%s) - T0 )) s"
