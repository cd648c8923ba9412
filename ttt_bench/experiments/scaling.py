"""Figures 11-14 and 18 (scaling with training FLOPs, context length as a hyper-parameter, loss by token
index) and the matched-FLOPs comparison of Figures 2 (right) and 14 (conf/sweep/scaling.yaml).

Methods x sizes x contexts on Pile-like (2k, 8k) and Books-like (1k-32k) data, with TF finetune (Section
3.2: the Transformer pretrained at `finetune_base`, +20% tokens at the longer context) and, at the largest
size and longest Books context, every method matched in training FLOPs to Mamba (Appendix C).
"""

from pathlib import Path

import numpy as np
import pandas as pd

from ..flops import match_flops
from ..io import write_atomic
from ..training.runs import token_index_losses
from . import units
from .curves import plot_token_index_of_runs
from .engine import plotting as P
from .engine.experiment import Experiment, PlotCommand, Section, drawn, read_csv
from .engine.floors import drawn_floors, read_drawn_floors
from .engine.plan import Run, composed_model, configuration, data_overrides
from .engine.registry import finished_runs, read_registry, select
from .engine.tables import summary_table
from .engine.verdicts import MISSING, NOT_TESTED, Claim, Verdict, combine, compare

TRANSFORMERS = {"Transformer": "TF pretrain", "TF finetune": "TF finetune"}
LONG_CONTEXT_TOKENS = 8192  # the paper's long contexts: Books at 8k and 32k tokens (2k is its short one)


def config_name(role: str, method: str, size: str, T: int, suffix: str = "") -> str:
    """A scaling configuration's name: `<role>-<method>-<size>-T<context><suffix>` (suffix `-matched`: a
    matched-FLOPs run beside the grid)."""
    return f"{role}-{method}-{size}-T{T}{suffix}"


def unmatched(df: pd.DataFrame) -> pd.DataFrame:
    """The runs of the scaling grid: not the matched-FLOPs runs added beside it, nor what they start from
    (configs named `...-matched`). A profile with `matched_in_grid` trains its matched runs as the grid
    points themselves (named as the grid's)."""
    return df[~df["config"].astype(str).str.endswith("-matched")]


def longest_books(reg) -> tuple[str | None, int | None]:
    """The largest size and longest Books context of the grid: where the headline comparisons are."""
    df = finished_runs(reg)
    if df.empty or "role" not in df:
        return None, None
    df = unmatched(df)
    df = df[df["role"] == "books"]
    if df.empty:
        return None, None
    return str(df["size"].iloc[-1]), int(pd.to_numeric(df["seq_len"]).max())


def at_context(runs: pd.DataFrame, T: int) -> pd.DataFrame:
    """The grid's runs at context T (not the matched runs beside it)."""
    return runs[runs["config"].astype(str).str.endswith(f"T{T}")]


# ---- the plan ----


def plan_scaling(sweep: dict, profile: str, data_dir: str | None, vocab_size: int = 256) -> list[Run]:
    p, methods, ft, m = sweep["profiles"][profile], sweep["methods"], sweep["finetune"], sweep["matched"]
    tokens = lambda scale: f"recipe.total_tokens='${{ttt.mul:${{size.tokens}},{scale:g}}}'"
    runs: dict[str, Run] = {}

    def fit_micro_batch(override: str, T: int) -> str:
        """A micro-batch of at most the step's sequences: long contexts under a fixed tokens-per-batch
        have few of them."""
        key, _, value = override.partition("=")
        if key != "data.micro_batch_size":
            return override
        per_batch = [o.split("=")[1] for o in p["overrides"] if o.startswith("recipe.tokens_per_batch=")]
        return override if not per_batch else f"{key}={min(int(value), max(1, int(per_batch[0]) // T))}"

    def add(role, key, label, size, T, extra=(), suffix="") -> Run:
        overrides = [*data_overrides(role, data_dir), *(fit_micro_batch(o, T) for o in p["overrides"]),
                     f"size={size}", f"data.seq_len={T}", tokens(p["token_scale"]), *extra]
        if key in ("transformer", "tf_finetune") and T >= p["rope_500k_from"]:
            overrides.append("model.block.rope_theta=500000")
        name = config_name(role, key, size, T, suffix)
        runs[name] = configuration(name, overrides, label, method=key, role=role, size=size, seq_len=T)
        return runs[name]

    def finetune(size, T, extra=(), suffix="") -> Run:
        """TF finetune (Section 3.2): the Transformer pretrained at finetune_base, +20% tokens at T."""
        lr = ft["lr_smallest"] if size == p["sizes"][0] else ft["lr"]
        run = add("books", "tf_finetune", ft["label"], size, T,
                  [*methods[ft["from"]]["overrides"], "recipe=finetune", f"recipe.lr={lr}",
                   tokens(ft["token_fraction"] * p["token_scale"]), *extra], suffix)
        run.after = config_name("books", ft["from"], size, p["finetune_base"], suffix)
        # the finetune recipe replaces the profile's (its recipe.* keys, e.g. tokens per batch, still apply)
        run.overrides = [o for o in run.overrides if not o.startswith("recipe=") or o == "recipe=finetune"]
        return run

    for role in ("pile", "books"):
        for size in p["sizes"]:
            for T in p[role]:
                for key in p.get(f"{role}_methods", sweep[role]):
                    add(role, key, methods[key]["label"], size, T, methods[key]["overrides"])
    for size in p["sizes"]:
        for T in (T for T in p["books"] if T >= 2 * p["finetune_base"]):
            finetune(size, T)
    # matched training FLOPs (Figures 2 right, 14): the largest size at the longest Books context, every
    # method matched to Mamba: TF finetune (pretrain at finetune_base + 20% at T) by depth, TTT by MLP width
    # (a profile's `matched_in_grid`: the matched runs replace those grid points instead of joining them)
    size, T, base = p["sizes"][-1], p.get("matched_context", p["books"][-1]), p["finetune_base"]
    suffix = "" if p.get("matched_in_grid") else "-matched"
    ref_name = config_name("books", m["reference"], size, T)
    keys = p.get("matched_methods", list(m["methods"]))  # a profile may match a subset
    reference = composed_model(runs[ref_name].overrides)[0] if keys else None
    for key in keys:
        by = m["methods"][key]
        if key == "tf_finetune":
            model, _ = composed_model(runs[config_name("books", ft["from"], size, base)].overrides)
            new, ratio = match_flops(model, reference, T, vocab_size, by=by,
                                     schedule=[(base, 1.0), (T, ft["token_fraction"])])
            extra = [f"{k}={v}" for k, v in new.items()]
            label = methods[ft["from"]]["label"]
            add("books", ft["from"], f"{label} (pretraining of the matched TF finetune)" if suffix else label,
                size, base, [*methods[ft["from"]]["overrides"], *extra], suffix=suffix)
            run = finetune(size, T, extra, suffix=suffix)
        else:
            model, _ = composed_model(runs[config_name("books", key, size, T)].overrides)
            new, ratio = match_flops(model, reference, T, vocab_size, by=by)
            run = add("books", key, methods[key]["label"], size, T,
                      [*methods[key]["overrides"], *(f"{k}={v}" for k, v in new.items())], suffix=suffix)
        run.info |= {"matched": by, "reference": ref_name, "flops_ratio": round(ratio, 4)}
    # the key comparisons (the largest size at the longest Books context, TF finetune, matched FLOPs) take
    # the profile's seeds; every other grid point takes `other_seeds`
    for run in runs.values():
        key = (run.info["size"] == size and run.role == "books"
               and (run.seq_len == T or (run.seq_len == base and run.info["method"] == ft["from"])))
        if not key and "other_seeds" in p:
            run.seeds = p["other_seeds"]
    return list(runs.values())


# ---- figures ----

def scaling_figure(reg: pd.DataFrame, floors: dict | None = None, panel_floors: dict | None = None):
    """Perplexity against training FLOPs, a panel per (role, context), each with the floors of its own
    validation text and context (`panel_floors`, by (role, context); else `floors`, by role)."""
    df = P.plotted_runs(reg)
    df = unmatched(df)
    roles = {r: i for i, r in enumerate(("pile", "books"))}
    panels = sorted(
        {(r, int(t)) for r, t in zip(df["role"], df["seq_len"], strict=True)},
        key=lambda p: (roles.get(p[0], 9), p[0], p[1]),
    )
    if not panels:
        raise ValueError("no finished runs in the scaling registry")
    agg = P.aggregate(df)
    rows, cols = P.panel_grid(len(panels))
    fig, axes = P.plt.subplots(
        rows, cols, figsize=(4.6 * cols, 3.9 * rows + 0.8), squeeze=False, layout="constrained"
    )
    single: dict[str, list[bool]] = {}
    drawn_names: list[str] = []
    for ax, (role, T) in zip(axes.flat, panels, strict=False):
        sub = agg[(agg["role"] == role) & (agg["seq_len"] == T)]
        for label, g in sub.groupby("label", sort=False):
            g = g.sort_values("total_train_flops")
            single.setdefault(label, []).append(len(g) == 1)
            P.errorbar(ax, g["total_train_flops"], g["val_ppl"], g["ppl_std"], label)
        P.draw_floors(ax, here := (panel_floors or {}).get((role, T)) or P.floors_for(floors, role))
        drawn_names.extend(here)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="Training FLOPs",
            ylabel=f"Perplexity ({P.seeds_note(sub['n_seeds'])})",
            title=f"{P.corpus_title(sub, role)}, context {P.context_label(T)}",
        )
        ax._ttt_labels = {lab: len(g) == 1 for lab, g in sub.groupby("label", sort=False)}
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax in axes.flat[: len(panels)]:
        P.plain_log_ticks(ax)
        P.label_floors(ax)
        # a method that is a single point here but a curve elsewhere: say so in this panel's title
        only_here = [lab for lab, one in ax._ttt_labels.items() if one and not all(single[lab])]
        if only_here:
            ax.set_title(ax.get_title() + "\nsingle point: " + ", ".join(only_here))
    handles = []
    for ax in axes.flat[: len(panels)]:
        for h in P.handles_of(ax):
            if all(single.get(h.get_label(), [False])):
                h.set_label(f"{h.get_label()} (single point)")
            handles.append(h)
    P.legend_below(fig, handles + P.floor_handles(drawn_names))
    note = P.seeds_note(agg["n_seeds"])
    fig.suptitle(
        "Perplexity vs training FLOPs, "
        + ("one seed per configuration (no error bars)" if note == "1 seed" else note),
        fontsize=11,
    )
    return fig


def lower_hull_index(x, y) -> list[int]:
    """Indices of the lower convex hull (monotone chain) of points in log-log space, left to right, up to its
    lowest point: a point with more FLOPs and a higher perplexity is dominated, not on the frontier."""
    pts = sorted(zip(np.log(np.asarray(x, float)), np.log(np.asarray(y, float)), range(len(x)), strict=True))
    hull: list = []
    for p in pts:
        while (
            len(hull) >= 2
            and (
                (hull[-1][0] - hull[-2][0]) * (p[1] - hull[-2][1])
                - (hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])
            )
            <= 0
        ):
            hull.pop()
        hull.append(p)
    lowest = min(range(len(hull)), key=lambda i: hull[i][1])
    return [p[2] for p in hull[: lowest + 1]]


def context_figure(reg: pd.DataFrame, floors: dict | None = None):
    df = P.plotted_runs(reg)
    df = unmatched(df)
    df = df[df["role"] == "books"]
    if df.empty:
        raise ValueError("no finished Books runs in the scaling registry")
    agg = P.aggregate(df)
    fig, ax = P.plt.subplots(figsize=(6.2, 5.0), layout="constrained")
    for label, g in agg.groupby("label", sort=False):
        if label in TRANSFORMERS:  # longer context costs more FLOPs: connect the hull over all (size, T)
            pts = g.iloc[lower_hull_index(g["total_train_flops"].to_numpy(), g["val_ppl"].to_numpy())]
            name, how = TRANSFORMERS[label], "lower hull over contexts"
        else:  # same FLOPs at every context: the best context per size
            pts = g.loc[g.groupby("size")["val_ppl"].idxmin()].sort_values("total_train_flops")
            name, how = label, "best context per size"
        one = " (single point)" if len(pts) == 1 else ""
        P.errorbar(ax, pts["total_train_flops"], pts["val_ppl"], pts["ppl_std"], f"{name}{one}",
                   style_of=name)
        for _, p in pts.iterrows():  # which context won, in small print beside the point
            ax.annotate(
                P.context_label(p["seq_len"]),
                (p["total_train_flops"], p["val_ppl"]),
                xytext=(4, 3),
                textcoords="offset points",
                fontsize=6,
                color=P.method_style(name)[0],
            )
        ax._ttt_how = {**getattr(ax, "_ttt_how", {}), f"{name}{one}": how}
    P.draw_floors(ax, P.floors_for(floors, "books"))
    Ts = sorted(int(t) for t in df["seq_len"].unique())
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="Training FLOPs",
        ylabel=f"Perplexity ({P.seeds_note(agg['n_seeds'])})",
        title=f"{P.corpus_title(df, 'books')}: context length as a hyper-parameter\n"
        f"contexts {', '.join(P.context_label(t) for t in Ts)} (small print: the context drawn)",
    )
    P.plain_log_ticks(ax)
    P.label_floors(ax)
    handles = P.handles_of(ax)
    for h in handles:
        h.set_label(f"{h.get_label()}: {ax._ttt_how.get(h.get_label(), '')}".rstrip(": "))
    P.legend_below(fig, handles + P.floor_handles(P.floors_for(floors, "books")), ncols=2)
    return fig


def token_index_runs(reg: pd.DataFrame) -> pd.DataFrame:
    """The finished matched-FLOPs runs and their reference (the registry's `matched` and `reference`
    columns; `reference` names a configuration, or a run in older registries): Figures 2 (right) and 14."""
    df = P.plotted_runs(reg)
    if "matched" not in df:
        return df.iloc[:0]
    refs = set(df["reference"].dropna()) if "reference" in df else set()
    return df[df["matched"].notna() | df["config"].isin(refs) | df["run"].isin(refs)]


def read_token_index(runs: pd.DataFrame, sweep_dir: Path) -> pd.DataFrame:
    """The token-index losses (run, token_index, loss) of the runs whose folders are under sweep_dir."""
    parts = [token_index_losses(folder).assign(run=run) for run in runs["run"]
             if ((folder := Path(sweep_dir) / run) / "token_index.csv").is_file()]
    if not parts:
        return pd.DataFrame(columns=["run", "token_index", "loss"])
    return pd.concat(parts, ignore_index=True)


def token_index_figure(reg: pd.DataFrame, curves: pd.DataFrame, window: int | None = None,
                       floors: dict | None = None):
    """The loss by token index of the matched-FLOPs runs and their reference (`token_index_runs`), from
    their `curves` (run, token_index, loss), mean and spread over seeds, averaged over windows of `window`
    tokens (default: 8, or T/128 at longer contexts, which a few validation windows leave noisy)."""
    chosen = token_index_runs(reg)
    if chosen.empty or chosen["matched"].isna().all():
        raise ValueError("no finished matched-FLOPs runs in the registry")
    T = int(chosen["seq_len"].iloc[0])
    window = window or max(8, T // 128)
    fig, ax = P.plt.subplots(figsize=(6.2, 4.8), layout="constrained")
    ns = []
    configs = list(dict.fromkeys(chosen["config"]))
    configs.sort(key=lambda c: chosen.loc[chosen["config"] == c, "matched"].notna().any())  # reference first
    for config in configs:
        g = chosen[chosen["config"] == config]
        curves_of = [c.set_index("token_index")["loss"].rolling(window, min_periods=1).mean()
                     for _, c in curves[curves["run"].isin(g["run"])].groupby("run")]
        if not curves_of:
            continue
        ns.append(len(curves_of))
        losses = pd.concat(curves_of, axis=1).dropna()
        mean, std = losses.mean(axis=1), losses.std(axis=1, ddof=1).fillna(0.0)
        r = g.iloc[0]
        label = r["label"]
        how = f"{r['matched']}-matched" if pd.notna(r["matched"]) else "reference"
        colour, _ = P.method_style(label)
        ax.plot(mean.index, np.exp(mean), color=colour, lw=1.5, label=f"{label} ({how})")
        if len(curves_of) > 1:
            ax.fill_between(mean.index, np.exp(mean - std), np.exp(mean + std), color=colour, alpha=0.2, lw=0)
    if not ns:
        raise ValueError("no token-index losses of the matched-FLOPs runs (their token_index.csv)")
    role = P.role_of(chosen)
    P.draw_floors(ax, P.floors_for(floors, role))
    band = "" if max(ns) == 1 else ", band: ± std"
    ax.set(
        xscale="log",
        yscale="log",
        xlabel=f"Token index (loss averaged over windows of {window} tokens)",
        ylabel=f"Perplexity ({P.seeds_note(ns)}{band})",
        title=f"{P.corpus_title(chosen, role)}, context {P.context_label(T)}, matched training FLOPs",
    )
    P.finish_log_axis(ax, "x", ticks=P.nice_log_ticks(*ax.get_xlim(), max_ticks=6))
    P.finish_log_axis(ax, "y")
    P.label_floors(ax)
    P.legend_below(fig, P.handles_of(ax) + P.floor_handles(P.floors_for(floors, role)), ncols=2)
    return fig


def plot_scaling(inputs: list[Path], stem: Path) -> list[Path]:
    return P.save(scaling_figure(read_registry(inputs[0]), panel_floors=read_drawn_floors(inputs[0], True)),
                  stem)


def plot_context(inputs: list[Path], stem: Path) -> list[Path]:
    return P.save(context_figure(read_registry(inputs[0]), read_drawn_floors(inputs[0])), stem)


def plot_token_index(inputs: list[Path], stem: Path) -> list[Path]:
    if Path(inputs[0]).is_dir() and not (Path(inputs[0]) / "registry.csv").is_file():  # run folders
        return plot_token_index_of_runs(inputs, stem)
    reg, kept = read_registry(inputs[0]), Path(inputs[0]) / "token_index.csv"
    # a step folder keeps its runs' curves in one file; a sweep folder has them in its run folders
    curves = (read_csv(inputs[0], "token_index.csv") if kept.is_file()
              else read_token_index(token_index_runs(reg), inputs[0]))
    return P.save(token_index_figure(reg, curves, floors=read_drawn_floors(inputs[0])), stem)


# ---- claims ----


def at_long_context(r, T: int | None, v: Verdict) -> Verdict:
    """A long-context claim's verdict `v`, judged at the Books context T (bytes): "not tested" (with `v`'s
    numbers) when T is shorter than the paper's long contexts."""
    text, tokens = (None, None) if T is None else units.context(r, "books", T)
    if tokens is not None and tokens < LONG_CONTEXT_TOKENS:
        return Verdict(NOT_TESTED, f"the longest context run is {text}, below the paper's long contexts "
                                   f"({LONG_CONTEXT_TOKENS:,} and 32k tokens; why: docs/ttt_layer.md, "
                                   f"'Long context on 2 cores'; PROFILE=gpu trains 8.5k tokens) "
                                   f"({v.sentence})", v.numbers)
    return v


def beats_mamba_at_long_context(method: str, label: str):
    def judge(r) -> Verdict:
        reg = r.csv("scaling")
        size, T = longest_books(reg)
        if size is None:
            return Verdict(MISSING, "no finished Books runs")
        a = at_context(select(reg, role="books", method=method, size=size, seq_len=T), T)
        b = at_context(select(reg, role="books", method="mamba", size=size, seq_len=T), T)
        v = compare(a, b, (label, "Mamba"), "<", r.floors)
        v.sentence = f"size {size}, context {units.context(r, 'books', T)[0]}: {v.sentence}"
        return at_long_context(r, T, v)

    return judge


def finetune_beats_pretrain(r) -> Verdict:
    reg = r.csv("scaling")
    df = finished_runs(reg)
    if "method" not in df:
        return Verdict(MISSING, "no finished runs")
    pairs = unmatched(df)
    pairs = pairs[pairs["method"] == "tf_finetune"]
    verdicts, names = [], []
    for (size, T), _ in pairs.groupby(["size", "seq_len"]):
        ft = at_context(select(reg, method="tf_finetune", size=size, seq_len=T), T)
        pre = at_context(select(reg, method="transformer", role="books", size=size, seq_len=T), T)
        verdicts.append(compare(ft, pre, ("TF finetune", "TF pretrain"), "<", r.floors))
        names.append(f"size {size}, context {units.context(r, 'books', int(T))[0]}")
    v = combine(verdicts, names)
    return at_long_context(r, None if pairs.empty else int(pd.to_numeric(pairs["seq_len"]).max()), v)


def keeps_improving_late(r) -> Verdict:
    """Figure 14 at matched FLOPs: over the second half of the token indices, TTT-Linear's loss falls faster
    with log(index) than Mamba's (a more negative least-squares slope), per seed (paired by seed). Mamba
    plateaus after 16k tokens in the paper: a long-context claim, not tested at a shorter context."""
    df, ti = finished_runs(r.csv("scaling")), r.csv("scaling", "token_index.csv")
    if ti is None or ti.empty or "matched" not in df:
        return Verdict(MISSING, "no matched-FLOPs token-index curves")
    T = pd.to_numeric(df.loc[df["matched"].notna(), "seq_len"]).max()

    def slopes(method):
        runs = df[(df["method"] == method) & (df["matched"].notna() | df["config"].isin(df["reference"]))]
        if "reference" in df:
            runs = runs[pd.to_numeric(runs["seq_len"]) == T]
        out = []
        for run, seed in zip(runs["run"], runs["seed"], strict=True):
            c = ti[ti["run"] == run]
            c = c[c["token_index"] > c["token_index"].max() / 2]
            if len(c) > 2:
                out.append({"seed": seed, "v": np.polyfit(np.log(c["token_index"] + 1), c["loss"], 1)[0]})
        return pd.DataFrame(out, columns=["seed", "v"])  # with the seed: the two methods pair up by seed

    v = compare(slopes("ttt_linear_m"), slopes("mamba"), ("TTT-Linear (M) late slope", "Mamba late slope"),
                "<", None, value="v")
    return at_long_context(r, None if pd.isna(T) else int(T), v)


class Scaling(Experiment):
    name = "scaling"
    section = Section(
        "Figures 11-14, 18: scaling, context length, token index",
        "At short context TTT-Linear (M), Mamba and the Transformer are comparable; at long context "
        "(Pile 8k, Books 32k) TTT-Linear/MLP (M) beat Mamba. TF finetune beats TF pretrain. With matched "
        "FLOPs, the Transformer and TTT keep improving with token index while Mamba plateaus after 16k.",
        ["scaling.md", "scaling.png", "context.png", "token_index.png"],
        ["Figures 11-14, 18"],
    )

    def configurations(self, profile: str, data_dir: str | None) -> list[Run]:
        return plan_scaling(self.sweep, profile, data_dir)

    def measure(self, step, trained, ctx) -> None:
        """Figures 2 (right) and 14: the matched runs' token-index losses, kept in the step."""
        sweep_dir = ctx.runs / self.name

        def measure(r):
            path = sweep_dir / r.run / "token_index.csv"
            return pd.read_csv(path) if path.is_file() else None

        step.per_run("token_index.csv", token_index_runs(trained.registry), measure)

    def tabulate(self, folder: Path) -> None:
        reg, floors = read_csv(folder, "registry.csv"), read_csv(folder, "floors.csv")
        if reg is None:
            return
        drawn_at, curves = drawn_floors(floors), read_csv(folder, "token_index.csv")
        drawn("scaling", lambda: P.save(scaling_figure(reg, panel_floors=drawn_floors(floors, True)),
                                        folder / "scaling"))
        drawn("context", lambda: P.save(context_figure(reg, drawn_at), folder / "context"))

        def token_index():
            if curves is None:
                raise ValueError("no token-index losses of the matched-FLOPs runs")
            P.save(token_index_figure(reg, curves, floors=drawn_at), folder / "token_index")

        drawn("token_index", token_index)
        keys = ["role", "size", "seq_len", "label", "matched"]
        write_atomic(folder / "scaling.md", summary_table(reg, keys, floors))

    def untested(self, profile: str) -> dict[str, str]:
        """A profile whose Books methods leave TTT-MLP (M) out does not test its claim."""
        out = super().untested(profile)
        methods = self.sweep["profiles"].get(profile, {}).get("books_methods", self.sweep["books"])
        if "ttt_mlp_m" not in methods:
            out.setdefault("scaling.ttt_mlp", "its books_methods leave TTT-MLP (M) out "
                                              "(conf/sweep/scaling.yaml)")
        return out

    @property
    def claims(self) -> list[Claim]:
        return [
            Claim("scaling.ttt_linear", "Figures 11-14, 18", "At long context TTT-Linear (M) has lower "
                  "perplexity than Mamba.", beats_mamba_at_long_context("ttt_linear_m", "TTT-Linear (M)")),
            Claim("scaling.ttt_mlp", "Figures 11-14, 18", "At long context TTT-MLP (M) has lower perplexity "
                  "than Mamba.", beats_mamba_at_long_context("ttt_mlp_m", "TTT-MLP (M)")),
            Claim("scaling.finetune", "Figures 11-14, 18",
                  "TF finetune beats TF pretrain at every long context.", finetune_beats_pretrain),
            Claim("scaling.late_tokens", "Figures 11-14, 18", "At matched training FLOPs TTT-Linear keeps "
                  "lowering its loss late in the context while Mamba plateaus.", keeps_improving_late),
        ]

    @property
    def plots(self) -> dict[str, PlotCommand]:
        return {
            "scaling": PlotCommand("perplexity vs training FLOPs per method (Figs 11/12/18); INPUT: a "
                                   "scaling sweep folder", plot_scaling),
            "context": PlotCommand("context length as a hyper-parameter (Fig 13); INPUT: a scaling sweep "
                                   "folder", plot_context),
            "token-index": PlotCommand("perplexity per token index (Figs 2 right/14); INPUT: a scaling sweep "
                                       "folder, or run folders", plot_token_index),
        }


EXPERIMENT = Scaling()
