"""Claims and their verdicts: each experiment states the papers' claims as `Claim`s whose judge reads the
committed results and returns a Verdict.

A verdict is "holds", "does not hold", "inconclusive", "underpowered", "under-trained", "not tested"
(what was run cannot test the claim: a long-context claim at a short context, an experiment this profile
leaves out) or "not measured", with the sentence printed beside it (made from the same numbers, so it
cannot contradict them). A difference whose 95% interval over seeds contains 0 is "inconclusive" (one
seed has no interval, so it is always inconclusive); arms that share their seeds are compared pair by
pair (engine/stats.py). A comparison that uses a run that does not beat the byte 3-gram floor of its
validation text is "under-trained": such a model has not learned what the claim is about. An inconclusive
comparison whose minimum detectable effect (the interval's half-width) is larger than the paper's effect
(relative to the reference, in the same units) is "underpowered": it could not have seen the paper's
effect. Within one table or figure, the directional claims that hold or do not hold are corrected for
multiplicity (Holm): one that is not significant after it is "inconclusive".
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from .floors import undertrained
from .stats import ALPHA, difference, holm, mean_sd

HOLDS, FAILS, INCONCLUSIVE, MISSING = "holds", "does not hold", "inconclusive", "not measured"
UNDERTRAINED, UNDERPOWERED, NOT_TESTED = "under-trained", "underpowered", "not tested"
STATUSES = (HOLDS, FAILS, INCONCLUSIVE, UNDERPOWERED, UNDERTRAINED, NOT_TESTED, MISSING)

# "a = b" holds when the whole 95% interval of the difference lies within +-EQUIVALENCE_MARGIN of b's mean
# (an equivalence test, as two one-sided tests at 2.5% each), or the claim's own margin (Table 1: below the
# smallest effect the paper reports in it); an interval that merely contains 0 is no evidence of equality,
# only of too few seeds.
EQUIVALENCE_MARGIN = 0.05


@dataclass
class Verdict:
    status: str
    sentence: str
    numbers: dict = field(default_factory=dict)


@dataclass
class Claim:
    id: str
    figure: str  # the report section's claim heading it belongs to
    claim: str  # the paper's claim, one sentence
    judge: Callable  # Results -> Verdict (engine/report.py's Results: the committed step folders)


def status_of(d, expect: str, reference: float, margin: float = EQUIVALENCE_MARGIN) -> str:
    """The verdict of a Difference for "a < b" ('<'), "a > b" ('>') or "a = b" ('=', within `margin`, a
    fraction of the reference)."""
    sign = d.sign()
    if sign is None:
        return INCONCLUSIVE
    if expect == "=":
        margin = margin * abs(reference)
        return FAILS if sign != 0 else (HOLDS if -margin <= d.lo and d.hi <= margin else INCONCLUSIVE)
    want = -1 if expect == "<" else 1
    return HOLDS if sign == want else (INCONCLUSIVE if sign == 0 else FAILS)


def paired_by_seed(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    """Whether two arms ran the same seeds (each once): their runs then pair up, seed by seed."""
    if "seed" not in a or "seed" not in b or len(a) < 2:
        return False
    return a["seed"].is_unique and b["seed"].is_unique and set(a["seed"]) == set(b["seed"])


def compare(
    a: pd.DataFrame,
    b: pd.DataFrame,
    names: tuple[str, str],
    expect: str,
    floors,
    paper: str = "",
    value: str = "val_ppl",
    paper_effect: float | None = None,
    margin: float | None = None,
) -> Verdict:
    """Judge "a < b" (expect '<'), "a > b" ('>') or "a = b" ('=') on a value over seeds: paired by seed
    where both arms ran the same seeds, else Welch. `paper_effect`: the paper's effect relative to the
    reference (a fraction of b's mean, in our units): an inconclusive result that could not have detected it
    is underpowered. `margin`: the equivalence margin of '=' as a fraction of b's mean (default
    EQUIVALENCE_MARGIN; a table sets it below the smallest effect it reports)."""
    margin = EQUIVALENCE_MARGIN if margin is None else margin
    if a.empty or b.empty:
        missing = " and ".join(n for n, d in zip(names, (a, b), strict=True) if d.empty)
        return Verdict(MISSING, f"no finished runs of {missing}")
    paired = paired_by_seed(a, b)
    if paired:
        a, b = a.sort_values("seed"), b.sort_values("seed")
    d = difference(a[value], b[value], paired=paired)
    status = status_of(d, expect, b[value].mean(), margin)
    under = undertrained(pd.concat([a, b]), floors) if value == "val_ppl" else []
    why = ""
    if under:
        status, why = UNDERTRAINED, f"; {len(under)} of the runs do not beat the 3-gram floor (under-trained)"
    elif d.lo is None:
        why = "; one seed: no interval"
    elif status == INCONCLUSIVE and expect == "=":  # these seeds could not show equality: underpowered
        status = UNDERPOWERED
        why = (f"; underpowered: no difference shown, but the interval is wider than the equivalence margin "
               f"+-{margin * abs(b[value].mean()):.3g} ({margin:.2%} of {names[1]})")
    elif status == HOLDS and expect == "=":
        why = f"; within the equivalence margin +-{margin * abs(b[value].mean()):.3g} ({margin:.2%})"
    elif status == INCONCLUSIVE and paper_effect is not None and d.mde > paper_effect * abs(b[value].mean()):
        status = UNDERPOWERED
        why = (f"; underpowered: the MDE is {d.mde / abs(b[value].mean()):.1%} of {names[1]}, the paper's "
               f"effect {paper_effect:.1%}")
    elif status == INCONCLUSIVE:
        why = "; the difference is within the seed spread"
    if paper_effect is not None and status != UNDERPOWERED:  # the MDE beside the paper's effect (underpowered
                                                              # says it already)
        paper += (f"; the paper's effect in our units {paper_effect * abs(b[value].mean()):.3g} "
                  f"({paper_effect:.1%} of {names[1]})")
    sentence = (
        f"{names[0]} {mean_sd(a[value])} vs {names[1]} {mean_sd(b[value])}: difference {d.text()}{paper}{why}"
    )
    numbers = {
        names[0]: a[value].tolist(),
        names[1]: b[value].tolist(),
        "diff": d.mean,
        "ci": [d.lo, d.hi],
        "mde": d.mde,
        "paper_effect": paper_effect,
        "paired": paired,
        "undertrained": under,
    }
    if expect != "=" and d.p is not None:  # a directional test: one of its table's family (Holm)
        numbers["p"] = d.p
    return Verdict(status, sentence, numbers)


def combine(verdicts: list[Verdict], names: list[str]) -> Verdict:
    """Several comparisons of one claim: holds if all hold, does not hold if any fails."""
    if not verdicts or all(v.status == MISSING for v in verdicts):
        return Verdict(MISSING, "no finished runs")
    statuses = [v.status for v in verdicts]
    status = (FAILS if FAILS in statuses else HOLDS if set(statuses) == {HOLDS}
              else UNDERTRAINED if UNDERTRAINED in statuses else UNDERPOWERED if UNDERPOWERED in statuses
              else INCONCLUSIVE)
    sentence = "; ".join(f"{n}: {v.status} ({v.sentence})" for n, v in zip(names, verdicts, strict=True))
    numbers = {n: v.numbers for n, v in zip(names, verdicts, strict=True)}
    ps = [v.numbers.get("p") for v in verdicts if v.status == status]
    if status in (HOLDS, FAILS) and ps and None not in ps:  # every part must hold: the largest p tests it
        numbers["p"] = max(ps)
    return Verdict(status, sentence, numbers)


def judge_all(claims: list[Claim], results, untested: dict[str, str] | None = None) -> pd.DataFrame:
    """Every claim's verdict, one row each (id, figure, claim, verdict, evidence), the directional claims
    of one table or figure (`figure`) corrected together for multiplicity (Holm). `untested`: claim id ->
    why what was run cannot test it ("not tested", not judged)."""
    untested = untested or {}
    verdicts = [Verdict(NOT_TESTED, untested[c.id]) if c.id in untested else c.judge(results) for c in claims]
    for figure in dict.fromkeys(c.figure for c in claims):
        family = [v for c, v in zip(claims, verdicts, strict=True)
                  if c.figure == figure and v.status in (HOLDS, FAILS) and "p" in v.numbers]
        for v, adjusted in zip(family, holm([v.numbers["p"] for v in family]), strict=True):
            if adjusted >= ALPHA:
                v.status = INCONCLUSIVE
                v.sentence += (f"; not significant after Holm's correction over the {len(family)} tested "
                               f"claims of {figure} (p = {v.numbers['p']:.3g}, adjusted {adjusted:.3g})")
    return pd.DataFrame([{"id": c.id, "figure": c.figure, "claim": c.claim, "verdict": v.status,
                          "evidence": v.sentence} for c, v in zip(claims, verdicts, strict=True)])
