"""The shape of an experiment: what its module provides to the engine.

An experiment is one paper table or figure (or a question the papers raise): its sweep definition
(conf/sweep/<name>.yaml), a planner from that definition to runs, the measurements it takes of trained
runs, the tables and figures it draws from its step folder, its claims with the paper's numbers, and its
section of REPORT.md. `make reproduce` runs each as a step into results/<profile>/<name>/:

    plan -> train_stage (engine/runner.py) -> measure -> tabulate -> step.json
    REPORT.md <- claims judged on every step folder (engine/report.py)

Subclasses override `configurations` (and, for special needs, `stages`, `train`, `measure`); `tabulate`
draws everything from the step folder's files alone, so `--report-only` redraws the committed results.
"""

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ...errors import UserError
from .plan import Run, check_profile, expand, load_sweep, merge
from .progress import Progress, last_wall_time
from .registry import load_csv
from .report import Step, StepContext
from .runner import Stage, Trained, train_stage
from .verdicts import Claim

log = logging.getLogger("ttt_bench.experiments")


@dataclass
class Section:
    """An experiment's section of REPORT.md."""

    title: str
    paper: str  # what the paper found, in a sentence or two
    files: list[str]  # tables (.md, inlined) and figures of the step folder, in the order shown
    claim_figures: list[str] = field(default_factory=list)  # the claims' `figure` headings listed under it


@dataclass
class PlotCommand:
    """A figure `ttt-bench plot NAME INPUT` draws: `draw(inputs, stem)` returns the written paths."""

    help: str
    draw: object  # (list[Path], Path) -> list[Path]


class Experiment:
    name: str = ""
    section: Section | None = None  # None: no section of its own (e.g. the cross-experiment budgets row)
    paper: str = "TTT"  # the paper it reproduces: TTT (2024) or MTTT (2023); the report orders by it
    measures: str = "quality"  # quality | speed: the report puts speed after quality, per paper
    trains: bool = True  # has a sweep of training runs (conf/sweep/<name>.yaml)
    seconds: dict[str, float] = {}  # a step that trains nothing: its wall time per profile on the 2-core CPU
    definition: dict | None = None  # the sweep definition, when not conf/sweep/<name>.yaml (tests)

    # ---- the sweep ----

    @functools.cached_property
    def sweep(self) -> dict:
        return self.definition if self.definition is not None else load_sweep(self.name, (self.name,))

    def seeds(self, profile: str) -> int:
        return int(self.sweep["profiles"][profile].get("seeds", 1))

    def expected_seconds(self, profile: str, folder: Path) -> float:
        """What a step that trains nothing will take (the pipeline's ETA prices it): the wall time its
        folder's step.json recorded last, else `seconds` of the profile (0: unknown)."""
        last = last_wall_time(folder)
        return last if last is not None else float(self.seconds.get(profile, 0.0))

    def parts(self, profile: str) -> int:
        """How many parts the step trains in (its profile's `parts`, default 1). Its folder is written after
        each part, so a step longer than a session is committed part by part; part k trains the first k/parts
        of the runs in plan order (seed-major: the first part holds every configuration's first seed)."""
        return int(self.sweep["profiles"][profile].get("parts", 1)) if self.trains else 1

    @property
    def equivalence_margin(self) -> tuple[float | None, str | None]:
        """The a-priori equivalence margin of the experiment's '=' claims, a fraction of the reference (the
        sweep's `equivalence_margin`), and where it comes from, for the claim's sentence; (None, None) where
        the sweep sets none (verdicts.EQUIVALENCE_MARGIN then)."""
        margin = self.sweep.get("equivalence_margin") if self.trains else None
        if margin is None:
            return None, None
        return float(margin), f"set a priori in conf/sweep/{self.name}.yaml: equivalence_margin {margin:g}"

    def left_out(self, profile: str) -> str | None:
        """Why the experiment is not a step of this profile (its sweep's `left_out`: profile -> reason), or
        None when it is. Its claims are then "not tested", with that reason."""
        if not self.trains:
            return None
        if not self.defines(profile):
            return f"conf/sweep/{self.name}.yaml defines no {profile} profile"
        return (self.sweep.get("left_out") or {}).get(profile)

    def untested(self, profile: str) -> dict[str, str]:
        """The claims this profile does not test, by id, with the reason (every claim of a step it leaves
        out); their verdict is "not tested"."""
        why = self.left_out(profile)
        return {c.id: why for c in self.claims} if why else {}

    def defines(self, profile: str) -> bool:
        """Whether the sweep has settings for this profile (a step without a sweep runs in every profile)."""
        return not self.trains or profile in self.sweep["profiles"]

    def configurations(self, profile: str, data_dir: str | None, **options) -> list[Run]:
        """The sweep's configurations (seed 0, before `expand`)."""
        raise NotImplementedError

    def plan(self, profile: str, data_dir: str | None = None, overrides: list[str] = (),
             **options) -> dict[str, Run]:
        """Every run of the sweep: each configuration once per seed, with `overrides` (training overrides
        of the user's, e.g. trainer.max_steps=2 for a trial) applied to every run, where they become part of
        its identity. `options` go to the planner."""
        check_profile(profile)
        if not self.defines(profile):
            raise UserError(f"conf/sweep/{self.name}.yaml defines no {profile} profile; use one of "
                            f"{', '.join(self.sweep['profiles'])}")
        configs = self.configurations(profile, data_dir, **options)
        runs = expand(configs, self.seeds(profile), self.sweep.get("data"), data_dir)
        for run in runs.values():
            run.overrides = merge(run.overrides, list(overrides))
        return runs

    def stages(self, profile: str, data_dir: str | None, overrides: list[str] = (),
               committed: Path | None = None) -> list[Stage]:
        """Every sweep folder the experiment trains (its folder relative to the runs root), in order, as
        planned up front (the pipeline's progress; an experiment whose later stage depends on an earlier one
        plans it with placeholders); none for an experiment that trains nothing. `overrides`: as `plan`'s;
        `committed`: the step folder of an earlier session, whose registry restores finished runs."""
        if not self.trains:
            return []
        return [Stage(self.name, self.plan(profile, data_dir, overrides),
                      committed and Path(committed) / "registry.csv")]

    def train(self, profile: str, out: Path, data_dir: str | None = None, launcher: list[str] = (),
              pipeline: Progress | None = None, committed: Path | None = None, train: bool = True,
              overrides: list[str] = (), part: tuple[int, int] = (1, 1), replace: bool = False) -> Trained:
        """Train the sweep in `out` (skipping finished runs), every run with `overrides`. `committed`: the
        step folder of an earlier session, whose registry's finished runs count as done; `part`: (k, parts),
        the first k of `parts` equal parts of the runs; `replace`: move runs of `out` made with other settings
        aside (engine/sweep_folder.py) instead of refusing."""
        stage, = self.stages(profile, data_dir, overrides, committed)
        return train_stage(self.name, profile, stage.first(*part), out, launcher, pipeline, train, replace)

    # ---- the step ----

    def run_step(self, ctx: StepContext) -> None:
        """The experiment as a step of `make reproduce`: train its sweeps (restoring the committed runs),
        keep their files, measure, tabulate, and record how; in parts, the folder is written after each."""
        step, parts = ctx.step(self), self.parts(ctx.profile)
        for k in range(1, parts + 1):
            trained = self.train(ctx.profile, ctx.runs / self.name, ctx.data_dir, ctx.launcher, ctx.progress,
                                 committed=step.dir, train=ctx.train, part=(k, parts), replace=ctx.replace)
            step.csv("registry.csv", trained.registry)
            for name, df in trained.files.items():
                step.csv(name, df)
            log.info("step %s: runs trained%s; measuring them and drawing the tables and figures", self.name,
                     f" (part {k} of {parts}: its folder can be committed now)" if parts > 1 else "")
            self.measure(step, trained, ctx)
            self.tabulate(step.dir)
            step.done(trained.registry, **trained.info, **({"part": f"{k} of {parts}"} if parts > 1 else {}))

    def measure(self, step: Step, trained: Trained, ctx: StepContext) -> None:
        """Measurements of the trained runs beyond their metrics, into the step folder (`step.per_run`)."""

    def tabulate(self, folder: Path) -> None:
        """The step's tables and figures, from the files of its folder alone."""

    def outside_results(self, folder: Path) -> tuple[dict, str | None]:
        """This step's measurements that a profile's results `folder` holds outside a step folder (the GPU
        campaign's benchmarks), as Results frames {(step, file name): table}, with a line saying what they
        are; ({}, None): none. The combined report judges the step's claims on them where the profile has no
        step folder (engine/combined.py)."""
        return {}, None

    def summary(self, folder: Path) -> str | None:
        """A line for the report under the step's files (None: none)."""
        return None

    # ---- the report ----

    @property
    def claims(self) -> list[Claim]:
        return []

    @property
    def plots(self) -> dict[str, PlotCommand]:
        return {}


def read_csv(folder: Path, name: str) -> pd.DataFrame | None:
    path = Path(folder) / name
    return load_csv(path) if path.is_file() else None


def drawn(name: str, draw) -> None:
    """Draw one figure of a step; a figure whose inputs are missing is a warning, not a failed step."""
    try:
        draw()
    except (ValueError, KeyError) as e:
        log.warning("figure %s not drawn: %s", name, e)
