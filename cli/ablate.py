"""`ttt-bench ablate SWEEP`: run a sweep of conf/sweep/SWEEP.yaml as a Hydra multirun into one results
registry (OUT/registry.csv); finished runs are skipped, failed runs recorded."""

import argparse
import os
from pathlib import Path

from ttt_bench.cli.main import SUBCOMMANDS


def run(args: list[str]) -> None:
    from ttt_bench.experiments.sweeps import PROFILES, SWEEPS

    p = argparse.ArgumentParser(prog="ttt-bench ablate", description=SUBCOMMANDS["ablate"] + " (conf/sweep/)")
    p.add_argument("sweep", choices=SWEEPS)
    p.add_argument(
        "--profile", choices=PROFILES, default="cpu", help="sizes, contexts and budgets (default cpu)"
    )
    p.add_argument("--out", type=Path, help="sweep folder (default: $TTT_BENCH_RUNS/sweeps/SWEEP-PROFILE)")
    p.add_argument(
        "--data-dir", help="real corpora (pile-mini/, books-mini/ or Pile shards); default synthetic"
    )
    p.add_argument("--plan", action="store_true", help="print the runs and their overrides, run nothing")
    p.add_argument(
        "launcher",
        nargs="*",
        help="Hydra overrides for the launcher, e.g. hydra/launcher=joblib "
        "hydra.launcher.n_jobs=2, or hydra/launcher=submitit_slurm hydra.launcher.partition=gpu",
    )
    a = p.parse_args(args)
    from ttt_bench.experiments.sweeps import plan_sweep, run_sweep

    if a.plan:
        for name, spec in plan_sweep(a.sweep, a.profile, a.data_dir).items():
            print(f"{name}: {' '.join(spec['overrides'])}")
        return
    out = a.out or Path(os.environ.get("TTT_BENCH_RUNS", "runs")) / "sweeps" / f"{a.sweep}-{a.profile}"
    df = run_sweep(a.sweep, a.profile, out, a.data_dir, a.launcher)
    counts = df["status"].value_counts().to_dict()
    print(f"{a.sweep}: {counts}; registry {Path(out) / 'registry.csv'}")
