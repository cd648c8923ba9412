"""Replay the reference-session ETA (ttt_bench/experiments/engine/progress.py) over a measured run: each
progress line's ETA recomputed from the run's progress file (the steps' reference wall times, the runs'
reference seconds), the runs' start and finish times and the steps' starts in the timestamped log, with the
speed taken over the last K finished runs (0: all) and weighted toward the reference by C seconds (env C).
Usage: C=120 python scripts/eta/replay.py /tmp/eta_reproduce.log /tmp/eta/main/runs/reproduce-quick [K]
A run another worker is training counts by the share of its time elapsed (the pipeline reads its logged
steps), so the replay is close to, not equal to, what the log printed."""
import json, re, sys
from pathlib import Path
log = Path(sys.argv[1]).read_text().splitlines(); root = Path(sys.argv[2]); K = int(sys.argv[3]) if len(sys.argv) > 3 else 0
total = int(log[-1].split()[0]); p = json.load(open(root / "progress.json"))
begin_re = re.compile(r"run (\d+)/(\d+) \(([^)]+)\): elapsed"); out_re = re.compile(r"outputs in (\S+)")
sweep_re = re.compile(r"sweep (\w+) \(quick\)"); step_re = re.compile(r"step (\w+): (started|done)")
sweep = None; begins = []; finish = {}; start_of = {}; began = {}; ended = {}
for l in log:
    t = int(l.split()[0])
    if m := sweep_re.search(l): sweep = m.group(1)
    if m := begin_re.search(l):
        d = str(root / sweep / m.group(3)); begins.append((t, d)); start_of.setdefault(d, t)
    if m := out_re.search(l):
        q = m.group(1); q = q if q.startswith("/") else "/tmp/eta/main/" + q; finish[q] = t
    if m := step_re.search(l): (began if m.group(2) == "started" else ended)[m.group(1)] = t
met = {d: json.load(open(Path(d) / "metrics.json")) for d in p["work"] if (Path(d) / "metrics.json").exists()}
work, walls, step_of, jobs = p["work"], p["walls"], p["step_of"], p["jobs"]
def eta(t):
    done = {d for d, tf in finish.items() if tf <= t}
    mine = sorted([d for d in done if d in met], key=lambda d: finish[d])
    if not mine: return None
    use = mine[-K:] if K else mine
    C = float(__import__("os").environ.get("C", "0")); speed = (sum(met[d]["wall_time_s"] for d in use) + C) / (sum(work[d] for d in use) + C)
    left = 0
    for s, w in walls.items():
        if w is None or s in ended and ended[s] <= t: continue
        if s not in began or began[s] > t: left += w * speed; continue
        running = {d: min((t - start_of[d]) / max(finish[d] - start_of[d], 1), 1) for d in start_of if d not in done and start_of[d] <= t and d in finish}
        rl = sum(work[d] * (1 - running.get(d, 0)) for d in work if step_of[d] == s and d not in done)
        left += max(w * speed - (t - began[s]), rl * speed / jobs)
    return left / 60
errs = []
for t, d in begins:
    e = eta(t); true = (total - t) / 60
    if e is None or t < total / 4: continue
    errs.append(100 * (e - true) / true)
print(f"K={K}: min {min(errs):+.0f}% max {max(errs):+.0f}% outside25 {sum(abs(x) > 25 for x in errs)}/{len(errs)}")
