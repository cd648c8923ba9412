"""Every run's validation curve, kept with its step folder (`curves.csv`: run, step, tokens, val_loss), so a
reader can see how each run trained after its run folder is gone; and the runs whose optimisation failed.

A run "stalled" when its validation loss at mid-training had not fallen below the unigram floor of its text
(the loss of predicting byte frequencies alone): it had not left the plateau every model starts on, so its
final perplexity measures a failed optimisation, not the model. The rule is conservative: Table 1's
Transformer++ seed 0 at 1,024 bytes (validation 23.4 at step 99 of 245, 20.3 at the end, against a unigram
floor of 25.2 and a 3-gram floor of 7.76) was just below it; such a run is still marked under-trained by the
3-gram floor, and its curve is there to see. Tables flag stalled runs.
"""

import math
from pathlib import Path

import pandas as pd

from ...errors import UserError
from ...training.runs import loss_curves
from .floors import ngram_floor

COLUMNS = ["run", "step", "tokens", "val_loss"]


def run_curves(out: Path, runs, kept: pd.DataFrame | None = None) -> pd.DataFrame:
    """The validation curves of the runs of a sweep folder that have one, and for the runs whose folders are
    gone (restored from a committed registry) their rows of `kept` (the committed curves.csv)."""
    frames = []
    for name in runs:
        try:
            df = loss_curves(Path(out) / name)
        except (UserError, OSError, ValueError):  # no run folder (restored), or a run that never trained
            if kept is not None and "run" in kept:
                frames.append(kept[kept["run"] == name][COLUMNS])
            continue
        val = df[df["split"] == "validation"]
        frames.append(pd.DataFrame({"run": name, "step": val["step"], "tokens": val["tokens"],
                                    "val_loss": val["loss"]}))
    frames = [f for f in frames if not f.empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)


def stalled(registry: pd.DataFrame, curves: pd.DataFrame | None, floors: pd.DataFrame | None) -> list[str]:
    """The runs whose validation loss at mid-training (the last point at or before half their steps) was not
    below the unigram floor of their text and context: failed optimisations."""
    if curves is None or curves.empty or floors is None:
        return []
    out = []
    for r in registry.itertuples():
        floor = ngram_floor(floors, getattr(r, "role", None), getattr(r, "seq_len", 0) or 0, "unigram")
        curve = curves[curves["run"] == r.run].sort_values("step")
        if floor is None or curve.empty:
            continue
        mid = curve[curve["step"] <= curve["step"].max() / 2]
        if not mid.empty and mid["val_loss"].iloc[-1] >= math.log(floor):
            out.append(r.run)
    return out
