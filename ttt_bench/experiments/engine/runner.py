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

import fcntl
import json
import logging
import shlex
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd

from ...config import CONFIG_MODULE
from ...errors import Interrupted, UserError
from ...io import write_atomic, write_json
from ...training.run_folder import RunFolderInUse, in_use
from ...training.runs import fraction_trained
from ...training.train import train
from .cost import run_cost
from .curves import run_curves
from .floors import text_floors
from .plan import Run, composed, identity
from .registry import failure_line, read_metrics, record_failure, run_finished, write_plan, write_registry
from .sweep_folder import claimed, data_fingerprint, settle

log = logging.getLogger("ttt_bench.experiments")


def launcher_jobs(launcher: list[str]) -> int:
    """How many runs a sweep's launcher trains at once: `hydra.launcher.n_jobs=N`, else 1."""
    return next((int(n) for o in launcher if o.startswith("hydra.launcher.n_jobs=")
                 and (n := o.split("=", 1)[1]).isdigit()), 1)


class Progress:
    """The whole pipeline's progress line, "run k/N, elapsed, ETA": `make reproduce` plans it over every
    sweep; a sweep run alone counts its own runs. It lives in a file (`path`), so that every process that
    trains the pipeline's runs (Hydra's joblib workers, a second `make reproduce`) reports the same line; the
    run folders say which runs have finished, and each run takes its number k under a lock on the file, so
    two workers that start together say k and k + 1.

    The ETA prices each run left as a fixed cost plus its planned training FLOPs (cost.py's estimate) at the
    speed of this session's finished runs (their FLOPs over their own training seconds). The fixed cost is
    the worker time not spent training, per run started: elapsed x jobs less the runs' training seconds,
    which holds each run's start-up and evaluation and the pipeline's other phases (n-gram floors, tables,
    figures, benchmarks). Training seconds alone made the quick profile's ETA 30-45% short at the halfway
    point. A run another process is training counts with the share of its steps it has logged; runs
    finished before the plan or restored from a committed registry took no time here and measure nothing.
    A step that trains nothing (latency's benchmark, which runs alone) is priced apart (`plan_step`: its
    last wall time, or the experiment's estimate) and its measured time (`step_done`) is kept out of the
    fixed cost: folded into it, a 2-minute benchmark had made every later run look 2 minutes dearer."""

    def __init__(self, path: Path, flops: dict | None = None, finished_before: list | None = None,
                 start: float | None = None, jobs: int = 1, started: list | None = None,
                 steps: dict | None = None, steps_done: dict | None = None):
        self.path = Path(path)
        self.flops: dict[str, float] = flops or {}  # run folder -> planned training FLOPs (0: unknown)
        self.finished_before = set(finished_before or ())  # finished when planned: not this session's work
        self.start = start or time.time()
        self.jobs = max(int(jobs), 1)  # runs trained at once
        self.started: list[str] = list(started or ())  # run folders begun since the plan, in order
        self.steps: dict[str, float] = dict(steps or {})  # a step that trains nothing -> its planned seconds
        self.steps_done: dict[str, float] = dict(steps_done or {})  # -> the seconds it took

    def _save(self) -> None:
        write_json(self.path, {"flops": self.flops, "finished_before": sorted(self.finished_before),
                               "start": self.start, "jobs": self.jobs, "started": self.started,
                               "steps": self.steps, "steps_done": self.steps_done})

    def plan_step(self, name: str, seconds: float) -> None:
        """A step of the pipeline that trains nothing and runs alone, priced at `seconds` of wall time."""
        self.steps[name] = float(seconds)
        self._save()

    def step_done(self, name: str, seconds: float) -> None:
        self.steps_done[name] = float(seconds)
        self._save()

    def plan(self, runs: dict[str, Run], out: Path, committed: Path | None = None,
             configs: dict | None = None) -> None:
        """Price the runs of one sweep folder `out`; those finished there, or that the `committed` registry
        will restore, are no work of this session. `configs`: the runs' composed configs, run name -> config
        (`compose_all`: a run missing there did not compose and costs nothing); without them each run left is
        composed here (once per process: plan.composed)."""
        restored = restorable(runs, committed)
        for name, run in runs.items():
            run_dir = str(Path(out) / name)
            if run_finished(run_dir) or name in restored:
                self.finished_before.add(run_dir)
                self.flops[run_dir] = 0.0
                continue
            try:
                cfg = composed(run.overrides) if configs is None else configs[name]
                self.flops[run_dir] = float(run_cost(cfg).train_flops)
            except Exception:  # noqa: BLE001  (a config that does not compose is recorded as failed)
                self.flops[run_dir] = 0.0
        self.started = []
        self._save()

    @classmethod
    def load(cls, path: Path) -> "Progress":
        try:
            return cls(path, **json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError):
            return cls(path)

    def _number(self, run_dir: str, done: set[str]) -> int:
        """k of "run k/N": the runs finished without being begun since the plan, then this run's place
        among those begun (claimed in the file under an exclusive lock)."""
        with open(self.path.with_name(self.path.name + ".lock"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if self.path.is_file():
                    self.started = Progress.load(self.path).started
                if run_dir not in self.started:
                    self.started.append(run_dir)
                    self._save()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return len(done - set(self.started)) + self.started.index(run_dir) + 1

    def eta(self, done: set[str]) -> str:
        metrics = {d: read_metrics(d) or {} for d in done - self.finished_before}
        mine = {d: m for d, m in metrics.items() if "restored_from" not in m}  # finished by this session
        running = {d: fraction_trained(d) for d in self.flops
                   if d not in done and Path(d).is_dir() and in_use(d)}
        todo = [d for d in self.flops if d not in done]
        steps_left = sum(s for name, s in self.steps.items() if name not in self.steps_done)
        elapsed = time.time() - self.start - sum(self.steps_done.values())  # time spent on runs
        trained_s = sum(float(m.get("wall_time_s") or 0.0) for m in mine.values())
        if not mine:
            return "ETA after a run"
        if trained_s <= 0 or any(self.flops[d] <= 0 for d in todo):  # no FLOP estimate: a run's mean time
            return f"ETA {_minutes(elapsed / len(mine) * len(todo) + steps_left)} (by run count)"
        rate = sum(self.flops[d] for d in mine) / trained_s  # FLOP/s of one worker
        partly_s = sum(self.flops[d] * f for d, f in running.items()) / rate
        fixed = max(elapsed * self.jobs - trained_s - partly_s, 0.0) / (len(mine) + len(running))
        left = sum(self.flops[d] * (1 - running.get(d, 0.0)) / rate + (0.0 if d in running else fixed)
                   for d in todo)
        return f"ETA {_minutes(left / self.jobs + steps_left)}"

    def begin(self, run_dir: Path) -> None:
        run_dir, done = str(run_dir), {d for d in self.flops if run_finished(d)}
        log.info("run %d/%d (%s): elapsed %.1f min, %s", self._number(run_dir, done), len(self.flops),
                 Path(run_dir).name, (time.time() - self.start) / 60, self.eta(done))


def _minutes(seconds: float) -> str:
    minutes = seconds / 60
    return f"{minutes:.1f} min" if minutes < 10 else f"{minutes:.0f} min"


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
            pipeline.plan(runs, out, stage.committed, configs)
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
