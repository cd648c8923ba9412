"""Claims and their verdicts: each experiment states the papers' claims as `Claim`s whose judge reads the
committed results and returns a Verdict.

A verdict is "holds", "does not hold", "inconclusive", "underpowered", "under-trained", "not tested"
(what was run cannot test the claim: a long-context claim at a short context, an experiment this profile
leaves out) or "not measured", with the sentence printed beside it (made from the same numbers, so it
cannot contradict them). A difference whose 95% interval over seeds contains 0 is "inconclusive" (one
seed has no interval, so it is always inconclusive); arms that share their seeds are compared pair by
pair (engine/stats.py). A comparison that uses a run that does not beat the byte 3-gram floor of its
validation text is "under-trained": such a model has not learned what the claim is about. An inconclusive
comparison whose minimum detectable effect (at 80% power: stats.Difference.mde) is larger than the paper's
effect (relative to the reference, in the same units) is "underpowered": it could not have seen the paper's
effect; its sentence names the seeds it would need at the measured spread. "a = b" is an equivalence test
(`status_of`). Within one table or figure, the directional claims that hold or do not hold are corrected for
multiplicity (Holm): one that is not significant after it is "inconclusive".

A `Claim` of kind "check" (CHECK) is not a claim of the paper but a calibration or budget row that tells
whether the setting can test the claims (the runs past their n-gram floors, MQAR's positive control); the
report counts the checks apart from the claims.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from .floors import undertrained
from .stats import ALPHA, MAX_SEEDS, POWER, difference, holm, mean_sd

HOLDS, FAILS, INCONCLUSIVE, MISSING = "holds", "does not hold", "inconclusive", "not measured"
UNDERTRAINED, UNDERPOWERED, NOT_TESTED = "under-trained", "underpowered", "not tested"
STATUSES = (HOLDS, FAILS, INCONCLUSIVE, UNDERPOWERED, UNDERTRAINED, NOT_TESTED, MISSING)

# "a = b" holds when the whole 95% interval of the difference lies within +-margin of b's mean (an
# equivalence test: two one-sided tests at 2.5% each), the margin set a priori by the sweep
# (`equivalence_margin` in conf/sweep/<name>.yaml, a fraction of the reference) or by the claim, else
# EQUIVALENCE_MARGIN; an interval that merely contains 0 is no evidence of equality, only of too few seeds.
EQUIVALENCE_MARGIN = 0.05
CLAIM, CHECK = "claim", "check"  # Claim.kind: a claim of the paper, or a calibration / budget check


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
    kind: str = CLAIM  # CHECK: a calibration or budget row, not a claim of the paper (counted apart)


def status_of(d, expect: str, reference: float, margin: float = EQUIVALENCE_MARGIN) -> str:
    """The verdict of a Difference for "a < b" ('<'), "a > b" ('>') or "a = b" ('=', within `margin`, a
    fraction of the reference). '=' is two one-sided tests at 2.5% each, on the same 95% interval: it holds
    where the whole interval lies inside +-margin, does not hold where the whole interval lies outside it
    (beyond +margin or beyond -margin), and is inconclusive where the interval straddles an edge of it;
    whether the interval excludes 0 does not matter."""
    sign = d.sign()
    if sign is None:
        return INCONCLUSIVE
    if expect == "=":
        margin = margin * abs(reference)
        if -margin < d.lo and d.hi < margin:
            return HOLDS
        return FAILS if (d.lo > margin or d.hi < -margin) else INCONCLUSIVE
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
    margin_source: str | None = None,
) -> Verdict:
    """Judge "a < b" (expect '<'), "a > b" ('>') or "a = b" ('=') on a value over seeds: paired by seed
    where both arms ran the same seeds, else Welch. `paper_effect`: the paper's effect relative to the
    reference (a fraction of b's mean, in our units): an inconclusive result whose MDE (80% power) is larger
    is underpowered, and says how many seeds would detect the effect at the measured spread
    (Difference.seeds_to_detect). `margin`: the equivalence margin of '=' as a fraction of b's mean (default
    EQUIVALENCE_MARGIN), `margin_source` where it comes from (printed with it); an equivalence interval that
    straddles the margin is underpowered where the observed difference lies inside the margin (the sentence
    names the seeds whose interval would fit inside it: Difference.seeds_to_fit), inconclusive where not."""
    if margin is None:
        margin, margin_source = EQUIVALENCE_MARGIN, margin_source or "the default margin, EQUIVALENCE_MARGIN"
    if a.empty or b.empty:
        missing = " and ".join(n for n, d in zip(names, (a, b), strict=True) if d.empty)
        return Verdict(MISSING, f"no finished runs of {missing}")
    paired = paired_by_seed(a, b)
    if paired:
        a, b = a.sort_values("seed"), b.sort_values("seed")
    d = difference(a[value], b[value], paired=paired)
    ref = abs(b[value].mean())
    status = status_of(d, expect, b[value].mean(), margin)
    under = undertrained(pd.concat([a, b]), floors) if value == "val_ppl" else []
    seeds = "pairs of seeds" if paired else "seeds a side"
    band = (f"the equivalence margin +-{margin * ref:.3g} ({margin:.2%} of {names[1]}"
            + (f", {margin_source}" if margin_source else "") + ")")
    needed, why = None, ""
    if under:
        status, why = UNDERTRAINED, f"; {len(under)} of the runs do not beat the 3-gram floor (under-trained)"
    elif d.lo is None:
        why = "; one seed: no interval"
    elif expect == "=":
        if status == HOLDS:
            why = f"; the whole interval lies inside {band}: equivalent"
        elif status == FAILS:
            why = f"; the whole interval lies outside {band}: not equivalent"
        elif (needed := d.seeds_to_fit(margin * ref)) is not None:  # these seeds could not show equality
            status = UNDERPOWERED
            why = (f"; underpowered: the interval does not fit inside {band}; "
                   f"{needed} {seeds} would fit it inside the margin, were the observed difference the "
                   "true one")
        else:
            why = (f"; the interval straddles an edge of {band}, and the observed difference is not inside "
                   "the margin: more seeds would not show equivalence")
    elif status == INCONCLUSIVE and paper_effect is not None and d.mde > paper_effect * ref:
        status = UNDERPOWERED
        needed = d.seeds_to_detect(paper_effect * ref)
        n = f"{needed} {seeds}" if needed else f"more than {MAX_SEEDS:,} {seeds}"
        why = (f"; underpowered: the MDE at {POWER:.0%} power is {d.mde:.3f} ({d.mde / ref:.1%} of "
               f"{names[1]}), above the paper's effect {paper_effect:.1%} ({paper_effect * ref:.3g}); {n} "
               "would detect the paper's effect at this seed spread")
    elif status == INCONCLUSIVE:
        why = "; the difference is within the seed spread"
    if paper_effect is not None and status != UNDERPOWERED:  # the MDE beside the paper's effect (underpowered
                                                              # says it already)
        mde = "" if d.mde is None else f", against our MDE {d.mde:.3f} at {POWER:.0%} power"
        paper += (f"; the paper's effect in our units {paper_effect * ref:.3g} "
                  f"({paper_effect:.1%} of {names[1]}){mde}")
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
    if expect == "=":
        numbers["margin"] = margin
    if needed is not None:
        numbers["seeds_needed"] = needed
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
    """Every claim's verdict, one row each (id, figure, kind, claim, verdict, evidence), the directional
    claims of one table or figure (`figure`) corrected together for multiplicity (Holm; checks are not in
    the family). `untested`: claim id -> why what was run cannot test it ("not tested", not judged)."""
    untested = untested or {}
    verdicts = [Verdict(NOT_TESTED, untested[c.id]) if c.id in untested else c.judge(results) for c in claims]
    for figure in dict.fromkeys(c.figure for c in claims):
        family = [v for c, v in zip(claims, verdicts, strict=True)
                  if c.figure == figure and c.kind != CHECK and v.status in (HOLDS, FAILS)
                  and "p" in v.numbers]
        for v, adjusted in zip(family, holm([v.numbers["p"] for v in family]), strict=True):
            if adjusted >= ALPHA:
                v.status = INCONCLUSIVE
                v.sentence += (f"; not significant after Holm's correction over the {len(family)} tested "
                               f"claims of {figure} (p = {v.numbers['p']:.3g}, adjusted {adjusted:.3g})")
    return pd.DataFrame([{"id": c.id, "figure": c.figure, "kind": c.kind, "claim": c.claim,
                          "verdict": v.status, "evidence": v.sentence}
                         for c, v in zip(claims, verdicts, strict=True)])
