"""Time every README example as written (in a fresh clone, on the reference 2-core machine): the short ones
to the end, the long training runs for LIMIT seconds, extrapolated from their logged steps."""
import csv, os, re, subprocess, sys, time, glob, json
from pathlib import Path
REPO = Path(sys.argv[1]).resolve()  # a clone set up with `make setup`
RUNS = REPO / "runs"
LIMIT = 150
env = {**os.environ, "PATH": f"{REPO}/.venv/bin:" + os.environ["PATH"]}
def run(cmd, limit=None):
    t = time.time()
    try:
        p = subprocess.run(cmd, shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", ""
    return time.time() - t, rc, out
def newest_run(before):
    runs = {p.parent for p in RUNS.glob("*/*/identity.json")} - before
    return max(runs, key=lambda p: p.stat().st_mtime) if runs else None
rows = []
def record(cmd, seconds, rc, how):
    rows.append({"command": cmd, "seconds": round(seconds, 1), "rc": rc, "how": how})
    print(rows[-1], flush=True)
    with open(sys.argv[3], "w") as f:
        w = csv.DictWriter(f, ["command", "seconds", "rc", "how"]); w.writeheader(); w.writerows(rows)
def train(cmd, full=False):
    before = {p.parent for p in RUNS.glob("*/*/identity.json")}
    s, rc, out = run(cmd, None if full else LIMIT)
    if rc == 0:
        return record(cmd, s, rc, "ran to the end"), newest_run(before)
    d = newest_run(before)
    cfg = json.loads((d / "identity.json").read_text())["config"]
    total = cfg["trainer"]["max_steps"]
    lines = (d / "losses.csv").read_text().strip().splitlines()[1:]
    steps = len(lines)
    # steady rate from the log's first and last step times is not logged; use the wall rate (startup included)
    record(cmd, s / max(steps, 1) * total, rc, f"{steps} of {total} steps in {s:.0f} s, extrapolated")
    return d
ckpt_run = None
cmds = [line.strip() for line in open(sys.argv[2]) if line.strip()]
for c in cmds:
    if c.startswith("ttt-bench train"):
        r = train(c, full="max_steps=200" in c or "task=image" in c)
        if "max_steps=200" in c:
            ckpt_run = r[1] if isinstance(r, tuple) else r
    else:
        c2 = c.replace("runs/<run>", str(ckpt_run) if ckpt_run else "runs/<run>")
        s, rc, out = run(c2)
        record(c, s, rc, "ran to the end" + ("" if rc == 0 else f": {out.strip().splitlines()[-1][:200] if out.strip() else ''}"))
