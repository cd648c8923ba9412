"""The paper's figures from sweep registries, as PNG and PDF (matplotlib, no display needed).

scaling      Figs 11/12/18: perplexity vs training FLOPs, log-log, one curve per method, one panel per data
             and context length
context      Figs 13/2 (left): context length as a hyper-parameter, per size: the argmin over contexts for
             linear-cost methods, the lower convex hull of all contexts for Transformers
token-index  Figs 2 (right)/14: perplexity at every token index (log x), matched training FLOPs
minibatch    Fig 8: our perplexity vs TTT mini-batch size, the paper's in a panel of its own, and the forward
             time split into the W's and the total
inner-loss   Figs 5/17: l(W_0; x_t), l(W_{t-1}; x_t), l(W_t; x_t) per layer
latency      Figs 3/15/20: latency per token vs context for each phase, from `ttt-bench bench` CSVs

Conventions shared by every figure:
- one colour and marker per method (METHOD_STYLES, `method_style`), the same in every figure;
- the runs of one configuration over several seeds (registry column `config`, else each run is its own
  configuration) are drawn as their mean with error bars (or a band) of the standard deviation over seeds;
  the number of seeds is in the y label;
- byte-level n-gram floors (`floors`: role -> {name: perplexity}) are grey horizontal lines, one line style
  per order, labelled with their value at the right edge of every perplexity panel of that role;
- log axes carry a few plain-number ticks, every panel its y label, legends sit below the axes, and titles
  name the corpus actually used (registry column `corpus`; "not recorded" in older registries).

Each figure has a builder (`*_figure`, returns the matplotlib Figure) and a function of the old name that
saves it as STEM.png and STEM.pdf and returns the two paths.
"""

import math
import re
import zlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullFormatter  # noqa: E402

from ..io import write_atomic  # noqa: E402
from .claims import unmatched  # noqa: E402

LINEAR_COST = ("TTT-Linear (M)", "TTT-MLP (M)", "Mamba", "TTT-Linear (T)", "TTT-MLP (T)")
TRANSFORMERS = {"Transformer": "TF pretrain", "TF finetune": "TF finetune"}
# `ttt-bench bench models` names models by config; the TTT configs default to the Mamba backbone
PAPER_NAMES = {
    "transformer": "Transformer",
    "mamba": "Mamba",
    "ttt_linear": "TTT-Linear (M)",
    "ttt_mlp": "TTT-MLP (M)",
}

# label -> (colour, marker): every figure draws a method with these
METHOD_STYLES: dict[str, tuple[str, str]] = {
    "Transformer": ("#1f77b4", "o"),
    "TF pretrain": ("#1f77b4", "o"),
    "TF finetune": ("#17becf", "v"),
    "TTT-Linear (M)": ("#d62728", "s"),
    "TTT-MLP (M)": ("#ff7f0e", "^"),
    "TTT-Linear (T)": ("#9467bd", "P"),
    "TTT-MLP (T)": ("#e377c2", "X"),
    "Mamba": ("#2ca02c", "D"),
    "Linear attention": ("#8c564b", "<"),
    "Linear attn. improved": ("#bcbd22", ">"),
}
_FALLBACK_COLOURS = ("#7f7f7f", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d")
_FALLBACK_MARKERS = ("h", "*", "p", "d", "8", "H")
FLOOR_COLOUR = "0.45"
_FLOOR_LINESTYLES = {"unigram": ":", "bigram": "--"}
_MORE_FLOOR_LINESTYLES = ("-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)), (0, (8, 3)))


def method_style(label: str) -> tuple[str, str]:
    """(colour, marker) of a method label; a label not in METHOD_STYLES gets a stable one from its name."""
    label = re.sub(r"\s*\[\d+\]$", "", str(label))  # "Linear attention [41]" is "Linear attention"
    if label in METHOD_STYLES:
        return METHOD_STYLES[label]
    h = zlib.crc32(label.encode())
    return _FALLBACK_COLOURS[h % len(_FALLBACK_COLOURS)], _FALLBACK_MARKERS[(h >> 8) % len(_FALLBACK_MARKERS)]


def save(fig, stem: Path) -> list[Path]:
    """Write stem.png and stem.pdf atomically."""
    import io

    paths = []
    for ext in ("png", "pdf"):
        buf = io.BytesIO()
        fig.savefig(buf, format=ext, dpi=150, bbox_inches="tight")
        write_atomic(Path(stem).with_suffix(f".{ext}"), buf.getvalue())
        paths.append(Path(stem).with_suffix(f".{ext}"))
    plt.close(fig)
    return paths


# ---- axes ----

_MANTISSAS = (
    (1,),
    (1, 2, 5),
    (1, 2, 3, 5),
    (1, 1.5, 2, 3, 4, 5, 6, 8),
    (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9),
)


def nice_log_ticks(lo: float, hi: float, max_ticks: int = 7, min_ticks: int = 3) -> list[float]:
    """A few round values in [lo, hi] for a log axis: 1-2-5 style, denser only when the range is narrow,
    plain linear steps when even the densest set leaves fewer than `min_ticks`."""
    lo, hi = min(lo, hi), max(lo, hi)
    best: list[float] = []
    for ms in _MANTISSAS:
        ticks = [
            float(f"{m * 10.0**k:.12g}")
            for k in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
            for m in ms
            if lo <= m * 10.0**k <= hi
        ]
        if len(ticks) > max_ticks:
            break
        best = ticks
        if len(ticks) >= min_ticks:
            return best
    if len(best) >= 2:
        return best
    lin = [float(t) for t in MaxNLocator(nbins=4, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi)]
    return [t for t in lin if lo <= t <= hi and t > 0] or best


def _plain(v: float, _pos=None) -> str:
    return f"{v:.10g}" if abs(v) < 1e6 else _sci(v)


def _sci(v: float, _pos=None) -> str:
    """2e12 as 2×10^12 (mathtext), 1e12 as 10^12."""
    if v <= 0:
        return f"{v:g}"
    k = math.floor(math.log10(v) + 1e-9)
    m = float(f"{v / 10.0**k:.3g}")
    return f"$10^{{{k}}}$" if m == 1 else f"${m:g}{{\\times}}10^{{{k}}}$"


def _context(T: int) -> str:
    return f"{T // 1024}k" if T >= 1024 and T % 1024 == 0 else str(int(T))


def finish_log_axis(ax, which: str, formatter=_plain, ticks=None) -> None:
    """Freeze the limits of a log axis and give it a few readable ticks (no minor labels)."""
    axis = ax.yaxis if which == "y" else ax.xaxis
    lo, hi = ax.get_ylim() if which == "y" else ax.get_xlim()
    (ax.set_ylim if which == "y" else ax.set_xlim)(lo, hi)
    if ticks is None:
        ticks = nice_log_ticks(lo, hi)
    axis.set_major_locator(FixedLocator([t for t in ticks if min(lo, hi) <= t <= max(lo, hi)]))
    axis.set_major_formatter(FuncFormatter(formatter))
    axis.set_minor_formatter(NullFormatter())


def plain_log_ticks(ax) -> None:
    """Both axes of a log-log panel: FLOPs-like x as a×10^k, perplexity-like y as plain numbers."""
    lo, hi = ax.get_xlim()
    finish_log_axis(ax, "x", _sci, ticks=nice_log_ticks(lo, hi, max_ticks=5))
    finish_log_axis(ax, "y")


# ---- registries ----


def finished(df: pd.DataFrame) -> pd.DataFrame:
    """Finished runs, numeric columns as numbers, and the seed columns of newer registries filled in for
    older ones: each run its own configuration with one seed, corpus unknown."""
    df = df[df["status"] == "finished"].copy()
    for col in ("val_ppl", "total_train_flops", "seq_len"):
        if col in df:
            df[col] = pd.to_numeric(df[col], errors="coerce")
    if "config" not in df:
        df["config"] = df["run"]
    df["config"] = df["config"].where(df["config"].notna(), df["run"]).astype(str)
    if "seed" not in df:
        df["seed"] = 0
    if "corpus" not in df:
        df["corpus"] = None
    if "matched" not in df:
        df["matched"] = None
    return df


def aggregate(df: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration: its first row's columns, with val_ppl and total_train_flops the means
    over its seeds, ppl_std their standard deviation (0 with one seed) and n_seeds their number."""
    if df.empty:
        return df.assign(ppl_std=[], n_seeds=[])
    g = df.groupby("config", sort=False)
    out = g.first()
    out["val_ppl"] = g["val_ppl"].mean()
    if "total_train_flops" in df:
        out["total_train_flops"] = g["total_train_flops"].mean()
    out["ppl_std"] = g["val_ppl"].std(ddof=1).fillna(0.0)
    out["n_seeds"] = g.size()
    return out.reset_index()


def seeds_note(n_seeds) -> str:
    """'mean ± std over 3 seeds', or '1 seed'; a range when configurations have different numbers."""
    ns = [int(n) for n in n_seeds] or [1]
    lo, hi = min(ns), max(ns)
    if hi == 1:
        return "1 seed"
    return f"mean ± std over {lo if lo == hi else f'{lo}-{hi}'} seeds"


def corpus_name(df: pd.DataFrame, role: str | None = None) -> str:
    """The corpus the runs actually used, from the registry's `corpus` column."""
    names = sorted({str(c) for c in df.get("corpus", pd.Series(dtype=object)).dropna() if str(c)})
    if names:
        return " + ".join(names)
    return f"{role.capitalize() if role else 'data'} (corpus not recorded)"


def _role(df: pd.DataFrame) -> str | None:
    for col in ("role", "data"):
        if col in df and df[col].notna().any():
            return str(df[col].dropna().iloc[0])
    return None


def floors_for(floors: dict | None, role: str | None) -> dict[str, float]:
    """The floors of one role ('pile' or 'books'); for runs of unknown role, those of the only role."""
    if not floors:
        return {}
    if role is None:
        return dict(next(iter(floors.values()))) if len(floors) == 1 else {}
    return dict(floors.get(role) or {})


def _floor_linestyle(name: str, order: list[str]):
    key = name.split()[0].lower()
    if key in _FLOOR_LINESTYLES:
        return _FLOOR_LINESTYLES[key]
    others = [n for n in order if n.split()[0].lower() not in _FLOOR_LINESTYLES]
    i = others.index(name) if name in others else 0
    return _MORE_FLOOR_LINESTYLES[i % len(_MORE_FLOOR_LINESTYLES)]


def draw_floors(ax, floors: dict[str, float]) -> dict[str, float]:
    """Horizontal grey lines at each floor's perplexity (they widen the y range to include them)."""
    order = list(floors)
    for name, value in floors.items():
        if value is None or not np.isfinite(value):
            continue
        ax.axhline(value, color=FLOOR_COLOUR, lw=1.1, ls=_floor_linestyle(name, order), zorder=1)
    ax._ttt_floors = {k: v for k, v in floors.items() if v is not None and np.isfinite(v)}
    return ax._ttt_floors


def label_floors(ax) -> None:
    """Each floor's name and value just right of the axes, at its height, nudged apart when close (call
    once the y limits are final)."""
    floors = getattr(ax, "_ttt_floors", {})
    if not floors:
        return
    lo, hi = ax.get_ylim()
    log = ax.get_yscale() == "log"
    pos = lambda v: (math.log(v / lo) / math.log(hi / lo)) if log else (v - lo) / (hi - lo)
    items = sorted(((pos(v), name, v) for name, v in floors.items()), key=lambda t: t[0])
    gap, placed = 0.06, []
    for y, name, v in items:
        y_text = max(y, placed[-1] + gap) if placed else y
        placed.append(y_text)
        ax.annotate(
            f"{name.split(' (')[0]} {v:.3g}",
            xy=(1.0, y),
            xycoords="axes fraction",
            xytext=(1.015, y_text),
            textcoords="axes fraction",
            va="center",
            ha="left",
            fontsize=7,
            color=FLOOR_COLOUR,
            annotation_clip=False,
        )


def floor_handles(names) -> list[Line2D]:
    order = list(dict.fromkeys(names))
    return [
        Line2D([], [], color=FLOOR_COLOUR, lw=1.1, ls=_floor_linestyle(n, order), label=f"{n} floor (bytes)")
        for n in order
    ]


def _errorbar(ax, x, y, std, label, style_of: str | None = None, **kw):
    """Mean with std error bars (clipped above zero for log axes), in the style of method `style_of`
    (default: the label)."""
    colour, marker = method_style(style_of or label)
    y, std = np.asarray(y, float), np.asarray(std, float)
    lower = np.minimum(std, 0.95 * y)
    return ax.errorbar(
        x,
        y,
        yerr=[lower, std] if std.any() else None,
        fmt="-",
        marker=marker,
        color=colour,
        ms=5,
        capsize=3,
        lw=1.5,
        elinewidth=1,
        label=label,
        **kw,
    )


def _legend_below(fig, handles: list, ncols: int | None = None) -> None:
    seen: dict[str, object] = {}
    for h in handles:
        seen.setdefault(h.get_label(), h)
    if seen:
        fig.legend(
            list(seen.values()),
            list(seen),
            loc="outside lower center",
            fontsize=8,
            frameon=False,
            ncols=ncols or min(4, len(seen)),
        )


def _handles(ax) -> list:
    hs, _ = ax.get_legend_handles_labels()
    return hs


def _grid(n: int) -> tuple[int, int]:
    cols = n if n <= 3 else (2 if n == 4 else 3)
    return -(-n // cols), cols


# ---- figures ----


def scaling_figure(reg: pd.DataFrame, floors: dict | None = None):
    df = finished(reg)
    df = unmatched(df)
    roles = {r: i for i, r in enumerate(("pile", "books"))}
    panels = sorted(
        {(r, int(t)) for r, t in zip(df["role"], df["seq_len"], strict=True)},
        key=lambda p: (roles.get(p[0], 9), p[0], p[1]),
    )
    if not panels:
        raise ValueError("no finished runs in the scaling registry")
    agg = aggregate(df)
    rows, cols = _grid(len(panels))
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.6 * cols, 3.9 * rows + 0.8), squeeze=False, layout="constrained"
    )
    single: dict[str, list[bool]] = {}
    for ax, (role, T) in zip(axes.flat, panels, strict=False):
        sub = agg[(agg["role"] == role) & (agg["seq_len"] == T)]
        for label, g in sub.groupby("label", sort=False):
            g = g.sort_values("total_train_flops")
            single.setdefault(label, []).append(len(g) == 1)
            _errorbar(ax, g["total_train_flops"], g["val_ppl"], g["ppl_std"], label)
        draw_floors(ax, floors_for(floors, role))
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="Training FLOPs",
            ylabel=f"Perplexity ({seeds_note(sub['n_seeds'])})",
            title=f"{corpus_name(sub, role)}, context {_context(T)}",
        )
        ax._ttt_labels = {lab: len(g) == 1 for lab, g in sub.groupby("label", sort=False)}
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax in axes.flat[: len(panels)]:
        plain_log_ticks(ax)
        label_floors(ax)
        # a method that is a single point here but a curve elsewhere: say so in this panel's title
        only_here = [lab for lab, one in ax._ttt_labels.items() if one and not all(single[lab])]
        if only_here:
            ax.set_title(ax.get_title() + "\nsingle point: " + ", ".join(only_here))
    handles = []
    for ax in axes.flat[: len(panels)]:
        for h in _handles(ax):
            if all(single.get(h.get_label(), [False])):
                h.set_label(f"{h.get_label()} (single point)")
            handles.append(h)
    names = [n for role, _ in panels for n in floors_for(floors, role)]
    _legend_below(fig, handles + floor_handles(names))
    note = seeds_note(agg["n_seeds"])
    fig.suptitle(
        "Perplexity vs training FLOPs, "
        + ("one seed per configuration (no error bars)" if note == "1 seed" else note),
        fontsize=11,
    )
    return fig


def scaling(reg: pd.DataFrame, stem: Path, floors: dict | None = None) -> list[Path]:
    return save(scaling_figure(reg, floors), stem)


def _lower_hull_index(x, y) -> list[int]:
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


def lower_hull(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The falling part of the lower convex hull of points in log-log space, left to right."""
    idx = _lower_hull_index(x, y)
    return np.asarray(x, float)[idx], np.asarray(y, float)[idx]


def context_figure(reg: pd.DataFrame, floors: dict | None = None):
    df = finished(reg)
    df = unmatched(df)
    df = df[df["role"] == "books"]
    if df.empty:
        raise ValueError("no finished Books runs in the scaling registry")
    agg = aggregate(df)
    fig, ax = plt.subplots(figsize=(6.2, 5.0), layout="constrained")
    for label, g in agg.groupby("label", sort=False):
        if label in TRANSFORMERS:  # longer context costs more FLOPs: connect the hull over all (size, T)
            pts = g.iloc[_lower_hull_index(g["total_train_flops"].to_numpy(), g["val_ppl"].to_numpy())]
            name, how = TRANSFORMERS[label], "lower hull over contexts"
        else:  # same FLOPs at every context: the best context per size
            pts = g.loc[g.groupby("size")["val_ppl"].idxmin()].sort_values("total_train_flops")
            name, how = label, "best context per size"
        one = " (single point)" if len(pts) == 1 else ""
        _errorbar(ax, pts["total_train_flops"], pts["val_ppl"], pts["ppl_std"], f"{name}{one}", style_of=name)
        for _, p in pts.iterrows():  # which context won, in small print beside the point
            ax.annotate(
                _context(p["seq_len"]),
                (p["total_train_flops"], p["val_ppl"]),
                xytext=(4, 3),
                textcoords="offset points",
                fontsize=6,
                color=method_style(name)[0],
            )
        ax._ttt_how = {**getattr(ax, "_ttt_how", {}), f"{name}{one}": how}
    draw_floors(ax, floors_for(floors, "books"))
    Ts = sorted(int(t) for t in df["seq_len"].unique())
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="Training FLOPs",
        ylabel=f"Perplexity ({seeds_note(agg['n_seeds'])})",
        title=f"{corpus_name(df, 'books')}: context length as a hyper-parameter\n"
        f"contexts {', '.join(_context(t) for t in Ts)} (small print: the context drawn)",
    )
    plain_log_ticks(ax)
    label_floors(ax)
    handles = _handles(ax)
    for h in handles:
        h.set_label(f"{h.get_label()}: {ax._ttt_how.get(h.get_label(), '')}".rstrip(": "))
    _legend_below(fig, handles + floor_handles(floors_for(floors, "books")), ncols=2)
    return fig


def context(reg: pd.DataFrame, stem: Path, floors: dict | None = None) -> list[Path]:
    return save(context_figure(reg, floors), stem)


def token_index_runs(reg: pd.DataFrame) -> pd.DataFrame:
    """The finished matched-FLOPs runs and their reference (the registry's `matched` and `reference`
    columns; `reference` names a configuration, or a run in older registries): Figures 2 (right) and 14."""
    df = finished(reg)
    if "matched" not in df:
        return df.iloc[:0]
    refs = set(df["reference"].dropna()) if "reference" in df else set()
    return df[df["matched"].notna() | df["config"].isin(refs) | df["run"].isin(refs)]


def read_token_index(runs: pd.DataFrame, sweep_dir: Path) -> pd.DataFrame:
    """The token-index losses (run, token_index, loss) of the runs whose folders are under sweep_dir."""
    parts = [pd.read_csv(p).assign(run=run) for run in runs["run"]
             if (p := Path(sweep_dir) / run / "token_index.csv").is_file()]
    if not parts:
        return pd.DataFrame(columns=["run", "token_index", "loss"])
    return pd.concat(parts, ignore_index=True)


def token_index_figure(reg: pd.DataFrame, curves: pd.DataFrame, window: int = 8, floors: dict | None = None):
    """The loss by token index of the matched-FLOPs runs and their reference (`token_index_runs`), from
    their `curves` (run, token_index, loss), mean and spread over seeds."""
    chosen = token_index_runs(reg)
    if chosen.empty or chosen["matched"].isna().all():
        raise ValueError("no finished matched-FLOPs runs in the registry")
    fig, ax = plt.subplots(figsize=(6.2, 4.8), layout="constrained")
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
        colour, _ = method_style(label)
        ax.plot(mean.index, np.exp(mean), color=colour, lw=1.5, label=f"{label} ({how})")
        if len(curves_of) > 1:
            ax.fill_between(mean.index, np.exp(mean - std), np.exp(mean + std), color=colour, alpha=0.2, lw=0)
    if not ns:
        raise ValueError("no token-index losses of the matched-FLOPs runs (their token_index.csv)")
    role = _role(chosen)
    draw_floors(ax, floors_for(floors, role))
    T = int(chosen["seq_len"].iloc[0])
    band = "" if max(ns) == 1 else ", band: ± std"
    ax.set(
        xscale="log",
        yscale="log",
        xlabel=f"Token index (loss averaged over windows of {window} tokens)",
        ylabel=f"Perplexity ({seeds_note(ns)}{band})",
        title=f"{corpus_name(chosen, role)}, context {_context(T)}, matched training FLOPs",
    )
    finish_log_axis(ax, "x", ticks=nice_log_ticks(*ax.get_xlim(), max_ticks=6))
    finish_log_axis(ax, "y")
    label_floors(ax)
    _legend_below(fig, _handles(ax) + floor_handles(floors_for(floors, role)), ncols=2)
    return fig


def token_index(
    reg: pd.DataFrame, curves: pd.DataFrame, stem: Path, window: int = 8, floors: dict | None = None
) -> list[Path]:
    return save(token_index_figure(reg, curves, window, floors), stem)


def _value_label(ax, x, v, colour, above: bool) -> None:
    """A point's value in small print, on a white ground so that a line through it does not hide it."""
    ax.annotate(
        f"{v:.2f}",
        (x, v),
        xytext=(0, 8 if above else -9),
        textcoords="offset points",
        ha="center",
        va="bottom" if above else "top",
        fontsize=7,
        color=colour,
        bbox={"fc": "white", "ec": "none", "alpha": 0.85, "pad": 0.4},
        zorder=5,
    )


def _b_order(b) -> float:
    s = str(b)
    return float(s) if s.replace(".", "", 1).isdigit() else math.inf


def minibatch_figure(reg: pd.DataFrame, timing: pd.DataFrame | None, floors: dict | None = None):
    df = finished(reg)
    if df.empty:
        raise ValueError("no finished runs in the minibatch registry")
    df["mini_batch"] = df["mini_batch"].astype(str).str.replace(r"\.0$", "", regex=True)
    agg = aggregate(df)
    agg = agg.iloc[sorted(range(len(agg)), key=lambda i: _b_order(agg["mini_batch"].iloc[i]))]
    ticks = [f"b={b}" if b == "T" else b for b in agg["mini_batch"]]
    x = np.arange(len(agg))
    fig, axes = plt.subplots(
        1, 3, figsize=(14, 4.6), layout="constrained", gridspec_kw={"width_ratios": [3, 2, 3]}
    )
    ours, paper_ax, time_ax = axes
    model = str(df["model"].dropna().iloc[0]) if "model" in df and df["model"].notna().any() else "ttt_linear"
    method = PAPER_NAMES.get(model, model)
    colour, marker = method_style(method)
    size = f", size {df['size'].iloc[0]}" if "size" in df and df["size"].notna().any() else ""
    _errorbar(ours, x, agg["val_ppl"], agg["ppl_std"], f"Ours: {method}{size}", style_of=method)
    role = _role(df)
    draw_floors(ours, floors_for(floors, role))
    T = int(df["seq_len"].iloc[0]) if df["seq_len"].notna().any() else None
    ours.set(
        yscale="log",
        xlabel="TTT mini-batch size b",
        ylabel=f"Perplexity ({seeds_note(agg['n_seeds'])})",
        title=f"Ours: {corpus_name(df, role)}" + (f", context {_context(T)}" if T else ""),
    )
    for xi, v in zip(x, agg["val_ppl"], strict=True):  # the values: the floors make the range wide
        _value_label(ours, xi, v, colour, above=True)
    ours.margins(y=0.1)
    ours.set_xticks(x, ticks)
    finish_log_axis(ours, "y")
    label_floors(ours)

    paper = pd.to_numeric(agg["paper_ppl"], errors="coerce") if "paper_ppl" in agg else pd.Series(dtype=float)
    have = paper.notna().to_numpy()
    if have.any():
        paper_ax.plot(
            x[have],
            paper[have],
            "--",
            marker=marker,
            color=colour,
            mfc="white",
            ms=6,
            label="Paper: TTT-Linear 125M (values it reports)",
        )
        for xi, v in zip(x[have], paper[have], strict=True):
            _value_label(paper_ax, xi, v, colour, above=False)
        paper_ax.margins(y=0.2)
    else:
        paper_ax.text(
            0.5,
            0.5,
            "no paper numbers\nin the registry",
            ha="center",
            va="center",
            transform=paper_ax.transAxes,
            color="0.4",
        )
    paper_ax.set_xticks(x, ticks)
    paper_ax.set_xlim(ours.get_xlim())
    paper_ax.set(
        xlabel="TTT mini-batch size b",
        ylabel="Paper perplexity (125M, Llama tokens)",
        title="Paper (Pile, T=2k)",
    )
    handles = _handles(ours) + _handles(paper_ax)

    if timing is not None and not timing.empty:
        t = timing.groupby("mini_batch", sort=True)[["total_ms", "w_ms"]].agg(["mean", "std"])
        bs = list(t.index)
        Tt = int(timing["seq_len"].iloc[0]) if "seq_len" in timing else None
        xt = np.arange(len(bs))
        for col, name, c, mk, ls in (
            ("total_ms", "Total (W's and z's)", "0.1", "o", "-"),
            ("w_ms", "W's at mini-batch ends", "0.55", "s", "--"),
        ):
            std = t[(col, "std")].fillna(0.0).to_numpy()
            time_ax.errorbar(
                xt,
                t[(col, "mean")],
                yerr=std if std.any() else None,
                color=c,
                marker=mk,
                ls=ls,
                ms=5,
                capsize=3,
                label=name,
            )
        time_ax.set_xticks(xt, ["b=T" if str(b) == "T" or str(b) == str(Tt) else str(b) for b in bs])
        time_ax.set(
            xlabel="TTT mini-batch size b",
            ylabel="Forward time (ms)",
            yscale="log",
            title="Forward time, one TTT-Linear layer, dual form" + (f", T={_context(Tt)}" if Tt else ""),
        )
        finish_log_axis(time_ax, "y")
        handles += _handles(time_ax)
    else:
        time_ax.text(
            0.5, 0.5, "no timing measured", ha="center", va="center", transform=time_ax.transAxes, color="0.4"
        )
        time_ax.set(xlabel="TTT mini-batch size b", ylabel="Forward time (ms)", title="Forward time")
    _legend_below(fig, handles + floor_handles(floors_for(floors, role)), ncols=3)
    return fig


def minibatch(
    reg: pd.DataFrame, timing: pd.DataFrame | None, stem: Path, floors: dict | None = None
) -> list[Path]:
    return save(minibatch_figure(reg, timing, floors), stem)


def inner_loss_figure(df: pd.DataFrame, window: int = 10):
    layers = sorted(df["layer"].unique())
    if not layers:
        raise ValueError("no inner losses")
    cols = min(4, len(layers))
    rows = -(-len(layers) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.6 * cols, 3.0 * rows + 0.7), squeeze=False, layout="constrained"
    )
    names = {"w0": r"$\ell(W_0; x_t)$", "prev": r"$\ell(W_{t-1}; x_t)$", "now": r"$\ell(W_t; x_t)$"}
    styles = {"w0": ("#7f7f7f", ":"), "prev": ("#1f77b4", "-"), "now": ("#d62728", "-")}
    for ax, layer in zip(axes.flat, layers, strict=False):
        g = df[df["layer"] == layer].sort_values("position")
        for key, name in names.items():
            c, ls = styles[key]
            ax.plot(
                g["position"],
                g[key].rolling(window, min_periods=1).mean(),
                color=c,
                ls=ls,
                lw=1.3,
                label=name,
            )
        ax.set(title=f"Layer {layer + 1}", xlabel="Token index t", ylabel="TTT loss")
    for ax in axes.flat[len(layers) :]:
        ax.axis("off")
    _legend_below(fig, _handles(axes[0][0]), ncols=3)
    fig.suptitle(f"TTT inner losses per layer (averaged over windows of {window} tokens)", fontsize=11)
    return fig


def inner_loss(df: pd.DataFrame, stem: Path, window: int = 10) -> list[Path]:
    return save(inner_loss_figure(df, window), stem)


def latency_figure(bench: pd.DataFrame):
    phases = [p for p in ("prefill", "decode", "train") if p in set(bench["phase"])]
    if not phases:
        raise ValueError("no prefill/decode/train rows in the benchmark CSV")
    bench = bench.copy()
    bench["latency_ms_per_token"] = pd.to_numeric(bench["latency_ms_per_token"], errors="coerce")
    bench = bench[bench["latency_ms_per_token"].notna()]
    fig, axes = plt.subplots(
        1, len(phases), figsize=(4.8 * len(phases), 4.4), squeeze=False, layout="constrained"
    )
    for ax, phase in zip(axes[0], phases, strict=True):
        sub = bench[bench["phase"] == phase]
        for model, g in sub.groupby("model", sort=False):
            s = g.groupby("context")["latency_ms_per_token"].agg(["mean", "std", "size"]).sort_index()
            label = PAPER_NAMES.get(model, model)
            one = " (single point)" if len(s) == 1 else ""
            _errorbar(ax, s.index, s["mean"], s["std"].fillna(0.0), f"{label}{one}", style_of=label)
        ctx = sorted(sub["context"].unique())
        info = []
        for col, fmt in (("device", "{}"), ("dtype", "{}"), ("threads", "{} threads"), ("batch", "batch {}")):
            if col in sub and sub[col].notna().any():
                vals = sorted({str(v).removesuffix(".0") for v in sub[col].dropna()})
                info.append(fmt.format("/".join(vals)))
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="Context length",
            ylabel="Latency per token (ms)",
            title=phase.capitalize() + (f" ({', '.join(info)})" if info else ""),
        )
        if ctx:
            ax.set_xlim(ctx[0] / 1.25, ctx[-1] * 1.25)
        finish_log_axis(ax, "x", lambda v, _p=None: _context(int(v)), ticks=[float(c) for c in ctx])
        finish_log_axis(ax, "y")
    _legend_below(fig, [h for ax in axes[0] for h in _handles(ax)])
    return fig


def latency(bench: pd.DataFrame, stem: Path) -> list[Path]:
    return save(latency_figure(bench), stem)


# ---- recall (MQAR) ----


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
    widths = sorted(agg["width"].unique())
    fig, axes = plt.subplots(1, len(widths) + 1, figsize=(4.2 * (len(widths) + 1), 4.2), layout="constrained")
    for ax, width in zip(axes, widths, strict=False):
        for label, g in agg[agg["width"] == width].groupby("label", sort=False):
            g = g.sort_values("pairs")
            _errorbar(ax, g["pairs"], g["accuracy"], g["accuracy_std"], label)
        ax.set(
            xscale="log",
            xlabel="key-value pairs",
            ylabel="answer accuracy",
            ylim=(-0.02, 1.02),
            title=f"width {width}",
        )
        finish_log_axis(ax, "x", ticks=sorted(agg["pairs"].unique()))
    frontier = axes[-1]
    for (label, pairs), g in agg.groupby(["label", "pairs"], sort=False):
        g = g.sort_values("state_floats")
        colour, marker = method_style(label)
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
    finish_log_axis(frontier, "x", formatter=_sci)
    T = int(agg["seq_len"].iloc[0])
    fig.suptitle(f"MQAR recall, {T} tokens per sequence ({seeds_note(agg['n_seeds'])})")
    _legend_below(fig, _handles(axes[0]) + _handles(frontier))
    return fig


def recall(reg: pd.DataFrame, stem: Path) -> list[Path]:
    return save(recall_figure(reg), stem)


# ---- long range (synthetic facts) ----


def fact_recall_figure(df: pd.DataFrame):
    """Loss on the digits of restated facts vs distance to their first mention, a line per method (mean and
    std over seeds; first mentions inside the window only), with a random digit's ln 10 and the first
    mentions' own loss as references."""
    from .longrange import RANDOM_DIGIT, bin_order

    rest = df[(df["kind"] == "restated") & df["in_context"]]
    if rest.empty:
        raise ValueError("no restated facts within the models' context")
    bins = sorted(rest["distance"].unique(), key=bin_order)
    x = {b: i for i, b in enumerate(bins)}
    fig, ax = plt.subplots(figsize=(7, 4.4), layout="constrained")
    per_seed = rest.groupby(["label", "seed", "distance"], sort=False)["loss"].mean().reset_index()
    for label, g in per_seed.groupby("label", sort=False):
        s = g.groupby("distance")["loss"].agg(["mean", "std"]).reindex(bins).dropna(subset=["mean"])
        _errorbar(ax, [x[b] for b in s.index], s["mean"], s["std"].fillna(0.0), label)
    ax.axhline(RANDOM_DIGIT, color=FLOOR_COLOUR, ls="--", lw=1.1, label="a random digit (ln 10)")
    first = df[df["kind"] == "first mention"]["loss"].mean()
    ax.axhline(first, color=FLOOR_COLOUR, ls=":", lw=1.1, label=f"first mentions ({first:.2f}, all models)")
    T = int(df["seq_len"].max())
    ax.set(
        xlabel="bytes back to the fact's first mention",
        ylabel="loss on the code's digits (nats)",
        title=f"Recalling facts from far back, synthetic corpus, context {_context(T)} "
        f"({seeds_note(rest.groupby('label')['seed'].nunique())})",
    )
    ax.set_xticks(range(len(bins)), bins)
    if len(bins) == 1:
        ax.set_title(ax.get_title() + "\none distance bin: every fact was restated within it")
    _legend_below(fig, _handles(ax))
    return fig


def fact_recall(df: pd.DataFrame, stem: Path) -> list[Path]:
    return save(fact_recall_figure(df), stem)
