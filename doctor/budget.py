"""The doctor's false-alarm budget: every threshold follows from how many tests a run makes and how well the
run's own noise is known, never from a calibration run.

A clean run of any length, depth and telemetry cadence must expect fewer than ALPHA incidents judged faults.
Half of that is spent on detection, half on judgement (doctor/judge.py, doctor/outcome.py). Within detection the
budget is split evenly over every test the doctor makes on the run (Bonferroni: a union bound, valid whatever the tests'
dependence), so a test's threshold is the score a null value exceeds with probability

    p = (ALPHA / 2) / (sides · tests)          sides = 2 where a quantity can fail both ways

and more series (depth, telemetry every step) or more steps raise every threshold instead of the alarm count.

The null distribution of a robust z. A score is (y − median of n baseline values) / (1.4826 · MAD of them):
with Gaussian noise the MAD's σ-estimate has the variance of a standard deviation taken from EFF_MAD · n
values (its asymptotic efficiency), so the score is Student-t with ν = EFF_MAD · n − 1 degrees of freedom,
widened by √(1 + π / (2n)) for the median's own error (the median's variance is πσ²/2n). Baseline values
that are autocorrelated (an Adam moment, a slowly drifting norm) carry fewer independent draws: n is the
effective count n·(1 − ρ)/(1 + ρ) of an AR(1) series with the series' own lag-one autocorrelation ρ
(measured on the run itself). A series whose noise is itself heavier-tailed than Gaussian (one layer's attention
logits flipping between two levels, a gradient that bursts) shows it in its own scores: crossing Z_REF anew more
than once in a run, where Gaussian noise almost never does. Its ν is then the one whose tail crosses Z_REF as often
(`tail_dof`, leaving one excursion out: a fault's own spike does not make its series heavy-tailed). A score with
too few effective values for a finite-variance tail (ν ≤ 2) is never scored.

    t = threshold(tests=40_000, n=30, rho=0.2, sides=2)     # the score above which a value deviates

NOTE: plain Python (no scipy): the Student-t tail through the regularised incomplete beta function
(Numerical Recipes' continued fraction), inverted by bisection; each (tests, n) pair is solved once.
"""
from __future__ import annotations

import math
from functools import lru_cache

ALPHA = 0.05   # expected incidents judged faults on a clean run (issue 36: "fewer than 0.05")
EFF_MAD = 0.3675  # asymptotic efficiency of the MAD as a σ-estimate under Gaussian noise: Var(σ̂_MAD) ≈
#                   1.3605 σ²/n against σ²/(2n) for the standard deviation (Hampel 1974)
MIN_DOF = 2.0  # a t with ν ≤ 2 has infinite variance: a baseline that short says nothing about its tail
Z_REF = 4.0    # a point in the tail: Gaussian noise crosses |z| = 4 with probability 6e-5 (once in ~16 000 steps)


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes §6.4)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        de = d * c
        h *= de
        if abs(de - 1.0) < 1e-15:  # double precision
            break
    return h


def ibeta(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side (Numerical Recipes)
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, nu: float) -> float:
    """P(T > t) for Student's t with ν degrees of freedom (t ≥ 0)."""
    return 0.5 * ibeta(nu / 2.0, 0.5, nu / (nu + t * t))


@lru_cache(maxsize=None)
def t_isf(p: float, nu: float) -> float:
    """The t with P(T > t) = p (bisection on t_sf; p < 1/2)."""
    lo, hi = 0.0, 1.0
    while t_sf(hi, nu) > p:
        hi *= 2.0
    for _ in range(200):  # bisection to double precision
        mid = 0.5 * (lo + hi)
        if t_sf(mid, nu) > p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-9 * hi:
            break
    return hi


def norm_isf(p: float) -> float:
    """The z with P(Z > z) = p for a standard normal (bisection on erfc; p < 1/2)."""
    lo, hi = 0.0, 40.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if 0.5 * math.erfc(mid / math.sqrt(2.0)) > p:
            lo = mid
        else:
            hi = mid
    return hi


def bound(tests: int, confirm: int = 1, alpha: float = ALPHA / 2) -> float:
    """A one-sided bound on a statistic already in standard errors of a known (not estimated) σ: exceeded by
    `confirm` consecutive independent null values with probability alpha / tests in all."""
    return norm_isf((alpha / max(tests, 1)) ** (1.0 / max(confirm, 1)))


def dof(n: float, rho: float = 0.0) -> float:
    """ν of a robust z against n baseline values with lag-one autocorrelation ρ (≥ 0 counted; a negative ρ
    is taken as none: it would only add effective draws)."""
    rho = min(max(rho, 0.0), 1.0 - 1.0 / max(n, 2.0))  # at most n − 1 ... 1 effective draw
    return EFF_MAD * n * (1.0 - rho) / (1.0 + rho) - 1.0


def tail_dof(crossings: int, n: int) -> float:
    """The ν of a t whose two tails cross ±Z_REF at the series' own rate, one crossing left out (inf: none to
    speak of). Bisection on ν over (MIN_DOF, 1000]: the tail's mass at Z_REF falls as ν grows."""
    rate = (crossings - 1) / max(n, 1)
    if crossings <= 1 or rate <= 2 * t_sf(Z_REF, 1000.0):
        return math.inf
    if rate >= 2 * t_sf(Z_REF, MIN_DOF):
        return MIN_DOF
    lo, hi = MIN_DOF, 1000.0
    for _ in range(60):  # to a few parts in a million of the ν range
        mid = 0.5 * (lo + hi)
        if 2 * t_sf(Z_REF, mid) > rate:
            lo = mid
        else:
            hi = mid
    return lo


def threshold(tests: int, n: float, rho: float = 0.0, sides: int = 1, alpha: float = ALPHA / 2,
              nu_max: float = math.inf) -> float:
    """The robust z a null value exceeds with probability alpha / (sides · tests): inf when the baseline's
    effective size gives ν ≤ MIN_DOF (too short to bound the tail). `nu_max`: the series' own tail (tail_dof)."""
    nu = min(dof(n, rho), nu_max)
    if nu <= MIN_DOF:
        return math.inf
    # NOTE: rounded so the cache holds few entries, each way to a higher threshold: ν down to a multiple of
    # 0.05, the test count up to two significant digits (a threshold moves < 1 % within either step)
    nu_r = math.floor(nu * 20) / 20
    mag = 10 ** max(int(math.log10(max(tests, 1))) - 1, 0)
    tests_r = math.ceil(max(tests, 1) / mag) * mag
    widen = math.sqrt(1.0 + math.pi / (2.0 * n))
    return t_isf(alpha / (sides * tests_r), nu_r) * widen
