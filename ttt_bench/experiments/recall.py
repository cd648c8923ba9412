"""Recall capacity: multi-query associative recall (MQAR, Zoology; docs/recall.md), every model at several
widths and numbers of key-value pairs, answer accuracy against the recurrent state's size
(conf/sweep/recall.yaml).

Two stages, as Zoology picks learning rates: a calibration grid (every lr of the profile for every method at
one width and number of pairs, one seed) in <sweep>/calibration, then the whole grid at each method's best
lr (`best_lrs`: highest answer accuracy, ties: lower answer loss) with the profile's seeds. One lr skips the
first stage.
"""

from pathlib import Path

import pandas as pd

from ..io import write_atomic
from ..models.state_size import state_floats
from .engine import plotting as P
from .engine.experiment import Experiment, PlotCommand, Section, drawn, read_csv
from .engine.plan import Run, composed_model, configuration, value
from .engine.progress import Progress
from .engine.registry import finished_runs, read_registry
from .engine.runner import Stage, Trained, train_stage
from .engine.stats import mean_sd
from .engine.verdicts import FAILS, HOLDS, MISSING, NOT_TESTED, Claim, Verdict, combine, compare

# the Transformer's accuracy, at the setting the claims are judged at, that says the probe works
CALIBRATED = 0.95


def elimination(pairs: int) -> float:
    """Answer accuracy of a model that knows which values the pairs hold but not which key each belongs to,
    and never repeats an answer it has seen: each value is fed back as the next input (docs/recall.md), so
    the k-th query has N - k + 1 candidates left: mean of 1 / (N - k + 1) = H_N / N (0.52 at 4 pairs, 0.34
    at 8)."""
    return sum(1 / k for k in range(1, pairs + 1)) / pairs


def chance(vocab: int) -> float:
    """Answer accuracy of a uniform guess among the value tokens (the upper half of the vocabulary)."""
    return 1 / (vocab - vocab // 2)


def vocab_of(df: pd.DataFrame) -> int | None:
    """The MQAR vocabulary of a registry's runs (column `vocab`, else `data.vocab_size=` in `overrides`)."""
    if "vocab" in df and df["vocab"].notna().any():
        return int(pd.to_numeric(df["vocab"]).dropna().iloc[0])
    found = df.get("overrides", pd.Series(dtype=str)).astype(str).str.extract(r"data\.vocab_size=(\d+)")[0]
    found = found.dropna()
    return int(found.iloc[-1]) if len(found) else None


def best_lrs(calibration: pd.DataFrame) -> dict:
    """Each method's learning rate from a calibration registry: the highest answer accuracy, ties broken by
    the lower answer loss (Zoology keeps the best lr per model)."""
    df = calibration[calibration["status"] == "finished"].copy()
    df = df.sort_values(["val_accuracy", "val_loss"], ascending=[False, True])
    return {m: float(g["lr"].iloc[0]) for m, g in df.groupby("method", sort=False)}


def recall_table(registry: pd.DataFrame, lrs: dict | None = None) -> str:
    """MQAR as Markdown: a row per method and width, a column per number of pairs with the answer accuracy
    (mean +- std over seeds), the recurrent state in floats, the TTT mini-batch size b and the learning rate
    used; then the chance and elimination baselines per number of pairs."""
    df = registry[registry["status"] == "finished"].copy()
    if df.empty:
        return "No finished recall runs yet.\n"
    df["val_accuracy"] = pd.to_numeric(df["val_accuracy"], errors="coerce")
    pairs = sorted(df["pairs"].unique())
    T = int(df["seq_len"].iloc[0])
    b_of = lambda g: (pd.to_numeric(g["b"], errors="coerce").dropna() if "b" in g else pd.Series(dtype=float))
    lines = [
        "| Method | width | state (floats) | b (T/b) | lr | "
        + " | ".join(f"{n} pairs" for n in pairs) + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(pairs),
    ]
    for (label, width), g in df.groupby(["label", "width"], sort=False):
        cells = []
        for n in pairs:
            acc = g.loc[g["pairs"] == n, "val_accuracy"]
            cells.append("-" if acc.empty else (f"{acc.mean():.3f}" if len(acc) < 2
                                                else f"{acc.mean():.3f} +- {acc.std():.3f} ({len(acc)})"))
        state = g.loc[g["pairs"] == pairs[-1], "state_floats"]
        b = b_of(g)
        b_cell = f"{int(b.iloc[0])} ({T // int(b.iloc[0])})" if len(b) else "-"
        lines.append(f"| {label} | {int(width)} | {int(state.iloc[0]) if len(state) else '-'} | {b_cell} | "
                     f"{g['lr'].iloc[0]:g} | " + " | ".join(cells) + " |")
    vocab = vocab_of(df)
    if vocab:
        lines.append(f"| *chance (1 of {vocab - vocab // 2} values)* | | | | | "
                     + " | ".join(f"{chance(vocab):.3f}" for _ in pairs) + " |")
    lines.append("| *elimination baseline (H_N / N)* | | | | | "
                 + " | ".join(f"{elimination(int(n)):.3f}" for n in pairs) + " |")
    lines.append(
        f"\nAnswer accuracy on the validation split (mean +- std (seeds)); {T} tokens per sequence. Each "
        "answer is the next input token (answers are not kept out of the inputs), so a model that knows "
        "which values the pairs hold but not which key each belongs to reaches the elimination baseline "
        "H_N / N by never repeating an answer; recall means accuracy above it. b: the TTT mini-batch size "
        "(T/b: inner steps per sequence)."
    )
    if lrs:
        lines.append("Learning rates chosen on the calibration grid (highest accuracy, then lowest loss): "
                     + ", ".join(f"{m} {v:g}" for m, v in lrs.items()) + ".")
    return "\n".join(lines) + "\n"


# ---- figures ----

def recall_accuracy(reg: pd.DataFrame) -> pd.DataFrame:
    """One row per (method, width, pairs): the answer accuracy's mean and std over seeds, the state size."""
    df = reg[reg["status"] == "finished"].copy()
    if df.empty:
        raise ValueError("no finished runs in the recall registry")
    for col in ("val_accuracy", "width", "pairs", "state_floats"):
        df[col] = pd.to_numeric(df[col], errors="coerce")
    g = df.groupby(["label", "width", "pairs"], sort=False)
    out = g.agg(
        accuracy=("val_accuracy", "mean"),
        state_floats=("state_floats", "first"),
        seq_len=("seq_len", "first"),
        n_seeds=("val_accuracy", "size"),
    )
    out["accuracy_std"] = g["val_accuracy"].std(ddof=1).fillna(0.0)
    return out.reset_index()


def recall_figure(reg: pd.DataFrame):
    """Left panels: answer accuracy vs number of key-value pairs, one panel per width. Right: accuracy vs
    the recurrent state's size in floats (Zoology's frontier), one point per (width, pairs), a line per
    method and number of pairs."""
    agg = recall_accuracy(reg)
    vocab = vocab_of(reg)
    widths = sorted(agg["width"].unique())
    fig, axes = P.plt.subplots(1, len(widths) + 1, figsize=(4.2 * (len(widths) + 1), 4.2),
                               layout="constrained")
    for ax, width in zip(axes, widths, strict=False):
        for label, g in agg[agg["width"] == width].groupby("label", sort=False):
            g = g.sort_values("pairs")
            P.errorbar(ax, g["pairs"], g["accuracy"], g["accuracy_std"], label)
        ticks = sorted(agg["pairs"].unique())
        ax.plot(ticks, [elimination(int(n)) for n in ticks], color=P.FLOOR_COLOUR, ls="--", lw=1.1,
                marker="_", markersize=24, label="elimination baseline")  # a mark where one pairs value
        if vocab:
            ax.axhline(chance(vocab), color=P.FLOOR_COLOUR, ls=":", lw=1.1, label="chance")
        ax.set(
            xscale="log",
            xlabel="key-value pairs",
            ylabel="answer accuracy",
            ylim=(-0.02, 1.02),
            title=f"width {width}",
        )
        if len(ticks) == 1:  # one number of pairs: centre it
            ax.set_xlim(ticks[0] / 2, ticks[0] * 2)
        P.finish_log_axis(ax, "x", ticks=ticks)
    frontier = axes[-1]
    for (label, pairs), g in agg.groupby(["label", "pairs"], sort=False):
        g = g.sort_values("state_floats")
        colour, marker = P.method_style(label)
        frontier.plot(
            g["state_floats"],
            g["accuracy"],
            color=colour,
            marker=marker,
            lw=1,
            alpha=0.35 + 0.65 * (pairs / agg["pairs"].max()),
            label=label,
        )
    frontier.set(
        xscale="log",
        xlabel="recurrent state per sequence (floats, all layers)",
        ylabel="answer accuracy",
        ylim=(-0.02, 1.02),
        title="accuracy vs state size (darker: more pairs)",
    )
    P.finish_log_axis(frontier, "x", formatter=P.sci)
    T = int(agg["seq_len"].iloc[0])
    fig.suptitle(f"MQAR recall, {T} tokens per sequence ({P.seeds_note(agg['n_seeds'])})")
    P.legend_below(fig, P.handles_of(axes[0]) + P.handles_of(frontier))
    return fig


def plot_recall(inputs: list[Path], stem: Path) -> list[Path]:
    return P.save(recall_figure(read_registry(inputs[0])), stem)


# ---- claims ----


FIXED_STATE = ("transformer", "ttt_kernel")  # methods whose state grows with the context (a KV cache)


def recall_calibration(r) -> Verdict:
    """The probe can decide its claims at the setting they are judged at (the most pairs, every width): the
    Transformer recalls there (every seed >= CALIBRATED), and at least one model with a fixed-size state does
    not (its mean below CALIBRATED), so the setting stresses a fixed state. Either failing, the recipe or the
    setting is wrong for this budget, and the recall comparisons are not testable here."""
    df = finished_runs(r.csv("recall"))
    tf = df[df.get("method", pd.Series(dtype=str)) == "transformer"] if not df.empty else df
    if tf.empty:
        return Verdict(MISSING, "no finished Transformer recall runs")
    hard_pairs = int(df["pairs"].max())
    hard = df[df["pairs"] == hard_pairs].copy()
    hard["val_accuracy"] = pd.to_numeric(hard["val_accuracy"])
    parts, ok = [], True
    for w, g in hard[hard["method"] == "transformer"].groupby("width"):
        acc = g["val_accuracy"]
        ok &= bool((acc >= CALIBRATED).all())
        parts.append(f"Transformer at {hard_pairs} pairs, width {int(w)}: {mean_sd(acc)}")
    fixed = hard[~hard["method"].isin(FIXED_STATE)]
    fixed = fixed.groupby(["label", "width"], sort=False)["val_accuracy"].mean()
    failing = fixed[fixed < CALIBRATED]
    stressed = not failing.empty
    parts.append("fixed-state models below " + str(CALIBRATED) + ": " + (", ".join(
        f"{label} (width {int(w)}) {v:.2f}" for (label, w), v in failing.items()) if stressed else "none"))
    if not (hard["method"] == "transformer").any():
        ok = False
        parts.insert(0, f"no Transformer run at {hard_pairs} pairs")
    sentence = "; ".join(parts) + (
        f" (the Transformer recalls: every seed >= {CALIBRATED})" if ok
        else f" (the Transformer does not recall there: not every seed >= {CALIBRATED})")
    return Verdict(HOLDS if ok and stressed else FAILS, sentence,
                   {"accuracy": hard.loc[hard["method"] == "transformer", "val_accuracy"].tolist()})


def recall_beats(a: str, b: str):
    """Method a recalls more than method b at the largest number of pairs, at every width (accuracy over
    seeds); not tested while the calibration does not hold."""

    def judge(r) -> Verdict:
        df = finished_runs(r.csv("recall"))
        if df.empty or "method" not in df:
            return Verdict(MISSING, "no finished recall runs")
        if absent := [m for m in (a, b) if not (df["method"] == m).any()]:
            return Verdict(NOT_TESTED, f"not in this profile's recall grid: {', '.join(absent)} "
                           "(conf/sweep/recall.yaml says why)")
        hard = df[df["pairs"] == df["pairs"].max()]
        label = lambda m: str(df.loc[df["method"] == m, "label"].iloc[0]) if (df["method"] == m).any() else m
        widths = sorted(hard["width"].unique())
        verdicts = [compare(hard[(hard["method"] == a) & (hard["width"] == w)],
                            hard[(hard["method"] == b) & (hard["width"] == w)],
                            (label(a), label(b)), ">", None, value="val_accuracy")
                    for w in widths]
        v = combine(verdicts, [f"{int(hard['pairs'].iloc[0])} pairs, width {int(w)}" for w in widths])
        calibration = recall_calibration(r)
        if v.status != MISSING and calibration.status != HOLDS:
            v = Verdict(NOT_TESTED, "not testable here: the calibration does not hold "
                        f"({calibration.sentence}); {v.sentence}", v.numbers)
        return v

    return judge


class Recall(Experiment):
    name = "recall"
    section = Section(
        "Does the expressive hidden state help at long range? Recall (MQAR)",
        "The paper's thesis (Sections 1-2, Figures 2 right and 14): a hidden state that is itself a model, "
        "trained at test time, compresses long context better than a fixed-size vector or matrix state, so "
        "TTT layers keep using context where Mamba plateaus, and TTT-MLP is more expressive than "
        "TTT-Linear. The paper has no recall benchmark; multi-query associative recall (Zoology, Arora et "
        "al. 2023) tests how many key-value associations a state holds, against its size.",
        ["recall.md", "recall.png"],
        ["Recall (MQAR)"],
    )

    def calibrates(self, profile: str) -> bool:
        """Whether the profile picks learning rates on a calibration grid (it has several)."""
        return len(self.sweep["profiles"][profile]["lrs"]) > 1

    def configurations(self, profile: str, data_dir: str | None, lrs: dict | None = None) -> list[Run]:
        """Methods x widths x numbers of pairs at each method's learning rate `lrs[method]`; without `lrs`
        (and with more than one lr in the profile), the calibration grid: every lr of the profile for every
        method at its calibration width and number of pairs, one seed."""
        sweep = self.sweep
        p, methods = sweep["profiles"][profile], sweep["methods"]
        tokens = p["steps"] * value(sweep["recipe"] + p["overrides"], "recipe.tokens_per_batch")
        base = [f"data={sweep['data']}", *sweep["recipe"], *p["overrides"], f"data.seq_len={p['seq_len']}",
                f"recipe.total_tokens={tokens}"]
        grid = [(w, n) for w in p["widths"] for n in p["pairs"]]
        calibrating = lrs is None and self.calibrates(profile)
        if calibrating:
            grid = [(p["calibration"]["width"], p["calibration"]["pairs"])]
        runs = []
        for key in p.get("methods", methods):
            for width, pairs in grid:
                for lr in p["lrs"] if calibrating else [(lrs or {}).get(key, p["lrs"][0])]:
                    extra = p.get("method_overrides", {}).get(key, [])
                    overrides = [*base, *methods[key]["overrides"], *extra, f"size.d_model={width}",
                                 f"size.mlp_hidden={width}", f"data.num_kv_pairs={pairs}", f"size.lr={lr:g}"]
                    model, seq_len = composed_model(overrides)
                    name = f"{key}-d{width}-n{pairs}" + (f"-lr{lr:g}" if calibrating else "")
                    runs.append(configuration(name, overrides, methods[key]["label"], method=key, width=width,
                                              pairs=pairs, lr=lr, b=model["block"].get("mini_batch_size"),
                                              state_floats=state_floats(model, seq_len)["total"],
                                              role="mqar", seeds=1 if calibrating else None))
        return runs

    def stages(self, profile: str, data_dir: str | None, overrides: list[str] = (),
               committed: Path | None = None) -> list[Stage]:
        committed = Path(committed) if committed is not None else None
        grid = Stage(self.name, self.plan(profile, data_dir, overrides, lrs={}),  # the chosen lrs: once they
                     committed and committed / "registry.csv")                     # are known
        if not self.calibrates(profile):
            return [grid]
        return [Stage(f"{self.name}/calibration", self.plan(profile, data_dir, overrides),
                      committed and committed / "calibration.csv"), grid]

    def train(self, profile: str, out: Path, data_dir: str | None = None, launcher: list[str] = (),
              pipeline: Progress | None = None, committed: Path | None = None, train: bool = True,
              overrides: list[str] = (), part: tuple[int, int] = (1, 1), replace: bool = False) -> Trained:
        """The calibration grid in <out>/calibration, each method's best learning rate from it, then the whole
        grid at those rates in <out> (`part`: the first k of `parts` equal parts of it). `committed`: a folder
        with an earlier session's registry.csv and calibration.csv."""
        out, lrs, files = Path(out), {}, {}
        committed = Path(committed) if committed is not None else None
        if self.calibrates(profile):
            stage = Stage("calibration", self.plan(profile, data_dir, overrides),
                          committed and committed / "calibration.csv")
            calibration = train_stage(self.name, profile, stage, out / "calibration", launcher, pipeline,
                                      train, replace)
            files["calibration.csv"] = calibration.registry
            lrs = best_lrs(calibration.registry)
        stage = Stage(self.name, self.plan(profile, data_dir, overrides, lrs=lrs),
                      committed and committed / "registry.csv")
        grid = train_stage(self.name, profile, stage.first(*part), out, launcher, pipeline, train, replace)
        return Trained(grid.registry, {**grid.files, **files}, {"lrs": lrs})

    def tabulate(self, folder: Path) -> None:
        reg = read_csv(folder, "registry.csv")
        if reg is None:
            return
        calibration = read_csv(folder, "calibration.csv")
        lrs = best_lrs(calibration) if calibration is not None else {}
        drawn("recall", lambda: P.save(recall_figure(reg), folder / "recall"))
        write_atomic(folder / "recall.md", recall_table(reg, lrs))

    @property
    def claims(self) -> list[Claim]:
        return [
            Claim("recall.calibration", "Recall (MQAR)", "Calibration (not a claim of the paper): at the "
                  "setting the claims are judged at, the Transformer recalls (>= 0.95) and a fixed-size "
                  "state does not.", recall_calibration, kind="check"),
            Claim("recall.ttt_linear_mamba", "Recall (MQAR)", "A hidden state that is a model trained at "
                  "test time (TTT-Linear) recalls more than Mamba's.", recall_beats("ttt_linear", "mamba")),
            Claim("recall.ttt_mlp_linear", "Recall (MQAR)", "TTT-MLP's more expressive hidden state recalls "
                  "more than TTT-Linear's.", recall_beats("ttt_mlp", "ttt_linear")),
            Claim("recall.ttt_linear_attention", "Recall (MQAR)", "TTT-Linear recalls more than linear "
                  "attention (the same state size, Theorem 1's starting point).",
                  recall_beats("ttt_linear", "linear_attention_improved")),
        ]

    @property
    def plots(self) -> dict[str, PlotCommand]:
        return {"recall": PlotCommand("MQAR answer accuracy vs pairs per width, and vs state size; INPUT: a "
                                      "recall sweep folder", plot_recall)}


EXPERIMENT = Recall()
