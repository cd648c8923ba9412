"""The papers' claims as data: one entry per claim, with the function of the results that judges it.

Every claim returns a Verdict: "holds", "does not hold", "inconclusive" or "not measured", the sentence
printed beside it (made from the same numbers, so it cannot contradict them) and the numbers it used.
A difference whose 95% interval over seeds contains 0 is "inconclusive" (one seed has no interval, so it
is always inconclusive); a comparison that uses a run that does not beat the byte-bigram floor of its
validation text is "inconclusive" too: such a model has not learned what the claim is about. The
report (reproduce.py), the README and the tests read this one table.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .stats import difference, mean_sd, spearman

HOLDS, FAILS, INCONCLUSIVE, MISSING = "holds", "does not hold", "inconclusive", "not measured"


@dataclass
class Results:
    """What the claims are judged on: sweep registries (one row per run and seed) and measurements."""

    table1: pd.DataFrame | None = None
    minibatch: pd.DataFrame | None = None
    scaling: pd.DataFrame | None = None
    timing: pd.DataFrame | None = None  # Figure 8 right: mini_batch, total_ms, w_ms
    inner_loss: pd.DataFrame | None = None  # seed, layer, position, w0, prev, now
    token_index: pd.DataFrame | None = None  # run, token_index, loss
    latency: pd.DataFrame | None = None  # `ttt-bench bench models`: model, phase, context, latency
    floors: pd.DataFrame | None = None  # role, seq_len, floor, val_ppl
    recall: pd.DataFrame | None = None  # MQAR: method, width, pairs, seed, val_accuracy
    fact_recall: pd.DataFrame | None = None  # experiments/longrange.py: method, seed, kind, distance, loss, n
    longrange: pd.DataFrame | None = None  # the registry of the runs fact_recall measured
    mttt: dict | None = None  # MTTT: sweep name -> registry (experiments/mttt.py)
    mttt_inner: dict | None = None  # MTTT: sweep name -> config, layer, step, inner_loss
    mttt_floors: dict | None = None  # MTTT: sweep name -> floor, test_acc (%)


@dataclass
class Verdict:
    status: str
    sentence: str
    numbers: dict = field(default_factory=dict)


@dataclass
class Claim:
    id: str
    figure: str  # the section of the report it belongs to
    claim: str  # the paper's claim, one sentence
    judge: Callable[[Results], Verdict]


# ---- reading the registries ----


def finished(reg: pd.DataFrame | None) -> pd.DataFrame:
    if reg is None or reg.empty:
        return pd.DataFrame(columns=["run", "config", "seed", "val_ppl", "status"])
    df = reg[reg["status"] == "finished"].copy()
    df["val_ppl"] = pd.to_numeric(df["val_ppl"], errors="coerce")
    if "config" not in df:
        df["config"] = df["run"]
    if "seed" not in df:
        df["seed"] = 0
    return df


def select(reg: pd.DataFrame | None, **where) -> pd.DataFrame:
    df = finished(reg)
    for k, v in where.items():
        if k not in df:
            return df.iloc[:0]
        df = df[df[k].astype(str) == str(v)]
    return df.sort_values("seed")


def ngram_floor(floors: pd.DataFrame | None, role=None, seq_len=None, kind: str = "bigram") -> float | None:
    """A byte n-gram floor of a validation text (by its role) at a context: `kind` is the floor's name
    without its smoothing ("bigram", "3-gram"); where the floors do not tell texts or contexts apart (no
    such column), the lowest."""
    if floors is None or floors.empty:
        return None
    f = floors[floors["floor"].astype(str).str.split(" ").str[0] == kind]
    if "role" in f:
        f = f[f["role"] == role]
    if "seq_len" in f:
        f = f[f["seq_len"] == (int(seq_len) if pd.notna(seq_len) else None)]
    return float(f["val_ppl"].min()) if len(f) else None


def undertrained(runs: pd.DataFrame, floors: pd.DataFrame | None) -> list[str]:
    """Runs whose validation perplexity does not beat the byte-bigram floor of their corpus and context."""
    out = []
    for r in runs.itertuples():
        floor = ngram_floor(floors, getattr(r, "role", None), getattr(r, "seq_len", 0) or 0)
        if floor is not None and r.val_ppl >= floor:
            out.append(r.run)
    return out


# "a = b" holds when the whole 95% interval of the difference lies within +-EQUIVALENCE_MARGIN of b's mean
# (an equivalence test, as two one-sided tests at 2.5% each); an interval that merely contains 0 is no
# evidence of equality, only of too few seeds.
EQUIVALENCE_MARGIN = 0.05


def _status(d, expect: str, reference: float) -> str:
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
    status = _status(d, expect, b[value].mean())
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


# ---- Table 1 ----

TABLE1_STEPS = {  # the paper's differences: (our row, the row above it in our ladder, the paper's Diff.)
    "improved": ("linear_attention_improved", "linear_attention", -0.68, "<"),
    "equivalence": ("ttt_equivalence", "linear_attention_improved", 0.00, "="),
    "learnable_w0": ("learnable_w0", "ttt_equivalence", +0.04, ">"),
    "ln_residual": ("ln_residual", "inner_bias", -1.22, "<"),
    "minibatch": ("minibatch", "token_scaling", -1.70, "<"),
    "learnable_eta": ("learnable_eta", "minibatch", -0.36, "<"),
    "mamba_backbone": ("mamba_backbone", "learnable_eta", -0.90, "<"),
}


def table1_row(reg, name: str) -> pd.DataFrame:
    df = finished(reg)
    return df[df["config"].astype(str).str.split("-", n=1).str[-1] == name].sort_values("seed")


def _label(reg, name: str) -> str:
    df = table1_row(reg, name)
    return str(df["label"].iloc[0]) if len(df) and "label" in df else name


def table1_step(key: str) -> Callable[[Results], Verdict]:
    row, above, paper, expect = TABLE1_STEPS[key]

    def judge(r: Results) -> Verdict:
        a, b = table1_row(r.table1, row), table1_row(r.table1, above)
        return compare(
            a, b, (_label(r.table1, row), _label(r.table1, above)), expect, r.floors, f"; paper {paper:+.2f}"
        )

    return judge


def seed_diffs(reg, row: str, above: str) -> np.ndarray:
    """Per-seed differences between two rows (the same seed: the same data order)."""
    a = table1_row(reg, row).set_index("seed")["val_ppl"]
    b = table1_row(reg, above).set_index("seed")["val_ppl"]
    return (a - b).dropna().to_numpy()


def largest_gain(r: Results) -> Verdict:
    """Mini-batch TTT's gain is larger than every other step's of the paper's ladder."""
    gains = {k: seed_diffs(r.table1, row, above) for k, (row, above, _, _) in TABLE1_STEPS.items()}
    if any(len(v) == 0 for v in gains.values()):
        return Verdict(MISSING, "not every row of the ladder finished")
    means = {k: float(v.mean()) for k, v in gains.items()}
    best = min(means, key=means.get)
    runner = min((k for k in means if k != "minibatch"), key=means.get)
    d = difference(gains["minibatch"], gains[runner])
    status = _status(d, "<", 0.0)
    under = undertrained(finished(r.table1), r.floors)
    if under:
        status = INCONCLUSIVE
    sentence = (
        f"the largest mean gain is {best} ({means[best]:+.3f}); mini-batch TTT {means['minibatch']:+.3f} vs "
        "the "
        f"next largest other step, {runner}, {means[runner]:+.3f}: difference {d.text()}"
        + (f"; {len(under)} runs do not beat the bigram floor (under-trained)" if under else "")
    )
    return Verdict(status, sentence, {"mean_gains": means})


def ttt_linear_beats_linear_attention(r: Results) -> Verdict:
    return compare(
        table1_row(r.table1, "mamba_backbone"),
        table1_row(r.table1, "linear_attention"),
        ("TTT-Linear (M)", "Linear attention [41]"),
        "<",
        r.floors,
        "; paper 11.09 vs 15.91",
    )


# ---- Figure 8 ----


def minibatch_trend(r: Results) -> Verdict:
    """Perplexity rises with b over the whole range (b = T the largest): Spearman's rho > 0."""
    df = finished(r.minibatch)
    if df.empty:
        return Verdict(MISSING, "no finished runs")
    order = {b: i for i, b in enumerate(sorted((b for b in df["mini_batch"].unique() if b != "T"), key=int))}
    order["T"] = len(order)
    rank = df["mini_batch"].astype(str).map(order)
    rho, lo, hi = spearman(rank, df["val_ppl"])
    status = INCONCLUSIVE if lo is None else (HOLDS if lo > 0 else (FAILS if hi < 0 else INCONCLUSIVE))
    under = undertrained(df, r.floors)
    if under:
        status = INCONCLUSIVE
    ci = "no interval (fewer than 5 runs)" if lo is None else f"95% CI {lo:+.2f} to {hi:+.2f}"
    means = df.groupby("mini_batch", sort=False)["val_ppl"].mean()
    sentence = (
        f"Spearman's rho between b and perplexity over {len(df)} runs: {rho:+.2f} ({ci}); means "
        + ", ".join(f"b={b}: {means[b]:.2f}" for b in sorted(means.index, key=order.get))
        + (f"; {len(under)} runs do not beat the bigram floor (under-trained)" if under else "")
    )
    return Verdict(status, sentence, {"rho": rho, "ci": [lo, hi], "means": means.to_dict()})


def b16_beats_bT(r: Results) -> Verdict:
    return compare(
        select(r.minibatch, mini_batch="16"),
        select(r.minibatch, mini_batch="T"),
        ("b=16", "b=T"),
        "<",
        r.floors,
        "; paper 11.09 vs 12.6",
    )


def dual_form_time(r: Results) -> Verdict:
    """Forward time in dual form falls from b = 1 to b = 16 (more parallel W's), and rises again at b = T
    (the z's, O(T b d)). One timing run: a change under 20% is called inconclusive (machine noise)."""
    t = r.timing
    if t is None or t.empty:
        return Verdict(MISSING, "no timing")
    total = dict(zip(t["mini_batch"].astype(int), t["total_ms"], strict=True))
    T = max(total)
    if 1 not in total or 16 not in total:
        return Verdict(MISSING, "b = 1 or b = 16 not timed")
    fall, rise = total[1] / total[16], total[T] / min(total.values())
    status = HOLDS if fall > 1.2 and rise > 1.2 else (FAILS if fall < 1 / 1.2 or rise < 1.0 else INCONCLUSIVE)
    sentence = (
        f"b=1 takes {fall:.1f}x the time of b=16 ({total[1]:.1f} vs {total[16]:.1f} ms), and b=T {rise:.1f}x "
        "the "
        f"fastest b ({total[T]:.1f} vs {min(total.values()):.1f} ms); a margin of 20% is required"
    )
    return Verdict(status, sentence, {"b1_over_b16": fall, "bT_over_best": rise})


# ---- Figures 5/17 ----


def _quarters(df: pd.DataFrame) -> pd.DataFrame:
    """Per seed and quarter of the positions: the mean inner losses."""
    q = pd.qcut(df["position"], 4, labels=["1st", "2nd", "3rd", "4th"])
    return df.assign(quarter=q).groupby(["seed", "quarter"], observed=True)[["w0", "prev", "now"]].mean()


def gd_step_lowers_loss(r: Results) -> Verdict:
    if r.inner_loss is None or r.inner_loss.empty:
        return Verdict(MISSING, "no inner losses")
    q = _quarters(r.inner_loss)
    parts = []
    for _, g in q.groupby(level="quarter", observed=True):
        parts.append(
            compare(
                g.assign(v=g["now"]),
                g.assign(v=g["prev"]),
                ("l(W_t; x_t)", "l(W_t-1; x_t)"),
                "<",
                None,
                value="v",
            )
        )
    return combine(parts, [f"{x} quarter of positions" for x in q.index.get_level_values("quarter").unique()])


def gap_grows_with_t(r: Results) -> Verdict:
    """The relative improvement 1 - l(W_t)/l(W_0) is larger in the last quarter of positions than in the
    first (relative, so that a drift of l(W_0) alone does not make it grow)."""
    if r.inner_loss is None or r.inner_loss.empty:
        return Verdict(MISSING, "no inner losses")
    q = _quarters(r.inner_loss)
    gain = (1 - q["now"] / q["w0"]).unstack("quarter")
    return compare(
        pd.DataFrame({"v": gain["4th"]}),
        pd.DataFrame({"v": gain["1st"]}),
        ("relative gain, last quarter", "first quarter"),
        ">",
        None,
        value="v",
    )


# ---- Figures 11-14, 18 ----


def unmatched(df: pd.DataFrame) -> pd.DataFrame:
    """The runs of the scaling grid: not the matched-FLOPs runs added beside it, nor what they start from
    (configs named `...-matched`). A profile with `matched_in_grid` trains its matched runs as the grid
    points themselves (named as the grid's)."""
    return df[~df["config"].astype(str).str.endswith("-matched")]


def _longest_books(r: Results) -> tuple[str | None, int | None]:
    df = finished(r.scaling)
    if df.empty or "role" not in df:
        return None, None
    df = unmatched(df)
    df = df[df["role"] == "books"]
    if df.empty:
        return None, None
    return str(df["size"].iloc[-1]), int(pd.to_numeric(df["seq_len"]).max())


def beats_mamba_at_long_context(method: str, label: str) -> Callable[[Results], Verdict]:
    def judge(r: Results) -> Verdict:
        size, T = _longest_books(r)
        if size is None:
            return Verdict(MISSING, "no finished Books runs")
        a = select(r.scaling, role="books", method=method, size=size, seq_len=T)
        b = select(r.scaling, role="books", method="mamba", size=size, seq_len=T)
        a, b = (d[d["config"].astype(str).str.endswith(f"T{T}")] for d in (a, b))
        v = compare(a, b, (label, "Mamba"), "<", r.floors)
        v.sentence = f"size {size}, context {T}: {v.sentence}"
        return v

    return judge


def finetune_beats_pretrain(r: Results) -> Verdict:
    df = finished(r.scaling)
    if "method" not in df:
        return Verdict(MISSING, "no finished runs")
    pairs = unmatched(df)
    pairs = pairs[pairs["method"] == "tf_finetune"]
    verdicts, names = [], []
    for (size, T), _ in pairs.groupby(["size", "seq_len"]):
        ft = select(r.scaling, method="tf_finetune", size=size, seq_len=T)
        pre = select(r.scaling, method="transformer", role="books", size=size, seq_len=T)
        ft, pre = (d[d["config"].astype(str).str.endswith(f"T{T}")] for d in (ft, pre))
        verdicts.append(compare(ft, pre, ("TF finetune", "TF pretrain"), "<", r.floors))
        names.append(f"size {size}, context {T}")
    return combine(verdicts, names)


def keeps_improving_late(r: Results) -> Verdict:
    """Figure 14 at matched FLOPs: over the second half of the token indices, TTT-Linear's loss falls faster
    with log(index) than Mamba's (a more negative least-squares slope), per seed."""
    df, ti = finished(r.scaling), r.token_index
    if ti is None or ti.empty or "matched" not in df:
        return Verdict(MISSING, "no matched-FLOPs token-index curves")

    def slopes(method):
        runs = df[(df["method"] == method) & (df["matched"].notna() | df["config"].isin(df["reference"]))]
        if "reference" in df:
            T = pd.to_numeric(df.loc[df["matched"].notna(), "seq_len"]).max()
            runs = runs[pd.to_numeric(runs["seq_len"]) == T]
        out = []
        for run in runs["run"]:
            c = ti[ti["run"] == run]
            c = c[c["token_index"] > c["token_index"].max() / 2]
            if len(c) > 2:
                out.append(np.polyfit(np.log(c["token_index"] + 1), c["loss"], 1)[0])
        return pd.DataFrame({"v": out})

    return compare(
        slopes("ttt_linear_m"),
        slopes("mamba"),
        ("TTT-Linear (M) late slope", "Mamba late slope"),
        "<",
        None,
        value="v",
    )


# ---- Figures 3/15 ----


def prefill_faster_from_8k(r: Results) -> Verdict:
    """One benchmark run (best of its repeats): a ratio within 10% of 1 is called inconclusive."""
    b = r.latency
    if b is None or b.empty:
        return Verdict(MISSING, "no latency benchmark")
    lat = b[b["phase"] == "prefill"].pivot_table(
        index="context", columns="model", values="latency_ms_per_token"
    )
    if not {"ttt_linear", "transformer"} <= set(lat.columns) or lat.index.max() < 8192:
        return Verdict(MISSING, "TTT-Linear and Transformer prefill at >= 8k not measured")
    ratio = (lat["ttt_linear"] / lat["transformer"])[lat.index >= 8192]
    status = HOLDS if (ratio < 0.9).all() else (FAILS if (ratio > 1.1).any() else INCONCLUSIVE)
    sentence = (
        "TTT-Linear / Transformer prefill latency per token: "
        + ", ".join(f"{c // 1024}k {v:.2f}x" for c, v in ratio.items())
        + " (one run; within 10% of 1 is inconclusive)"
    )
    return Verdict(status, sentence, {"ratio": ratio.to_dict()})


# ---- recall (MQAR) ----

CALIBRATED = 0.99  # the Transformer's accuracy at the easiest setting that says the recipe works


def recall_calibration(r: Results) -> Verdict:
    """The Transformer recalls (near) perfectly at the easiest setting (fewest pairs, largest width): if it
    does not, the training recipe is wrong, and the recall comparisons say nothing about the models."""
    df = finished(r.recall)
    tf = df[df.get("method", pd.Series(dtype=str)) == "transformer"] if not df.empty else df
    if tf.empty:
        return Verdict(MISSING, "no finished Transformer recall runs")
    easy = tf[(tf["pairs"] == tf["pairs"].min())]
    easy = easy[easy["width"] == easy["width"].max()]
    acc = pd.to_numeric(easy["val_accuracy"])
    ok = bool((acc >= CALIBRATED).all())
    sentence = (
        f"Transformer at {int(easy['pairs'].iloc[0])} pairs, width {int(easy['width'].iloc[0])}: "
        f"answer accuracy {mean_sd(acc)} ({'all' if ok else 'not all'} seeds >= {CALIBRATED})"
    )
    return Verdict(HOLDS if ok else FAILS, sentence, {"accuracy": acc.tolist()})


def recall_beats(a: str, b: str) -> Callable[[Results], Verdict]:
    """Method a recalls more than method b at the largest number of pairs, at every width (accuracy over
    seeds); inconclusive while the calibration does not hold."""

    def judge(r: Results) -> Verdict:
        df = finished(r.recall)
        if df.empty or "method" not in df:
            return Verdict(MISSING, "no finished recall runs")
        df["val_accuracy"] = pd.to_numeric(df["val_accuracy"], errors="coerce")
        hard = df[df["pairs"] == df["pairs"].max()]
        label = lambda m: str(df.loc[df["method"] == m, "label"].iloc[0]) if (df["method"] == m).any() else m
        widths = sorted(hard["width"].unique())
        verdicts = [
            compare(
                hard[(hard["method"] == a) & (hard["width"] == w)],
                hard[(hard["method"] == b) & (hard["width"] == w)],
                (label(a), label(b)),
                ">",
                None,
                value="val_accuracy",
            )
            for w in widths
        ]
        v = combine(verdicts, [f"{int(hard['pairs'].iloc[0])} pairs, width {int(w)}" for w in widths])
        calibration = recall_calibration(r)
        if v.status != MISSING and calibration.status != HOLDS:
            v = Verdict(
                INCONCLUSIVE,
                f"the calibration does not hold ({calibration.sentence}); {v.sentence}",
                v.numbers,
            )
        return v

    return judge


# ---- long range (synthetic facts) ----

FAR = 1024  # bytes back to the first mention from which a fact counts as far


def far_fact_loss(df: pd.DataFrame | None) -> pd.DataFrame:
    """Per run: the loss on restated digits whose first mention is >= FAR bytes back and inside the window
    (weighted by count), with the run's method, label and seed."""
    from .longrange import bin_order

    if df is None or df.empty:
        return pd.DataFrame(columns=["method", "label", "seed", "loss"])
    far = df[(df["kind"] == "restated") & df["in_context"].astype(bool)]
    far = far[far["distance"].map(bin_order) >= FAR]
    total = far.assign(w=far["loss"] * far["n"]).groupby(["method", "label", "seed"])[["w", "n"]].sum()
    return (total["w"] / total["n"]).rename("loss").reset_index()


def recalls_far_facts_better(a: str, b: str) -> Callable[[Results], Verdict]:
    def judge(r: Results) -> Verdict:
        df = far_fact_loss(r.fact_recall)
        if df.empty:
            return Verdict(MISSING, "no fact-recall measurements")
        label = lambda m: str(df.loc[df["method"] == m, "label"].iloc[0]) if (df["method"] == m).any() else m
        from .longrange import RANDOM_DIGIT

        pair = df[df["method"].isin([a, b])]
        v = compare(pair[pair["method"] == a], pair[pair["method"] == b], (label(a), label(b)), "<", None,
                    value="loss")
        status, sentence = v.status, f"loss on facts >= {FAR} bytes back: {v.sentence}"
        if v.status != MISSING and (pair["loss"] >= RANDOM_DIGIT - 0.1).all():  # a floor, as the bigram's
            status = INCONCLUSIVE
            sentence += (f"; neither is below chance (a random digit: ln 10 = {RANDOM_DIGIT:.2f}): neither "
                         "model learned to recall facts at this budget")
        runs = finished(r.longrange)
        under = undertrained(runs[runs["method"].isin([a, b])], r.floors) if "method" in runs else []
        if v.status != MISSING and under:
            status = INCONCLUSIVE
            sentence += f"; {len(under)} of the runs do not beat the bigram floor of the text (under-trained)"
        return Verdict(status, sentence, v.numbers)

    return judge


# ---- budgets: a model that has not learned a text's n-gram statistics says nothing about the claims ----

HEADLINE_FLOOR = "3-gram"  # the smoothed n-gram floor the headline comparisons must beat


def headline_runs(r: Results) -> pd.DataFrame:
    """The runs of the headline comparisons: Table 1's last ladder row and its reference rows (configs
    without a row number), and every method at the scaling grid's largest size and longest Books context."""
    t1 = finished(r.table1)
    row = t1["config"].astype(str).str.split("-", n=1).str[0]
    numbered = row.str.isdigit()
    last = row[numbered].astype(int).max() if numbered.any() else None
    t1 = t1[~numbered | (row == str(last))]
    size, T = _longest_books(r)
    if size is None:
        return t1
    sc = unmatched(finished(r.scaling))
    sc = sc[(sc["role"] == "books") & (sc["size"].astype(str) == size) & (pd.to_numeric(sc["seq_len"]) == T)]
    return pd.concat([t1, sc], ignore_index=True)


def trained_past_floors(r: Results) -> Verdict:
    """Every run of Table 1, Figure 8 and the scaling grid beats its text's bigram floor, and every run of
    the headline comparisons the 3-gram floor (each run, each seed)."""
    runs = pd.concat([finished(x) for x in (r.table1, r.minibatch, r.scaling)], ignore_index=True)
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


CLAIMS = [
    Claim(
        "budgets",
        "Budgets",
        "Calibration (not a claim of the paper): every model of Table 1, Figure 8 and the scaling grid is "
        "past the bigram floor, and the headline comparisons past the 3-gram floor.",
        trained_past_floors,
    ),
    Claim(
        "table1.improved",
        "Table 1",
        "Linear attention without the feature map and normalizer (improved) has "
        "lower perplexity than Katharopoulos et al.'s.",
        table1_step("improved"),
    ),
    Claim(
        "table1.equivalence",
        "Table 1",
        "The TTT layer of Theorem 1 is the improved linear attention: the same perplexity.",
        table1_step("equivalence"),
    ),
    Claim(
        "table1.learnable_w0",
        "Table 1",
        "A learnable W_0 hurts slightly (+0.04).",
        table1_step("learnable_w0"),
    ),
    Claim(
        "table1.ln_residual",
        "Table 1",
        "LN and residual in f lower perplexity (-1.22).",
        table1_step("ln_residual"),
    ),
    Claim(
        "table1.minibatch",
        "Table 1",
        "Mini-batch TTT (b = T -> 16) lowers perplexity (-1.70).",
        table1_step("minibatch"),
    ),
    Claim(
        "table1.learnable_eta",
        "Table 1",
        "A learnable inner learning rate lowers perplexity (-0.36).",
        table1_step("learnable_eta"),
    ),
    Claim(
        "table1.mamba_backbone",
        "Table 1",
        "The Mamba backbone lowers perplexity (-0.90).",
        table1_step("mamba_backbone"),
    ),
    Claim(
        "table1.largest_gain",
        "Table 1",
        "Mini-batch TTT is the largest improvement of the ladder.",
        largest_gain,
    ),
    Claim(
        "table1.end_to_end",
        "Table 1",
        "TTT-Linear (M) ends well below linear attention (11.09 vs 15.91).",
        ttt_linear_beats_linear_attention,
    ),
    Claim(
        "fig8.trend",
        "Figure 8",
        "Smaller TTT mini-batches give lower perplexity, over the whole range of b.",
        minibatch_trend,
    ),
    Claim("fig8.b16", "Figure 8", "b = 16 is clearly better than b = T (batch GD).", b16_beats_bT),
    Claim(
        "fig8.time",
        "Figure 8",
        "Dual-form forward time falls from b = 1 to b = 16 and rises again at b = T.",
        dual_form_time,
    ),
    Claim(
        "fig17.step",
        "Figures 5/17",
        "One inner GD step lowers the TTT loss: l(W_t; x_t) < l(W_t-1; x_t), at every range of positions.",
        gd_step_lowers_loss,
    ),
    Claim(
        "fig17.growth",
        "Figures 5/17",
        "l(W_t; x_t) improves further from l(W_0; x_t) as t grows.",
        gap_grows_with_t,
    ),
    Claim(
        "scaling.ttt_linear",
        "Figures 11-14, 18",
        "At long context TTT-Linear (M) has lower perplexity than Mamba.",
        beats_mamba_at_long_context("ttt_linear_m", "TTT-Linear (M)"),
    ),
    Claim(
        "scaling.ttt_mlp",
        "Figures 11-14, 18",
        "At long context TTT-MLP (M) has lower perplexity than Mamba.",
        beats_mamba_at_long_context("ttt_mlp_m", "TTT-MLP (M)"),
    ),
    Claim(
        "scaling.finetune",
        "Figures 11-14, 18",
        "TF finetune beats TF pretrain at every long context.",
        finetune_beats_pretrain,
    ),
    Claim(
        "scaling.late_tokens",
        "Figures 11-14, 18",
        "At matched training FLOPs TTT-Linear keeps lowering its "
        "loss late in the context while Mamba plateaus.",
        keeps_improving_late,
    ),
    Claim(
        "latency.prefill",
        "Figures 3/15",
        "TTT-Linear's prefill is faster per token than the Transformer's from 8k context.",
        prefill_faster_from_8k,
    ),
    Claim(
        "recall.calibration",
        "Recall (MQAR)",
        "Calibration (not a claim of the paper): the Transformer recalls near-perfectly at the easiest "
        "setting.",
        recall_calibration,
    ),
    Claim(
        "recall.ttt_linear_mamba",
        "Recall (MQAR)",
        "A hidden state that is a model trained at test time (TTT-Linear) recalls more than Mamba's.",
        recall_beats("ttt_linear", "mamba"),
    ),
    Claim(
        "recall.ttt_mlp_linear",
        "Recall (MQAR)",
        "TTT-MLP's more expressive hidden state recalls more than TTT-Linear's.",
        recall_beats("ttt_mlp", "ttt_linear"),
    ),
    Claim(
        "recall.ttt_linear_attention",
        "Recall (MQAR)",
        "TTT-Linear recalls more than linear attention (the same state size, Theorem 1's starting point).",
        recall_beats("ttt_linear", "linear_attention_improved"),
    ),
    Claim(
        "longrange.ttt_linear",
        "Long range (synthetic facts)",
        "TTT-Linear (M) uses facts far back in its context better than Mamba (lower loss on them).",
        recalls_far_facts_better("ttt_linear_m", "mamba"),
    ),
    Claim(
        "longrange.ttt_mlp",
        "Long range (synthetic facts)",
        "TTT-MLP (M) uses facts far back in its context better than Mamba (lower loss on them).",
        recalls_far_facts_better("ttt_mlp_m", "mamba"),
    ),
]


# MTTT, the predecessor paper (experiments/mttt.py, docs/mttt.md)
from .mttt import mttt_claims  # noqa: E402

CLAIMS += mttt_claims(Claim)


def judge_all(results: Results) -> pd.DataFrame:
    """Every claim's verdict, one row each (id, figure, claim, verdict, evidence)."""
    rows = []
    for c in CLAIMS:
        v = c.judge(results)
        rows.append(
            {"id": c.id, "figure": c.figure, "claim": c.claim, "verdict": v.status, "evidence": v.sentence}
        )
    return pd.DataFrame(rows)
