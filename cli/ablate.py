"""`ttt-bench ablate SWEEP`: run an experiment's sweep (conf/sweep/SWEEP.yaml) as a Hydra multirun into one
results registry (OUT/registry.csv); finished runs are skipped, failed runs recorded."""

from pathlib import Path

from ttt_bench.cli.common import SUBCOMMANDS, ArgumentParser, fail

from ttt_bench.config import runs_root


def run(args: list[str]) -> None:
    from ttt_bench.experiments import EXPERIMENTS, sweeps
    from ttt_bench.experiments.engine.plan import PROFILES

    p = ArgumentParser(prog="ttt-bench ablate", description=SUBCOMMANDS["ablate"] + " (conf/sweep/)")
    p.add_argument("sweep", choices=sweeps())
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
        "--replace", action="store_true",
        help="runs in OUT made with other settings (a sweep refuses them) are moved aside to "
        "OUT/replaced/<time>/ and trained again; nothing is ever deleted",
    )
    p.add_argument(
        "--scale", type=float, default=1.0, metavar="F",
        help="every run's training budget times F, for a trial (e.g. 0.1); part of each run's identity, "
        "and the default folder becomes SWEEP-PROFILE-xF",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides: for the launcher (hydra/launcher=joblib hydra.launcher.n_jobs=2, or "
        "hydra/launcher=submitit_slurm hydra.launcher.partition=gpu), or for training, applied to every run "
        "and part of its identity (e.g. trainer.max_steps=2 for a trial: another sweep folder is advised)",
    )
    a = p.parse_intermixed_args(args)  # overrides before or after the options
    launcher = [o for o in a.overrides if o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    overrides = [o for o in a.overrides if o not in launcher]
    if seeded := [o for o in overrides if o.lstrip("+~").split("=", 1)[0] == "seed"]:
        fail(f"{seeded[0]}: the sweep sets each run's seed (the profile's seeds); leave seed= out")
    if a.data_dir is not None and not (a.data_dir and Path(a.data_dir).is_dir()):
        fail(f"--data-dir {a.data_dir} is not a folder; pass the folder holding pile-mini/ and books-mini/ "
             "(e.g. ../shared/data), or leave it out for the synthetic corpus")
    if not 0 < a.scale < float("inf"):
        fail(f"--scale {a.scale:g} must be a positive number, e.g. --scale 0.1 for a trial at a tenth of the "
             "budget")
    if a.scale != 1:
        overrides.append(f"budget_scale={a.scale:g}")
    experiment = EXPERIMENTS[a.sweep]
    folder = f"{a.sweep}-{a.profile}" + (f"-x{a.scale:g}" if a.scale != 1 else "")
    out = a.out or runs_root() / "sweeps" / folder
    if a.plan:
        print_plan(experiment, a.profile, a.data_dir, overrides, launcher)
        print_folder(experiment, a.profile, a.data_dir, overrides, out, a.replace)
        return
    trained = experiment.train(a.profile, out, a.data_dir, launcher, overrides=overrides, replace=a.replace)
    for key, value in ((k, v) for k, v in trained.info.items() if v):  # what the sweep decided (recall: lrs)
        print(f"{key}: " + (", ".join(f"{m} {v:g}" for m, v in value.items()) if isinstance(value, dict)
                            else str(value)))
    df = trained.registry
    failed = df[df["status"] == "failed"]
    named = len(failed) and {"run", "error"} <= set(failed)
    why = (f"; the first, {failed['run'].iloc[0]}: {failed['error'].iloc[0]} (its log: "
           f"{Path(out) / failed['run'].iloc[0] / 'hydra'}/)" if named else "")
    if len(failed) == len(df):  # nothing to tabulate: say why instead of drawing empty tables
        fail(f"all {len(df)} runs failed{why}; fix the cause and run the same command again")
    print_results(experiment, Path(out))
    counts = df["status"].value_counts().to_dict()
    print(f"{a.sweep}: {counts}; registry {Path(out) / 'registry.csv'}")
    if len(failed):  # recorded and skipped by the sweep; the command still says it did not succeed
        fail(f"{len(failed)} of {len(df)} runs failed (the registry's 'error' column){why}; fix the cause "
             "and run the same command again to train only those")


def print_folder(experiment, profile: str, data_dir: str | None, overrides: list[str], out: Path,
                 replace: bool) -> None:
    """What the sweep would do to the folder `out`: refuse it (another sweep's, in use), or refuse or move
    aside the runs there made with other settings (engine/sweep_folder.py)."""
    from ttt_bench.errors import UserError
    from ttt_bench.experiments.engine.plan import composed
    from ttt_bench.experiments.engine.sweep_folder import check_owner, conflicts, data_fingerprint, refusal

    try:
        check_owner(Path(out), experiment.name)
    except UserError as e:
        print(f"# folder: refused: {e}")
        return
    found = []
    for stage in experiment.stages(profile, data_dir, overrides):
        where = Path(out) / stage.folder.partition("/")[2] if "/" in stage.folder else Path(out)
        prints = {n: data_fingerprint(composed(r.overrides)) for n, r in stage.runs.items()}
        found += [(where, c) for c in conflicts(where, stage.runs, prints)]
    if not found:
        print(f"# folder {out}: no run there was made with other settings")
    elif replace:
        print(f"# folder {out}: {len(found)} runs made with other settings would be moved aside to "
              f"{Path(out) / 'replaced'}/<time>/ and trained again: {', '.join(c.run for _, c in found)}")
    else:
        print(f"# folder: refused: {refusal(found[0][0], [c for _, c in found])}")


def print_results(experiment, out: Path) -> None:
    """The sweep's tables (written into `out` as the reproduce step writes them) and its claims' verdicts."""
    from ttt_bench.experiments.engine.report import Results
    from ttt_bench.experiments.engine.verdicts import judge_all

    experiment.tabulate(out)
    for table in sorted(out.glob("*.md")):
        print(f"\n## {table.name}\n\n{table.read_text().strip()}")
    if experiment.claims:
        results = Results(steps=[experiment.name], folders={experiment.name: out})
        verdicts = judge_all(experiment.claims, results)
        print("\n## verdicts (from this folder alone; `make reproduce` judges every step together)\n")
        for v in verdicts.itertuples():
            print(f"- {v.verdict}: {v.claim} {v.evidence}")
    print()


def print_plan(experiment, profile: str, data_dir: str | None, overrides: list[str] = (),
               launcher: list[str] = (), results: Path = Path("results")) -> None:
    """Every stage's runs (with the user's training `overrides`) as they will run, with their budget, FLOPs
    and estimated time: minutes on the reference CPU as measured there (engine.cost.Throughput), or
    A100-hours for GPU runs (the paper profile); a warning under each run whose budget passes over its
    training corpus more than a few times (data/epochs.py). `results`: the committed results folder whose
    cpu/ and gpu/ registries give the measured times (results/ of the current directory, as reproduce's)."""
    from ttt_bench.data.epochs import planned_loop_warning
    from ttt_bench.experiments.engine.cost import (
        A100_BF16_FLOPS,
        ASSUMED_MFU,
        Throughput,
        run_cost,
    )
    from ttt_bench.experiments.engine.plan import composed
    from ttt_bench.experiments.engine.runner import launcher_jobs

    stages = experiment.stages(profile, data_dir, overrides)
    synthetic = any(o in ("data=synthetic", "data=synthetic_images") for stage in stages
                    for run in stage.runs.values() for o in run.overrides)
    if data_dir is None and synthetic:
        print("# data: the embedded synthetic corpus (no --data-dir), whatever the run names say; pass "
              "--data-dir for the real corpora (e.g. ../shared/data)")
    minutes = gpu_hours = flops = gpu_minutes = 0.0
    measured, sources = Throughput.committed(results / "cpu"), set()
    measured_gpu, gpu_runs, gpu_measured = Throughput.committed(results / "gpu"), 0, 0
    for stage in stages:
        if len(stages) > 1:
            print(f"# {stage.folder}: {len(stage.runs)} runs")
        for name, run in stage.runs.items():
            cfg = composed(run.overrides)
            cost = run_cost(cfg)
            on_gpu = cfg.trainer.accelerator in ("gpu", "cuda")
            flops += cost.train_flops
            if on_gpu:
                gpu_hours, gpu_runs = gpu_hours + cost.gpu_hours, gpu_runs + 1
                when = f"~{cost.gpu_hours:.3g} A100-hours"
                if (seconds := measured_gpu.measured(run.overrides)) is not None:
                    gpu_minutes, gpu_measured = gpu_minutes + seconds / 60, gpu_measured + 1
                    when += f"; {seconds / 60:.1f} min measured on a lent GPU"
            else:
                run_minutes, source = measured.minutes(run.overrides, cfg.model.name, cost.train_flops)
                minutes += run_minutes
                sources.add("measured" if source == "measured" else "rate")
                when = f"~{run_minutes:.1f} min, {source}"
            print(f"{name} [{cost.budget:.3g} {'images' if cost.tokens != cost.tokens else 'tokens'}, "
                  f"{cost.train_flops:.2g} FLOPs, {when}]: {' '.join(run.overrides)}")
            if loops := planned_loop_warning(name, cfg.data, cost.tokens):  # a budget far above its corpus
                print(f"# WARNING: {loops}")
    print(f"# {flops:.3g} training FLOPs in all")
    if gpu_hours:
        hours = f"{gpu_hours:,.0f}" if gpu_hours >= 10 else f"{gpu_hours:.2g}"
        print(f"# GPU runs: ~{hours} A100-hours at {ASSUMED_MFU:.0%} MFU of its "
              f"{A100_BF16_FLOPS / 1e12:.0f} bf16 TFLOP/s (an H100's bf16 peak is about 3x an A100's)")
    if gpu_measured:
        print(f"# {gpu_measured} of the {gpu_runs} GPU runs trained before (results/gpu/*/registry.csv, "
              f"RUN.md): {gpu_minutes:.0f} run-minutes, several at once; small models at long context are "
              "bound by their scans, not FLOPs, so the A100-hours above are a lower bound")
    if minutes:
        jobs = launcher_jobs(launcher)
        how = " and ".join(sorted({"measured": "runs' measured times", "rate": "models' measured FLOP/s"}[k]
                                  for k in sources))
        print(f"# CPU runs: ~{minutes:.0f} run-minutes on the 2-core reference CPU (from the committed "
              f"registries' {how}, two runs at once), so ~{minutes / max(jobs, 1):.0f} min with {jobs} "
              f"job{'s' if jobs > 1 else ''} (hydra.launcher.n_jobs)")
