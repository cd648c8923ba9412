"""One table of verdicts for the whole reproduction: results/REPORT.md lists every claim once, with its
verdict at the largest profile that decided it (cpu < gpu), that profile's scale, and both where two
profiles decided it differently. `python -m ttt_bench.experiments.engine.combined --combine results`;
`make reproduce PROFILE=cpu|gpu` writes it as its last step. Each profile's verdicts are the same judge_all
as its own REPORT.md (report.py)."""

import json
from pathlib import Path

import pandas as pd

from ...io import write_atomic
from .plan import PROFILES
from .registry import load_csv
from .report import Results, profile_verdicts, status_counts
from .tables import context_label
from .verdicts import (
    CHECK,
    FAILS,
    HOLDS,
    INCONCLUSIVE,
    MISSING,
    NOT_TESTED,
    STATUSES,
    UNDERPOWERED,
    UNDERTRAINED,
)

DECIDED = (HOLDS, FAILS)
JUDGED = (UNDERPOWERED, INCONCLUSIVE, UNDERTRAINED)  # judged, but undecided
COMBINE_COMMAND = "python -m ttt_bench.experiments.engine.combined --combine results"


def _span(values, fmt) -> str:
    values = sorted(set(values))
    return fmt(values[0]) if len(values) == 1 else f"{fmt(values[0])}-{fmt(values[-1])}"


def _millions(v) -> str:
    return f"{v / 1e6:.1f}M" if v >= 1e5 else f"{v:,.0f}"


def step_scale(folder: Path) -> str | None:
    """What a step folder's claims were judged at, from its registry (size, context, training tokens or
    images a run, seeds, corpus), or its latency benchmark; and the machine its runs trained on (step.json's
    `trained_on`, else its `hardware` unless it was only tabulated). None: no such folder."""
    folder = Path(folder)
    meta = json.loads((folder / "step.json").read_text()) if (folder / "step.json").is_file() else {}
    parts = []
    reg = load_csv(folder / "registry.csv") if (folder / "registry.csv").is_file() else None
    bench = load_csv(folder / "latency.csv") if (folder / "latency.csv").is_file() else None
    if reg is not None and "status" in reg:
        runs = reg[reg["status"] == "finished"]
        if runs.empty:
            return "no finished runs"
        num = lambda c: (pd.to_numeric(runs[c], errors="coerce").dropna() if c in runs
                         else pd.Series([], dtype=float))
        if "size" in runs and runs["size"].notna().any():
            parts.append("size " + "/".join(sorted(runs["size"].dropna().astype(str).unique())))
        if len(num("seq_len")):
            text = "role" in runs and runs["role"].isin(["pile", "books"]).any()
            parts.append("context " + _span(num("seq_len").astype(int), lambda v: f"{v:,}")
                         + (" bytes" if text else " tokens"))
        if len(num("tokens_seen")):
            parts.append(_span(num("tokens_seen"), _millions) + " training tokens a run")
        if len(num("images_seen")):
            images = f"{_span(num('images_seen').astype(int), lambda v: f'{v:,}')} training images a run"
            if len(num("image_size")) and len(num("num_tokens")):
                images = (f"{_span(num('image_size').astype(int), str)}px images as "
                          f"{_span(num('num_tokens').astype(int), str)} tokens, " + images)
            parts.append(images)
        if "seed" in runs:
            parts.append(f"{runs['seed'].nunique()} seeds")
        if "corpus" in runs and runs["corpus"].notna().any():
            parts.append("/".join(sorted(runs["corpus"].dropna().astype(str).unique())))
    elif bench is not None:
        prefill = bench[bench["phase"] == "prefill"] if "phase" in bench else bench
        for col, fmt in (("batch", "batch {}"), ("dtype", "{}"), ("device", "on {}")):
            if col in prefill and prefill[col].notna().any():
                vals = sorted({str(v).removesuffix(".0") for v in prefill[col].dropna()})
                parts.append(fmt.format("/".join(vals)))
        if "d_model" in prefill and prefill["d_model"].notna().any():
            parts.append("width " + _span(prefill["d_model"].astype(int), str))
        if "context" in prefill and len(prefill):
            parts.append("contexts " + _span(prefill["context"].astype(int), context_label))
    elif not meta:
        return None
    machine = (meta.get("trained_on") or ([] if meta.get("tabulated_only") else [meta.get("hardware")])
               or ["trained on a machine step.json does not record: the profile's RUN.md says which"])
    machine = "; ".join(str(m).split(", torch")[0] for m in machine if m)
    return ", ".join(parts) + (f" ({machine})" if machine else "")


def combined_verdicts(root: Path, experiments: list, profiles: list[str] | None = None) -> pd.DataFrame:
    """Every claim once (id, figure, kind, claim), with each profile's verdict and scale (columns
    `<profile>`, `<profile>_scale`, `<profile>_evidence`) and the combined one: `verdict` and `profile`, the
    largest profile (in PROFILES order) that decided it (holds or does not hold), `disagree` where two
    profiles decided it differently (`verdict` is then the largest's); an undecided claim takes the
    largest profile's judged verdict (inconclusive, underpowered, under-trained), else not tested, else not
    measured. Each profile's verdicts are judge_all on its step folders (profile_verdicts); a step without
    a folder in a profile is judged on what its experiment finds there outside step folders
    (`Experiment.outside_results`: the gpu profile's Figure 3 on the GPU campaign's benchmarks)."""
    root = Path(root)
    if profiles is None:
        profiles = [p for p in PROFILES if any((root / p).glob("*/step.json"))]
    owner = {c.id: e.name for e in experiments for c in e.claims}
    table = None
    for p in profiles:
        out, tested, frames, scales = root / p, (), {}, {}
        for e in experiments:
            if not (out / e.name / "step.json").is_file() and (found := e.outside_results(out))[0]:
                frames.update(found[0])
                tested, scales[e.name] = tested + tuple(c.id for c in e.claims), found[1]
        results = Results(out, [e.name for e in experiments], frames=frames)
        v = profile_verdicts(out, experiments, p, results, tested)
        scale = {name: scales.get(name) or step_scale(out / name) for name in set(owner.values())}
        v[f"{p}_scale"] = [scale.get(owner.get(i)) if verdict not in (NOT_TESTED, MISSING) else None
                           for i, verdict in zip(v["id"], v["verdict"], strict=True)]
        v = v.rename(columns={"verdict": p, "evidence": f"{p}_evidence"})
        table = v if table is None else table.merge(v[["id", p, f"{p}_scale", f"{p}_evidence"]], on="id")
    if table is None:
        raise ValueError(f"no profile folders with step folders in {root}")
    rank = {s: (3 if s in DECIDED else 2 if s in JUDGED else 1 if s == NOT_TESTED else 0) for s in STATUSES}
    picked, disagree = [], []
    for r in table.to_dict("records"):
        best = max(reversed(profiles), key=lambda p: rank[r[p]])  # ties: the largest profile
        picked.append(best)
        disagree.append(len({r[p] for p in profiles if r[p] in DECIDED}) > 1)
    table["profile"] = picked
    table["verdict"] = [r[p] for r, p in zip(table.to_dict("records"), picked, strict=True)]
    table["disagree"] = disagree
    return table


def write_combined_report(root: Path, experiments: list, profiles: list[str] | None = None) -> Path:
    """results/REPORT.md: every claim once with its verdict at the largest profile that decided it (both
    where two profiles decided it differently), that profile's scale, and the other profiles' verdicts;
    it opens with the counts (claims apart from checks), how many claims are decided and how many of those
    by the cpu profile alone. See combined_verdicts."""
    root = Path(root)
    table = combined_verdicts(root, experiments, profiles)
    profiles = [p for p in PROFILES if p in table.columns]
    claims = table[table["kind"] != CHECK]
    decided = claims[claims["verdict"].isin(DECIDED)]
    by = lambda p: decided[[{q for q in profiles if r[q] in DECIDED} == {p}
                            for r in decided.to_dict("records")]]
    alone = {p: len(by(p)) for p in profiles}
    reports = ", ".join(f"[{p}/REPORT.md]({p}/REPORT.md)" for p in profiles)
    lines = [
        "# ttt-bench: every claim once, at the largest scale that decided it\n",
        f"Made by `{COMBINE_COMMAND}` from the step folders of "
        f"{', '.join(f'results/{p}' for p in profiles)}, "
        f"judged by the same claims as each profile's report ({reports}, where each verdict's evidence is). "
        f"Each claim shows its verdict at the largest profile ({' < '.join(profiles)}) that decided it "
        "(holds or does not hold), with that profile's scale: model size, context, training tokens or images "
        "a run, seeds and the machine its runs trained on, from the step folder's registry.csv and "
        "step.json. Where two profiles decided it differently, both are shown. A claim no profile decided "
        "shows the largest profile's inconclusive, underpowered or under-trained verdict, else not tested, "
        "else not measured. Calibration and budget rows are checks, counted apart.\n",
        f"**{status_counts(table)}** Decided (holds or does not hold): {len(decided)} of {len(claims)} "
        "claims, "
        + ", ".join(f"{alone[p]} by the {p} profile alone" for p in profiles)
        + (f", {len(decided) - sum(alone.values())} by more than one" if len(decided) > sum(alone.values())
           else "")
        + f"; {int(claims['disagree'].sum())} decided differently by two profiles.\n",
    ]
    if "gpu" in profiles and any(isinstance(s, str) and s.startswith("GPU campaign")
                                 for s in table["gpu_scale"]):
        lines.append("The gpu profile has no latency step: its Figure 3 verdict is judged, by the same "
                     "claim, on the GPU campaign's prefill benchmarks at the paper's size and batch "
                     "(results/gpu/RUN.md), not on a step folder.\n")
    lines += ["| claim | verdict | decided at: profile, scale | other profiles |", "|---|---|---|---|"]
    for r in table.to_dict("records"):
        p = r["profile"]
        shown = [p] + ([q for q in reversed(profiles) if q != p and r[q] in DECIDED] if r["disagree"] else [])
        verdict = "; ".join(f"**{r[q]}**" + (f" ({q})" if r["disagree"] else "") for q in shown)
        scales = {q: r[f"{q}_scale"] for q in shown if isinstance(r[f"{q}_scale"], str)}
        where = "<br>".join(f"{q}: {scales[q]}" if q in scales else q for q in shown)
        if r["verdict"] not in DECIDED:
            where = f"not decided; {where}"
        others = "; ".join(f"{q}: {r[q]}" for q in profiles if q not in shown)
        kind = " *(check)*" if r["kind"] == CHECK else ""
        lines.append(f"| {r['figure']}: {r['claim']}{kind} | {verdict} | {where} | {others} |")
    split = table[table["disagree"]]
    if len(split):
        lines += ["", "## Where profiles disagree", ""]
        for r in split.to_dict("records"):
            lines.append(f"**{r['figure']}: {r['claim']}**\n")
            lines += [f"- {q}, **{r[q]}**: {str(r[f'{q}_evidence']).rstrip('.')}." for q in reversed(profiles)
                      if r[q] in DECIDED]
            lines.append("")
    write_atomic(root / "REPORT.md", "\n".join(lines) + "\n")
    return root / "REPORT.md"


def main(argv: list[str] | None = None) -> None:
    """`python -m ttt_bench.experiments.engine.combined --combine results`: results/REPORT.md from every
    profile folder under it."""
    import argparse

    from ttt_bench.experiments import EXPERIMENTS
    from ttt_bench.experiments.engine import combined  # this module by its name, not as __main__

    p = argparse.ArgumentParser(prog="python -m ttt_bench.experiments.engine.combined",
                                description="one table of verdicts for every profile's results")
    p.add_argument("--combine", type=Path, required=True, metavar="RESULTS",
                   help="the results root with a folder per profile (results/)")
    p.add_argument("--profiles", help=f"comma-separated profiles (default: those of {', '.join(PROFILES)} "
                   "with step folders under RESULTS)")
    a = p.parse_args(argv)
    profiles = [x for x in a.profiles.split(",") if x] if a.profiles else None
    print(combined.write_combined_report(a.combine, list(EXPERIMENTS.values()), profiles))


if __name__ == "__main__":
    main()
