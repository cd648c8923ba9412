"""Loss curves (not a figure of the papers): `ttt-bench plot curves RUN...` draws the training loss (per
step, smoothed) and the validation loss of several run folders against steps and against tokens seen, one
colour per run, or per configuration (mean and range over its runs) beyond GROUP_ABOVE runs, so the figure
stays readable at the scale of a sweep; `ttt-bench plot curves STEP_FOLDER` draws the validation curves a
sweep or step folder keeps (curves.csv, engine/curves.py), one line per configuration with its seeds'
range, and its stalled runs each on its own. `ttt-bench runs` lists the run folders (training/runs.py)."""

from pathlib import Path

import numpy as np
import pandas as pd

from ..training.runs import find_runs, loss_curves, read_run, token_index_losses
from .engine import plotting as P
from .engine.experiment import Experiment, PlotCommand

SMOOTH = 8  # steps of the training loss's moving average
GROUP_ABOVE = 8  # more run folders than this: one line per configuration (mean and range over its runs)


def run_folders(inputs: list[Path]) -> list[Path]:
    """The run folders named, or found under the folders named."""
    runs = [run for path in inputs for run in find_runs(path)]
    if not runs:
        named = ", ".join(map(str, inputs))
        raise ValueError(f"no run folder (one `ttt-bench train` wrote, with its identity.json) in {named}")
    return runs


def curves_figure(curves: dict[str, pd.DataFrame]):
    """Two panels, loss against steps and against tokens: a run's smoothed training loss as a line, its
    validation losses as markers of the same colour."""
    fig, axes = P.plt.subplots(1, 2, figsize=(10, 4.2), squeeze=False, layout="constrained")
    colours = P.plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, df) in enumerate(curves.items()):
        colour = colours[i % len(colours)]
        train, val = df[df["split"] == "train"], df[df["split"] == "validation"]
        smooth = train["loss"].rolling(SMOOTH, min_periods=1).mean()
        for ax, x in zip(axes[0], ("step", "tokens"), strict=True):
            ax.plot(train[x], smooth, color=colour, lw=1.4, label=label)
            if not val.empty:
                ax.plot(val[x], val["loss"], "o--", color=colour, ms=4, lw=0.8, label=f"{label} (validation)")
    for ax, x in zip(axes[0], ("Optimizer step", "Tokens (or images) seen"), strict=True):
        ax.set(xlabel=x, ylabel="Loss (nats)", title=f"Training loss (mean of {SMOOTH} steps) and validation")
        ax.grid(alpha=0.3)
    P.legend_below(fig, P.handles_of(axes[0][0]))
    return fig


def grouped_figure(curves: pd.DataFrame, title: str, stalled: list[str] = ()):
    """Validation loss against tokens, one line per `group` (the mean over its runs at each step, the range
    shaded); the `stalled` runs drawn each on its own, dashed."""
    fig, ax = P.plt.subplots(figsize=(7.5, 4.6), layout="constrained")
    kept = curves[~curves["run"].isin(stalled)]
    for group, df in kept.groupby("group", sort=False):
        by = df.groupby("tokens")["val_loss"]
        n = df["run"].nunique()
        line, = ax.plot(by.mean().index, by.mean(), lw=1.5, label=f"{group} ({n} run{'s' * (n > 1)})")
        if n > 1:
            ax.fill_between(by.min().index, by.min(), by.max(), color=line.get_color(), alpha=0.18, lw=0)
    for run in stalled:
        df = curves[curves["run"] == run]
        ax.plot(df["tokens"], df["val_loss"], "--", lw=1, color="0.4", label=f"{run} (stalled)")
    ax.set(xlabel="Tokens (or images) seen", ylabel="Validation loss (nats)", title=title)
    ax.grid(alpha=0.3)
    P.legend_below(fig, P.handles_of(ax), ncols=2)
    return fig


def plot_step_curves(folder: Path, stem: Path) -> list[Path]:
    """A sweep or step folder's curves.csv, by configuration (its registry's labels)."""
    from .engine.curves import stalled
    from .engine.experiment import read_csv

    curves, reg = read_csv(folder, "curves.csv"), read_csv(folder, "registry.csv")
    if curves is None or curves.empty or reg is None:
        raise ValueError(f"{folder} has no validation curves (curves.csv, from ablate or make reproduce)")
    labels = dict(zip(reg["run"], reg["label"] if "label" in reg else reg["run"], strict=True))
    curves = curves.assign(group=curves["run"].map(labels).fillna(curves["run"]))
    title = f"{Path(folder).name}: validation loss by configuration (mean; range over seeds)"
    return P.save(grouped_figure(curves, title, stalled(reg, curves, read_csv(folder, "floors.csv"))), stem)


def plot_curves(inputs: list[Path], stem: Path) -> list[Path]:
    if len(inputs) == 1 and (Path(inputs[0]) / "curves.csv").is_file():
        return plot_step_curves(Path(inputs[0]), stem)
    runs = [run for run in run_folders(inputs) if (run / "losses.csv").is_file()]  # failed ones: none
    if not runs:
        raise ValueError("no run folder with a losses.csv (runs that trained at least one step have one)")
    if len(runs) > GROUP_ABOVE:  # one line per configuration, or the legend fills the figure
        frames = [loss_curves(run).query("split == 'validation'").assign(run=str(run),
                                                                         group=read_run(run).label)
                  for run in runs]
        curves = pd.concat(frames, ignore_index=True).rename(columns={"loss": "val_loss"})
        return P.save(grouped_figure(curves, f"Validation loss of {len(runs)} runs, by configuration "
                                             "(mean, range over runs)"), stem)
    labels = {}
    for run in runs:
        label = read_run(run).label
        labels[label if label not in labels else f"{label} ({run.name[:12]})"] = loss_curves(run)
    return P.save(curves_figure(labels), stem)


def plot_token_index_of_runs(inputs: list[Path], stem: Path, window: int = 8) -> list[Path]:
    """`ttt-bench plot token-index RUN...`: each run's validation perplexity by token index (its
    token_index.csv, averaged over windows of `window` tokens)."""
    fig, ax = P.plt.subplots(figsize=(6.2, 4.8), layout="constrained")
    drawn = 0
    for run in run_folders(inputs):
        if not (run / "token_index.csv").is_file():
            continue
        df = token_index_losses(run)
        loss = df.set_index("token_index")["loss"].rolling(window, min_periods=1).mean()
        ax.plot(loss.index, np.exp(loss), lw=1.5, label=read_run(run).label)
        drawn += 1
    if not drawn:
        raise ValueError("no token_index.csv in the run folders (language-model runs write one)")
    ax.set(xscale="log", yscale="log", xlabel=f"Token index (loss averaged over windows of {window} tokens)",
           ylabel="Validation perplexity", title="Perplexity by position in the context")
    P.finish_log_axis(ax, "x", ticks=P.nice_log_ticks(*ax.get_xlim(), max_ticks=6))
    P.finish_log_axis(ax, "y")
    P.legend_below(fig, P.handles_of(ax))
    return P.save(fig, stem)


class Curves(Experiment):
    name = "curves"
    trains = False

    @property
    def plots(self) -> dict:
        return {"curves": PlotCommand("training and validation loss against steps and tokens of several "
                                      "runs (by configuration beyond 8); INPUT: run folders, folders of runs "
                                      "(e.g. runs/), or a sweep or step folder (its curves.csv)",
                                      plot_curves)}


EXPERIMENT = Curves()
