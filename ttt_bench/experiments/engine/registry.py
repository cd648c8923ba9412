"""A sweep folder and its registry: one row per run, merged on read from the runs' metrics.json files.

    <out>/plan.json              the expanded runs: name -> Run (overrides, label, what the tables need)
    <out>/<run>/metrics.json     written by train(), or {"status": "failed", "error": ...}
    <out>/<run>/run.json         the run's overrides and the command that reproduces it
    <out>/<run>/config.yaml      the run's config as the planner composed it: what the job trains
    <out>/<run>/hydra/           Hydra's job files and log
    <out>/registry.csv           every run's metrics and plan columns
"""

import json
from pathlib import Path

import pandas as pd

from ...errors import UserError
from ...io import read_table, write_atomic, write_json
from .plan import Run, identity

NUMERIC = ("val_ppl", "val_accuracy", "test_accuracy", "forward_flops_per_image", "non_embedding_params",
           "params")


def read_metrics(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / "metrics.json").read_text())
    except (OSError, ValueError):
        return None


def run_finished(run_dir: Path) -> bool:
    """Whether the run folder holds a finished run's metrics."""
    return (read_metrics(run_dir) or {}).get("status") == "finished"


def record_failure(run_dir: Path, error: str) -> None:
    write_json(Path(run_dir) / "metrics.json", {"status": "failed", "error": error, "run_dir": str(run_dir)})


def failure_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith("full_key")]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def write_plan(out: Path, sweep: str, profile: str, runs: dict[str, Run], progress: Path) -> Path:
    path = Path(out) / "plan.json"
    write_json(path, {"sweep": sweep, "profile": profile, "dir": str(out), "order": list(runs),
                      "runs": {n: r.to_json() for n, r in runs.items()}, "progress": str(progress)})
    return path


def read_plan(out: Path) -> tuple[dict, dict[str, Run]]:
    plan = json.loads((Path(out) / "plan.json").read_text())
    return plan, {n: Run.from_json(plan["runs"][n]) for n in plan["order"]}  # the plan's order


def collect(out: Path) -> pd.DataFrame:
    """Every run of a sweep folder as one row: plan columns, then metrics (missing runs: status 'pending')."""
    plan, runs = read_plan(out)
    rows = [{"run": name, "sweep": plan["sweep"], "profile": plan["profile"], **run.columns(),
             **(read_metrics(Path(out) / name) or {"status": "pending"}),
             "after": run.after, "overrides": " ".join(run.overrides)}
            for name, run in runs.items()]
    df = pd.DataFrame(rows)
    if "train_flops" not in df:
        df["train_flops"] = float("nan")
    # TF finetune's budget includes its pretraining (the x axis of Figures 13 and 18)
    own = pd.to_numeric(df["train_flops"], errors="coerce")
    parent = df["after"].map(dict(zip(df["run"], own, strict=True)))
    df["total_train_flops"] = own + parent.fillna(0.0)
    return df


def write_registry(out: Path) -> pd.DataFrame:
    df = collect(out)
    write_atomic(Path(out) / "registry.csv", df.to_csv(index=False))
    return df


def read_registry(path: Path) -> pd.DataFrame:
    """A sweep folder's registry (merged anew from its runs when they are there) or a registry CSV."""
    path = Path(path)
    if path.is_dir():
        return collect(path) if (path / "plan.json").is_file() else load_csv(path / "registry.csv")
    if not path.is_file():
        raise UserError(f"no registry at {path}; run `ttt-bench ablate SWEEP --out DIR` first")
    return load_csv(path)


def load_csv(path: Path) -> pd.DataFrame:
    """A committed CSV of a sweep folder; a registry (registry.csv, calibration.csv) is checked as it is read:
    columns `run` and `status`, each run once, and the measurements of finished runs numbers, or a one-line
    error naming the file, the row and what to do."""
    path = Path(path)
    df = read_table(path, fix="restore it from git or delete it and run the sweep again")
    if path.name in ("registry.csv", "calibration.csv"):
        check_registry(df, path)
    return df


def check_registry(df: pd.DataFrame, path: Path) -> None:
    """One line naming `path` and its first problem: a missing `run`/`status` column, a run listed twice (it
    would count as two seeds), a finished run's measurement that is not a number (it would drop a point)."""
    from ...io import not_numbers

    fix = "restore it from git, or delete it and run the sweep again to rebuild it from the run folders"
    if missing := [c for c in ("run", "status") if c not in df]:
        raise UserError(f"registry {path} has no column {', '.join(missing)}; {fix}")
    twice = df["run"][df["run"].duplicated()]
    if len(twice):
        rows = [int(i) + 2 for i in df.index[df["run"] == twice.iloc[0]]]  # file lines: the header is line 1
        raise UserError(f"registry {path} lists run {twice.iloc[0]} twice (lines {rows[0]} and {rows[1]}); "
                        f"{fix}")
    finished = df[df["status"] == "finished"]
    for col in (c for c in NUMERIC if c in finished):
        values = finished[col]
        bad = not_numbers(values)  # "n/a" included: read_table leaves it text
        if bad.any():
            i = bad.idxmax()
            raise UserError(f"registry {path}, line {int(i) + 2} (run {df.at[i, 'run']}): {col} is "
                            f"{values[i]!r}, not a number; {fix}")


def finished_runs(reg: pd.DataFrame | None) -> pd.DataFrame:
    """The registry's finished runs, measurements as numbers; registries older than the seed columns read
    as each run its own configuration, seed 0."""
    if reg is None or reg.empty or "status" not in reg:
        return pd.DataFrame(columns=["run", "config", "seed", "status", "val_ppl", "test_accuracy"])
    df = reg[reg["status"] == "finished"].copy()
    for col in NUMERIC:
        if col in df:
            df[col] = pd.to_numeric(df[col], errors="coerce")
    if "config" not in df:
        df["config"] = df["run"]
    if "seed" not in df:
        df["seed"] = 0
    return df


def select(reg: pd.DataFrame | None, **where) -> pd.DataFrame:
    """Finished runs whose columns equal `where` (compared as text), by seed."""
    df = finished_runs(reg)
    for k, v in where.items():
        if k not in df:
            return df.iloc[:0]
        df = df[df[k].astype(str) == str(v)]
    return df.sort_values("seed")


def restorable(runs: dict[str, Run], registry: Path | None) -> dict[str, dict]:
    """The planned runs that a committed registry (an earlier session's) holds finished with the same
    identity, with their rows; not a run that another run starts from (its checkpoint is needed)."""
    if registry is None or not Path(registry).is_file():
        return {}
    parents = {run.after for run in runs.values()}
    old = pd.read_csv(registry)
    return {row["run"]: row for row in old[old["status"] == "finished"].to_dict("records")
            if row["run"] in runs and row["run"] not in parents
            and identity(row["overrides"]) == identity(runs[row["run"]].overrides)}
