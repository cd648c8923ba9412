"""Each progress line of a timestamped `make reproduce` log (scripts/eta/measure.sh) against the time that
was really left: seconds_since_start, run, of, name, eta_min, true_remaining_min, error_pct (CSV on stdout)."""

import csv
import re
import sys

lines = open(sys.argv[1]).read().splitlines()
total = int(lines[-1].split()[0])
pattern = re.compile(r"run (\d+)/(\d+) \(([^)]+)\): elapsed [\d.]+ min, (ETA ([\d.]+) (min|s)|ETA after a run)")
out = csv.writer(sys.stdout)
out.writerow(["seconds_since_start", "run", "of", "name", "eta_min", "true_remaining_min", "error_pct"])
for line in lines:
    if m := pattern.search(line):
        t, left = int(line.split()[0]), (total - int(line.split()[0])) / 60
        eta = None if not m.group(5) else float(m.group(5)) / (60 if m.group(6) == "s" else 1)
        err = round(100 * (eta - left) / left, 1) if eta is not None and left > 0 else None
        out.writerow([t, m.group(1), m.group(2), m.group(3), eta, round(left, 2), err])
