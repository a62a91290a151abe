"""The run's outcome, after each incident is judged (doctor/judge.py): on a segment whose steps ran their
specification checks, up to the first that failed (what follows is the fault's), `outcome` turns a natural incident
into a **recipe instability** where
  damage       a source's loss against its floor (or the loss, without one) ends the run above the best level it
               held, beyond its noise: lasting damage, or divergence;
  recurrence   the loss spikes more often than the run has sources — each source's circuit forms once (a phase
               transition, the copy source's induction head), so a clean run's loss spikes at most once per
               source; more is the recipe spiking again and again;
  stall        a source holds more than half its gap to its floor from an incident on for as long as the run had
               trained before it (with no incident: never gets halfway from its first window's gap, in a run as long
               as its default's), while the run sits on the unstable side of its recipe's default on a lever
               (doctor/levers.py) — the default is the recipe that learns this data, which the fix's rerun proves.
Each such finding is the incident it began at (or an incident of its own when none did), its class
`recipe.instability`, its fix the lever the evidence picks (doctor/levers.py).

Every threshold is the run's false-alarm budget's (doctor/budget.py): half of ALPHA on these outcome tests,
split over the objective series and the levels each compares.

    found = outcome(ctx, incidents)  # [(incident or None, kind, reason, evidence)]
    incidents = settle(ctx, incidents, found, make)
"""
from __future__ import annotations

import math
import statistics

import numpy as np

from doctor.budget import threshold
from doctor.checks import NEAR, Context
from doctor.classes import CLASSES
from doctor.diagnosis import FAULT, INSTABILITY, Judgement
from doctor.judge import MEDIAN_EFF
from doctor.timeline import MAD_SIGMA
from stability.signals import family


def gaps(ctx: Context) -> dict[str, dict[int, float]]:
    """Per objective series, its value against the exact floor step by step (the batch's own floor by source,
    record v4; else the data's; else the loss itself): what damage is measured on."""
    out = {}
    by_source = {q: s for q, s in ctx.tl.items() if s.spec.role == "objective" and s.spec.per_source}
    series = by_source or {q: s for q, s in ctx.tl.items() if s.spec.role == "objective"}
    floors = {r["step"]: r.get("floor_by_source") or {} for r in ctx.seg}
    for q, s in series.items():
        src = q.split("/", 1)[1] if s.spec.per_source else None
        g = {}
        for t, v in s.values.items():
            f = floors.get(t, {}).get(src) if src else None
            f = f if f is not None else (ctx.floors or {}).get(src) if src else None
            if math.isfinite(v):
                g[t] = v - (f if f is not None else 0.0)
        out[q] = g
    return out


def _levels(g: dict[int, float], w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, int]:
    """(steps, trailing medians over w steps, forward medians over w steps, per-step noise σ, noise sample size):
    σ from the step-to-step differences (robust to the trend and to a few spikes: MAD/√2)."""
    steps = np.array(sorted(g), dtype=np.int64)
    y = np.array([g[int(t)] for t in steps])
    n = len(y)
    back, fwd = np.full(n, np.nan), np.full(n, np.nan)
    if n > 2 * w:
        sw = np.lib.stride_tricks.sliding_window_view(y, w)
        med = np.median(sw, axis=1)  # med[i] = median(y[i:i+w])
        back[w:] = med[:n - w]
        fwd[:n - w + 1] = med
    d = np.diff(y)
    sigma = MAD_SIGMA * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(2) if len(d) else 0.0
    return steps, back, fwd, sigma, len(d)


def _end(g: dict[int, float], steps: np.ndarray, w: int) -> float:
    """The run's end level: the median of the last w values."""
    return float(np.median([g[int(t)] for t in steps[-w:]]))


def _halfway(steps: np.ndarray, fwd: np.ndarray, gap: float, since: int) -> int | None:
    """The first step from `since` whose forward window's median is down to half `gap` (None: never)."""
    down = np.where((steps >= since) & np.isfinite(fwd) & (fwd <= gap / 2))[0]
    return int(steps[down[0]]) if len(down) else None


def outcome(ctx: Context, incidents: list) -> list[tuple[object, str, str, dict]]:
    """The run's outcome tests on one segment: [(the incident it began at or None, kind, reason, evidence)]. Only on
    a segment whose steps ran their specification checks: without them a run's damage may be an execution fault
    the records cannot show, and the slow symptoms (doctor/symptoms.py) speak for it instead."""
    w, start = ctx.window, ctx.start
    last = ctx.seg[-1]["step"]
    found = []
    series = gaps(ctx)
    checked = [r for r in ctx.seg if r["step"] >= start]
    if not series or not checked or not all((r.get("spec") or {}).get("miss") for r in checked):
        return found
    dyn = [i for i in incidents if i.judgement.verdict != FAULT]
    # the steps from a failed check on are the fault's (doctor/conformance.py names it): the spikes after it and the
    # level it leaves are its consequences, not the recipe's, so the outcome is judged on the steps before it
    broke = next((r["step"] for r in checked if (r.get("spec") or {}).get("fail")), None)
    if broke is not None:
        last = broke - 1
        series = {q: {t: v for t, v in g.items() if t < broke} for q, g in series.items()}
        dyn = [i for i in dyn if i.step < broke]
    # damage: the end level above the best level held before, over every candidate level (~ scored steps / w
    # independent ones) of every objective series
    tests = max(len(series) * max((last - start) // max(w, 1), 1), 1)
    for q, g in series.items():
        steps, back, fwd, sigma, n = _levels({t: v for t, v in g.items() if t >= start - w}, w)
        if sigma <= 0 or n < 2 * w or len(steps) < 3 * w:  # a level before, a candidate best, the end: three windows
            continue
        end = _end(g, steps, w)
        se = sigma * math.sqrt(MEDIAN_EFF * 2 / w)
        lim = threshold(tests, n, 0.0, 1)
        cand = (steps >= start + w) & (steps <= last - w) & np.isfinite(back)
        if not cand.any():
            continue
        z = np.where(cand, (end - back) / se, -np.inf)
        i = int(np.argmax(z))
        if z[i] <= lim:
            continue
        best, t_best = float(back[i]), int(steps[i])
        # the onset: the first step from which every forward level stays above the best by the same margin
        over = np.isfinite(fwd) & ((fwd - best) / se > lim)
        tail = np.where(~over[i:len(steps) - w + 1])[0]
        k = i + (int(tail[-1]) + 1 if len(tail) else 0)
        onset = int(steps[min(k, len(steps) - 1)]) + w // 2  # a forward median crosses half a window early
        near = [x for x in dyn if t_best - w <= x.step <= onset + w // 2]
        inc = min(near, key=lambda x: abs(x.step - onset)) if near else None
        found.append((inc, "damage", f"{q} ends the run at {end:+.3f} against its floor, above the {best:+.3f} it held "
                      f"by step {t_best} ({z[i]:.1f} standard errors, past the budget's {lim:.1f}): lasting damage",
                      {"series": q, "best": best, "best_step": t_best, "end": end, "z": float(z[i]), "limit": lim,
                       "onset": onset}))
    # recurrence: more loss spikes than the run has sources
    spikes = [i for i in dyn if any(family(d.quantity) is not None and family(d.quantity).role == "objective"
                                    and d.baseline is not None and d.value > d.baseline
                                    and i.step <= d.step <= i.step + NEAR for d in i.devs.values())]
    if len(spikes) > len(series):
        found.append((spikes[0], "recurrence", f"the loss spiked {len(spikes)} times (steps "
                      f"{', '.join(str(i.step) for i in spikes)}), more than the run's {len(series)} source(s) can "
                      f"each spike once as its circuit forms: the recipe spikes again and again",
                      {"steps": [i.step for i in spikes]}))
    return found + stall(ctx, series, dyn, last)


def stall(ctx: Context, series: dict, dyn: list, last: int) -> list:
    """A source held far above its floor after an incident, on a recipe moved to its unstable side of its default
    (doctor/levers.py): the default learns this data; this recipe stopped. "Held far": its gap to the floor stayed
    above half what it was at the incident — half beyond its noise — for as long after the incident as the run had
    trained before it (a plateau as long as the run that led to it; the end of the run if it never got halfway).
    A source that got halfway soon after and stopped there is the damage test's (outcome)."""
    from doctor.levers import LEVERS, recipe_default
    if not (ctx.floors or any(r.get("floor_by_source") for r in ctx.seg)):  # a gap needs an exact floor
        return []
    default = recipe_default(ctx.run)
    if default is None:
        return []
    moved = [lv.name for lv in LEVERS.values() if lv.unstable(ctx.run.config, default)]
    if not moved:
        return []
    w = ctx.window
    tests = max(len(series) * len(dyn), 1)
    for inc in dyn:
        if last - inc.step < inc.step:
            continue
        for q, g in series.items():
            if not ctx.tl[q].spec.per_source:
                continue
            steps, _, fwd, sigma, n = _levels(g, w)
            at = [v for t, v in g.items() if inc.step - w <= t < inc.step]
            if sigma <= 0 or len(steps) < 2 * w or len(at) < w // 2:
                continue
            se = sigma * math.sqrt(MEDIAN_EFF / w)
            before = statistics.median(at)
            if before / 2 / se <= threshold(tests, n, 0.0, 1):  # half its gap is within the noise of the floor
                continue
            halfway = _halfway(steps, fwd, before, inc.step)
            reached = last if halfway is None else halfway
            if reached - inc.step >= inc.step:
                end = _end(g, steps, w)
                when = "to the run's end" if halfway is None else f"until step {reached}"
                return [(inc, "stall", f"{q} held more than half the {before:+.3f} nats above its exact floor it had at "
                         f"the incident at step {inc.step} {when} ({reached - inc.step} steps, longer than the run "
                         f"had trained before it; {end:+.3f} at the end), on a recipe moved to its unstable side of "
                         f"its default ({', '.join(moved)}): a stall the default recipe does not have",
                         {"series": q, "before": before, "end": end, "reached": reached, "levers": moved})]
    return held_from_start(ctx, series, moved, default, last)


def held_from_start(ctx: Context, series: dict, moved: list[str], default: dict, last: int) -> list:
    """A recipe that breaks the model before any detector has a baseline leaves no incident: the run's start stands
    in for it. A source that never gets down to half the gap of its first window, in a run at least as long as its
    default recipe's (the length in which the default learns this data), is held: a stall with an incident of its
    own at the end of that first window."""
    from doctor.levers import get
    w = ctx.window
    length = get(default, "train.steps")
    if not isinstance(length, int) or last < length:
        return []
    for q, g in series.items():
        if not ctx.tl[q].spec.per_source:
            continue
        steps, _, fwd, sigma, n = _levels(g, w)
        if sigma <= 0 or len(steps) < 3 * w:
            continue
        first = float(np.median([g[int(t)] for t in steps[:w]]))
        if first / 2 / (sigma * math.sqrt(MEDIAN_EFF / w)) <= threshold(len(series), n, 0.0, 1):
            continue
        if _halfway(steps, fwd, first, int(steps[0])) is None:
            end = _end(g, steps, w)
            return [(None, "stall", f"{q} never got down to half the {first:+.3f} nats above its exact floor of its "
                     f"first {w} steps ({end:+.3f} at the end of a run as long as its default's), on a recipe moved to "
                     f"its unstable side of its default ({', '.join(moved)}): a stall the default recipe does not have",
                     {"series": q, "before": first, "end": end, "levers": moved, "onset": int(steps[w])})]
    return []


def settle(ctx: Context, incidents: list, found: list, make) -> list:
    """Apply the outcome's findings: the incident a finding began at becomes a recipe instability (its lever
    picked from the evidence); a finding with no incident becomes an incident of its own (`make(kind, evidence)`)."""
    from doctor.levers import pick, recipe_default
    default = None
    out = list(incidents)
    for inc, kind, reason, ev in found:
        made = inc is None  # no incident began it: it has no first read to name
        if made:
            inc = make(kind, ev)
            if inc is None:
                continue
            out.append(inc)
        if inc.judgement is not None and inc.judgement.verdict == INSTABILITY:
            inc.judgement.evidence.setdefault("outcome", []).append({"kind": kind, "reason": reason, **ev})
            continue
        prior = inc.judgement.reason if inc.judgement else ""
        inc.judgement = Judgement(INSTABILITY, reason, {**(inc.judgement.evidence if inc.judgement else {}),
                                                        "outcome": [{"kind": kind, "reason": reason, **ev}],
                                                        "first_read": prior})
        if default is None:
            default = recipe_default(ctx.run) or {}
        c = Context(ctx.run, ctx.tl, inc.devs, inc.step, ctx.seg_index, ctx.floors, ctx.start, [], ctx.budget)
        inc.lever = pick(c, inc, default or None)
        was = inc.fault_class
        inc.fault_class = "recipe.instability"
        began = "" if made else f"; the incident began as {was}" + (
            f" ({inc.anomaly.describe() if inc.anomaly else '—'})" if inc.judgement.evidence.get("conforming") else "")
        inc.summary = (f"recipe.instability at step {inc.step}: {reason}{began}"
                       + (", every step conforming to its specification"
                          if inc.judgement.evidence.get("conforming") else ""))
        inc.symptom = CLASSES["recipe.instability"].symptom
    return sorted(out, key=lambda i: (i.seg_index, i.step))

