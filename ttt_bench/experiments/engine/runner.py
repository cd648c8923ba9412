"""Training a planned sweep: one Hydra multirun over its runs (basic launcher by default;
hydra/launcher=joblib or submitit_slurm by override) into one sweep folder (engine/registry.py says what it
holds).

Re-running a sweep skips finished runs and resumes interrupted ones (train() resumes from last.ckpt); a
failed run is recorded and does not stop the sweep. A sweep never deletes a run: sweep_folder.py keeps one
process and one sweep to a folder, and refuses (or, asked to, moves aside) runs made with other settings.
Each run's config is composed once, by the planner: it checks, prices and fingerprints the run with it and
writes it beside the run's record (`<run>/config.yaml` beside `<run>/run.json`, both written before the
launch); the job trains what that file holds and composes nothing, in this process or another (joblib's
threads, submitit's processes). Runs with `after` (TF finetune) start once the run they depend on has
finished. A committed registry of an earlier session counts its finished runs as done
(`restore`): a new machine re-tabulates what it cannot retrain.
"""

import json
import logging
import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd

from ...config import CONFIG_MODULE
from ...errors import Interrupted, UserError
from ...io import write_atomic, write_json
from ...training.run_folder import RunFolderInUse, in_use
from ...training.train import train
from .curves import run_curves
from .floors import text_floors
from .plan import Run, composed
from .progress import Progress
from .registry import failure_line, record_failure, restorable, run_finished, write_plan, write_registry
from .sweep_folder import claimed, data_fingerprint, settle

log = logging.getLogger("ttt_bench.experiments")


def launcher_jobs(launcher: list[str]) -> int:
    """How many runs a sweep's launcher trains at once: `hydra.launcher.n_jobs=N`, else 1."""
    return next((int(n) for o in launcher if o.startswith("hydra.launcher.n_jobs=")
                 and (n := o.split("=", 1)[1]).isdigit()), 1)


# Lightning's per-run banners ("Seed set to 0", "GPU available: False", "`Trainer.fit` stopped"), a third of a
# sweep's log, and Hydra's launchers' listing of every job ("#12 : +sweep_dir=... +run=..."; the sweep's own
# line says how many runs it trains, and each run's progress line names it): at debug level in sweeps,
# shown only where the logger is set to debug
BANNER_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.seed",
                  "lightning.pytorch.accelerators.cuda", "hydra_plugins.hydra_joblib_launcher._core",
                  "hydra._internal.core_plugins.basic_launcher")


def demote_to_debug(record: logging.LogRecord) -> bool:
    if record.levelno != logging.INFO:
        return True
    record.levelno, record.levelname = logging.DEBUG, "DEBUG"
    return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_banners() -> None:
    for name in BANNER_LOGGERS:
        logger = logging.getLogger(name)
        if demote_to_debug not in logger.filters:
            logger.addFilter(demote_to_debug)


CONFIG = "config.yaml"  # a run's composed config, beside its run.json (Hydra's own files are in <run>/hydra/)


def read_config(run_dir: Path):
    """The config the planner composed for the run (unresolved, as composed: interpolations resolve in the
    job, as they would in a composition there), struct like a composed config (a new key needs open_dict)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(run_dir) / CONFIG)
    OmegaConf.set_struct(cfg, True)
    return cfg


def run_one(run_dir: Path) -> None:
    """Train the run that `run_dir/run.json` records, from the config the planner wrote beside it, unless it
    has finished; record a failure instead of raising."""
    if run_finished(run_dir):
        return
    record = json.loads((run_dir / "run.json").read_text())
    name = record["name"]
    quiet_banners()
    Progress.load(record["progress"]).begin(run_dir)
    try:
        train(read_config(run_dir), run_dir)
    except RunFolderInUse:  # a `ttt-bench train` of another process holds the folder
        log.info("run %s is being trained by another process; skipped here", name)
    except Interrupted as e:  # Ctrl-C / SIGTERM: the sweep stops (the run resumes from its checkpoint); not
        raise KeyboardInterrupt(str(e)) from e  # an Exception, after which Hydra's launchers would go on
    except UserError as e:  # the run's settings or machine: its one line says what to fix
        log.error("run %s failed: %s", name, e)
        record_failure(run_dir, failure_line(e))
    except Exception as e:  # noqa: BLE001  (a failed run is data, not the end of the sweep)
        log.exception("run %s failed", name)
        record_failure(run_dir, failure_line(e))


def _job(cfg) -> None:
    """The Hydra task of a sweep's multirun: one run of the sweep folder, picked by `+run=<name>`."""
    run_one(Path(cfg.sweep_dir) / cfg.run)


def launch(out: Path, names: list[str], launcher: list[str]) -> None:
    """One Hydra multirun over the runs `names` of the sweep folder `out`, each read from its run.json and
    config.yaml (e.g. hydra/launcher=joblib). The multirun's own config is no training config (config_name
    None: Hydra's settings and the launcher's, +sweep_dir and +run): Hydra composes it for the multirun and
    for each job, and a job needs only the run's folder; composing `train` there would compose every run's
    config a second time (the defaults, unused)."""
    import hydra

    argv = [
        "--multirun",
        f"+sweep_dir='{out}'",
        "+run=" + ",".join(f"'{n}'" for n in names),
        f"hydra.sweep.dir='{out}'",
        "hydra.sweep.subdir=${run}/hydra",
        *launcher,
    ]
    # Hydra has no supported API that runs a multirun (through the configured launcher) from a list of
    # arguments: hydra.main's app parses sys.argv (argparse, no argument for it), and the functions it calls
    # (hydra._internal.utils._run_hydra, Hydra.multirun) are Hydra's internals. The command line goes
    # through sys.argv for the call, restored after it.
    saved = sys.argv
    sys.argv = ["ttt-bench ablate", *argv]
    quiet_banners()
    try:
        hydra.main(config_path=CONFIG_MODULE, config_name=None, version_base="1.3")(_job)()
    finally:
        sys.argv = saved


def write_run(run_dir: Path, name: str, run: Run, cfg, fingerprint: str | None, progress: Path) -> None:
    """The run's record and config, written by the planner (under the sweep folder's lock, before the launch)
    for the job to read: `cfg`, its config as composed by the planner (config.yaml, what the job trains); its
    overrides, the command that reproduces it, and the content of the data it reads (run.json)."""
    from omegaconf import OmegaConf

    write_atomic(Path(run_dir) / CONFIG, OmegaConf.to_yaml(cfg))
    command = "ttt-bench train " + " ".join(shlex.quote(o) for o in run.overrides)
    write_json(Path(run_dir) / "run.json", {"name": name, **run.to_json(), "command": command,
                                            "data_fingerprint": fingerprint, "progress": str(progress)})


@dataclass
class Stage:
    """A sweep folder's worth of runs: what one `train_stage` trains and tabulates."""

    folder: str  # relative to the runs root: the experiment's name, or e.g. recall/calibration
    runs: dict[str, Run]
    committed: Path | None = None  # a registry of earlier sessions (on a new machine: restored)

    def first(self, k: int, parts: int) -> "Stage":
        """The stage with the first k of `parts` equal parts of its runs, in plan order."""
        n = -(-len(self.runs) * k // parts)
        return replace(self, runs=dict(list(self.runs.items())[:n]))


@dataclass
class Trained:
    """What training an experiment's sweeps leaves for its step folder: CSVs by name (registry.csv,
    floors.csv, ...) and facts for step.json."""

    registry: pd.DataFrame
    files: dict[str, pd.DataFrame] = field(default_factory=dict)
    info: dict = field(default_factory=dict)


def compose_all(runs: dict[str, Run]) -> tuple[dict, dict[str, str]]:
    """Every run's config, composed once up front (the one composition of a run: the plan's prices, the data
    fingerprints, the floors and the config.yaml the job trains from), and the error of each run whose
    config does not compose (a model config that does not exist yet, a bad override): recorded as failed
    instead of stopping the multirun."""
    configs, errors = {}, {}
    for name, run in runs.items():
        try:
            configs[name] = composed(run.overrides)
        except Exception as e:  # noqa: BLE001
            errors[name] = failure_line(e)
    return configs, errors


def train_stage(sweep: str, profile: str, stage: Stage, out: Path, launcher: list[str] = (),
                pipeline: Progress | None = None, train: bool = True, replace: bool = False) -> Trained:
    """Restore, train (skipping finished runs) and tabulate one stage's runs in `out`, with the n-gram
    floors of their texts, holding the folder against other processes. `pipeline`: the progress of a whole
    pipeline this stage is part of (else its own); `train=False` tabulates the runs finished so far and
    trains nothing; `replace`: move runs made with other settings aside instead of refusing."""
    out = Path(out).resolve()
    runs = stage.runs
    with claimed(out, sweep):
        for run in runs.values():  # TF finetune starts from the weights of the run it depends on
            if run.after is not None:
                run.overrides.append(f"recipe.init_from='{out / run.after / 'checkpoints' / 'last.ckpt'}'")
        configs, errors = compose_all(runs)
        fingerprints = {n: data_fingerprint(cfg) for n, cfg in configs.items()}
        if moved := settle(out, runs, fingerprints, replace):
            log.info("%d runs made with other settings moved aside to %s: %s", len(moved), out / "replaced",
                     ", ".join(moved))
        if pipeline is None:
            pipeline = Progress(out / "progress.json", jobs=launcher_jobs(launcher))
            pipeline.plan(runs, out, stage.committed, configs=configs)
        write_plan(out, sweep, profile, runs, pipeline.path)
        for name, error in errors.items():
            if not run_finished(out / name):
                record_failure(out / name, error)
        if stage.committed is not None:
            restore(out, runs, stage.committed)
        for dependent in (False, True):  # runs without dependencies, then those that start from another run
            todo = []
            for n in configs:
                run = runs[n]
                if (run.after is not None) != dependent or run_finished(out / n):
                    continue
                if dependent and not run_finished(out / run.after):
                    if in_use(out / run.after):  # a `ttt-bench train` of another process holds it
                        log.info("run %s waits for %s, trained by another process", n, run.after)
                    else:
                        record_failure(out / n, f"the run it starts from ({run.after}) did not finish")
                    continue
                todo.append(n)
                write_run(out / n, n, run, configs[n], fingerprints[n], pipeline.path)
            log.info("sweep %s (%s): %d runs to train%s", sweep, profile, len(todo),
                     " first" * (not dependent))
            if todo and train:
                launch(out, todo, list(launcher))
        floors = text_floors(runs, configs)
        write_atomic(out / "floors.csv", floors.to_csv(index=False))  # `ttt-bench plot` draws them
        kept = stage.committed and Path(stage.committed).with_name("curves.csv")
        curves = run_curves(out, runs, pd.read_csv(kept) if kept and kept.is_file() else None)
        write_atomic(out / "curves.csv", curves.to_csv(index=False))  # tables flag the stalled runs
        return Trained(write_registry(out), {"floors.csv": floors, "curves.csv": curves})


def restore(out: Path, runs: dict[str, Run], registry: Path) -> int:
    """Count the finished runs of a committed registry (an earlier session's, whose run folders are gone)
    as done: their metrics.json is written back. Returns how many were restored."""
    n = 0
    for name, row in restorable(runs, registry).items():
        if run_finished(out / name):
            continue
        plan_keys = set(runs[name].columns()) | {"run", "sweep", "profile", "after", "overrides",
                                                  "total_train_flops"}
        metrics = {k: v for k, v in row.items() if k not in plan_keys and not pd.isna(v)}
        record = {"name": name, **runs[name].to_json(), "restored_from": str(registry)}
        write_json(out / name / "run.json", record)  # what a later plan compares itself with
        write_json(out / name / "metrics.json", {**metrics, "restored_from": str(registry)})
        n += 1
    if n:
        log.info("%d finished runs restored from %s", n, registry)
    return n
