"""The pipeline's progress line, "run k/N, elapsed, ETA", and the reference session that prices it.

The ETA has two models. With `Priors` (a reference session of the same steps: each step's wall time and
each run's training seconds, measured with as many runs at once), a step still ahead takes its reference
wall time and the step under way the larger of what is left of its reference time and its runs' reference
seconds still to train; both scaled by this machine's speed: this session's finished runs' training seconds
over their reference seconds, weighted toward 1 (PRIOR_WEIGHT_S). Without priors (a new configuration,
another JOBS), each run left is priced by its planned training FLOPs at this session's FLOP rate plus a fixed
cost a run. The FLOP model was 20-40% short through the middle of the default `make reproduce`
(results/speed/eta): its runs differ several-fold in seconds per FLOP (Table 1's first runs at 35-45
GFLOP/s, recall's tiny models and the 2,048-token runs at 10-25), so no rate learnt on the first steps
prices the later ones, a rate per model neither (replayed over that measurement: -42% to +33%); and a
step's tables, figures and tail, where one run trains alone, are its own cost.
"""

import fcntl
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ...io import write_json
from ...training.run_folder import in_use
from ...training.runs import fraction_trained
from .cost import Throughput, run_cost
from .plan import Run, composed
from .registry import read_metrics, restorable, run_finished

log = logging.getLogger("ttt_bench.experiments")

# The reference's speed counts as this many seconds of runs measured at it: the speed moves away from it as
# this session's runs say, not on its first runs alone. Chosen on the measurement at e1139c0
# (results/speed/eta: the first step's runs 28% slower than the reference's, the later ones 0.8-1.2 times,
# the whole pipeline as fast), where the unweighted speed made the ETA 13-33% long through the middle and
# 120 s keeps it within 25% in a replay; the next measurement is its test.
PRIOR_WEIGHT_S = 120.0
PRIORS = "priors.json"  # in a reference session's folder: {"jobs": runs trained at once, "command": ...}


def last_wall_time(folder: Path) -> float | None:
    """The seconds a step took when its folder was last written (its step.json), None where unknown."""
    try:
        return float(json.loads((Path(folder) / "step.json").read_text())["wall_time_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Priors:
    """A reference session of the pipeline, from its results folder: each step's wall time
    (`<step>/step.json`), each run's training seconds by its identity (`<step>/registry.csv`), and how many
    runs it trained at once (`priors.json`, which marks the folder as a reference)."""

    walls: dict[str, float]  # step -> seconds
    runs: Throughput
    jobs: int

    @classmethod
    def load(cls, folder: Path) -> "Priors | None":
        """The folder's reference session; None without its priors.json."""
        try:
            jobs = int(json.loads((Path(folder) / PRIORS).read_text())["jobs"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        walls = {step.parent.name: wall for step in sorted(Path(folder).glob("*/step.json"))
                 if (wall := last_wall_time(step.parent)) is not None}
        return cls(walls, Throughput.committed(folder), jobs)


class Progress:
    """The whole pipeline's progress line, "run k/N, elapsed, ETA": `make reproduce` plans it over every
    sweep; a sweep run alone counts its own runs. It lives in a file (`path`), so that every process that
    trains the pipeline's runs (Hydra's joblib workers, a second `make reproduce`) reports the same line; the
    run folders say which runs have finished, and each run takes its number k under a lock on the file, so
    two workers that start together say k and k + 1.

    The FLOP model (no priors) prices each run left as a fixed cost plus its planned training FLOPs (cost.py's
    estimate) at the speed of this session's finished runs (their FLOPs over their own training seconds). The
    fixed cost is the worker time not spent training, per run started: elapsed x jobs less the runs' training
    seconds, which holds each run's start-up and evaluation and the pipeline's other phases. A run another
    process is training counts with the share of its steps it has logged; runs finished before the plan or
    restored from a committed registry took no time here and measure nothing. A step that trains nothing
    (latency's benchmark, which runs alone) is priced apart (`plan_step` with `alone`: its last wall time, or
    the experiment's estimate) and its measured time is kept out of the fixed cost: folded into it, a 2-minute
    benchmark had made every later run look 2 minutes dearer. The priors model: the module's docstring."""

    def __init__(self, path: Path, flops: dict | None = None, finished_before: list | None = None,
                 start: float | None = None, jobs: int = 1, started: list | None = None,
                 steps: dict | None = None, steps_done: dict | None = None, work: dict | None = None,
                 step_of: dict | None = None, walls: dict | None = None, began: dict | None = None):
        self.path = Path(path)
        self.flops: dict[str, float] = flops or {}  # run folder -> planned training FLOPs (0: unknown)
        self.finished_before = set(finished_before or ())  # finished when planned: not this session's work
        self.start = start or time.time()
        self.jobs = max(int(jobs), 1)  # runs trained at once
        self.started: list[str] = list(started or ())  # run folders begun since the plan, in order
        self.steps: dict[str, float] = dict(steps or {})  # a step that trains nothing -> its planned seconds
        self.steps_done: dict[str, float] = dict(steps_done or {})  # a step that ended -> the seconds it took
        self.work: dict[str, float] = dict(work or {})  # run folder -> its reference training seconds
        self.step_of: dict[str, str] = dict(step_of or {})  # run folder -> its step
        self.walls: dict[str, float | None] = dict(walls or {})  # step -> its reference wall seconds
        self.began: dict[str, float] = dict(began or {})  # step -> when it began (time.time())

    def _save(self) -> None:
        write_json(self.path, {"flops": self.flops, "finished_before": sorted(self.finished_before),
                               "start": self.start, "jobs": self.jobs, "started": self.started,
                               "steps": self.steps, "steps_done": self.steps_done, "work": self.work,
                               "step_of": self.step_of, "walls": self.walls, "began": self.began})

    def plan_step(self, name: str, seconds: float | None = None, alone: bool = False,
                  priors: Priors | None = None) -> None:
        """A step of the pipeline with its reference wall time (`priors`, else None: unknown). `alone`: it
        trains nothing and runs alone, priced at `seconds` in the FLOP model."""
        if alone:
            self.steps[name] = float(seconds or 0.0)
        self.walls[name] = priors.walls.get(name) if priors is not None and priors.jobs == self.jobs else None
        self._save()

    def step_began(self, name: str) -> None:
        self.began[name] = time.time()
        self._save()

    def step_done(self, name: str, seconds: float) -> None:
        self.steps_done[name] = float(seconds)
        self._save()

    def plan(self, runs: dict[str, Run], out: Path, committed: Path | None = None,
             step: str | None = None, priors: Priors | None = None, configs: dict | None = None) -> None:
        """Price the runs of one sweep folder `out` (of the pipeline's `step`); those finished there, or that
        the `committed` registry will restore, are no work of this session. `configs`: the runs' composed
        configs, run name -> config (`compose_all`: a run missing there did not compose and costs nothing);
        without them each run left is composed here (once per process: plan.composed). `priors`: the
        reference session: each run's training seconds there, or for a run it lacks, its FLOPs at the rate of
        its model there."""
        restored = restorable(runs, committed)
        for name, run in runs.items():
            run_dir = str(Path(out) / name)
            if run_finished(run_dir) or name in restored:
                self.finished_before.add(run_dir)
                self.flops[run_dir] = 0.0
                continue
            if step is not None:
                self.step_of[run_dir] = step
            try:
                cfg = composed(run.overrides) if configs is None else configs[name]
                self.flops[run_dir] = float(run_cost(cfg).train_flops)
            except Exception:  # noqa: BLE001  (a config that does not compose is recorded as failed)
                self.flops[run_dir] = self.work[run_dir] = 0.0
                continue
            if priors is not None:  # the same run's seconds there, else its FLOPs at its model's rate there
                minutes, _ = priors.runs.minutes(run.overrides, cfg.model.get("name"), self.flops[run_dir])
                self.work[run_dir] = minutes * 60
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
        mine = {d: float(m.get("wall_time_s") or 0.0) for d, m in metrics.items()
                if "restored_from" not in m}  # finished by this session: their training seconds
        running = {d: fraction_trained(d) for d in self.flops
                   if d not in done and Path(d).is_dir() and in_use(d)}
        if not mine:
            return "ETA after a run"
        if (left := self._left_from_priors(done, mine, running)) is not None:
            return f"ETA {_minutes(left)}"
        return self._eta_from_flops(done, mine, running)

    def _left_from_priors(self, done: set[str], mine: dict[str, float], running: dict[str, float]
                          ) -> float | None:
        """Seconds left by the reference session (the module's docstring); None where it does not price
        every run and step left, or no finished run of this session has a reference time."""
        ahead = [s for s in self.walls if s not in self.steps_done]
        todo = [d for d in self.flops if d not in done and self.step_of.get(d) not in self.steps_done]
        timed = [d for d in mine if d in self.work and mine[d] > 0]  # a run of a step that ended is not todo
        if (not timed or any(self.walls[s] is None for s in ahead)
                or any(d not in self.work or self.step_of.get(d) not in ahead for d in todo)):
            return None
        speed = ((sum(mine[d] for d in timed) + PRIOR_WEIGHT_S)  # this machine's seconds per reference second
                 / (sum(self.work[d] for d in timed) + PRIOR_WEIGHT_S))
        left = 0.0
        for s in ahead:
            wall = self.walls[s] * speed
            if s not in self.began:
                left += wall
                continue
            runs_left = sum(self.work[d] * (1 - running.get(d, 0.0)) for d in todo if self.step_of[d] == s)
            left += max(wall - (time.time() - self.began[s]), runs_left * speed / self.jobs)
        return left

    def _eta_from_flops(self, done: set[str], mine: dict[str, float], running: dict[str, float]) -> str:
        todo = [d for d in self.flops if d not in done]
        steps_left = sum(s for name, s in self.steps.items() if name not in self.steps_done)
        alone_s = sum(s for name, s in self.steps_done.items() if name in self.steps)
        elapsed = time.time() - self.start - alone_s  # time spent on runs
        trained_s = sum(mine.values())
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
    """Seconds under a minute (in tenths of a minute the last minute's ETA was a third off by rounding
    alone), then minutes."""
    minutes = seconds / 60
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{minutes:.1f} min" if minutes < 10 else f"{minutes:.0f} min"
