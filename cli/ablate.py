"""`ttt-bench ablate SWEEP`: run a sweep of conf/sweep/SWEEP.yaml as a Hydra multirun into one results
registry (OUT/registry.csv); finished runs are skipped, failed runs recorded."""

import os
from pathlib import Path

from ttt_bench.cli.main import SUBCOMMANDS, ArgumentParser, fail


def run(args: list[str]) -> None:
    from ttt_bench.experiments.sweeps import PROFILES, SWEEPS

    p = ArgumentParser(prog="ttt-bench ablate", description=SUBCOMMANDS["ablate"] + " (conf/sweep/)")
    p.add_argument("sweep", choices=SWEEPS)
    p.add_argument(
        "--profile", choices=PROFILES, default="cpu", help="sizes, contexts and budgets (default cpu)"
    )
    p.add_argument("--out", type=Path, help="sweep folder (default: $TTT_BENCH_RUNS/sweeps/SWEEP-PROFILE)")
    p.add_argument(
        "--data-dir", help="real corpora (pile-mini/, books-mini/ or Pile shards); default synthetic"
    )
    p.add_argument(
        "--plan", action="store_true", help="print the runs, their overrides and estimated time; run nothing"
    )
    p.add_argument(
        "launcher",
        nargs="*",
        help="Hydra overrides for the launcher, e.g. hydra/launcher=joblib "
        "hydra.launcher.n_jobs=2, or hydra/launcher=submitit_slurm hydra.launcher.partition=gpu",
    )
    a = p.parse_intermixed_args(args)  # launcher overrides before or after the options
    if a.data_dir is not None and not (a.data_dir and Path(a.data_dir).is_dir()):
        fail(f"--data-dir {a.data_dir} is not a folder; pass the folder holding pile-mini/ and books-mini/ "
             "(e.g. ../shared/data), or leave it out for the synthetic corpus")
    from ttt_bench.experiments.sweeps import (
        CPU_TRAIN_FLOPS,
        calibrates,
        estimate,
        plan_sweep,
        run_recall,
        run_sweep,
    )

    if a.plan:
        stages = [("", {})]
        if a.sweep == "recall" and calibrates(a.profile):
            stages = [
                ("calibration (one seed per lr): ", {}),
                ("grid, at each method's chosen lr (shown at the first): ", {"lrs": {}}),
            ]
        total = 0.0
        for title, options in stages:
            runs = plan_sweep(a.sweep, a.profile, a.data_dir, **options)
            if title:
                print(f"# {title}{len(runs)} runs")
            for name, spec in runs.items():
                e = estimate(spec)
                total += e["minutes"]
                print(
                    f"{name} [{e['tokens']:.3g} tokens, {e['train_flops']:.2g} FLOPs, "
                    f"~{e['minutes']:.1f} min]: {' '.join(spec['overrides'])}"
                )
        print(
            f"# estimated training time: {total:.0f} min at {CPU_TRAIN_FLOPS / 1e9:.0f} GFLOP/s, the small "
            "models' training rate on a 2-core CPU (flops.py's count); GPUs are far faster"
        )
        return
    out = a.out or Path(os.environ.get("TTT_BENCH_RUNS", "runs")) / "sweeps" / f"{a.sweep}-{a.profile}"
    if a.sweep == "recall":
        df, _, lrs = run_recall(a.profile, out, a.data_dir, a.launcher)
        if lrs:
            print(
                "learning rates from the calibration grid: " + ", ".join(f"{m} {v:g}" for m, v in lrs.items())
            )
    else:
        df = run_sweep(a.sweep, a.profile, out, a.data_dir, a.launcher)
    counts = df["status"].value_counts().to_dict()
    print(f"{a.sweep}: {counts}; registry {Path(out) / 'registry.csv'}")
    if counts.get("failed"):  # recorded and skipped by the sweep; the command still says it did not succeed
        fail(f"{counts['failed']} of {len(df)} runs failed (see the registry's 'error' column); fix the "
             "cause and run the same command again to train only those")
