"""The statistics behind every verdict: seed means, Welch intervals for differences, rank correlations.

No SciPy: Student's t quantiles come from a table (two-sided 95%, df rounded down, so intervals are at
least as wide as exact ones), and a rank correlation's interval uses Fisher's z with the Fieller et al.
(1957) standard error for Spearman's rho, 1.06 / sqrt(n - 3).
"""

import math
from dataclasses import dataclass

import numpy as np

# two-sided 95% quantiles of Student's t for df = 1..30; beyond, the normal 1.96
T975 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]


def t975(df: float) -> float:
    return T975[min(int(math.floor(df)), 30) - 1] if df < 31 else 1.96


@dataclass
class Difference:
    """mean(a) - mean(b) with its 95% interval (Welch); lo/hi are None with fewer than 2 seeds a side."""

    mean: float
    lo: float | None
    hi: float | None
    n_a: int
    n_b: int

    def sign(self) -> int | None:
        """-1 or +1 where the interval excludes 0, 0 where it contains 0, None without an interval."""
        if self.lo is None:
            return None
        return -1 if self.hi < 0 else (1 if self.lo > 0 else 0)

    def text(self) -> str:
        ci = "no interval: one seed" if self.lo is None else f"95% CI {self.lo:+.3f} to {self.hi:+.3f}"
        return f"{self.mean:+.3f} ({ci}; n = {self.n_a} vs {self.n_b})"


def difference(a, b) -> Difference:
    a, b = np.asarray(a, float), np.asarray(b, float)
    mean = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2:
        return Difference(mean, None, None, len(a), len(b))
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return Difference(mean, mean, mean, len(a), len(b))
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t975(df) * se
    return Difference(mean, mean - half, mean + half, len(a), len(b))


def spearman(x, y) -> tuple[float, float | None, float | None]:
    """Spearman's rho of paired samples (average ranks for ties) with its 95% interval."""
    rx = _ranks(np.asarray(x, float))
    ry = _ranks(np.asarray(y, float))
    n = len(rx)
    if n < 3 or rx.std() == 0 or ry.std() == 0:
        return float("nan"), None, None
    rho = float(np.corrcoef(rx, ry)[0, 1])
    if n < 5:
        return rho, None, None
    z, half = math.atanh(max(min(rho, 0.999999), -0.999999)), 1.96 * 1.06 / math.sqrt(n - 3)
    return rho, math.tanh(z - half), math.tanh(z + half)


def _ranks(v: np.ndarray) -> np.ndarray:
    order = v.argsort(kind="stable")
    ranks = np.empty(len(v))
    ranks[order] = np.arange(len(v), dtype=float)
    for value in np.unique(v):  # ties share their average rank
        tie = v == value
        ranks[tie] = ranks[tie].mean()
    return ranks


def mean_sd(v) -> str:
    v = np.asarray(v, float)
    return f"{v.mean():.2f}" if len(v) < 2 else f"{v.mean():.2f} +- {v.std(ddof=1):.2f}"
