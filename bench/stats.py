"""Small-sample statistics for seeded benchmarks: the mean's Student-t confidence interval and the one-sided
t-test that modded-nanogpt's record rule asks of a claimed loss (the mean over runs below the target, p < 0.01).

The t distribution is the doctor's (doctor/budget.py: its tail through the regularised incomplete beta
function, its quantile by bisection), standard library only.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from doctor.budget import t_isf, t_sf


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with df degrees of freedom."""
    return 1.0 - t_sf(t, df) if t >= 0 else t_sf(-t, df)


def t_quantile(p: float, df: float) -> float:
    """The t with P(T ≤ t) = p."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p={p} is not in (0, 1)")
    if p == 0.5:
        return 0.0
    return t_isf(1.0 - p, df) if p > 0.5 else -t_isf(p, df)


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
