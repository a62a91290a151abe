"""Small-sample statistics for seeded benchmarks: the mean's Student-t confidence interval and the one-sided
t-test that modded-nanogpt's record rule asks of a claimed loss (the mean over runs below the target, p < 0.01).

Standard library only: the t distribution's CDF through the regularised incomplete beta function (the
continued fraction of Numerical Recipes §6.4), its quantile by bisection on that CDF.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def _beta_cf(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz), convergent for x < (a + 1) / (a + b + 2)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_cf(a, b, x) / a
    return 1.0 - front * _beta_cf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with df degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T ≤ t) = p (bisection: the CDF is monotone)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p={p} is not in (0, 1)")
    lo, hi = -1e4, 1e4
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def mean_ci(xs: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width): the two-sided `level` confidence interval of the mean is mean ± half-width."""
    if len(xs) < 2:
        raise ValueError(f"mean_ci: {len(xs)} value(s); a confidence interval needs at least 2")
    m, s = statistics.fmean(xs), statistics.stdev(xs)
    return m, t_quantile(0.5 + level / 2.0, len(xs) - 1) * s / math.sqrt(len(xs))


def p_below(xs: Sequence[float], target: float) -> float:
    """One-sided p-value of "the mean is below target" (H0: mean ≥ target); 0 when every run lands at the same
    value below it, 1 at or above it."""
    if len(xs) < 2:
        raise ValueError(f"p_below: {len(xs)} value(s); a t-test needs at least 2")
    m, s = statistics.fmean(xs), statistics.stdev(xs)
    if s == 0.0:
        return 0.0 if m < target else 1.0
    return t_cdf((m - target) / (s / math.sqrt(len(xs))), len(xs) - 1)
