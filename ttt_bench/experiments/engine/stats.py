"""The statistics behind every verdict, from well-kept libraries: the 95% interval of a difference of seed
means (scipy.stats: the paired t interval where the two arms share seeds, and so their data order and
initialisation draws; Welch's where they do not), Page's test of an ordered trend over levels with seeds as
blocks (scipy.stats.page_trend_test), and Holm's correction across the claims of one table or figure
(statsmodels).

A difference's minimum detectable effect (`Difference.mde`) is its interval's half-width: an effect smaller
than that cannot be told from the seed spread at this number of seeds.
"""

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats
from statsmodels.stats.multitest import multipletests

ALPHA = 0.05


@dataclass
class Difference:
    """mean(a) - mean(b) with its 95% interval and p-value; lo/hi/p are None with fewer than 2 seeds a side
    (2 pairs when paired)."""

    mean: float
    lo: float | None
    hi: float | None
    n_a: int
    n_b: int
    paired: bool = False
    p: float | None = None

    @property
    def mde(self) -> float | None:
        return None if self.lo is None else (self.hi - self.lo) / 2

    def sign(self) -> int | None:
        """-1 or +1 where the interval excludes 0, 0 where it contains 0, None without an interval."""
        if self.lo is None:
            return None
        return -1 if self.hi < 0 else (1 if self.lo > 0 else 0)

    def text(self) -> str:
        n = f"paired by seed, n = {self.n_a}" if self.paired else f"Welch, n = {self.n_a} vs {self.n_b}"
        if self.lo is None:
            return f"{self.mean:+.3f} (no interval: one seed; {n})"
        return f"{self.mean:+.3f} (95% CI {self.lo:+.3f} to {self.hi:+.3f}, MDE {self.mde:.3f}; {n})"


def difference(a, b, paired: bool = False) -> Difference:
    """The difference of means of two samples; `paired`: a[i] and b[i] share a seed (equal lengths)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    mean = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2:
        return Difference(mean, None, None, len(a), len(b), paired)
    spread = np.std(a - b) if paired else math.hypot(np.std(a), np.std(b))
    if spread == 0:  # no seed spread at all: the difference is exact
        return Difference(mean, mean, mean, len(a), len(b), paired, 0.0 if mean else 1.0)
    test = stats.ttest_rel(a, b) if paired else stats.ttest_ind(a, b, equal_var=False)
    ci = test.confidence_interval(1 - ALPHA)
    return Difference(mean, float(ci.low), float(ci.high), len(a), len(b), paired, float(test.pvalue))


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
