"""Figure 8 (TTT mini-batch size b) and Figures 5/17 (the inner losses of a trained TTT model)
(conf/sweep/minibatch.yaml).

Figure 8 left: TTT-Linear (M) at b in {1, ..., 64, T}; right: the forward time of one TTT-Linear layer in
dual form, split into the W's at the end of every mini-batch and the z's (`time_w_and_z`, measured with
the runs). Figures 5/17: l(W_0; x_t), l(W_{t-1}; x_t) and l(W_t; x_t) of the b = 1 networks.
"""

import logging
import math
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..bench.common import loaded, timings
from ..io import read_table, write_atomic
from ..kernels import ttt
from ..kernels.ttt.dual_scan import BATCH_GD_CHUNK, ttt_linear_dual
from ..training.checkpoint import load_checkpoint
from ..training.evaluate import inner_losses as measure_inner_losses
from . import mttt, units
from .engine import plotting as P
from .engine import timing
from .engine.experiment import Experiment, PlotCommand, Section, read_csv
from .engine.floors import drawn_floors, undertrained
from .engine.plan import Run, configuration, data_overrides
from .engine.registry import finished_runs, read_registry, select
from .engine.stats import trend
from .engine.tables import summary_table
from .engine.verdicts import (
    FAILS,
    HOLDS,
    INCONCLUSIVE,
    MISSING,
    UNDERTRAINED,
    Claim,
    Verdict,
    combine,
    compare,
    status_of,
)

log = logging.getLogger("ttt_bench.experiments")

# ---- measurements ----


@torch.no_grad()
def time_w_and_z(mini_batch_sizes: list, batch: int, heads: int, head_dim: int, seq_len: int,
                 repeats: int = 3, seed: int = 0) -> pd.DataFrame:
    """Figure 8 (right): forward time of one TTT-Linear layer in dual form (dual_scan.ttt_linear_dual) at
    context `seq_len`, total and for the W's at the end of every mini-batch alone (the same steps without
    the outputs), the two timed in alternation after a warm-up call (bench.common.timings: the median of
    `repeats` each, their spread and the load during them, columns engine/timing.py reads); the z's take
    the difference, and
    the W's, a part of the work timed apart, are capped at the total. `layer_ms`: what the layer runs,
    the dual form except at b = T above a chunk, where the op (kernels/ttt: `ttt.linear`) takes the chunked
    batch GD (dual_scan.ttt_linear_batch_gd). The b's above the context are left out."""
    g = torch.Generator().manual_seed(seed)
    H, f = heads, head_dim
    ln = (torch.ones(H, 1, f), torch.zeros(H, 1, f))
    W0, b0 = torch.randn(batch, H, f, f, generator=g) * 0.02, torch.zeros(batch, H, 1, f)
    rows = []
    for b in mini_batch_sizes:
        b = seq_len if b == "T" else int(b)
        if b > seq_len:
            continue
        N = seq_len // b
        XQ, XK, XV = (torch.randn(batch, H, N, b, f, generator=g) for _ in range(3))
        both = partial(ttt_linear_dual, XQ, XK, XV, torch.full((batch, H, N, b, b), 1.0 / f), W0, b0, *ln)
        fns = {"total": both, "w": partial(both, outputs=False)}
        if N == 1 and b > BATCH_GD_CHUNK:  # the op's (and so the layer's) batch-GD path
            lr, token_eta = torch.full((batch, H, b), 1.0 / f), 1 / torch.arange(1.0, b + 1)
            one = (XQ[:, :, 0], XK[:, :, 0], XV[:, :, 0])
            fns["layer"] = partial(ttt.linear, *one, lr, token_eta, (W0, b0), ln, backend="dual")
        t = timings(fns, torch.device("cpu"), warmup=1, repeats=repeats)
        total, weights = t["total"].median, min(t["w"].median, t["total"].median)
        threads = torch.get_num_threads()
        rows.append({"mini_batch": b, "total_ms": 1e3 * total, "w_ms": 1e3 * weights,
                     "z_ms": 1e3 * (total - weights), "layer_ms": 1e3 * t.get("layer", t["total"]).median,
                     "spread": t["total"].spread, "busy_cores_during": t["total"].others,
                     "loaded_during": loaded(t["total"].others, threads), "repeats": repeats,
                     "seq_len": seq_len, "heads": H, "head_dim": f, "batch": batch, "threads": threads})
    return pd.DataFrame(rows)


@torch.no_grad()
def checkpoint_inner_losses(ckpt_path: str, max_sequences: int = 16, batch_size: int = 4) -> pd.DataFrame:
    """Figures 5/17 for a checkpoint, on the validation data it was trained with (evaluate.inner_losses)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    module, _ = load_checkpoint(ckpt_path)
    data_cfg = OmegaConf.create(module.hparams["config"]["data"])
    data_cfg.tokenizer = module.hparams["tokenizer"]
    dm = instantiate(data_cfg)
    dm.prepare_data()
    return measure_inner_losses(module.model, dm.val_dataset(), max_sequences, batch_size)


# ---- figures ----


def _value_label(ax, x, v, colour, above: bool) -> None:
    """A point's value in small print, on a white ground so that a line through it does not hide it."""
    ax.annotate(f"{v:.2f}", (x, v), xytext=(0, 8 if above else -9), textcoords="offset points", ha="center",
                va="bottom" if above else "top", fontsize=7, color=colour,
                bbox={"fc": "white", "ec": "none", "alpha": 0.85, "pad": 0.4}, zorder=5)


def _b_order(b) -> float:
    s = str(b)
    return float(s) if s.replace(".", "", 1).isdigit() else math.inf


def minibatch_figure(reg: pd.DataFrame, timing: pd.DataFrame | None, floors: dict | None = None):
    """Figure 8: our perplexity vs b, the paper's in a panel of its own, and the forward time split into the
    W's and the total."""
    df = P.plotted_runs(reg)
    if df.empty:
        raise ValueError("no finished runs in the minibatch registry")
    df["mini_batch"] = df["mini_batch"].astype(str).str.replace(r"\.0$", "", regex=True)
    agg = P.aggregate(df)
    agg = agg.iloc[sorted(range(len(agg)), key=lambda i: _b_order(agg["mini_batch"].iloc[i]))]
    ticks = [f"b={b}" if b == "T" else b for b in agg["mini_batch"]]
    x = np.arange(len(agg))
    fig, axes = P.plt.subplots(1, 3, figsize=(14, 4.6), layout="constrained",
                               gridspec_kw={"width_ratios": [3, 2, 3]})
    ours, paper_ax, time_ax = axes
    model = str(df["model"].dropna().iloc[0]) if "model" in df and df["model"].notna().any() else "ttt_linear"
    method = P.PAPER_NAMES.get(model, model)
    colour, marker = P.method_style(method)
    size = f", size {df['size'].iloc[0]}" if "size" in df and df["size"].notna().any() else ""
    P.errorbar(ours, x, agg["val_ppl"], agg["ppl_std"], f"Ours: {method}{size}", style_of=method)
    role = P.role_of(df)
    shown = P.near_floors(P.floors_for(floors, role), agg["val_ppl"])  # the 3-gram floor decides
    P.draw_floors(ours, shown)
    T = int(df["seq_len"].iloc[0]) if df["seq_len"].notna().any() else None
    ours.set(yscale="log", xlabel="TTT mini-batch size b",
             ylabel=f"Perplexity ({P.seeds_note(agg['n_seeds'])})",
             title=f"Ours: {P.corpus_title(df, role)}" + (f", context {P.context_label(T)}" if T else ""))
    for xi, v in zip(x, agg["val_ppl"], strict=True):  # the values: the floors make the range wide
        _value_label(ours, xi, v, colour, above=True)
    ours.margins(y=0.1)
    ours.set_xticks(x, ticks)
    P.finish_log_axis(ours, "y")
    P.label_floors(ours)

    paper = pd.to_numeric(agg["paper_ppl"], errors="coerce") if "paper_ppl" in agg else pd.Series(dtype=float)
    have = paper.notna().to_numpy()
    if have.any():
        paper_ax.plot(x[have], paper[have], "--", marker=marker, color=colour, mfc="white", ms=6,
                      label="Paper: TTT-Linear 125M (values it reports)")
        for xi, v in zip(x[have], paper[have], strict=True):
            _value_label(paper_ax, xi, v, colour, above=False)
        paper_ax.margins(y=0.2)
    else:
        paper_ax.text(0.5, 0.5, "no paper numbers\nin the registry", ha="center", va="center",
                      transform=paper_ax.transAxes, color="0.4")
    paper_ax.set_xticks(x, ticks)
    paper_ax.set_xlim(ours.get_xlim())
    paper_ax.set(xlabel="TTT mini-batch size b", ylabel="Paper perplexity (125M, Llama tokens)",
                 title="Paper (Pile, T=2k)")
    handles = P.handles_of(ours) + P.handles_of(paper_ax)

    if timing is not None and not timing.empty:
        t = timing.groupby("mini_batch", sort=True)[["total_ms", "w_ms"]].agg(["mean", "std"])
        bs = list(t.index)
        Tt = int(timing["seq_len"].iloc[0]) if "seq_len" in timing else None
        xt = np.arange(len(bs))
        for col, name, c, mk, ls in (("total_ms", "Total (W's and z's)", "0.1", "o", "-"),
                                     ("w_ms", "W's at mini-batch ends", "0.55", "s", "--")):
            std = t[(col, "std")].fillna(0.0).to_numpy()
            time_ax.errorbar(xt, t[(col, "mean")], yerr=std if std.any() else None, color=c, marker=mk, ls=ls,
                             ms=5, capsize=3, label=name)
        if "layer_ms" in timing:  # where the layer runs something else than the dual form (b = T: batch GD)
            layer = timing.groupby("mini_batch", sort=True)["layer_ms"].mean()
            other = (layer - t[("total_ms", "mean")]).abs() > 1e-9
            if other.any():
                time_ax.plot(xt[other.to_numpy()], layer[other], ls="none", marker="*", ms=10, color="0.1",
                             label="What the layer runs at b=T (chunked batch GD)")
        time_ax.set_xticks(xt, ["b=T" if str(b) == "T" or str(b) == str(Tt) else str(b) for b in bs])
        time_ax.set(xlabel="TTT mini-batch size b", ylabel="Forward time (ms)", yscale="log",
                    title="Forward time, one TTT-Linear layer, dual form"
                    + (f", T={P.context_label(Tt)}" if Tt else ""))
        P.finish_log_axis(time_ax, "y")
        handles += P.handles_of(time_ax)
    else:
        time_ax.text(0.5, 0.5, "no timing measured", ha="center", va="center", transform=time_ax.transAxes,
                     color="0.4")
        time_ax.set(xlabel="TTT mini-batch size b", ylabel="Forward time (ms)", title="Forward time")
    P.legend_below(fig, handles + P.floor_handles(shown), ncols=3)
    return fig


def inner_loss_figure(df: pd.DataFrame, window: int = 10, mini_batch: str | None = None):
    """Figures 5/17: the three inner losses per layer against the token index (of a network with TTT
    mini-batch size `mini_batch`, named in the title when given)."""
    layers = sorted(df["layer"].unique())
    if not layers:
        raise ValueError("no inner losses")
    cols = min(4, len(layers))
    rows = -(-len(layers) // cols)
    fig, axes = P.plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows + 0.7), squeeze=False,
                               layout="constrained")
    names = {"w0": r"$\ell(W_0; x_t)$", "prev": r"$\ell(W_{t-1}; x_t)$", "now": r"$\ell(W_t; x_t)$"}
    styles = {"w0": ("#7f7f7f", ":"), "prev": ("#1f77b4", "-"), "now": ("#d62728", "-")}
    for ax, layer in zip(axes.flat, layers, strict=False):
        g = df[df["layer"] == layer].sort_values("position")
        for key, name in names.items():
            c, ls = styles[key]
            ax.plot(g["position"], g[key].rolling(window, min_periods=1).mean(), color=c, ls=ls, lw=1.3,
                    label=name)
        ax.set(title=f"Layer {layer + 1}", xlabel="Token index t", ylabel="TTT loss")
    for ax in axes.flat[len(layers) :]:
        ax.axis("off")
    P.legend_below(fig, P.handles_of(axes[0][0]), ncols=3)
    of = f" of TTT-Linear (M) with mini-batch b = {mini_batch}" if mini_batch else ""
    fig.suptitle(f"TTT inner losses per layer{of} (averaged over windows of {window} tokens)", fontsize=11)
    return fig


def plot_minibatch(inputs: list[Path], stem: Path) -> list[Path]:
    from .engine.floors import read_drawn_floors

    src = inputs[0]
    timing = read_csv(src if src.is_dir() else src.parent, "timing.csv")
    return P.save(minibatch_figure(read_registry(src), timing, read_drawn_floors(src)), stem)


def plot_inner_loss(inputs: list[Path], stem: Path) -> list[Path]:
    """A language model's inner losses by token position, or MTTT's by inner step: a run's inner_losses.csv
    (for MTTT, its validation images) or a reproduce step's inner_loss.csv (MTTT: one panel a row)."""
    src = inputs[0]
    if Path(src).is_dir():  # a run folder
        src = Path(src) / "inner_losses.csv"
        if not src.is_file():
            raise ValueError(f"no inner_losses.csv in {src.parent} (runs with TTT layers write one)")
    df = read_table(src, numeric=("position", "step", "w0", "prev", "now", "inner_loss"),
                    fix="pass the inner_losses.csv a run wrote, or a reproduce step's inner_loss.csv")
    if "position" in df:
        b = str(df["mini_batch"].iloc[0]) if "mini_batch" in df else None
        return P.save(inner_loss_figure(df, mini_batch=b), stem)
    if "config" not in df:  # one MTTT run: its validation images, titled <model>-<size>-<data>-T<tokens>
        df = df[df["split"] == "val"].assign(config=src.resolve().parent.parent.name)
    fig = mttt.inner_steps_figure(df, min_steps=1)
    if fig is None:
        raise ValueError("no inner losses in it")
    return P.save(fig, stem)


# ---- claims ----


def minibatch_trend(r) -> Verdict:
    """Perplexity rises with b over the whole range (b = T the largest): Page's trend test with seeds as
    blocks (the runs of one seed share the data order), over the seeds that ran every b."""
    df = finished_runs(r.csv("minibatch"))
    if df.empty:
        return Verdict(MISSING, "no finished runs")
    df = df.assign(mini_batch=df["mini_batch"].astype(str))
    levels = sorted((b for b in df["mini_batch"].unique() if b != "T"), key=int)
    levels += ["T"] * ("T" in set(df["mini_batch"]))
    table = df.pivot_table(index="seed", columns="mini_batch", values="val_ppl").reindex(columns=levels)
    t = trend(table.dropna().to_numpy())
    status = status_of(t, ">", 0.0)
    under = undertrained(df, r.floors)
    if under:
        status = UNDERTRAINED
    test = ("no test (fewer than 2 seeds ran every b)" if t.p_up is None else
            f"Page's test, one-sided p = {t.p_up:.2g} for a rise, {t.p_down:.2g} for a fall")
    means = df.groupby("mini_batch")["val_ppl"].mean()
    sentence = (
        f"perplexity against b ({', '.join(levels)}) within each of {t.seeds} seeds: mean Spearman's rho "
        f"{t.rho:+.2f}, {test}; means " + ", ".join(f"b={b}: {means[b]:.2f}" for b in levels)
        + (f"; {len(under)} runs do not beat the 3-gram floor (under-trained)" if under else "")
    )
    numbers = {"rho": t.rho, "p_up": t.p_up, "p_down": t.p_down, "means": means.to_dict()}
    if t.sign() in (1, -1):  # one of its figure's family (Holm)
        numbers["p"] = t.p_up if t.sign() == 1 else t.p_down
    return Verdict(status, sentence, numbers)


def dual_form_time(r) -> Verdict:
    """Forward time in dual form falls from b = 1 to b = 16 (more parallel W's), and rises again at b = T
    (the z's, O(T b d)): each ratio must exceed 1.2 and lie outside its timings' spread; a timing that
    engine/timing.py doubts (too few repeats, under load, load not recorded) is inconclusive."""
    t = r.csv("minibatch", "timing.csv")
    if t is None or t.empty:
        return Verdict(MISSING, "no timing")
    t = t.assign(b=t["mini_batch"].astype(int), s=timing.spread(t)).set_index("b")
    total, noise = t["total_ms"].to_dict(), t["s"].to_dict()
    T, best = max(total), min(total, key=total.get)
    if 1 not in total or 16 not in total:
        return Verdict(MISSING, "b = 1 or b = 16 not timed")
    fall, rise = total[1] / total[16], total[T] / total[best]
    clear = (timing.beyond_spread(fall, noise[1], noise[16]),
             timing.beyond_spread(rise, noise[T], noise[best]))
    status = (HOLDS if fall > 1.2 and rise > 1.2 and all(clear) else
              FAILS if (fall < 1 / 1.2 and clear[0]) or (rise < 1.0 and clear[1]) else INCONCLUSIVE)
    sentence = (
        f"b=1 takes {fall:.1f}x the time of b=16 ({total[1]:.1f} vs {total[16]:.1f} ms), and b=T {rise:.1f}x "
        f"the fastest b ({total[T]:.1f} vs {total[best]:.1f} ms); a margin of 20% and a ratio outside the "
        f"repeats' spread ({timing.spread_text(t)}) are required"
    )
    if (why := timing.doubt(t)) is not None:
        status, sentence = INCONCLUSIVE, f"{sentence}; inconclusive: {why}"
    return Verdict(status, sentence, {"b1_over_b16": fall, "bT_over_best": rise})


def _quarters(df: pd.DataFrame) -> pd.DataFrame:
    """Per seed and quarter of the positions: the mean inner losses (seed a column, so that the losses of one
    run pair up by seed: they are measured on the same run and tokens)."""
    q = pd.qcut(df["position"], 4, labels=["1st", "2nd", "3rd", "4th"])
    means = df.assign(quarter=q).groupby(["seed", "quarter"], observed=True)[["w0", "prev", "now"]].mean()
    return means.reset_index()


def gd_step_lowers_loss(r) -> Verdict:
    inner = r.csv("minibatch", "inner_loss.csv")
    if inner is None or inner.empty:
        return Verdict(MISSING, "no inner losses")
    q = _quarters(inner)
    parts = [compare(g.assign(v=g["now"]), g.assign(v=g["prev"]), ("l(W_t; x_t)", "l(W_t-1; x_t)"), "<", None,
                     value="v")
             for _, g in q.groupby("quarter", observed=True)]
    return combine(parts, [f"{x} quarter of positions" for x in q["quarter"].unique()])


def gap_grows_with_t(r) -> Verdict:
    """The relative improvement 1 - l(W_t)/l(W_0) is larger in the last quarter of positions than in the
    first (relative, so that a drift of l(W_0) alone does not make it grow)."""
    inner = r.csv("minibatch", "inner_loss.csv")
    if inner is None or inner.empty:
        return Verdict(MISSING, "no inner losses")
    q = _quarters(inner)
    gain = q.assign(v=1 - q["now"] / q["w0"])
    return compare(gain[gain["quarter"] == "4th"], gain[gain["quarter"] == "1st"],
                   ("relative gain, last quarter", "first quarter"), ">", None, value="v")


class MiniBatch(Experiment):
    name = "minibatch"
    section = Section(
        "Figure 8 and Figures 5/17: TTT mini-batch size, inner losses",
        "Smaller b gives lower perplexity (more GD steps); dual-form forward time falls with b, then the "
        "z's (O(T b d)) dominate. One GD step lowers the inner loss, and l(W_t; x_t) improves further "
        "from l(W_0; x_t) as t grows.",
        ["minibatch.md", "minibatch.png", "inner_loss.png"],
        ["Figure 8", "Figures 5/17"],
    )

    def configurations(self, profile: str, data_dir: str | None) -> list[Run]:
        p = self.sweep["profiles"][profile]
        base = data_overrides(self.sweep["data"], data_dir) + p["overrides"] + self.sweep["model"]
        runs = []
        for b in p.get("mini_batch_sizes", self.sweep["mini_batch_sizes"]):
            value = "${data.seq_len}" if b == "T" else b
            runs.append(configuration(f"b{b}", base + [f"model.block.mini_batch_size={value}"], f"b={b}",
                                      mini_batch=str(b), paper_ppl=self.sweep["paper_ppl"].get(b)))
        return runs

    def measure(self, step, trained, ctx) -> None:
        """Figure 8 (right), timed with the runs (tabulating or only restoring them keeps the committed
        timing, unless it has no record of the load during it: that one is moved aside to
        timing.no-load-record.csv and timed again); Figures 5/17: the inner losses of the networks with the
        smallest b trained, one per seed (the paper's are b = 1)."""
        reg, timed = trained.registry, read_csv(step.dir, "timing.csv")
        if timed is not None and "loaded_during" not in timed:
            (step.dir / "timing.csv").replace(step.dir / "timing.no-load-record.csv")
            log.info("minibatch: timing.csv has no record of the load during it: moved to "
                     "timing.no-load-record.csv and timed again")
            timed = None
        if timed is None or (ctx.train and not step.restored_only(reg)):
            step.csv("timing.csv", time_w_and_z(self.sweep["mini_batch_sizes"],
                                                **self.sweep["timing"][ctx.profile]))
        sweep_dir = ctx.runs / self.name

        def measure(r):  # with the run's b: the figure names it
            ckpt = sweep_dir / r.run / "checkpoints" / "last.ckpt"
            if not ckpt.is_file():
                return None
            return checkpoint_inner_losses(str(ckpt)).assign(seed=r.seed, mini_batch=str(r.mini_batch))

        done = reg[reg["status"] == "finished"]
        sizes = [b for b in done["mini_batch"].astype(str) if b.isdigit()]
        smallest = done[done["mini_batch"].astype(str) == min(sizes, key=int)] if sizes else done.iloc[:0]
        step.per_run("inner_loss.csv", smallest, measure)

    def tabulate(self, folder: Path) -> None:
        reg, floors = read_csv(folder, "registry.csv"), read_csv(folder, "floors.csv")
        if reg is None:
            return
        P.save(minibatch_figure(reg, read_csv(folder, "timing.csv"), drawn_floors(floors)),
               folder / "minibatch")
        inner = read_csv(folder, "inner_loss.csv")
        if inner is not None:
            b = str(inner["mini_batch"].iloc[0]) if "mini_batch" in inner else "1"  # older steps: b = 1
            P.save(inner_loss_figure(inner[inner["seed"] == inner["seed"].min()], mini_batch=b),
                   folder / "inner_loss")
        write_atomic(folder / "minibatch.md", summary_table(reg, ["label"], floors))

    @property
    def claims(self) -> list[Claim]:
        paper, role = self.sweep["paper_ppl"], self.sweep["data"]
        cpu_b = min(int(b) for b in self.sweep["profiles"]["cpu"]["mini_batch_sizes"] if b != "T")
        return [
            Claim("fig8.trend", "Figure 8", "Smaller TTT mini-batches give lower perplexity, over the whole "
                  f"range of b (the paper's: b = 1 to T; judged on b >= {cpu_b} to T, the b's the cpu "
                  "profile trains).", minibatch_trend),
            Claim("fig8.b16", "Figure 8", "b = 16 is clearly better than b = T (batch GD).",
                  lambda r: compare(select(r.csv("minibatch"), mini_batch="16"),
                                    select(r.csv("minibatch"), mini_batch="T"), ("b=16", "b=T"), "<",
                                    r.floors, f"; paper {paper[16]} vs {paper['T']}",
                                    paper_effect=units.paper_effect(r, role, paper[16], paper["T"]))),
            Claim("fig8.time", "Figure 8", "Dual-form forward time falls from b = 1 to b = 16 and rises "
                  "again at b = T.", dual_form_time),
            Claim("fig17.step", "Figures 5/17", "One inner GD step lowers the TTT loss: l(W_t; x_t) < "
                  "l(W_t-1; x_t), at every range of positions.", gd_step_lowers_loss),
            Claim("fig17.growth", "Figures 5/17", "l(W_t; x_t) improves further from l(W_0; x_t) as t grows.",
                  gap_grows_with_t),
        ]

    @property
    def plots(self) -> dict[str, PlotCommand]:
        return {
            "minibatch": PlotCommand("TTT mini-batch size (Fig 8); INPUT: a minibatch sweep folder (with "
                                     "timing.csv)", plot_minibatch),
            "inner-loss": PlotCommand("TTT inner losses per layer: against the token index for a language "
                                      "model (Figs 5/17), against the inner step for MTTT (its Figs 1 "
                                      "right/3/4); INPUT: a run folder or its inner_losses.csv, or an "
                                      "MTTT step's inner_loss.csv",
                                      plot_inner_loss),
        }


EXPERIMENT = MiniBatch()
