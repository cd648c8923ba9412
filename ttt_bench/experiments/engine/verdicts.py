"""Claims and their verdicts: each experiment states the papers' claims as `Claim`s whose judge reads the
committed results and returns a Verdict.

A verdict is "holds", "does not hold", "inconclusive" or "not measured", with the sentence printed beside
it (made from the same numbers, so it cannot contradict them). A difference whose 95% interval over seeds
contains 0 is "inconclusive" (one seed has no interval, so it is always inconclusive); a comparison that
uses a run that does not beat the byte-bigram floor of its validation text is "inconclusive" too: such a
model has not learned what the claim is about.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from .floors import undertrained
from .stats import difference, mean_sd

HOLDS, FAILS, INCONCLUSIVE, MISSING = "holds", "does not hold", "inconclusive", "not measured"

# "a = b" holds when the whole 95% interval of the difference lies within +-EQUIVALENCE_MARGIN of b's mean
# (an equivalence test, as two one-sided tests at 2.5% each); an interval that merely contains 0 is no
# evidence of equality, only of too few seeds.
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


def status_of(d, expect: str, reference: float) -> str:
    """The verdict of a Difference for "a < b" ('<'), "a > b" ('>') or "a = b" ('=', within the margin)."""
    sign = d.sign()
    if sign is None:
        return INCONCLUSIVE
    if expect == "=":
        margin = EQUIVALENCE_MARGIN * abs(reference)
        return FAILS if sign != 0 else (HOLDS if -margin <= d.lo and d.hi <= margin else INCONCLUSIVE)
    want = -1 if expect == "<" else 1
    return HOLDS if sign == want else (INCONCLUSIVE if sign == 0 else FAILS)


def compare(
    a: pd.DataFrame,
    b: pd.DataFrame,
    names: tuple[str, str],
    expect: str,
    floors,
    paper: str = "",
    value: str = "val_ppl",
) -> Verdict:
    """Judge "a < b" (expect '<'), "a > b" ('>') or "a = b" ('=') on a value over seeds."""
    if a.empty or b.empty:
        missing = " and ".join(n for n, d in zip(names, (a, b), strict=True) if d.empty)
        return Verdict(MISSING, f"no finished runs of {missing}")
    d = difference(a[value], b[value])
    status = status_of(d, expect, b[value].mean())
    under = undertrained(pd.concat([a, b]), floors) if value == "val_ppl" else []
    why = ""
    if under:
        status, why = INCONCLUSIVE, f"; {len(under)} of the runs do not beat the bigram floor (under-trained)"
    elif d.lo is None:
        why = "; one seed: no interval"
    elif status == INCONCLUSIVE and expect == "=":
        margin = EQUIVALENCE_MARGIN * abs(b[value].mean())
        why = (f"; no difference shown, but the interval is wider than the equivalence margin +-{margin:.3g} "
               f"({EQUIVALENCE_MARGIN:.0%} of {names[1]})")
    elif status == HOLDS and expect == "=":
        why = f"; within the equivalence margin +-{EQUIVALENCE_MARGIN * abs(b[value].mean()):.3g}"
    elif status == INCONCLUSIVE:
        why = "; the difference is within the seed spread"
    sentence = (
        f"{names[0]} {mean_sd(a[value])} vs {names[1]} {mean_sd(b[value])}: difference {d.text()}{paper}{why}"
    )
    numbers = {
        names[0]: a[value].tolist(),
        names[1]: b[value].tolist(),
        "diff": d.mean,
        "ci": [d.lo, d.hi],
        "undertrained": under,
    }
    return Verdict(status, sentence, numbers)


def combine(verdicts: list[Verdict], names: list[str]) -> Verdict:
    """Several comparisons of one claim: holds if all hold, does not hold if any fails."""
    if not verdicts or all(v.status == MISSING for v in verdicts):
        return Verdict(MISSING, "no finished runs")
    statuses = [v.status for v in verdicts]
    status = FAILS if FAILS in statuses else (HOLDS if set(statuses) == {HOLDS} else INCONCLUSIVE)
    sentence = "; ".join(f"{n}: {v.status} ({v.sentence})" for n, v in zip(names, verdicts, strict=True))
    return Verdict(status, sentence, {n: v.numbers for n, v in zip(names, verdicts, strict=True)})


def judge_all(claims: list[Claim], results) -> pd.DataFrame:
    """Every claim's verdict, one row each (id, figure, claim, verdict, evidence)."""
    rows = []
    for c in claims:
        v = c.judge(results)
        rows.append(
            {"id": c.id, "figure": c.figure, "claim": c.claim, "verdict": v.status, "evidence": v.sentence}
        )
    return pd.DataFrame(rows)
