"""The conventions every figure shares (matplotlib, no display needed):

- one colour and marker per method (METHOD_STYLES, `method_style`), the same in every figure;
- the runs of one configuration over several seeds (registry column `config`, else each run is its own
  configuration) are drawn as their mean with error bars (or a band) of the standard deviation over seeds;
  the number of seeds is in the y label;
- byte-level n-gram floors (`floors`: role -> {name: perplexity}) are grey horizontal lines, one line style
  per order, labelled with their value at the right edge of every perplexity panel of that role;
- log axes carry a few plain-number ticks, every panel its y label, legends sit below the axes, and titles
  name the corpus actually used (registry column `corpus`; "not recorded" in older registries);
- a figure is saved as STEM.png (`save`), written atomically; within `vector()` (`ttt-bench plot --pdf`)
  also as STEM.pdf, without a creation date so that drawing the same numbers twice gives the same files.
  The committed results keep the PNG alone: a paper that needs vector art draws it with --pdf.

Each experiment module builds its figures (`*_figure`, returning the matplotlib Figure) with these.
"""

import contextlib
import io
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

from ...io import write_atomic  # noqa: E402
from .tables import by_config  # noqa: E402

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


_FORMATS = ["png"]  # what `save` writes: PNG, and PDF within `vector()`


@contextlib.contextmanager
def vector():
    """Figures saved in the block are also written as PDF (vector art for a paper)."""
    _FORMATS.append("pdf")
    try:
        yield
    finally:
        _FORMATS.remove("pdf")


def save(fig, stem: Path) -> list[Path]:
    """Write stem.png atomically, and stem.pdf within `vector()` (without a creation date: the same
    figure, the same bytes)."""
    paths = []
    for ext in dict.fromkeys(_FORMATS):
        buf = io.BytesIO()
        metadata = {"CreationDate": None} if ext == "pdf" else None
        fig.savefig(buf, format=ext, dpi=150, bbox_inches="tight", metadata=metadata)
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


def plain(v: float, _pos=None) -> str:
    return f"{v:.10g}" if abs(v) < 1e6 else sci(v)


def sci(v: float, _pos=None) -> str:
    """2e12 as 2×10^12 (mathtext), 1e12 as 10^12."""
    if v <= 0:
        return f"{v:g}"
    k = math.floor(math.log10(v) + 1e-9)
    m = float(f"{v / 10.0**k:.3g}")
    return f"$10^{{{k}}}$" if m == 1 else f"${m:g}{{\\times}}10^{{{k}}}$"


def context_label(T: int) -> str:
    return f"{T // 1024}k" if T >= 1024 and T % 1024 == 0 else str(int(T))


def finish_log_axis(ax, which: str, formatter=plain, ticks=None) -> None:
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
    finish_log_axis(ax, "x", sci, ticks=nice_log_ticks(lo, hi, max_ticks=5))
    finish_log_axis(ax, "y")


# ---- registries ----


def plotted_runs(df: pd.DataFrame) -> pd.DataFrame:
    """The finished runs a figure draws: numeric columns as numbers, and the seed columns of newer registries
    filled in for older ones: each run its own configuration with one seed, corpus unknown."""
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
    """The finished runs `df` per configuration, as drawn (tables.by_config): val_ppl and total_train_flops
    the means over its seeds, ppl_std their standard deviation (0 with one seed) and n_seeds their number."""
    if df.empty:
        return df.assign(ppl_std=[], n_seeds=[])
    out = by_config(df, means=("total_train_flops",) if "total_train_flops" in df else ())
    return out.assign(val_ppl=out["ppl_mean"], ppl_std=out["ppl_std"].fillna(0.0), n_seeds=out["seeds"])


def seeds_note(n_seeds) -> str:
    """'mean ± std over 3 seeds', or '1 seed'; a range when configurations have different numbers."""
    ns = [int(n) for n in n_seeds] or [1]
    lo, hi = min(ns), max(ns)
    if hi == 1:
        return "1 seed"
    return f"mean ± std over {lo if lo == hi else f'{lo}-{hi}'} seeds"


def corpus_title(df: pd.DataFrame, role: str | None = None) -> str:
    """The corpus the runs actually used, from the registry's `corpus` column."""
    names = sorted({str(c) for c in df.get("corpus", pd.Series(dtype=object)).dropna() if str(c)})
    if names:
        return " + ".join(names)
    return f"{role.capitalize() if role else 'data'} (corpus not recorded)"


def role_of(df: pd.DataFrame) -> str | None:
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


def near_floors(floors: dict[str, float], values, deciding: str = "3-gram", reach: float = 1.3) -> dict:
    """The floors worth drawing beside `values`: the one that decides under-training (`deciding`) and those
    within a factor `reach` of the values' range, so that the axis shows the data rather than every floor."""
    lo, hi = float(np.nanmin(values)), float(np.nanmax(values))
    return {k: v for k, v in floors.items()
            if k.split(" ")[0] == deciding or lo / reach <= v <= hi * reach}


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


def errorbar(ax, x, y, std, label, style_of: str | None = None, **kw):
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


def legend_below(fig, handles: list, ncols: int | None = None) -> None:
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


def handles_of(ax) -> list:
    hs, _ = ax.get_legend_handles_labels()
    return hs


def panel_grid(n: int) -> tuple[int, int]:
    cols = n if n <= 3 else (2 if n == 4 else 3)
    return -(-n // cols), cols
