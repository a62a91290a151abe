"""bench/stats.py: Student-t quantiles and tails against printed tables, the interval and the record rule's test."""
from __future__ import annotations

import math

import pytest

from bench.stats import mean_ci, p_below, t_cdf, t_quantile
from doctor.budget import ibeta as betainc


@pytest.mark.parametrize("p, df, want", [(0.975, 1, 12.7062), (0.975, 4, 2.7764), (0.995, 9, 3.2498),
                                         (0.99, 4, 3.7469), (0.95, 30, 1.6973), (0.975, 10_000, 1.9602)])
def test_t_quantiles_match_the_tables(p, df, want):
    assert t_quantile(p, df) == pytest.approx(want, abs=1e-4)
    assert t_quantile(1 - p, df) == pytest.approx(-want, abs=1e-4)  # symmetric


def test_t_cdf_and_the_incomplete_beta_at_known_points():
    assert t_cdf(0.0, 7) == pytest.approx(0.5)
    assert t_cdf(-1.5, 3) == pytest.approx(0.11529, abs=1e-5)
    assert t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy: 1/2 + atan(1)/π
    assert betainc(2, 3, 0.4) == pytest.approx(0.5248, abs=1e-4)  # Σ_{j≥2} C(4,j) 0.4^j 0.6^(4-j)
    assert betainc(0.5, 0.5, 0.25) == pytest.approx(2 / math.pi * math.asin(0.5))


def test_mean_ci_and_the_record_rule():
    m, h = mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    assert m == 3.0 and h == pytest.approx(2.7764 * math.sqrt(2.5) / math.sqrt(5), abs=1e-4)
    below = [1.870, 1.880, 1.875, 1.872, 1.879]
    assert p_below(below, 1.8857) < 0.01 < p_below(below, 1.881) < 0.05  # clearly below; barely below is not enough
    assert p_below([1.9, 1.95, 1.92], 1.8857) > 0.9  # above the target: no claim
    assert p_below([1.8, 1.8], 1.8857) == 0.0 and p_below([1.9, 1.9], 1.8857) == 1.0
    with pytest.raises(ValueError, match="at least 2"):
        mean_ci([1.0])
