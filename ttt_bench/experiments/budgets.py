"""Budgets: a cross-experiment calibration row of the claim table (not a claim of the paper). A model that
has not learned its text's n-gram statistics says nothing about the claims: every run of Table 1, Figure 8
and the scaling grid must beat its text's bigram floor, and every run of the headline comparisons (Table
1's last rows, the longest Books context of the largest scaling size) the 3-gram floor."""

import pandas as pd

from . import scaling, table1
from .engine.experiment import Experiment
from .engine.floors import ngram_floor, undertrained
from .engine.registry import finished_runs
from .engine.verdicts import FAILS, HOLDS, MISSING, Claim, Verdict

HEADLINE_FLOOR = "3-gram"  # the smoothed n-gram floor the headline comparisons must beat


def headline_runs(r) -> pd.DataFrame:
    """The runs of the headline comparisons: Table 1's last ladder row and its reference rows, and every
    method at the scaling grid's largest size and longest Books context."""
    return pd.concat([table1.last_rows(r.csv("table1")), scaling.headline_runs(r.csv("scaling"))],
                     ignore_index=True)


def trained_past_floors(r) -> Verdict:
    """Every run of Table 1, Figure 8 and the scaling grid beats its text's bigram floor, and every run of
    the headline comparisons the 3-gram floor (each run, each seed)."""
    runs = pd.concat([finished_runs(r.csv(s)) for s in ("table1", "minibatch", "scaling")], ignore_index=True)
    if runs.empty:
        return Verdict(MISSING, "no finished runs of Table 1, Figure 8 or the scaling grid")
    if r.floors is None or r.floors.empty:
        return Verdict(MISSING, "no n-gram floors to compare with")
    head, under = headline_runs(r), undertrained(runs, r.floors)
    margins = []  # (perplexity / floor, run, perplexity, floor) of each headline run
    for x in head.itertuples():
        f = ngram_floor(r.floors, getattr(x, "role", None), getattr(x, "seq_len", None), HEADLINE_FLOOR)
        margins += [] if f is None else [(x.val_ppl / f, x.run, x.val_ppl, f)]
    short = [run for ratio, run, _, _ in margins if ratio >= 1]
    closest = max(margins, default=None)
    sentence = (
        f"{len(runs) - len(under)} of {len(runs)} runs beat their text's bigram floor"
        + (f" (not: {', '.join(under)})" if under else "")
        + f"; {len(head) - len(short)} of {len(head)} headline runs (Table 1's last rows, the longest Books "
        f"context of the largest scaling size) beat the {HEADLINE_FLOOR} floor"
        + (f" (not: {', '.join(short)})" if short else "")
        + ("" if closest is None else f"; the closest to its floor: {closest[1]} {closest[2]:.2f} against "
           f"{closest[3]:.2f}")
    )
    status = FAILS if under or short else HOLDS
    return Verdict(status, sentence, {"under_bigram": under, "under_headline": short})


class Budgets(Experiment):
    name = "budgets"
    trains = False

    @property
    def claims(self) -> list[Claim]:
        return [Claim("budgets", "Budgets", "Calibration (not a claim of the paper): every model of Table 1, "
                      "Figure 8 and the scaling grid is past the bigram floor, and the headline comparisons "
                      "past the 3-gram floor.", trained_past_floors)]


EXPERIMENT = Budgets()
