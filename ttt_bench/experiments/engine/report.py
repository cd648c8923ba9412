"""Step folders and the report assembled from them.

Each experiment writes its own folder `<out>/<name>/` when its step finishes (registry with every seed,
n-gram floors, measurements, tables, figures, and `step.json` with its command, hardware and wall time),
so a long reproduction can be committed step by step. REPORT.md, claims.csv and the README's results block
are then made from every step folder present: `Results` reads the folders, each experiment's claims judge
them, and each experiment's section shows its files.
"""

import functools
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ...io import write_atomic, write_json
from ...machine import hardware
from .progress import Progress, last_wall_time
from .registry import load_csv
from .verdicts import (
    CHECK,
    STATUSES,
    judge_all,
)

log = logging.getLogger("ttt_bench.experiments")
README_BLOCK = ("<!-- results:begin -->", "<!-- results:end -->")


class Step:
    """One experiment's step folder: what it measured and how (`step.json`), written when the step ends."""

    def __init__(self, out: Path, name: str, command: str, trains: bool = True):
        self.dir, self.name, self.command, self.start = Path(out) / name, name, command, time.perf_counter()
        self.trains = trains  # False: tabulated (--no-train) from runs trained by other processes
        self.dir.mkdir(parents=True, exist_ok=True)
        last = last_wall_time(self.dir)  # the step's own estimate
        estimate = "" if last is None else f" (it took {last / 60:.1f} min when {self.dir} was last written)"
        log.info("step %s: started%s", name, estimate)

    def csv(self, name: str, df: pd.DataFrame) -> None:
        write_atomic(self.dir / name, df.to_csv(index=False))

    def per_run(self, name: str, runs: pd.DataFrame, measure) -> pd.DataFrame | None:
        """The step's CSV `name` of a measurement of each run (`measure(run)`: a DataFrame, or None when
        the run's folder is not on this machine), with a `run` column. A run whose folder is gone (its
        registry row restored from the committed results, on a new machine) keeps its committed rows."""
        path = self.dir / name
        committed = pd.read_csv(path) if path.is_file() else None
        parts = []
        for r in runs.itertuples():
            df = measure(r)
            if df is not None:
                parts.append(df.assign(run=r.run))
            elif committed is not None and "run" in committed:
                parts.append(committed[committed["run"] == r.run])
            else:
                log.warning("%s: %s is not measured (its run folder is not here, nor in %s)", self.name,
                            r.run, path)
        parts = [p for p in parts if len(p)]
        if not parts:
            return None
        df = pd.concat(parts, ignore_index=True)
        self.csv(name, df)
        return df

    def restored_only(self, registry: pd.DataFrame) -> bool:
        """Every finished run of the registry was restored from the committed results (a new machine that
        trained nothing): what the step measured before still describes them."""
        finished = registry[registry["status"] == "finished"]
        return "restored_from" in finished and len(finished) > 0 and finished["restored_from"].notna().all()

    def done(self, registry: pd.DataFrame | None = None, **info) -> None:
        """Write step.json; a step that only restored its runs, or whose runs (and part) are those its
        step.json already describes (a resumed pipeline re-tabulating a finished part), keeps it: the
        command, hardware and wall time of the session that trained them, not seconds of re-tabulation."""
        meta = self.dir / "step.json"
        log.info("step %s: done in %.1f min", self.name, (time.perf_counter() - self.start) / 60)
        if registry is not None and meta.is_file() and self.restored_only(registry) and not info.get("error"):
            log.info("%s: every run restored from the committed registry; step.json kept", self.name)
            return
        trained = (
            float(pd.to_numeric(registry["wall_time_s"], errors="coerce").sum())
            if (registry is not None and "wall_time_s" in registry)
            else None
        )
        before = json.loads(meta.read_text()) if meta.is_file() else {}
        if trained and before.get("trained_s") == trained and before.get("part") == info.get("part"):
            log.info("%s: no run trained since step.json was written; step.json kept", self.name)
            return
        write_json(meta, {
            "step": self.name,
            "command": self.command,
            "hardware": hardware(),
            "wall_time_s": round(time.perf_counter() - self.start, 1),
            "trained_s": trained,
            "tabulated_only": not self.trains,
            **trained_on(registry),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            **info,
        })


def trained_on(registry: pd.DataFrame | None) -> dict:
    """The machines the registry's runs trained on (their metrics' `hardware`), where they recorded it: a step
    tabulated on another machine (`--no-train`) still says where its numbers come from."""
    if registry is None or "hardware" not in registry:
        return {}
    return {"trained_on": sorted(registry["hardware"].dropna().astype(str).unique())}


@dataclass
class StepContext:
    """What every step of one `make reproduce` shares."""

    profile: str
    data_dir: str | None
    out: Path  # results/<profile>: the step folders
    runs: Path  # the run folders, one sweep folder per stage
    train: bool  # False (--no-train): tabulate the runs finished so far
    progress: Progress
    launcher: list[str]  # Hydra launcher overrides (joblib with --jobs > 1)
    replace: bool = False  # move runs made with other settings aside instead of refusing (--replace)

    @property
    def flags(self) -> str:
        return f" --profile {self.profile}" + (f" --data-dir {self.data_dir}" if self.data_dir else "")

    def step(self, experiment) -> Step:
        return Step(self.out, experiment.name, f"ttt-bench ablate {experiment.name}{self.flags}",
                    trains=self.train)


class Results:
    """The step folders of one reproduction, as the claims read them: any step's CSV by name (read once), and
    the n-gram floors of every step together. `frames`: tables given directly, by (step, file name);
    `folders`: a step's folder where it is not <out>/<step> (e.g. an `ablate --out` folder)."""

    def __init__(self, out: Path | None = None, steps: list[str] = (), frames: dict | None = None,
                 folders: dict | None = None):
        self.out, self.steps, self.folders = out, list(steps), dict(folders or {})
        self.frames: dict[tuple[str, str], pd.DataFrame | None] = dict(frames or {})

    def csv(self, step: str, name: str = "registry.csv") -> pd.DataFrame | None:
        if (step, name) not in self.frames:
            folder = self.folders.get(step) or (None if self.out is None else Path(self.out) / step)
            path = None if folder is None else Path(folder) / name
            self.frames[step, name] = load_csv(path) if path is not None and path.is_file() else None
        return self.frames[step, name]

    @functools.cached_property
    def floors(self) -> pd.DataFrame | None:
        """Every step's byte n-gram floors (role, seq_len, floor, val_ppl), once per text and context (the
        first step's, in the registry's order)."""
        steps = self.steps + [s for s, n in self.frames if n == "floors.csv" and s not in self.steps]
        parts = [f for s in steps if (f := self.csv(s, "floors.csv")) is not None and len(f)]
        if not parts:
            return None
        return pd.concat(parts, ignore_index=True).drop_duplicates(["role", "seq_len", "floor"])


def profile_verdicts(out: Path, experiments: list, profile: str, results: Results | None = None,
                     tested: tuple[str, ...] = ()) -> pd.DataFrame:
    """judge_all on the step folders in `out` of one profile: every experiment's claims, those the profile
    does not test marked "not tested". `results`: the Results to judge (default: read from `out`); `tested`:
    claim ids judged although the profile's experiment says it does not test them (their inputs are in
    `results` from elsewhere, e.g. the GPU campaign's benchmarks)."""
    results = Results(out, [e.name for e in experiments]) if results is None else results
    claims = [c for e in experiments for c in e.claims]
    untested = {claim: f"not tested in the {profile} profile: {why}" for e in experiments
                for claim, why in e.untested(profile).items() if claim not in tested}
    return judge_all(claims, results, untested)


def write_report(out: Path, experiments: list, profile: str, data_dir: str | None, make: str) -> Path:
    """REPORT.md and claims.csv from the step folders in `out`: the verdicts of every experiment's claims,
    then each experiment's section."""
    verdicts = profile_verdicts(out, experiments, profile)
    write_atomic(out / "claims.csv", verdicts.to_csv(index=False))
    data = (
        "real corpora (pile-mini as the Pile, books-mini as Books)"
        if data_dir
        else "the embedded synthetic corpus (it stands in for both the Pile and Books)"
    )
    parts = [
        f"# ttt-bench results ({profile} profile)\n",
        f"Produced by `{make}` on {data}. Perplexities are per byte (the paper's are per Llama token), so "
        "only orderings and trends compare with the paper, not values. Every verdict below is computed by "
        "the experiment modules of `ttt_bench/experiments/` from the registries in this folder: a difference "
        "is judged by its 95% interval over seeds (paired by seed where both arms ran the same seeds, Welch "
        "otherwise) and, within one table or figure, corrected for multiplicity (Holm); an interval that "
        "contains 0 is inconclusive, or underpowered where its minimum detectable effect (MDE: the "
        "difference detected with 80% power, (t_.975 + t_.8) standard errors) exceeds the paper's effect in "
        "our units, and the sentence then names the seeds it would need at the measured spread. An equality "
        "is two one-sided tests on the same interval: it holds where the whole interval lies inside its "
        "equivalence margin (fixed before the runs, and named in the sentence), does not where the whole "
        "interval lies outside it. A comparison that uses a run that does not beat the byte 3-gram "
        "floor is under-trained. Calibration and budget rows are checks, counted apart from the paper's "
        "claims. Each step's folder holds its registry (every seed), floors, tables and figures.\n",
        "## Verdicts\n",
        status_counts(verdicts) + "\n",
        "| claim | verdict |",
        "|---|---|",
    ]
    parts += [f"| {r.figure}: {r.claim} | **{r.verdict}** |" for r in verdicts.itertuples()]
    parts.append("")
    for e in reported(experiments):
        parts += section(e, out, verdicts, make, profile)
    write_atomic(out / "REPORT.md", "\n".join(parts))
    return out / "REPORT.md"


def status_counts(verdicts: pd.DataFrame) -> str:
    """How many claims have each verdict, in the order of STATUSES, then the checks (kind "check":
    calibration and budget rows, not claims of the paper) apart; a table without `kind` is all claims."""
    is_check = verdicts["kind"].eq(CHECK) if "kind" in verdicts else pd.Series(False, index=verdicts.index)
    claims, checks = verdicts[~is_check], verdicts[is_check]
    text = f"{len(claims)} claims: " + _counts(claims)
    return text + (f"; {len(checks)} checks: " + _counts(checks) if len(checks) else "") + "."


def _counts(verdicts: pd.DataFrame) -> str:
    counts = verdicts["verdict"].value_counts()
    return ", ".join(f"{int(counts[s])} {s}" for s in STATUSES if s in counts)


def reported(experiments: list) -> list:
    """The experiments with a report section, in report order: each paper's quality results, then its
    speed (the registry's order within each)."""
    papers = list(dict.fromkeys(e.paper for e in experiments))
    keyed = [(papers.index(e.paper), e.measures == "speed", i, e) for i, e in enumerate(experiments)]
    return [e for *_, e in sorted(keyed, key=lambda k: k[:3]) if e.section is not None]


def section(e, out: Path, verdicts: pd.DataFrame, make: str, profile: str) -> list[str]:
    s, meta_path = e.section, out / e.name / "step.json"
    parts = [f"## {s.title}\n\n**Paper.** {s.paper}\n"]
    if why := e.left_out(profile):  # its claims are not tested; a committed run of it is still shown
        parts.append(f"**Not in the {profile} profile.** {why[:1].upper()}{why[1:].rstrip('.')}.\n")
        if not meta_path.is_file():
            return parts
        make = f"not a default step of `{make}`; `{make} STEPS={e.name}` runs it"
    elif not meta_path.is_file():
        return parts + [f"**Not run yet in this profile.** `{make} STEPS={e.name}` runs it.\n"]
    else:
        make = f"part of `{make}`"
    meta = json.loads(meta_path.read_text())
    if meta.get("error"):
        parts.append(f"**Failed:** {meta['error']}\n")
    for f in s.files:
        path = out / e.name / f
        if path.suffix == ".md" and path.is_file():
            parts.append(path.read_text())
        elif path.is_file():
            parts.append(f"![{f}]({e.name}/{f})\n")
    if (summary := e.summary(out / e.name)) is not None:
        parts.append(summary + "\n")
    for r in verdicts[verdicts["figure"].isin(s.claim_figures)].itertuples():
        parts.append(f"- **{r.verdict}** — {r.claim} {r.evidence.rstrip('.')}.")
    trained = f"; its runs trained for {meta['trained_s'] / 60:.1f} min" if meta.get("trained_s") else ""
    wall = ("Tabulated with `--no-train` from runs trained by other processes"
            if meta.get("tabulated_only") else f"Wall time {meta['wall_time_s'] / 60:.1f} min")
    machine = f"Hardware: {meta['hardware']}"
    if meta.get("tabulated_only"):  # the runs may have trained elsewhere (a GPU lease)
        where = ("; ".join(meta["trained_on"]) if meta.get("trained_on")
                 else "not recorded in them (they predate it; see RUN.md beside this report)")
        machine = f"Tabulated on: {meta['hardware']}; its runs' machines: {where}"
    parts.append(
        f"\n**Command.** `{meta['command']}` ({make}). {machine}. "
        f"{wall}{trained}; finished {meta['finished']}.\n"
    )
    return parts


def update_readme(readme: Path, out: Path, experiments: list, make: str, profile: str,
                  headline: tuple[str, str, str]) -> None:
    """The README's current results, made from the committed folder's step files and verdicts (the same
    claims.csv as REPORT.md), between the README_BLOCK markers. `headline`: (step, table file, caption) of
    the table shown in full."""
    text = readme.read_text()
    if README_BLOCK[0] not in text:
        return
    verdicts = pd.read_csv(out / "claims.csv")
    rel = out.resolve().relative_to(readme.parent.resolve()).as_posix()
    lines = [
        f"From `{make}`; [{rel}/REPORT.md]({rel}/REPORT.md) has every table, "
        "figure and number"
        + (f"; [{rel}/RUN.md]({rel}/RUN.md) says how the run went" if (out / "RUN.md").is_file() else "")
        + ". Steps run so far:",
        "",
    ]
    for e in reported(experiments):
        meta, left_out = out / e.name / "step.json", e.left_out(profile)
        if left_out and not meta.is_file():
            lines.append(f"- `{e.name}`: not in this profile (REPORT.md says why); its claims are not tested")
        elif meta.is_file():
            m = json.loads(meta.read_text())
            trained = f" (its runs trained {m['trained_s'] / 60:.0f} min)" if m.get("trained_s") else ""
            minutes = f"{m['wall_time_s'] / 60:.0f} min"
            wall = "tabulated with `--no-train`" if m.get("tabulated_only") else minutes
            lines.append(
                f"- `{e.name}`: `{m['command']}`, {wall}{trained} on {m['hardware']}, "
                f"finished {m['finished']}"
                + ("; not a default step of this profile (REPORT.md says why): its claims are not tested"
                   if left_out else "")
            )
        else:
            lines.append(f"- `{e.name}`: not run yet (`{make} STEPS={e.name}`)")
    step, table, caption = headline
    if (out / step / table).is_file():
        reg = load_csv(out / step / "registry.csv") if (out / step / "registry.csv").is_file() else None
        has = reg is not None and "seq_len" in reg
        contexts = sorted({int(v) for v in reg["seq_len"].dropna()}) if has else []
        caption = caption.replace("{context}", "/".join(f"{c:,}" for c in contexts) or "?")
        lines += ["", caption, "", (out / step / table).read_text().strip()]
    lines += ["", f"This profile's verdicts: {status_counts(verdicts)} (each claim with its evidence: "
              f"[{rel}/REPORT.md]({rel}/REPORT.md))."]
    combined = out.parent / "REPORT.md"  # every profile's verdicts in one table (write_combined_report)
    if combined.is_file() and (counts := re.search(r"\*\*(\d+ claims: [^*]+)\*\*", combined.read_text())):
        rel_all = combined.resolve().relative_to(readme.parent.resolve()).as_posix()
        lines += ["", f"All profiles together ([{rel_all}]({rel_all})): **{counts.group(1)}**"]
    start, end = text.index(README_BLOCK[0]), text.index(README_BLOCK[1])
    write_atomic(readme, text[: start + len(README_BLOCK[0])] + "\n" + "\n".join(lines) + "\n" + text[end:])
