#!/usr/bin/env bash
# How true is the progress line's ETA (results/speed/eta/README.md): the default `make reproduce` in a clean
# clone of this repository's HEAD at /tmp/eta/main, timestamped line by line (seconds since its start).
# Usage: bash scripts/eta/measure.sh [REPO]  ->  /tmp/eta_reproduce.log; then
#   python scripts/eta/table.py /tmp/eta_reproduce.log > ETA.csv   (each line's ETA against the time left)
set -u
REPO=${1:-$(git rev-parse --show-toplevel)}
rm -rf /tmp/eta && git clone -q "$REPO" /tmp/eta/main && ln -sfn "$REPO/../shared" /tmp/eta/shared
cd /tmp/eta/main
git log --oneline | head -1
make setup > /tmp/eta_setup.log 2>&1
rm -rf runs results/quick-synthetic
T0=$(date +%s)
make reproduce 2>&1 | while IFS= read -r line; do echo "$(( $(date +%s) - T0 )) $line"; done > /tmp/eta_reproduce.log
echo "wall $(( $(date +%s) - T0 )) s"
