"""Budgets: a cross-experiment calibration row of the claim table (not a claim of the paper). A model that
has not learned its text's 3-gram statistics says nothing about the claims: every finished run of every
language-model step that a verdict reads (Table 1, Figure 8, the scaling grid, long range) must beat the byte
3-gram floor of its own validation text and context. No subset is picked: the row lists every run that
falls short, step by step (each such verdict is "under-trained" on its own)."""

from .engine.experiment import Experiment
from .engine.floors import TRAINED_PAST, undertrained
from .engine.registry import finished_runs
from .engine.verdicts import FAILS, HOLDS, MISSING, Claim, Verdict

LM_STEPS = ("table1", "minibatch", "scaling", "longrange")  # the steps whose verdicts read text perplexity


def trained_past_floors(r) -> Verdict:
    """Every finished run of LM_STEPS beats the 3-gram floor of its text and context."""
    if r.floors is None or r.floors.empty:
        return Verdict(MISSING, "no n-gram floors to compare with")
    counts, short = [], {}
    for step in LM_STEPS:
        runs = finished_runs(r.csv(step))
        if runs.empty:
            continue
        under = undertrained(runs, r.floors)
        counts.append(f"{step} {len(runs) - len(under)} of {len(runs)}")
        if under:
            short[step] = under
    if not counts:
        return Verdict(MISSING, f"no finished runs of {', '.join(LM_STEPS)}")
    sentence = (f"runs past the {TRAINED_PAST} floor of their text and context: " + ", ".join(counts)
                + "".join(f"; {step} short: {', '.join(runs)}" for step, runs in short.items()))
    return Verdict(FAILS if short else HOLDS, sentence, {"under": short})


class Budgets(Experiment):
    name = "budgets"
    trains = False

    @property
    def claims(self) -> list[Claim]:
        return [Claim("budgets", "Budgets", "Calibration (not a claim of the paper): every language model a "
                      f"verdict reads is past the {TRAINED_PAST} floor of its validation text and context.",
                      trained_past_floors, kind="check")]


EXPERIMENT = Budgets()
