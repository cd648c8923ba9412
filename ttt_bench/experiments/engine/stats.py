"""The statistics behind every verdict, from well-kept libraries: the 95% interval of a difference of seed
means (scipy.stats: the paired t interval where the two arms share seeds, and so their data order and
initialisation draws; Welch's where they do not), Page's test of an ordered trend over levels with seeds as
blocks (scipy.stats.page_trend_test), and Holm's correction across the claims of one table or figure
(statsmodels).

A difference's minimum detectable effect (`Difference.mde`) is the effect a two-sided test at ALPHA would
detect with POWER (80%) at this number of seeds and the measured seed spread: (t_{1-ALPHA/2, df} + t_{POWER,
df}) standard errors of the difference (the interval's half-width alone, t_{1-ALPHA/2} standard errors, is
the effect detected half the time). `Difference.seeds_to_detect` turns that around: the seeds a side a
claim would need to detect a given effect, at the same spread.
"""

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats
from statsmodels.stats.multitest import multipletests

ALPHA = 0.05
POWER = 0.8  # the power the minimum detectable effect is stated at
MAX_SEEDS = 100_000  # seeds_to_detect gives up beyond this


@dataclass
class Difference:
    """mean(a) - mean(b) with its 95% interval and p-value; lo/hi/p are None with fewer than 2 seeds a side
    (2 pairs when paired). `sd_a`, `sd_b`: each arm's seed standard deviation; `sd_d`: that of the per-seed
    differences (paired); they give the standard error at any number of seeds (`se_at`)."""

    mean: float
    lo: float | None
    hi: float | None
    n_a: int
    n_b: int
    paired: bool = False
    p: float | None = None
    sd_a: float | None = None
    sd_b: float | None = None
    sd_d: float | None = None

    def se_at(self, n_a: int, n_b: int | None = None) -> tuple[float, float] | None:
        """(standard error, degrees of freedom) of the difference with n_a and n_b seeds (n_b: n_a) at the
        measured spread: paired, sd_d / sqrt(n) on n - 1; Welch, sqrt(sd_a^2 / n_a + sd_b^2 / n_b) on
        Welch-Satterthwaite's df. None without a spread (one seed)."""
        n_b = n_a if n_b is None else n_b
        if self.paired:
            if self.sd_d is None:
                return None
            return self.sd_d / math.sqrt(n_a), float(n_a - 1)
        if self.sd_a is None or self.sd_b is None:
            return None
        va, vb = self.sd_a**2 / n_a, self.sd_b**2 / n_b
        if va + vb == 0:
            return 0.0, float(n_a + n_b - 2)
        df = (va + vb) ** 2 / (va**2 / (n_a - 1) + vb**2 / (n_b - 1))
        return math.sqrt(va + vb), df

    @staticmethod
    def _mde(se: float, df: float) -> float:
        return (stats.t.ppf(1 - ALPHA / 2, df) + stats.t.ppf(POWER, df)) * se

    @property
    def mde(self) -> float | None:
        """The minimum detectable effect at POWER: (t_{1-ALPHA/2, df} + t_{POWER, df}) standard errors."""
        se = None if self.lo is None else self.se_at(self.n_a, self.n_b)
        return None if se is None else self._mde(*se)

    def seeds_to_detect(self, effect: float) -> int | None:
        """The fewest seeds a side (pairs when paired) whose MDE at the measured spread is at most `effect`
        (> 0): the n with (t_{.975, df(n)} + t_{.8, df(n)}) se(n) <= effect. None without a spread or beyond
        MAX_SEEDS."""
        return self._fewest(lambda se, df: self._mde(se, df) <= effect) if effect > 0 else None

    def seeds_to_fit(self, margin: float) -> int | None:
        """For an equivalence margin: the fewest seeds a side whose 95% interval, centred on the observed
        difference (were it the true one), lies inside +-margin: |mean| + t_{.975, df(n)} se(n) <= margin.
        None where the observed difference is not inside the margin (no number of seeds would show
        equivalence), without a spread, or beyond MAX_SEEDS."""
        room = margin - abs(self.mean)
        return self._fewest(lambda se, df: stats.t.ppf(1 - ALPHA / 2, df) * se <= room) if room > 0 else None

    def _fewest(self, enough) -> int | None:
        if self.se_at(2) is None:
            return None
        ok = lambda n: enough(*self.se_at(n))
        hi = 2
        while not ok(hi):  # doubling, then bisection: the standard error falls with n
            hi *= 2
            if hi > MAX_SEEDS:
                return None
        lo = max(2, hi // 2)
        if ok(lo):
            return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        return hi

    def sign(self) -> int | None:
        """-1 or +1 where the interval excludes 0, 0 where it contains 0, None without an interval."""
        if self.lo is None:
            return None
        return -1 if self.hi < 0 else (1 if self.lo > 0 else 0)

    def text(self) -> str:
        n = f"paired by seed, n = {self.n_a}" if self.paired else f"Welch, n = {self.n_a} vs {self.n_b}"
        if self.lo is None:
            return f"{self.mean:+.3f} (no interval: one seed; {n})"
        return (f"{self.mean:+.3f} (95% CI {self.lo:+.3f} to {self.hi:+.3f}, MDE {self.mde:.3f} at "
                f"{POWER:.0%} power; {n})")


def difference(a, b, paired: bool = False) -> Difference:
    """The difference of means of two samples; `paired`: a[i] and b[i] share a seed (equal lengths)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    mean = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2:
        return Difference(mean, None, None, len(a), len(b), paired)
    sds = {"sd_a": float(np.std(a, ddof=1)), "sd_b": float(np.std(b, ddof=1)),
           "sd_d": float(np.std(a - b, ddof=1)) if paired else None}
    spread = sds["sd_d"] if paired else math.hypot(sds["sd_a"], sds["sd_b"])
    if spread == 0:  # no seed spread at all: the difference is exact
        return Difference(mean, mean, mean, len(a), len(b), paired, 0.0 if mean else 1.0, **sds)
    test = stats.ttest_rel(a, b) if paired else stats.ttest_ind(a, b, equal_var=False)
    ci = test.confidence_interval(1 - ALPHA)
    return Difference(mean, float(ci.low), float(ci.high), len(a), len(b), paired, float(test.pvalue), **sds)


@dataclass
class Trend:
    """An ordered trend over levels, seeds as blocks: `rho` the mean over seeds of Spearman's rho between
    the level's rank and the value; `p_up` / `p_down` Page's one-sided p-values of a rising / falling trend
    (None with fewer than 2 seeds that ran every level)."""

    rho: float
    p_up: float | None
    p_down: float | None
    seeds: int

    def sign(self) -> int | None:
        """+1 rising, -1 falling (at ALPHA), 0 neither, None untested."""
        if self.p_up is None:
            return None
        return 1 if self.p_up < ALPHA else (-1 if self.p_down < ALPHA else 0)


def trend(table: np.ndarray) -> Trend:
    """Page's L test on `table` (a row per seed, a column per level in the predicted order): does the value
    rise with the level within seeds? Seeds are blocks, so a seed's own offset (its data order and
    initialisation) does not hide an ordering every seed shows."""
    table = np.asarray(table, float)
    rhos = [stats.spearmanr(np.arange(table.shape[1]), row).statistic for row in table if np.ptp(row) > 0]
    rho = float(np.mean(rhos)) if rhos else float("nan")
    if table.shape[0] < 2 or table.shape[1] < 3:
        return Trend(rho, None, None, table.shape[0])
    up = stats.page_trend_test(table).pvalue
    down = stats.page_trend_test(table[:, ::-1]).pvalue
    return Trend(rho, float(up), float(down), table.shape[0])


def holm(pvalues: list[float]) -> list[float]:
    """Holm-adjusted p-values of one family of tests (the claims of one table or figure)."""
    return list(multipletests(pvalues, alpha=ALPHA, method="holm")[1]) if pvalues else []


def mean_sd(v) -> str:
    v = np.asarray(v, float)
    return f"{v.mean():.2f}" if len(v) < 2 else f"{v.mean():.2f} +- {v.std(ddof=1):.2f}"
