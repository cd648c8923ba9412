"""`make reproduce [PROFILE=quick|cpu|gpu|smoke|paper] [DATA_DIR=...]`: every experiment into results/.

Each experiment is a step (ttt_bench/experiments/, in EXPERIMENTS order) that writes its own folder
`<out>/<profile>/<step>/` when it finishes (registry with every seed, n-gram floors, tables, figures,
`step.json` with its command, hardware and wall time), so a long run can be committed step by step.
`REPORT.md` is then assembled from every step folder present, judged by the experiments' claims. Runs (with
checkpoints) go to $TTT_BENCH_RUNS/reproduce-<profile>; re-running resumes and skips finished runs.
`--report-only` redraws every step's tables and figures from its folder and assembles the report, training
nothing. PROFILE=paper without a GPU prints the plan and its GPU budget and stops; PROFILE=gpu (one GPU for
minutes: the steps whose sweep defines it) refuses to train without one. The last step rewrites README.md's
results block (`--readme`, default README.md in the current directory) when the cpu profile's folder is the
results/cpu beside it, the one the README quotes.
"""

import argparse
import logging
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from .config import runs_root
from .errors import UserError
from .experiments import EXPERIMENTS, steps
from .experiments.engine.combined import write_combined_report
from .experiments.engine.cost import ASSUMED_MFU, run_cost
from .experiments.engine.plan import PROFILES, composed
from .experiments.engine.progress import Priors, Progress
from .experiments.engine.report import StepContext, update_readme, write_report
from .experiments.engine.runner import Stage

README_HEADLINE = ("table1", "table1.md",
                   "Table 1 (pile-mini, context {context} bytes, size `xs`; perplexity per byte, mean +- std "
                   "over seeds, and the bootstrap standard error of each evaluation over documents):")


def planned_runs(profile: str, data_dir: str | None, names=None,
                 out: Path | None = None) -> list[tuple[str, Stage]]:
    """(step, stage) of every sweep that `make reproduce PROFILE=<profile>` trains, in order: what `main`
    plans its progress over and the steps then train. `out`: the results folder, whose committed step
    folders restore finished runs."""
    return [(name, stage) for name in (steps() if names is None else names)
            for stage in EXPERIMENTS[name].stages(profile, data_dir, committed=out and out / name)]


def paper_plan(data_dir: str | None) -> pd.DataFrame:
    """Every run that `make reproduce PROFILE=paper` trains, with the config it composes and its cost."""
    rows = []
    for step, stage in planned_runs("paper", data_dir):
        for name, run in stage.runs.items():
            cfg = composed(run.overrides)
            cost = run_cost(cfg)
            rows.append({"sweep": step, "folder": stage.folder, "run": name, "tokens": cost.tokens,
                         "images": cost.images, "train_flops": cost.train_flops, "seq_len": cost.seq_len,
                         "tokenizer": cost.tokenizer, "precision": str(cfg.trainer.precision),
                         "tokens_per_batch": int(cfg.recipe.get("tokens_per_batch") or 0),
                         "overrides": run.overrides, "gpu_hours": cost.gpu_hours})
    return pd.DataFrame(rows)


def print_paper_plan(data_dir: str | None) -> None:
    plan = paper_plan(data_dir)
    print(plan.groupby("sweep")[["tokens", "images", "train_flops", "gpu_hours"]].sum(min_count=1)
          .assign(runs=plan.groupby("sweep").size()).to_string(float_format="{:.3g}".format))
    print(f"total: {len(plan)} runs, {plan['tokens'].sum():.3g} tokens and "
          f"{plan['images'].sum():.3g} images, "
          f"{plan['train_flops'].sum():.3g} FLOPs, ~{plan['gpu_hours'].sum():.0f} A100-hours at "
          f"{ASSUMED_MFU:.0%} MFU. No GPU here: nothing was run.")


def output_dir(results: Path, profile: str, data_dir: str | None) -> Path:
    """results/<profile> for real data, results/<profile>-synthetic without: runs of another profile or
    corpus never overwrite the committed results/cpu."""
    return results / (profile if data_dir else f"{profile}-synthetic")


def main(argv: list[str] | None = None) -> None:
    all_steps = steps()
    p = argparse.ArgumentParser(prog="python -m ttt_bench.reproduce", description=__doc__.splitlines()[0])
    p.add_argument("--profile", choices=PROFILES, default="quick")
    p.add_argument("--data-dir", help="folder with pile-mini/ and books-mini/ (default: synthetic data)")
    p.add_argument("--out", type=Path, default=Path("results"), help="results root (default results/)")
    p.add_argument("--runs", type=Path, help="run folders (default: $TTT_BENCH_RUNS/reproduce-PROFILE)")
    p.add_argument("--steps", default=",".join(all_steps),
                   help=f"comma-separated subset of {','.join(all_steps)}")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs trained at once (Hydra's joblib launcher, a thread each); latency runs alone")
    p.add_argument("--report-only", action="store_true",
                   help="redraw the steps' tables and figures from their folders and assemble REPORT.md")
    p.add_argument("--no-train", action="store_true",
                   help="write the steps' folders from the runs finished so far, training nothing")
    p.add_argument("--readme", type=Path, default=Path("README.md"),
                   help="the README whose results block the last step rewrites (default README.md; only for "
                        "--profile cpu with --data-dir, when --out is the results/ beside it)")
    p.add_argument("--priors", type=Path,
                   help="a reference session's results folder (with priors.json) whose steps' wall times and "
                        "runs' seconds price the ETA (default: OUT/speed/eta/<profile folder>, if there)")
    p.add_argument("--replace", action="store_true",
                   help="runs made with other settings than the plan's (a step refuses them) are moved aside "
                        "to <sweep folder>/replaced/<time>/ and trained again; nothing is deleted")
    a = p.parse_args(argv)
    try:
        run(p, a)
    except UserError as e:  # bad input or a refused folder: its one line says what to do
        sys.stderr.write(f"{p.prog}: error: {e}\n")
        sys.exit(2)
    except KeyboardInterrupt as e:  # Ctrl-C: the runs saved their steps and the step folders are complete
        where = f" ({e})" if str(e) else ""
        sys.stderr.write(f"{p.prog}: interrupted{where}; finished runs, checkpoints and step folders are "
                         "saved, and the same command resumes\n")
        sys.exit(130)


def run(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    all_steps = steps()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    chosen = [s for s in a.steps.split(",") if s]
    if not chosen:
        p.error(f"--steps {a.steps!r} names no step; use a comma-separated subset of {','.join(all_steps)}")
    if a.jobs < 1:
        p.error(f"--jobs must be at least 1, got {a.jobs}")
    if unknown := set(chosen) - set(all_steps):
        p.error(f"unknown step(s) {', '.join(sorted(unknown))}; use {','.join(all_steps)}")
    left_out = {name: why for name in chosen if (why := EXPERIMENTS[name].left_out(a.profile))}
    if a.steps == p.get_default("steps"):
        chosen = [name for name in chosen if name not in left_out]
    elif undefined := [name for name in chosen if not EXPERIMENTS[name].defines(a.profile)]:
        p.error(f"{', '.join(undefined)}: conf/sweep/ defines no {a.profile} profile for it; steps that have "
                f"one: {','.join(n for n in all_steps if EXPERIMENTS[n].defines(a.profile))}")
    else:  # named: it runs, and its claims stay "not tested" in this profile's report
        for name, why in left_out.items():
            logging.warning("%s is not a step of the %s profile (%s); running it because --steps names it",
                            name, a.profile, why)
    if a.profile == "paper" and not torch.cuda.is_available():
        print_paper_plan(a.data_dir)
        return
    trains = any(EXPERIMENTS[name].trains for name in chosen) and not (a.report_only or a.no_train)
    if a.profile == "gpu" and trains and not torch.cuda.is_available():
        p.exit(2, "the gpu profile trains on a CUDA GPU and none is visible here; run it on a GPU machine, "
                  "or use --profile cpu\n")
    out = output_dir(a.out, a.profile, a.data_dir)
    make = f"make reproduce PROFILE={a.profile}" + (f" DATA_DIR={a.data_dir}" if a.data_dir else "")
    experiments = list(EXPERIMENTS.values())
    if a.report_only:
        for name in chosen:
            if (out / name / "step.json").is_file():
                EXPERIMENTS[name].tabulate(out / name)
    else:
        runs = a.runs or runs_root() / f"reproduce-{a.profile}"
        progress = Progress(runs / "progress.json", jobs=a.jobs)
        priors = Priors.load(a.priors or a.out / "speed" / "eta" / out.name)
        for name, stage in planned_runs(a.profile, a.data_dir, chosen, out):
            progress.plan(stage.runs, (runs / stage.folder).resolve(), stage.committed, name, priors)
        for name in chosen:  # a step that trains nothing (a benchmark) is priced apart in the FLOP model
            alone = not EXPERIMENTS[name].trains
            seconds = EXPERIMENTS[name].expected_seconds(a.profile, out / name) if alone else None
            progress.plan_step(name, seconds, alone, priors)
        ctx = StepContext(a.profile, a.data_dir, out, runs.resolve(), not a.no_train, progress,
                          ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={a.jobs}"] if a.jobs > 1 else [],
                          a.replace)
        for name in chosen:
            start = time.time()
            progress.step_began(name)
            EXPERIMENTS[name].run_step(ctx)
            progress.step_done(name, time.time() - start)
            write_report(out, experiments, a.profile, a.data_dir, make)  # after every step: committable
    print(f"results in {write_report(out, experiments, a.profile, a.data_dir, make)}")
    if a.profile in ("cpu", "gpu") and a.data_dir:  # the committed profiles: one table of verdicts over both
        print(f"combined verdicts in {write_combined_report(a.out, experiments)}")
    last_step_readme(a.readme, out, experiments, a.profile, a.data_dir, make)


def last_step_readme(readme: Path, out: Path, experiments: list, profile: str, data_dir: str | None,
                     make: str) -> None:
    """The command's last step: README.md's results block, rewritten from `out`'s step files and verdicts
    (engine/report.py's update_readme). Only the committed reproduction writes it (the cpu profile on the
    real corpora, into the results/cpu beside the README); `--report-only` does it too."""
    if profile != "cpu" or not data_dir:
        return
    if out.resolve() != (readme.parent / "results" / "cpu").resolve():
        logging.info("last step: README.md's results block left as it is: %s is not the results/cpu "
                     "beside %s", out, readme)
        return
    if not readme.is_file():
        logging.warning("last step: README.md's results block not written: no README at %s (--readme)",
                        readme)
        return
    logging.info("last step: README.md's results block (%s)", readme)
    update_readme(readme, out, experiments, make, profile, README_HEADLINE)


if __name__ == "__main__":
    main()
