"""The doctor's statistics: every test that says a quantity left its baseline, vectorised (numpy sliding
windows, linear in steps), and the first step each quantity deviated.

Four tests per quantity (its Signal in stability/signals.py: direction, log scale, floors), signed by its direction:
    point      robust z against the trailing WINDOW values (median, MAD) > THRESHOLD; on a log quantity the
               floor bounds the noise from below (max), it is not added to it
    change     two-window: median of the K steps from t − median of the B before t, as a robust z against
               that same statistic over the trailing WINDOW steps (a steady drift cancels) > CHANGE
    sustained  K consecutive values all above SUSTAINED against the baseline before t, where the change
               statistic at t is ≥ CONFIRM (a new level, not a drift)
    guard      on the quantities the online guard watches: its own detector at the run's settings
               (window, threshold, floor 1e-3·|median|), from the guard's own warm-up: the doctor flags
               whatever the guard would
A per-source loss is a mean over that source's tokens: its one-step tests scale by √(n / n̄) below n̄. A quantity
whose Signal names one it needs (a layer's gradient RMS needs grad_norm) counts only at a step where that
one deviates too. Thresholds: the largest values of each test over clean runs (bench/doctor_eval/calibrate.py;
README); a per-layer quantity's change test: CHANGE_LAYER.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from stability.signals import family, guard_defaults

from doctor.timeline import (B, CHANGE, CHANGE_LAYER, CONFIRM, K, MAD_SIGMA, MIN_HISTORY, SUSTAINED, THRESHOLD,
                             WINDOW, DETREND, Deviation, Series)


def baselines(y: np.ndarray, window: int = WINDOW, min_history: int = MIN_HISTORY
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(level, MAD, slope) of the trailing window y[i-window:i] for every i (NaN before min_history
    values). The window's trend is taken out when DETREND: slope b = (median of its last third − median
    of its first third) / (2/3·window), residuals r_k = y_k − b·(k − centre); level = median(r) at the
    centre, so the prediction for y[i+j] is level + b·(window/2 + j + 0.5). Slope 0 until the window is full.
    NOTE: vectorised (numpy sliding windows): 20k steps × 70 quantities in about a second. No value is
    left out of a baseline: only the first deviation of a quantity is sought, and before it none deviated."""
    n = len(y)
    lev, mad, slope = np.full(n, np.nan), np.full(n, np.nan), np.zeros(n)
    if n <= min_history:
        return lev, mad, slope
    pad = np.concatenate([np.full(window, np.nan), y])
    win = np.lib.stride_tricks.sliding_window_view(pad, window)[min_history:n]  # row i: y[i-W:i]
    third = window // 3
    full = np.arange(min_history, n) >= window
    b = np.zeros(len(win))
    if DETREND and full.any():
        w = win[full]
        b[full] = (np.median(w[:, -third:], axis=1) - np.median(w[:, :third], axis=1)) / (window - third)
    centre = np.arange(window) - (window - 1) / 2
    r = win - b[:, None] * centre[None, :] if DETREND else win
    # NOTE: np.median on the full windows, nanmedian only on the few padded ones (nanmedian is a Python-level loop, many times slower)
    m, d = np.empty(len(win)), np.empty(len(win))
    if full.any():
        m[full] = np.median(r[full], axis=1)
        d[full] = np.median(np.abs(r[full] - m[full, None]), axis=1)
    if (~full).any():
        m[~full] = np.nanmedian(r[~full], axis=1)
        d[~full] = np.nanmedian(np.abs(r[~full] - m[~full, None]), axis=1)
    lev[min_history:], slope[min_history:], mad[min_history:] = m, b, d
    return lev, mad, slope


def predict(lev: np.ndarray, slope: np.ndarray, j: int, window: int = WINDOW) -> np.ndarray:
    """The baseline's value j steps after the window's end (j = 0: the step being scored)."""
    return lev + slope * ((window - 1) / 2 + 1 + j)


def two_window(y: np.ndarray, floor, abs_floor: float, b: int = B, k: int = K, window: int = WINDOW
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The change-point statistic at every t: D_t = median(y[t:t+k]) − median(y[t-b:t]), scored as a robust
    z against the D_s that end before t (s ≤ t − k, the trailing `window` of them):
        z_t = (D_t − median(D_s)) / max(1.4826·MAD(D_s), floor)
    A steady drift gives every D the same offset, which the median of the D_s takes out; the noise of D
    (batch noise, autocorrelation) is measured on D itself, so no model of either is assumed. Medians on
    both sides: a one-step spike moves neither (the point test is for those). NaN where undefined.
    Returns (z, the shift D_t − median(D_s), the before-median median(y[t-b:t])).
    NOTE: vectorised, linear in steps (sliding-window medians of width b, k and `window`)."""
    n = len(y)
    if n < b + k + MIN_HISTORY + k:
        return np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    sw = np.lib.stride_tricks.sliding_window_view
    d = np.full(n, np.nan)
    d[b:n - k + 1] = np.median(sw(y, k), axis=1)[b:] - np.median(sw(y, b), axis=1)[:n - k + 1 - b]
    lev, mad, _ = baselines(np.nan_to_num(d, nan=0.0)[b:], window, MIN_HISTORY)
    # row i of baselines(d[b:]) is the window of d[b:][i-W:i]; D_s for s ≤ t − k means shifting by k − 1
    lev_t, mad_t = np.full(n, np.nan), np.full(n, np.nan)
    lev_t[b + k - 1:] = lev[:n - b - k + 1]
    mad_t[b + k - 1:] = mad[:n - b - k + 1]
    medb = np.full(n, np.nan)
    medb[b:] = np.median(sw(y, b), axis=1)[:n - b]
    return (d - lev_t) / (np.maximum(MAD_SIGMA * mad_t, floor) + abs_floor), d - lev_t, medb


@dataclass(frozen=True)
class GuardTest:
    """The online guard's detector (stability/detector.py) at the run's settings: window, threshold, floor
    rel_floor·|median| (a log quantity: spread at least log_floor), no score before min_history values.
    Before its first trigger no value was left out of its history, so its first trigger is this vectorised
    test's first hit."""
    window: int = 50
    threshold: float = 6.0
    min_history: int = 20
    rel_floor: float = 1e-3
    log_floor: float = 0.2
    directions: tuple = ()   # (metric family, "up" | "both")
    warmup: int = 0          # no score before this step (guard.detector.warmup)

    def direction(self, name: str) -> str | None:
        fam = family(name)
        return dict(self.directions).get(fam.name if fam else name.split("/")[0])


def guard_test(config: dict) -> GuardTest:
    """The guard's detector settings from the run's config.yaml (the defaults of stability/config.py
    DetectorConfig for any key it does not set; its default metrics from the signal registry)."""
    det = ((config.get("guard") or {}).get("detector") or {})
    metrics = det.get("metrics") or guard_defaults()
    return GuardTest(int(det.get("window", 50)), float(det.get("threshold", 6.0)), int(det.get("min_history", 20)),
                     1e-3, float(det.get("log_floor", 0.2)),
                     tuple((m, (spec or {}).get("direction", "up")) for m, spec in metrics.items()),
                     int(det.get("warmup", 0)))


@dataclass
class Scores:
    """One quantity's statistics at every step (index i ↔ steps[i]); -inf where a test cannot score."""
    steps: np.ndarray
    x: np.ndarray
    nf: int                      # index of the first non-finite value (len(x) when none)
    med: np.ndarray              # the trailing baseline (log units for a log quantity)
    z: dict                      # kind -> directed statistic (point, sustained, change, guard)
    per_layer: bool = False      # one model layer's quantity (its change test's threshold: CHANGE_LAYER)


def scores(s: Series, guard: GuardTest | None = None, name: str = "") -> Scores | None:
    """Every test's statistic for one (non-exact) quantity, signed by its direction; thresholds are
    applied by first_deviation, and bench/doctor_eval/calibrate.py reads the clean runs' maxima from here."""
    steps = np.array(sorted(s.values), dtype=np.int64)
    x = np.array([s.values[int(t)] for t in steps], dtype=np.float64)
    spec, fin = s.spec, np.isfinite(x)
    nf = int(np.argmax(~fin)) if not fin.all() else len(x)  # a non-finite value needs no baseline

    def signed(z: np.ndarray, direction: str) -> np.ndarray:
        if direction == "none":  # a quantity judged by its level only (Signal.point = "none")
            return np.full(len(z), -np.inf)
        z = z if direction == "up" else (-z if direction == "down" else np.abs(z))
        return np.nan_to_num(z, nan=-np.inf)

    y = np.log(np.maximum(x[:nf], 1e-30)) if spec.log else x[:nf]
    lev, mad, slope = baselines(y)
    med = predict(lev, slope, 0)
    floor = spec.rel_floor if spec.log else spec.rel_floor * np.abs(med)
    den = MAD_SIGMA * mad + floor + spec.abs_floor
    z = {}
    # NOTE: on a log quantity the floor bounds the noise from below, it is not added to it: added, it
    # dilutes a real jump of a quantity that is noisy already (its z nearly halves when the floor and the
    # MAD are alike); the floor exists for sub-percent MADs, where max() and + agree
    zpt = ((y - med) / (np.maximum(MAD_SIGMA * mad, max(floor, spec.point_floor)) + spec.abs_floor) if spec.log
           else (y - med) / den)
    z["point"] = signed(zpt * _sample_size(s, steps[:nf], WINDOW, MIN_HISTORY), spec.point or spec.direction)
    zsus = np.full(nf, -np.inf)
    if nf > K:  # sustained: values t..t+K-1 all against the baseline before t
        m = nf - K + 1
        zk = np.stack([(y[j:j + m] - predict(lev, slope, j)[:m]) / den[:m] for j in range(K)])
        lo, hi = np.min(zk, axis=0), np.max(zk, axis=0)
        up = lo if spec.direction != "down" else np.full(m, -np.inf)
        down = -hi if spec.direction != "up" else np.full(m, -np.inf)
        zsus[:m] = np.maximum(np.nan_to_num(up, nan=-np.inf), np.nan_to_num(down, nan=-np.inf))
    # change point: the two-window test, two-sided unless the quantity's direction says otherwise.
    # NOTE: the median of K values already holds a shift that starts at t0 when K − 1 of them are shifted,
    # so D fires from t0 − 1 (t0 − 2 at half strength): a step scores only when its own value lies past
    # half the shift, i.e. where the new level starts
    z2, shift, before = two_window(y, spec.rel_floor if spec.log else spec.rel_floor * np.abs(lev), spec.abs_floor)
    with np.errstate(invalid="ignore"):
        past = np.sign(shift) * (y - before) > np.abs(shift) / 2
    z["change"] = np.where(past, signed(z2, spec.direction), -np.inf)
    # NOTE: a sustained run of K high values counts only where the two-window statistic says a new level
    # starts (≥ CONFIRM): alone, the K-step test fires on slow drifts of clean runs (an update ratio
    # decaying, an activation RMS climbing), which never open a new level, while a planted shift does at
    # its first step (bench/doctor_eval/calibrate.py reads both)
    z["sustained"] = np.where(z["change"] >= CONFIRM, zsus, -np.inf)
    direction = guard.direction(name) if guard else None  # the families the run's guard watched
    if direction and nf > guard.min_history:  # the guard's own test: never less sensitive than the guard
        glev, gmad, _ = baselines(y, guard.window, guard.min_history)
        gden = (np.maximum(MAD_SIGMA * gmad, guard.log_floor) if spec.log
                else MAD_SIGMA * gmad + guard.rel_floor * np.abs(glev)) + 1e-12
        z["guard"] = signed((y - glev) / gden * _sample_size(s, steps[:nf], guard.window, guard.min_history), direction)
    return Scores(steps, x, nf, med, z, s.spec.per_layer)


def _sample_size(s: Series, steps: np.ndarray, window: int, min_history: int) -> np.ndarray | float:
    """min(1, √(n / n̄)) for a quantity that is a mean over n tokens (Series.counts), n̄ the median count of
    the trailing window; 1 where a count is unknown. A mean's noise is ∝ 1/√n: a source with 8 of the batch's
    tokens (60 typical) moved its loss ×1.9 on clean drill-model runs, the noise of 8 tokens."""
    if not s.counts:
        return 1.0
    n = np.array([s.counts.get(int(t), np.nan) for t in steps], dtype=np.float64)
    nbar, _, _ = baselines(n, window, min_history)
    with np.errstate(invalid="ignore", divide="ignore"):
        f = np.sqrt(n / nbar)
    return np.where(np.isfinite(f) & (f > 0), np.minimum(f, 1.0), 1.0)  # never up: stability/detector.py


def thresholds(guard: GuardTest | None, threshold: float = THRESHOLD, sustained: float = SUSTAINED) -> dict:
    return {"point": threshold, "sustained": sustained, "change": CHANGE,
            "guard": guard.threshold if guard else math.inf}


def support(tl: dict[str, Series], s: Series, start: int, threshold: float, sustained: float,
            guard: GuardTest | None, guard_start: int | None) -> np.ndarray | None:
    """For a quantity whose Signal names a run-level quantity it needs (Signal.needs): at each of this one's
    steps, does that quantity deviate there too (any of its tests past its threshold)? None when the
    quantity needs none, or the run lacks the one it needs (then it counts on its own)."""
    other = tl.get(s.spec.needs) if s.spec.needs else None
    if other is None or not other.values:
        return None
    sc = other.cache.get(guard)
    if sc is None:
        sc = other.cache[guard] = scores(other, guard, s.spec.needs)
    hit = hits(sc, start, threshold, sustained, guard, guard_start)
    at = set(sc.steps[:len(hit)][hit].tolist())
    return np.array([int(t) in at for t in sorted(s.values)], dtype=bool)


def hits(sc: Scores, start: int, threshold: float, sustained: float, guard: GuardTest | None,
         guard_start: int | None, kinds: dict | None = None) -> np.ndarray:
    """Where any test exceeds its threshold over the scored steps (kind -> bool array when `kinds` is a dict)."""
    nf, steps = sc.nf, sc.steps
    anyhit = np.zeros(nf, dtype=bool)
    for kind, limit in thresholds(guard, threshold, sustained).items():
        zk = sc.z.get(kind)
        if zk is None:
            continue
        if kind == "change" and sc.per_layer:
            limit = max(limit, CHANGE_LAYER)
        h = (steps[:nf] >= (guard_start if kind == "guard" and guard_start is not None else start)) & (zk > limit)
        if kinds is not None:
            kinds[kind] = h
        anyhit |= h
    return anyhit


TIE = ("sustained", "change", "point", "guard", "nonfinite")


def first_deviation(name: str, s: Series, start: int, threshold: float = THRESHOLD,
                    sustained: float = SUSTAINED, guard: GuardTest | None = None,
                    guard_start: int | None = None, backing: np.ndarray | None = None,
                    exact_start: int = 1) -> Deviation | None:
    """The first step from `start` (the guard's own test: from `guard_start`, default `start`) at which
    any test exceeds its threshold, a non-finite value, or — from `exact_start` — a departure from an
    exact value that begins there (a value still off since an earlier step is that earlier incident)."""
    if not s.values:
        return None
    spec = s.spec
    if spec.exact is not None:
        steps = np.array(sorted(s.values), dtype=np.int64)
        x = np.array([s.values[int(t)] for t in steps], dtype=np.float64)
        off = ~np.isfinite(x) | (np.abs(x - spec.exact) > spec.rel_floor * max(abs(spec.exact), 1.0) + spec.abs_floor)
        onset = off & ~np.concatenate([[False], off[:-1]]) & (steps >= exact_start)
        i = int(np.argmax(onset))
        return Deviation(name, spec.layer, s.order, int(steps[i]), float(x[i]), spec.exact, math.inf,
                         s.layer_name, "exact") if onset[i] else None
    if spec.bound is not None:  # one-sided invariant: above the bound for `confirm` consecutive values
        steps = np.array(sorted(s.values), dtype=np.int64)
        x = np.array([s.values[int(t)] for t in steps], dtype=np.float64)
        off = np.isfinite(x) & (x > spec.bound)
        ok = off.copy()
        for j in range(1, spec.confirm):
            ok[:len(ok) - j] &= off[j:]
            ok[max(len(ok) - j, 0):] = False
        ok &= steps >= exact_start
        i = int(np.argmax(ok))
        return Deviation(name, spec.layer, s.order, int(steps[i]), float(x[i]), spec.bound, float(x[i]),
                         s.layer_name, "bound") if ok[i] else None
    sc = s.cache.get(guard)
    if sc is None:
        sc = s.cache[guard] = scores(s, guard, name)
    steps, x, nf, med = sc.steps, sc.x, sc.nf, sc.med
    cands, per_kind = [], {}
    hits(sc, start, threshold, sustained, guard, guard_start, per_kind)
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
    # NOTE: at one step, a value that moved and held (sustained, a new level) says more than one that moved
    i, z, kind = min(cands, key=lambda c: (c[0], TIE.index(c[2])))
    base = med[i] if i < nf else (np.nanmedian(np.log(np.maximum(x[max(0, nf - WINDOW):nf], 1e-30)) if spec.log
                                                else x[max(0, nf - WINDOW):nf]) if nf else np.nan)
    base = None if not np.isfinite(base) else float(math.exp(base) if spec.log else base)
    return Deviation(name, spec.layer, s.order, int(steps[i]), float(x[i]), base, z, s.layer_name, kind)


def deviations(tl: dict[str, Series], start: int = 1, threshold: float = THRESHOLD,
               sustained: float = SUSTAINED, guard: GuardTest | None = None,
               guard_start: int | None = None, exact_start: int = 1,
               holds: dict[str, int] | None = None) -> dict[str, Deviation]:
    """The first deviating step of every quantity. Baseline-relative scores count from step `start`
    on (earlier values only build the baseline; the guard's own test from `guard_start`, where the
    guard itself starts scoring); a non-finite value, or a quantity off the value a healthy run holds
    exactly, counts from step 1: it needs no baseline."""
    out = {}
    holds = holds or {}
    for name, s in tl.items():
        if not s.spec.scored:  # judged exactly by a specification check (doctor/conformance.py)
            continue
        # NOTE: a quantity that moved in an earlier incident waits a baseline window (its own values fill
        # it); every other one is searched again from `start`
        h = holds.get(name, 0)
        st, gst, xst = max(start, h), max(guard_start if guard_start is not None else start, h), max(exact_start, h)
        back = support(tl, s, st, threshold, sustained, guard, gst)
        d = first_deviation(name, s, st, threshold, sustained, guard, gst, back, xst)
        if d is not None:
            out[name] = d
    return out
