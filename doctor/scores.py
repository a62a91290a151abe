"""The doctor's statistics: the tests that say a quantity left its baseline, vectorised (numpy sliding windows,
linear in steps), each with a threshold from the run's false-alarm budget (doctor/budget.py), and the first step
each quantity deviated.

Two tests per quantity (its Signal in stability/signals.py: direction, log scale, floors), signed by its direction:
    point   the value's innovation against the series' own noise model: y_t minus its trailing median (the
            run's guard window), less ρ times the step before's (AR(1), ρ the series' own lag-one autocorrelation,
            measured robustly on the run), as a robust z against the trailing innovations. A one-step spike
            scores at its step; so does the first step of a new level, smooth series (an optimizer moment,
            a weight norm) included, whose autocorrelation a plain z against the median would mistake for
            signal. Its threshold: doctor/budget.py, from the number of point tests on the run (every scored
            value of every scored series) and the baseline's size; two-sided where the quantity fails both ways.
    guard   on the quantities the online guard watches: its own detector at the run's settings (window,
            threshold, floor 1e-3·|median|), from the guard's own warm-up: the doctor flags whatever the
            guard would. Not budgeted: every signal the guard watches by default is judged by what the run
            did after it (doctor/judge.py), not by its score.
A per-source loss is a mean over that source's tokens: its scores scale by √(n / n̄) below n̄. A quantity whose
Signal names one it needs (a layer's gradient RMS needs grad_norm) counts only at a step where that one deviates too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from doctor.budget import EFF_MAD, MIN_DOF, Z_REF, bound, tail_dof, threshold
from doctor.timeline import MAD_SIGMA, Deviation, Series
from stability.signals import BUDGET, family, guard_defaults

MIN_MEDIAN = 3  # values a trailing median needs before a residual is read: the fewest one outlier cannot move
# the fewest baseline values whose robust z has a t-tail of finite variance (ν = EFF_MAD·n − 1 > MIN_DOF)
MIN_HISTORY = math.ceil((MIN_DOF + 1) / EFF_MAD)


def baselines(y: np.ndarray, window: int, min_history: int = MIN_MEDIAN) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(median, MAD, count) of the trailing window y[i-window:i] for every i, over its finite values (NaN where
    fewer than min_history). NOTE: vectorised (numpy sliding windows): 20k steps × 70 quantities in about a
    second; np.median on the full windows, nanmedian only on the padded or holed ones (a Python-level loop)."""
    n = len(y)
    lev, mad, cnt = np.full(n, np.nan), np.full(n, np.nan), np.zeros(n)
    if n <= min_history:
        return lev, mad, cnt
    pad = np.concatenate([np.full(window, np.nan), y])
    win = np.lib.stride_tricks.sliding_window_view(pad, window)[:n]  # row i: y[i-W:i]
    c = np.isfinite(win).sum(axis=1)
    full = c == window
    m, d = np.full(n, np.nan), np.full(n, np.nan)
    if full.any():
        m[full] = np.median(win[full], axis=1)
        d[full] = np.median(np.abs(win[full] - m[full, None]), axis=1)
    part = ~full & (c >= min_history)
    if part.any():
        m[part] = np.nanmedian(win[part], axis=1)
        d[part] = np.nanmedian(np.abs(win[part] - m[part, None]), axis=1)
    ok = c >= min_history
    lev[ok], mad[ok], cnt[ok] = m[ok], d[ok], c[ok]
    return lev, mad, cnt


def lag_correlation(r: np.ndarray) -> float:
    """The lag-one autocorrelation of a residual series, robustly (Gnanadesikan–Kettenring with MAD scales:
    ρ = (s²(a+b) − s²(a−b)) / (s²(a+b) + s²(a−b)), a = r_t, b = r_{t−1}); a fault's few outliers cannot move it."""
    a, b = r[1:], r[:-1]
    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < MIN_HISTORY:
        return 0.0
    u, v = a[ok] + b[ok], a[ok] - b[ok]
    su, sv = np.median(np.abs(u - np.median(u))) ** 2, np.median(np.abs(v - np.median(v))) ** 2
    return float((su - sv) / (su + sv)) if su + sv > 0 else 0.0


@dataclass(frozen=True)
class GuardTest:
    """The online guard's detector (stability/detector.py) at the run's settings: window, threshold, floor
    rel_floor·|median| (a log quantity: spread at least log_floor), no score before min_history values.
    Before its first trigger no value was left out of its history, so its first trigger is this vectorised
    test's first hit. The defaults are stability/config.py DetectorConfig's."""
    window: int
    threshold: float
    min_history: int
    rel_floor: float
    log_floor: float
    directions: tuple = ()   # (metric family, "up" | "both")
    warmup: int = 0          # no score before this step (guard.detector.warmup)

    def direction(self, name: str) -> str | None:
        fam = family(name)
        return dict(self.directions).get(fam.name if fam else name.split("/")[0])


def guard_test(config: dict) -> GuardTest:
    """The guard's detector settings from the run's config.yaml (DetectorConfig's defaults for any key it does
    not set; its default metrics from the signal registry)."""
    from stability.config import DetectorConfig
    from stability.detector import REL_FLOOR
    d = DetectorConfig.__dataclass_fields__
    det = ((config.get("guard") or {}).get("detector") or {})
    metrics = det.get("metrics") or guard_defaults()

    def get(k):
        return det.get(k, d[k].default)
    return GuardTest(int(get("window")), float(get("threshold")), int(get("min_history")), REL_FLOOR,
                     float(get("log_floor")),
                     tuple((m, (spec or {}).get("direction", "up")) for m, spec in metrics.items()), int(get("warmup")))


@dataclass
class Scores:
    """One quantity's statistics at every step (index i ↔ steps[i]); -inf where a test cannot score."""
    steps: np.ndarray
    x: np.ndarray
    nf: int                      # index of the first non-finite value (len(x) when none)
    med: np.ndarray              # the trailing baseline (log units for a log quantity)
    z: dict                      # kind -> directed statistic (point, guard)
    n: np.ndarray                # baseline values behind each point score (the budget's ν)
    big: np.ndarray | None = None  # the point test's move is at least its signal's floor (an effect size)
    rho: float = 0.0             # the series' own lag-one autocorrelation
    sides: int = 1               # 2: the point test counts moves both ways
    nu_tail: float = math.inf    # the t-tail its own scores show (doctor/budget.py tail_dof)


def point_sides(spec) -> int:
    d = spec.point or spec.direction
    return 0 if d == "none" else 2 if d == "both" else 1


def scores(s: Series, window: int, guard: GuardTest | None = None, name: str = "") -> Scores:
    """Every test's statistic for one (non-exact) quantity, signed by its direction; thresholds are applied by
    first_deviation (the run's budget)."""
    steps = np.array(sorted(s.values), dtype=np.int64)
    x = np.array([s.values[int(t)] for t in steps], dtype=np.float64)
    spec, fin = s.spec, np.isfinite(x)
    nf = int(np.argmax(~fin)) if not fin.all() else len(x)  # a non-finite value needs no baseline

    def signed(z: np.ndarray, direction: str) -> np.ndarray:
        if direction == "none":  # a quantity judged by its level only (Signal.point = "none")
            return np.full(len(z), -np.inf)
        z = z if direction == "up" else (-z if direction == "down" else np.abs(z))
        return np.nan_to_num(z, nan=-np.inf)

    y = np.log(np.maximum(x[:nf], 1e-300)) if spec.log else x[:nf]
    lev, _, _ = baselines(y, window)
    r = y - lev
    rho = max(lag_correlation(r), 0.0)
    e = np.full(nf, np.nan)
    e[1:] = r[1:] - rho * (y[:-1] - lev[1:])  # the innovation: the step's own move under the series' AR(1) noise
    elev, emad, n = baselines(e, window, MIN_HISTORY)
    floor = spec.rel_floor if spec.log else spec.rel_floor * np.abs(lev)
    pf = spec.point_floor if spec.log and isinstance(spec.point_floor, float) else 0.0
    # NOTE: the floor is an effect size, not a noise scale: a move counts when it is past the budget's threshold
    # in the series' own noise AND at least the floor (a series that never moves — a share at 1.0 — has no noise
    # to speak of, and there the floor alone decides)
    # The point floor is a noise floor, the guard's own (its log_floor: a scale-free quantity jitters step to step
    # however calm its history looks, and a MAD measured on a calm stretch says otherwise)
    move = e - elev
    z = {"point": signed(move / (np.maximum(MAD_SIGMA * emad, pf) + spec.abs_floor) * _sample_size(s, steps[:nf], window),
                         spec.point or spec.direction)}
    big = np.nan_to_num(np.abs(move) >= floor, nan=False)
    direction = guard.direction(name) if guard else None  # the families the run's guard watched
    if direction and nf > guard.min_history:  # the guard's own test: never less sensitive than the guard
        glev, gmad, _ = baselines(y, guard.window, guard.min_history)
        gden = (np.maximum(MAD_SIGMA * gmad, guard.log_floor) if spec.log
                else MAD_SIGMA * gmad + guard.rel_floor * np.abs(glev)) + 1e-12  # the detector's own ε
        z["guard"] = signed((y - glev) / gden * _sample_size(s, steps[:nf], guard.window, guard.min_history), direction)
    # NOTE: excursions, not values: a level that shifted once keeps its innovations high for a few steps while its
    # median catches up — one event; a series that bursts again and again crosses anew each time
    pz = np.abs(move / (MAD_SIGMA * emad + spec.abs_floor))
    fin = np.isfinite(pz) & (n >= MIN_HISTORY)
    over = fin & (pz > Z_REF)
    onsets = int((over & ~np.concatenate([[False], over[:-1]])).sum())
    return Scores(steps, x, nf, lev, z, n, big, rho, point_sides(spec), tail_dof(onsets, int(fin.sum())))


def _sample_size(s: Series, steps: np.ndarray, window: int, min_history: int = MIN_MEDIAN) -> np.ndarray | float:
    """min(1, √(n / n̄)) for a quantity that is a mean over n tokens (Series.counts), n̄ the median count of
    the trailing window; 1 where a count is unknown. A mean's noise is ∝ 1/√n: a source with a few of the
    batch's tokens moves its loss by the noise of those few tokens."""
    if not s.counts:
        return 1.0
    n = np.array([s.counts.get(int(t), np.nan) for t in steps], dtype=np.float64)
    nbar, _, _ = baselines(n, window, min_history)
    with np.errstate(invalid="ignore", divide="ignore"):
        f = np.sqrt(n / nbar)
    return np.where(np.isfinite(f) & (f > 0), np.minimum(f, 1.0), 1.0)  # never up: stability/detector.py


@dataclass(frozen=True)
class Budget:
    """What the run's detection budget is spread over: its point tests (scored values × sides of every scored
    series) and the baseline window (the run's guard window: the doctor's baselines are the guard's)."""
    tests: int
    window: int
    guard: GuardTest | None = None

    def limit(self, sc: Scores) -> np.ndarray:
        """The point test's threshold at every index of a series (inf where the baseline is too short)."""
        out = np.full(len(sc.n), np.inf)
        for k in np.unique(sc.n[sc.n >= MIN_HISTORY]):
            out[sc.n == k] = threshold(self.tests, float(k), 0.0, max(sc.sides, 1), nu_max=sc.nu_tail)
        return out


def budget(tl: dict[str, Series], config: dict, start: int) -> Budget:
    """The run's point tests: every value from `start` of every series the statistics score."""
    gt = guard_test(config)
    tests = sum((1 if s.spec.bound is not None else point_sides(s.spec)) * sum(1 for t in s.values if t >= start)
                for s in tl.values() if s.spec.scored and s.spec.exact is None)
    return Budget(max(tests, 1), gt.window, gt)


def cached(s: Series, b: Budget, name: str) -> Scores:
    sc = s.cache.get(b)
    if sc is None:
        sc = s.cache[b] = scores(s, b.window, b.guard, name)
    return sc


def hits(sc: Scores, b: Budget, start: int, guard_start: int | None, kinds: dict | None = None) -> np.ndarray:
    """Where any test exceeds its threshold over the scored steps (kind -> bool array when `kinds` is a dict)."""
    nf, steps = sc.nf, sc.steps
    anyhit = np.zeros(nf, dtype=bool)
    limits = {"point": b.limit(sc)[:nf], "guard": b.guard.threshold if b.guard else math.inf}
    for kind, limit in limits.items():
        zk = sc.z.get(kind)
        if zk is None:
            continue
        h = (steps[:nf] >= (guard_start if kind == "guard" and guard_start is not None else start)) & (zk > limit)
        if kind == "point" and sc.big is not None:
            h &= sc.big[:nf]
        if kinds is not None:
            kinds[kind] = h
        anyhit |= h
    return anyhit


def support(tl: dict[str, Series], s: Series, b: Budget, start: int, guard_start: int | None) -> np.ndarray | None:
    """For a quantity whose Signal names a run-level quantity it needs (Signal.needs): at each of this one's
    steps, does that quantity deviate there too? None when the quantity needs none, or the run lacks the one
    it needs (then it counts on its own)."""
    other = tl.get(s.spec.needs) if s.spec.needs else None
    if other is None or not other.values:
        return None
    sc = cached(other, b, s.spec.needs)
    hit = hits(sc, b, start, guard_start)
    at = set(sc.steps[:len(hit)][hit].tolist())
    return np.array([int(t) in at for t in sorted(s.values)], dtype=bool)


TIE = ("point", "guard", "nonfinite")


def first_deviation(name: str, s: Series, b: Budget, start: int, guard_start: int | None = None,
                    backing: np.ndarray | None = None, exact_start: int = 1) -> Deviation | None:
    """The first step from `start` (the guard's own test: from `guard_start`, default `start`) at which
    any test exceeds its threshold, a non-finite value, or — from `exact_start` — a departure from an
    exact value that begins there (a value still off since an earlier step is that earlier incident)."""
    if not s.values:
        return None
    spec = s.spec
    if spec.exact is not None or spec.bound is not None:
        return _exact_or_bound(name, s, b, exact_start)
    sc = cached(s, b, name)
    steps, x, nf, med = sc.steps, sc.x, sc.nf, sc.med
    cands, per_kind = [], {}
    hits(sc, b, start, guard_start, per_kind)
    for kind, hit in per_kind.items():
        if backing is not None:  # Signal.needs: the run-level quantity deviates at the same step
            hit = hit & backing[:nf]
        if hit.any():
            i = int(np.argmax(hit))
            cands.append((i, float(sc.z[kind][i]), kind))
    if nf < len(x):
        cands.append((nf, math.inf, "nonfinite"))
    if not cands:
        return None
    i, z, kind = min(cands, key=lambda c: (c[0], TIE.index(c[2])))
    base = med[i] if i < nf else (np.nanmedian(med[max(0, nf - b.window):nf]) if nf else np.nan)
    base = None if not np.isfinite(base) else float(math.exp(base) if spec.log else base)
    return Deviation(name, spec.layer, s.order, int(steps[i]), float(x[i]), base, z, s.layer_name, kind)


def _exact_or_bound(name: str, s: Series, b: Budget, exact_start: int) -> Deviation | None:
    spec = s.spec
    steps = np.array(sorted(s.values), dtype=np.int64)
    x = np.array([s.values[int(t)] for t in steps], dtype=np.float64)
    if spec.exact is not None:
        off = ~np.isfinite(x) | (np.abs(x - spec.exact) > spec.rel_floor * max(abs(spec.exact), 1.0) + spec.abs_floor)
        onset = off & ~np.concatenate([[False], off[:-1]]) & (steps >= exact_start)
        i = int(np.argmax(onset))
        return Deviation(name, spec.layer, s.order, int(steps[i]), float(x[i]), spec.exact, math.inf,
                         s.layer_name, "exact") if onset[i] else None
    lim = bound(b.tests, spec.confirm) if spec.bound == BUDGET else float(spec.bound)
    off = np.isfinite(x) & (x > lim)  # one-sided invariant: above the bound for `confirm` consecutive values
    ok = off.copy()
    for j in range(1, spec.confirm):
        ok[:len(ok) - j] &= off[j:]
        ok[max(len(ok) - j, 0):] = False
    ok &= steps >= exact_start
    i = int(np.argmax(ok))
    return Deviation(name, spec.layer, s.order, int(steps[i]), float(x[i]), lim, float(x[i]),
                     s.layer_name, "bound") if ok[i] else None


def deviations(tl: dict[str, Series], b: Budget, start: int = 1, guard_start: int | None = None,
               exact_start: int = 1, holds: dict[str, int] | None = None) -> dict[str, Deviation]:
    """The first deviating step of every quantity. Baseline-relative scores count from step `start` on (earlier
    values only build the baseline; the guard's own test from `guard_start`, where the guard itself starts
    scoring); a non-finite value, or a quantity off the value a healthy run holds exactly, counts from step 1:
    it needs no baseline."""
    out = {}
    holds = holds or {}
    for name, s in tl.items():
        if not s.spec.scored:  # judged exactly by a specification check (doctor/conformance.py)
            continue
        # NOTE: a quantity that moved in an earlier incident waits a baseline window (its own values fill
        # it); every other one is searched again from `start`
        h = holds.get(name, 0)
        st, gst, xst = max(start, h), max(guard_start if guard_start is not None else start, h), max(exact_start, h)
        back = support(tl, s, b, st, gst)
        d = first_deviation(name, s, b, st, gst, back, xst)
        if d is not None:
            out[name] = d
    return out
