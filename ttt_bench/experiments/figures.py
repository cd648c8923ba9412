"""The paper's figures from sweep registries, as PNG and PDF (matplotlib, no display needed).

scaling      Figs 11/12/18: perplexity vs training FLOPs, log-log, points connected per method, one panel
             per data and context length
context      Figs 13/2 (left): context length as a hyper-parameter, per size: the argmin over contexts for
             linear-cost methods, the lower convex hull of all contexts for Transformers
token-index  Figs 2 (right)/14: perplexity at every token index (log x), matched training FLOPs
minibatch    Fig 8: perplexity vs TTT mini-batch size (left), forward time split into W's and z's (right)
inner-loss   Figs 5/17: l(W_0; x_t), l(W_{t-1}; x_t), l(W_t; x_t) per layer
latency      Figs 3/15/20: latency per token vs context for each phase, from `ttt-bench bench` CSVs
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import FormatStrFormatter, NullFormatter  # noqa: E402

from ..io import write_atomic  # noqa: E402

LINEAR_COST = ("TTT-Linear (M)", "TTT-MLP (M)", "Mamba", "TTT-Linear (T)", "TTT-MLP (T)")
TRANSFORMERS = {"Transformer": "TF pretrain", "TF finetune": "TF finetune"}
# `ttt-bench bench models` names models by config; the TTT configs default to the Mamba backbone
PAPER_NAMES = {"transformer": "Transformer", "mamba": "Mamba", "ttt_linear": "TTT-Linear (M)",
               "ttt_mlp": "TTT-MLP (M)"}


def save(fig, stem: Path) -> list[Path]:
    """Write stem.png and stem.pdf atomically."""
    import io

    paths = []
    for ext in ("png", "pdf"):
        buf = io.BytesIO()
        fig.savefig(buf, format=ext, dpi=150, bbox_inches="tight")
        write_atomic(stem.with_suffix(f".{ext}"), buf.getvalue())
        paths.append(stem.with_suffix(f".{ext}"))
    plt.close(fig)
    return paths


def plain_log_ticks(ax) -> None:
    """Log axes without clutter: no minor labels on x (FLOPs), plain numbers on y (perplexity, ms)."""
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))


def finished(df: pd.DataFrame) -> pd.DataFrame:
    df = df[df["status"] == "finished"].copy()
    for col in ("val_ppl", "total_train_flops", "seq_len"):
        df[col] = pd.to_numeric(df[col], errors="coerce")
    return df


def _context(T: int) -> str:
    return f"{T // 1024}k" if T >= 1024 and T % 1024 == 0 else str(T)


def scaling(reg: pd.DataFrame, stem: Path) -> list[Path]:
    df = finished(reg)
    df = df[df.get("matched", pd.Series(index=df.index, dtype=object)).isna()]
    panels = sorted({(r, int(t)) for r, t in zip(df["role"], df["seq_len"], strict=True)})
    if not panels:
        raise ValueError("no finished runs in the scaling registry")
    fig, axes = plt.subplots(
        1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False, layout="constrained"
    )
    for ax, (role, T) in zip(axes[0], panels, strict=True):
        sub = df[(df["role"] == role) & (df["seq_len"] == T)]
        for label, g in sub.groupby("label", sort=False):
            g = g.sort_values("total_train_flops")
            ax.plot(g["total_train_flops"], g["val_ppl"], "o-", label=label)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="FLOPs",
            ylabel="Perplexity",
            title=f"{'Books' if role == 'books' else 'Pile'} {_context(T)}",
        )
        plain_log_ticks(ax)
        ax.legend(fontsize=7)
    return save(fig, stem)


def lower_hull(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The lower convex hull of points (monotone chain) in log-log space, left to right."""
    pts = sorted(zip(np.log(x), np.log(y), strict=True))
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
    hx, hy = zip(*hull, strict=True)
    return np.exp(hx), np.exp(hy)


def context(reg: pd.DataFrame, stem: Path) -> list[Path]:
    df = finished(reg)
    df = df[(df["role"] == "books") & df.get("matched", pd.Series(index=df.index, dtype=object)).isna()]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for label, g in df.groupby("label", sort=False):
        if label in TRANSFORMERS:  # longer context costs more FLOPs: connect the hull over all (size, T)
            x, y = lower_hull(g["total_train_flops"].to_numpy(), g["val_ppl"].to_numpy())
            ax.plot(x, y, "o-", label=TRANSFORMERS[label])
        else:  # same FLOPs at every context: the best context per size
            best = g.loc[g.groupby("size")["val_ppl"].idxmin()].sort_values("total_train_flops")
            ax.plot(best["total_train_flops"], best["val_ppl"], "o-", label=label)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="FLOPs",
        ylabel="Perplexity",
        title="Books, context length as a hyper-parameter",
    )
    plain_log_ticks(ax)
    ax.legend(fontsize=7)
    return save(fig, stem)


def token_index(reg: pd.DataFrame, sweep_dir: Path, stem: Path, window: int = 8) -> list[Path]:
    """Matched-FLOPs runs and their reference (the registry's `matched` and `reference` columns)."""
    df = finished(reg)
    refs = set(df["reference"].dropna()) if "reference" in df else set()
    chosen = df[df["matched"].notna() | df["run"].isin(refs)] if "matched" in df else df.iloc[:0]
    if chosen.empty:
        raise ValueError("no finished matched-FLOPs runs in the registry")
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for _, r in chosen.iterrows():
        ti = pd.read_csv(Path(sweep_dir) / r["run"] / "token_index.csv")
        loss = ti["loss"].rolling(window, min_periods=1).mean()
        ax.plot(ti["token_index"], np.exp(loss), label=r["label"])
    ax.set(
        xscale="log",
        xlabel="Token index",
        ylabel="Perplexity",
        title=f"Books {_context(int(chosen['seq_len'].iloc[0]))}, matched training FLOPs",
    )
    ax.legend(fontsize=7)
    return save(fig, stem)


def minibatch(reg: pd.DataFrame, timing: pd.DataFrame | None, stem: Path) -> list[Path]:
    df = finished(reg)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"wspace": 0.45})
    labels = df["mini_batch"].astype(str).tolist()
    axes[0].plot(range(len(df)), df["val_ppl"], "o-", color="C0", label="Ours")
    paper = pd.to_numeric(df["paper_ppl"], errors="coerce")
    if paper.notna().any():
        twin = axes[0].twinx()
        twin.plot(np.arange(len(df))[paper.notna()], paper.dropna(), "s--", color="C1", label="Paper (125M)")
        twin.set_ylabel("Paper perplexity")
        twin.legend(loc="upper right", fontsize=7)
    axes[0].set_xticks(range(len(df)), labels)
    axes[0].set(xlabel="TTT mini-batch size b", ylabel="Perplexity", title="Perplexity")
    axes[0].legend(loc="upper left", fontsize=7)
    if timing is not None and not timing.empty:
        x = range(len(timing))
        axes[1].plot(x, timing["total_ms"], "o-", color="C1", label="Total (W's and z's)")
        axes[1].plot(x, timing["w_ms"], "o-", color="C0", label="W's at mini-batch ends")
        axes[1].set_xticks(list(x), [str(b) for b in timing["mini_batch"]])
        T = int(timing["seq_len"].iloc[0])
        axes[1].set(
            xlabel="TTT mini-batch size b",
            ylabel="Forward time (ms)",
            yscale="log",
            title=f"Forward time in dual form, T={T}",
        )
        plain_log_ticks(axes[1])
        axes[1].legend(fontsize=7)
    return save(fig, stem)


def inner_loss(df: pd.DataFrame, stem: Path, window: int = 10) -> list[Path]:
    layers = sorted(df["layer"].unique())
    cols = min(4, len(layers))
    rows = -(-len(layers) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.5 * cols, 3 * rows), squeeze=False)
    names = {"w0": r"$\ell(W_0; x_t)$", "prev": r"$\ell(W_{t-1}; x_t)$", "now": r"$\ell(W_t; x_t)$"}
    for ax, layer in zip(axes.flat, layers, strict=False):
        g = df[df["layer"] == layer].sort_values("position")
        for key, name in names.items():
            ax.plot(g["position"], g[key].rolling(window, min_periods=1).mean(), label=name)
        ax.set(title=f"Layer {layer + 1}", xlabel="t")
    for ax in axes.flat[len(layers) :]:
        ax.axis("off")
    axes[0][0].legend(fontsize=7)
    return save(fig, stem)


def latency(bench: pd.DataFrame, stem: Path) -> list[Path]:
    phases = [p for p in ("prefill", "decode", "train") if p in set(bench["phase"])]
    if not phases:
        raise ValueError("no prefill/decode/train rows in the benchmark CSV")
    fig, axes = plt.subplots(
        1, len(phases), figsize=(4.5 * len(phases), 4), squeeze=False, layout="constrained"
    )
    for ax, phase in zip(axes[0], phases, strict=True):
        sub = bench[bench["phase"] == phase]
        for model, g in sub.groupby("model", sort=False):
            g = g.sort_values("context")
            ax.plot(g["context"], g["latency_ms_per_token"], "o-", label=PAPER_NAMES.get(model, model))
        ax.set(
            xscale="log", xlabel="Context length", ylabel="Latency per token (ms)", title=phase.capitalize()
        )
        ax.legend(fontsize=7)
    return save(fig, stem)
