"""Table 1: from linear attention to TTT-Linear, one design change per row (conf/sweep/table1.yaml).

The ladder is incremental: a row with `change` is the row above with those overrides applied, so
consecutive rows differ by exactly that change; a row with `overrides` starts a new model. The paper's
perplexities (the sweep's `paper_ppl`) give each step's paper difference: a claim per step that the paper
reports, judged on the same step of our ladder.
"""

import numpy as np
import pandas as pd

from ..io import write_atomic
from . import units
from .engine.experiment import Experiment, Section, read_csv
from .engine.floors import undertrained
from .engine.plan import Run, configuration, data_overrides, merge, value
from .engine.registry import finished_runs
from .engine.stats import difference
from .engine.tables import by_config, floor_rows, fmt_ppl, fmt_se, stalled_note, undertrained_mark
from .engine.verdicts import MISSING, UNDERTRAINED, Claim, Verdict, compare, status_of

ETA_PREFIX = "eta-"  # the step-size sweep's configurations: eta-<eta>

# the claim of each ladder step the paper reports: row -> (claim key, sentence; {diff}: the paper's)
STEP_CLAIMS = {
    "linear_attention_improved": ("improved", "Linear attention without the feature map and normalizer "
                                  "(improved) has lower perplexity than Katharopoulos et al.'s."),
    "ttt_equivalence": ("equivalence", "The TTT layer of Theorem 1 is the improved linear attention: the "
                        "same perplexity."),
    "learnable_w0": ("learnable_w0", "A learnable W_0 hurts slightly ({diff})."),
    "ln_residual": ("ln_residual", "LN and residual in f lower perplexity ({diff})."),
    "minibatch": ("minibatch", "Mini-batch TTT (b = T -> 16) lowers perplexity ({diff})."),
    "learnable_eta": ("learnable_eta", "A learnable inner learning rate lowers perplexity ({diff})."),
    "mamba_backbone": ("mamba_backbone", "The Mamba backbone lowers perplexity ({diff})."),
}


def table1_row(reg, name: str) -> pd.DataFrame:
    """The finished runs of one ladder row, by its name (configs are `<row number>-<name>`)."""
    df = finished_runs(reg)
    return df[df["config"].astype(str).str.split("-", n=1).str[-1] == name].sort_values("seed")


def last_rows(reg) -> pd.DataFrame:
    """The finished runs of the ladder's last row and of the reference models (configs without a row
    number, outside the step-size sweep): what the headline comparisons rest on."""
    t1 = finished_runs(reg)
    t1 = t1[~t1["config"].astype(str).str.startswith(ETA_PREFIX)]
    row = t1["config"].astype(str).str.split("-", n=1).str[0]
    numbered = row.str.isdigit()
    last = row[numbered].astype(int).max() if numbered.any() else None
    return t1[~numbered | (row == str(last))]


def eta_markdown(registry: pd.DataFrame, sweep: dict, floors: pd.DataFrame | None = None) -> str:
    """The step-size sweep at one ladder row: perplexity per fixed eta (the row itself, at the authors' scale,
    is in table1.md)."""
    cfg = by_config(registry)
    cfg = cfg[cfg["eta"].notna()]
    lines = [f"| fixed $\\eta$ | {_label(registry, sweep['row'])}: Ppl. (mean +- std) | seeds |",
             "|---:|---:|---:|"]
    for _, r in cfg.sort_values("eta").iterrows():
        mark = undertrained_mark(r, floors)
        lines.append(f"| {r['eta']:g} | {fmt_ppl(r['ppl_mean'], r['ppl_std'], r['seeds'])}{mark} | "
                     f"{r['seeds']} |")
    return "\n".join(lines) + "\n"


def table1_markdown(registry: pd.DataFrame, floors: pd.DataFrame | None = None,
                    curves: pd.DataFrame | None = None) -> tuple[pd.DataFrame, str]:
    """Table 1: mean +- std over seeds, the Diff. of the means from the row above, the paper's numbers, and
    the n-gram floors; a row that does not beat the 3-gram floor is marked under-trained, one with a stalled
    run (its `curves`) is starred and the run named."""
    cfg = by_config(registry)
    stalled, note = stalled_note(registry, curves, floors)
    star = lambda r: "\\*" if str(r["config"]) in stalled else ""
    rows = cfg[cfg["row"].notna()].sort_values("row")
    refs = cfg[cfg["row"].isna() & ~cfg["config"].astype(str).str.startswith(ETA_PREFIX)]
    fmt = lambda v, signed=False: "-" if pd.isna(v) else (f"{v:+.2f}" if signed else f"{v:.2f}")
    diff, paper = rows["ppl_mean"].diff(), pd.to_numeric(rows["paper_ppl"], errors="coerce")
    paper_diff = paper - paper.ffill().shift()  # from the nearest row above that the paper has
    se = "eval_se" in cfg  # the evaluation's own error beside the seed spread, where measured
    lines = [
        "| Configuration | Ppl. (mean +- std) | Diff. |" + (" eval SE |" if se else "")
        + " seeds | Paper Ppl. | Paper Diff. |",
        "|---|---:|---:|" + ("---:|" if se else "") + "---:|---:|---:|",
    ]
    for (_, r), d, pp, pd_ in zip(rows.iterrows(), diff, paper, paper_diff, strict=True):
        mark = undertrained_mark(r, floors)
        lines.append(
            f"| {r['label']}{star(r)} | {fmt_ppl(r['ppl_mean'], r['ppl_std'], r['seeds'])}{mark} | "
            f"{fmt(d, True)} |" + (f" {fmt_se(r)} |" if se else "") + f" {r['seeds']} | {fmt(pp)} | "
            f"{fmt(pd_, True)} |"
        )
    for _, r in refs.iterrows():
        mark = undertrained_mark(r, floors)
        lines.append(
            f"| *{r['label']} (reference)*{star(r)} | "
            f"{fmt_ppl(r['ppl_mean'], r['ppl_std'], r['seeds'])}{mark} | |"
            + (f" {fmt_se(r)} |" if se else "") + f" {r['seeds']} | | |"
        )
    lines += floor_rows(floors, ["label"], 4 + se)
    table = pd.concat([rows, refs])[["config", "label", "ppl_mean", "ppl_std", "seeds", "paper_ppl"]]
    return table, "\n".join(lines) + "\n" + note


class Table1(Experiment):
    name = "table1"

    @property
    def section(self) -> Section:
        p = self.paper_ppl
        d = dict(self.steps())
        return Section(
            "Table 1: from linear attention to TTT-Linear",
            f"Each design lowers perplexity except learnable W0 ({d['learnable_w0'][2]:+.2f}); the biggest "
            f"gain is mini-batch TTT (b = T -> 16, {d['minibatch'][2]:+.2f}), then LN and residual in f "
            f"({d['ln_residual'][2]:+.2f}); TTT-Linear (M) ends at {p['mamba_backbone']:.2f} vs "
            f"{p['linear_attention']:.2f} for linear attention (125M, Pile 2k, Llama tokens).",
            ["table1.md", "table1_eta.md"],
            ["Table 1"],
        )

    @property
    def paper_ppl(self) -> dict[str, float]:
        return {r["name"]: r["paper_ppl"] for r in self.sweep["runs"] if r.get("paper_ppl") is not None}

    def steps(self) -> list[tuple[str, tuple[str, str, float, str]]]:
        """(claim key, (row, the row above it in our ladder, the paper's difference, expected sign)) of every
        step the paper reports: its difference from the nearest row above that the paper has."""
        return [(key, step[:4]) for key, step in self.paper_steps()]

    def paper_steps(self) -> list[tuple[str, tuple]]:
        """`steps` with the two perplexities the paper's difference is of (the row's, the one above)."""
        rows, out, paper_above = [r["name"] for r in self.sweep["runs"]], [], None
        for above, row in zip([None, *rows], rows, strict=False):
            paper = self.paper_ppl.get(row)
            if paper is None:
                continue
            if paper_above is not None and row in STEP_CLAIMS:
                diff = round(paper - paper_above, 2)
                expect = "<" if diff < 0 else ">" if diff else "="
                out.append((STEP_CLAIMS[row][0], (row, above, diff, expect, paper, paper_above)))
            paper_above = paper
        return out

    def configurations(self, profile: str, data_dir: str | None) -> list[Run]:
        base = data_overrides(self.sweep["data"], data_dir) + self.sweep["profiles"][profile]["overrides"]
        runs, model = [], []
        for i, row in enumerate(self.sweep["runs"]):
            model = list(row["overrides"]) if "overrides" in row else merge(model, row["change"])
            runs.append(configuration(f"{i + 1}-{row['name']}", base + model, row["label"], row=i + 1,
                                      paper_ppl=row.get("paper_ppl"), change=" ".join(row.get("change", []))))
        for ref in self.sweep.get("references", []):
            runs.append(configuration(ref["name"], base + ref["overrides"], ref["label"], row=None,
                                      paper_ppl=None))
        p = self.sweep["profiles"][profile]
        return runs + self.eta_sweep(runs, p.get("etas", []), p.get("eta_seeds"))

    def eta_sweep(self, runs: list[Run], etas: list[float], seeds: int | None) -> list[Run]:
        """The `eta_sweep` row at each fixed eta of the profile's `etas` (eta = eta_base / head_dim), one
        change each, with `seeds` seeds (None: the profile's)."""
        if not etas:
            return []
        row = next(r for r in runs if r.config.split("-", 1)[-1] == self.sweep["eta_sweep"]["row"])
        head_dim = "${ttt.div:${size.d_model},${size.n_heads}}"
        return [configuration(f"{ETA_PREFIX}{eta:g}",
                              merge(row.overrides, [f"model.block.eta_base='${{ttt.mul:{head_dim},{eta}}}'"]),
                              f"{row.label}, $\\eta$ = {eta:g}", row=None, paper_ppl=None, eta=eta,
                              seeds=seeds)
                for eta in etas]

    def tabulate(self, folder) -> None:
        reg = read_csv(folder, "registry.csv")
        if reg is not None:
            floors = read_csv(folder, "floors.csv")
            curves = read_csv(folder, "curves.csv")
            write_atomic(folder / "table1.md", table1_markdown(reg, floors, curves)[1])
            if "eta" in reg and reg["eta"].notna().any():  # the profile swept eta
                write_atomic(folder / "table1_eta.md", eta_markdown(reg, self.sweep["eta_sweep"], floors))

    def summary(self, folder) -> str | None:
        """The inner steps the mini-batch row takes at this profile's context, and where the claim's
        long-context form is judged."""
        reg = read_csv(folder, "registry.csv")
        row = None if reg is None else table1_row(reg, "minibatch")
        if row is None or row.empty or "seq_len" not in row:
            return None
        T = int(row["seq_len"].iloc[0])
        b = value(next(r for r in self.sweep["runs"] if r["name"] == "minibatch")["change"],
                  "model.block.mini_batch_size")
        return (f"At this context ({T:,} tokens) the mini-batch row (b = {b}) takes T/b = {T // b} inner "
                "steps a sequence (the paper at 2k: 128); the long-context form of the mini-batch claim is "
                "Figure 8's, judged at 1,024 bytes (the minibatch step).")

    @property
    def claims(self) -> list[Claim]:
        steps, role = dict(self.steps()), self.sweep["data"]
        sentences = dict(STEP_CLAIMS.values())
        out = [Claim(f"table1.{key}", "Table 1", sentences[key].format(diff=f"{paper:+.2f}"),
                     self.step_judge(row, above, paper, expect, (role, ppl, ppl_above)))
               for key, (row, above, paper, expect, ppl, ppl_above) in self.paper_steps()]
        p = self.paper_ppl
        return out + [
            Claim("table1.largest_gain", "Table 1",
                  "Mini-batch TTT is the largest improvement of the ladder.",
                  lambda r: largest_gain(r, steps)),
            Claim("table1.end_to_end", "Table 1", f"TTT-Linear (M) ends well below linear attention "
                  f"({p['mamba_backbone']:.2f} vs {p['linear_attention']:.2f}).",
                  lambda r: compare(table1_row(r.csv("table1"), "mamba_backbone"),
                                    table1_row(r.csv("table1"), "linear_attention"),
                                    ("TTT-Linear (M)", "Linear attention [41]"), "<", r.floors,
                                    f"; paper {p['mamba_backbone']:.2f} vs {p['linear_attention']:.2f}",
                                    paper_effect=units.paper_effect(r, role, p["mamba_backbone"],
                                                                    p["linear_attention"]))),
        ]

    def step_judge(self, row: str, above: str, paper: float, expect: str, paper_ppls: tuple):
        """`paper_ppls`: (role, the paper's perplexity of the row, of the row above), for the paper's effect
        per byte."""
        def judge(r) -> Verdict:
            reg = r.csv("table1")
            effect = units.paper_effect(r, *paper_ppls) if expect != "=" else None
            margin, source = self.equivalence_margin if expect == "=" else (None, None)
            return compare(table1_row(reg, row), table1_row(reg, above),
                           (_label(reg, row), _label(reg, above)), expect, r.floors, f"; paper {paper:+.2f}",
                           paper_effect=effect, margin=margin, margin_source=source)

        return judge

    def margin(self, r=None) -> float | None:
        """Table 1's equivalence margin, a fraction of the reference row's perplexity: the sweep's a-priori
        `equivalence_margin` (1%), fixed before the runs; not half the smallest of the paper's effects per
        byte (learnable W0's, 0.067%: a margin of 0.03%, far below what our seeds can resolve); None: the
        default margin."""
        return self.equivalence_margin[0]


def _label(reg, name: str) -> str:
    df = table1_row(reg, name)
    return str(df["label"].iloc[0]) if len(df) and "label" in df else name


def seed_diffs(reg, row: str, above: str) -> np.ndarray:
    """Per-seed differences between two rows (the same seed: the same data order)."""
    a = table1_row(reg, row).set_index("seed")["val_ppl"]
    b = table1_row(reg, above).set_index("seed")["val_ppl"]
    return (a - b).dropna().to_numpy()


def largest_gain(r, steps: dict) -> Verdict:
    """Mini-batch TTT's gain is larger than every other step's of the paper's ladder; under-trained where a
    run of the rows these steps compare does not beat its 3-gram floor (the registry's other runs, the eta
    sweep and the reference models, do not enter it)."""
    reg = r.csv("table1")
    gains = {k: seed_diffs(reg, row, above) for k, (row, above, _, _) in steps.items()}
    if any(len(v) == 0 for v in gains.values()):
        return Verdict(MISSING, "not every row of the ladder finished")
    means = {k: float(v.mean()) for k, v in gains.items()}
    best = min(means, key=means.get)
    runner = min((k for k in means if k != "minibatch"), key=means.get)
    # the steps' gains share their seeds (the same data order in every row): paired, so the variance of the
    # difference counts their correlation
    d = difference(gains["minibatch"], gains[runner], paired=len(gains["minibatch"]) == len(gains[runner]))
    status = status_of(d, "<", 0.0)
    # under-trained: only the runs of the ladder's rows it compares (not the eta sweep's or the references')
    ladder = pd.concat([table1_row(reg, name) for row, above, _, _ in steps.values()
                        for name in (row, above)])
    under = undertrained(ladder.drop_duplicates("run"), r.floors)
    if under:
        status = UNDERTRAINED
    sentence = (
        f"the largest mean gain is {best} ({means[best]:+.3f}); mini-batch TTT {means['minibatch']:+.3f} vs "
        "the "
        f"next largest other step, {runner}, {means[runner]:+.3f}: difference {d.text()}"
        + (f"; {len(under)} runs do not beat the 3-gram floor (under-trained)" if under else "")
    )
    return Verdict(status, sentence, {"mean_gains": means} | ({} if d.p is None else {"p": d.p}))


EXPERIMENT = Table1()
