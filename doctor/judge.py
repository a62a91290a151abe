"""Judgement by cause, not coincidence (docs/design.md §7): is an incident an execution fault, the run's own
behaviour, or its recipe's instability?

An incident's verdict, by the first of these that holds (VERDICTS, in order):
  fault        an exact invariant broke or a value is non-finite: a fault whatever the run does after it;
  natural      what moved first is vouched for by a specification check that ran at its step and passed (its
               Signal's `vouched`: an input statistic by the data check — the batch is exactly the content its
               sample ids name, so an unusual statistic is the data's own, not a corruption);
  fault        what moved first cannot move on its own (an input statistic, the optimizer state falling, a
               setting, a loss below its floor): a fault whatever the run does after it. So is a class that names a broken invariant or a changed setting
               (doctor/classes: not `dynamics`), and — where no specification check ran to say the step did what
               it was told — a quantity that stepped to a new level in one reading and held it.
  natural      otherwise: the run's own dynamics. Under steps that conform to their specification (record v5
               `spec`, doctor/conformance.py) a spike is what the recipe does; it is natural unless the run
               takes lasting damage.
Then the run's outcome (`outcome`, per segment whose steps ran their checks) turns a natural incident into a
**recipe instability** where
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

    j = judge(ctx, diag)             # Judgement(verdict, reason, evidence)
    found = outcome(ctx, incidents)  # [(incident or None, kind, reason, evidence)]
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable

import numpy as np

from doctor.budget import threshold
from doctor.checks import NEAR, Context
from doctor.classes import CLASSES
from doctor.diagnosis import FAULT, INSTABILITY, NATURAL, Judgement
from doctor.scores import MIN_HISTORY, MIN_MEDIAN
from doctor.timeline import MAD_SIGMA, Series, memory
from stability.signals import family

EXACT_KINDS = ("invariant", "exact", "nonfinite", "bound", "spec")
MEDIAN_EFF = math.pi / 2  # the variance of a median over a mean's (Gaussian noise): a median of n has σ²·π/(2n)


def _values(s: Series, lo: int, hi: int) -> list[tuple[int, float]]:
    return [(t, v) for t, v in sorted(s.values.items()) if lo <= t < hi and math.isfinite(v)]


def _y(s: Series, v: float) -> float:
    return math.log(max(v, 1e-300)) if s.spec.log else v


def cadence(s: Series) -> int:
    steps = sorted(s.values)
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    return int(statistics.median(gaps)) if gaps else 1


def recover_steps(ctx: Context, s: Series) -> int:
    """Steps within which a transient is back in its band: the optimizer's memory (Adam's ‖v‖ holds a burst's g²
    for 1/(1 − β₂) steps, and the update and the loss follow it), plus one reading of a sparse series."""
    return max(memory(ctx.run.config.get("optim") or {}), 1) + cadence(s)


def recovery(ctx: Context, s: Series, t0: int, last: int) -> dict | None:
    """How one deviating series behaved after t0, against its band (median and spread of the window before):
    the steps until it was back (and stayed the next two readings: a median of three), whether the level it held
    after the recovery window is still out of band, and whether it got there in one reading (stepped) rather than
    growing over several (the model's internals move gradually as it learns; a code path switches at once)."""
    pre = [_y(s, v) for _, v in _values(s, -1, t0)][-ctx.window:]
    at = s.values.get(t0)
    if len(pre) < MIN_HISTORY or at is None or not math.isfinite(at):  # the budget's least baseline (scores.py)
        return None
    med = statistics.median(pre)
    floor = s.spec.rel_floor if s.spec.log else s.spec.rel_floor * abs(med)
    scale = max(MAD_SIGMA * statistics.median(abs(y - med) for y in pre), floor) + s.spec.abs_floor or 1e-300
    sign = 1.0 if _y(s, at) >= med else -1.0
    lim = threshold(ctx.budget.tests, len(pre), 0.0, 1)

    def z(v: float) -> float:
        return sign * (_y(s, v) - med) / scale
    after = _values(s, t0 + 1, last + 1)
    back = None
    for i, (t, v) in enumerate(after):
        nxt = after[i:i + MIN_MEDIAN]
        if len(nxt) == MIN_MEDIAN and all(z(x) < lim for _, x in nxt):
            back = t - t0
            break
    R = recover_steps(ctx, s)
    late = [_y(s, v) for _, v in _values(s, t0 + R, last + 1)]
    # the median of the late readings, in its own standard error (a median of n: σ·√(π/2n))
    level = (sign * (statistics.median(late) - med) / (scale * math.sqrt(MEDIAN_EFF / len(late)))
             if len(late) >= MIN_MEDIAN else None)
    prev = [v for _, v in _values(s, t0 - ctx.window, t0)][-1:]
    jump = z(at) - z(prev[0]) if prev else None
    total = level * math.sqrt(MEDIAN_EFF / len(late)) if level is not None else None
    # NOTE: more than half of the move in one reading: nearer a step than a ramp (the midpoint between the two)
    stepped = jump is not None and total is not None and total > 0 and jump > total / 2
    return {"returned": back, "level_z": level, "limit": lim, "direction": "up" if sign > 0 else "down",
            "stepped": stepped, "held": level is not None and level > lim, "recover": R, "after": len(after)}


def conforms(ctx: Context, t0: int) -> bool | None:
    """Did the steps of the incident run their specification checks (record v5 `spec`)? True: they ran and none
    failed (a failure is an execution fault of its own, doctor/conformance.py); None: the records carry none."""
    recs = [r for r in ctx.seg if t0 <= r["step"] <= t0 + NEAR]
    spec = [r.get("spec") for r in recs]
    if not spec or not all(isinstance(x, dict) and x.get("miss") for x in spec):
        return None
    return not any(x.get("fail") for x in spec)


@dataclass
class Facts:
    """What an incident's verdict reads."""
    kind: str            # the first deviation's test kind
    signal: object       # its Signal (None: an invariant or a check)
    cls: object          # its FaultClass
    conforming: bool | None
    rec: dict            # quantity -> recovery()
    quantity: str
    step: int
    spec: dict | None = None  # the step's own specification checks (record v5 `spec`)


def _exact(f: Facts) -> str | None:
    if f.kind in EXACT_KINDS:
        return ("an exact invariant broke" if f.kind in ("invariant", "exact", "bound") else
                "a non-finite value" if f.kind == "nonfinite" else "a specification check failed") + \
            f": {f.quantity} at step {f.step}"
    return None


def _vouched(f: Facts) -> str | None:
    check = f.signal.vouched if f.signal is not None else None
    miss = (f.spec or {}).get("miss") or {}
    if check is None or check not in miss or (f.spec or {}).get("fail") or not miss[check] <= 1:
        return None
    return (f"the {check} check ran at step {f.step} and passed ({miss[check]:.2g}× its tolerance): {f.quantity} "
            f"moved with the step doing what it was told — the run's own (its data, its optimizer), not a fault")


def _cannot_move(f: Facts) -> str | None:
    if f.signal is None or not f.signal.recover:
        return f"{f.quantity} does not move this way on its own (step {f.step})"
    return None


def _not_dynamics(f: Facts) -> str | None:
    if f.cls is None or not f.cls.dynamics:
        return (f"{f.cls.name if f.cls else '?'}: {f.cls.means if f.cls else 'a fault class'} — a fault whatever "
                f"happens after it")
    return None


def _unchecked_step(f: Facts) -> str | None:
    if f.conforming:
        return None
    held = [q for q, r in f.rec.items() if r["stepped"] and r["held"]]
    if held:
        return (f"{held[0]} stepped to a new level at step {f.step} in one reading and held it, and no specification "
                f"check ran to say the step did what it was told")
    return None


def _natural(f: Facts) -> str:
    back = [r["returned"] for r in f.rec.values() if r["returned"] is not None]
    held = [q for q, r in f.rec.items() if r["held"]]
    how = (f"back in its band within {max(back)} step(s)" if back and not held else
           f"{held[0]} held a new level (the model's internals moving as it learns)" if held else
           "no return can be seen before the run's end")
    checked = ("every step conformed to its specification" if f.conforming else
               "the records carry no specification check" if f.conforming is None else
               "a specification check failed at its steps (an incident of its own)")
    return f"{how}; {checked}, and the run took no lasting damage: the run's own behaviour"


# the verdicts, in order: the first that holds decides (a verdict's predicate returns its reason, or None)
VERDICTS: list[tuple[str, Callable[[Facts], str | None]]] = [
    (FAULT, _exact), (NATURAL, _vouched), (FAULT, _cannot_move), (FAULT, _not_dynamics), (FAULT, _unchecked_step),
]


def judge(ctx: Context, diag) -> Judgement:
    """An incident's verdict: FAULT, or NATURAL until the run's outcome says otherwise (`outcome`)."""
    a, t0 = diag.anomaly, diag.step
    if a is None or t0 is None:
        return Judgement(FAULT, "no anomalous step", {})
    last = ctx.seg[-1]["step"]
    moved = {q: d for q, d in diag.devs.items() if t0 <= d.step <= t0 + NEAR and q in ctx.tl
             and d.kind not in EXACT_KINDS}
    if a.quantity in ctx.tl:
        moved.setdefault(a.quantity, a)
    rec = {q: r for q, d in moved.items() if (r := recovery(ctx, ctx.tl[q], d.step, last)) is not None}
    # NOTE: a quantity that counts only beside a run-level one (its Signal's `needs`) holds only when that one does
    rec = {q: ({**r, "held": False} if _unbacked(ctx, q, rec) else r) for q, r in rec.items()}
    at = ctx.rec(t0) or {}
    f = Facts(a.kind, family(a.quantity), CLASSES.get(diag.fault_class), conforms(ctx, t0), rec, a.quantity, t0,
              at.get("spec"))
    ev = {"recovery": rec, "conforming": f.conforming}
    for verdict, rule in VERDICTS:
        why = rule(f)
        if why:
            return Judgement(verdict, why, ev)
    return Judgement(NATURAL, _natural(f), ev)


def _unbacked(ctx: Context, q: str, rec: dict) -> bool:
    need = ctx.tl[q].spec.needs
    return bool(need) and need in rec and not rec[need]["held"]


# ---- the run's outcome ----------------------------------------------------------------------------------
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
    # damage: the end level above the best level held before, over every candidate level (~ scored steps / w
    # independent ones) of every objective series
    tests = max(len(series) * max((last - start) // max(w, 1), 1), 1)
    for q, g in series.items():
        steps, back, fwd, sigma, n = _levels({t: v for t, v in g.items() if t >= start - w}, w)
        if sigma <= 0 or n < 2 * w or len(steps) < 3 * w:  # a level before, a candidate best, the end: three windows
            continue
        end = float(np.median([g[int(t)] for t in steps[-w:]]))
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
    return found + stall(ctx, series, dyn)


def stall(ctx: Context, series: dict, dyn: list) -> list:
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
    w, last = ctx.window, ctx.seg[-1]["step"]
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
            # the first window after the incident whose median is down to half the gap: the source got halfway
            down = np.where((steps >= inc.step) & np.isfinite(fwd) & (fwd <= before / 2))[0]
            reached = int(steps[down[0]]) if len(down) else last
            if reached - inc.step >= inc.step:
                end = statistics.median(g[int(t)] for t in steps[-w:])
                when = f"until step {reached}" if len(down) else "to the run's end"
                return [(inc, "stall", f"{q} held more than half the {before:+.3f} nats above its exact floor it had at "
                         f"the incident at step {inc.step} {when} ({reached - inc.step} steps, longer than the run "
                         f"had trained before it; {end:+.3f} at the end), on a recipe moved to its unstable side of "
                         f"its default ({', '.join(moved)}): a stall the default recipe does not have",
                         {"series": q, "before": before, "end": end, "reached": reached, "levers": moved})]
    return held_from_start(ctx, series, moved, default)


def held_from_start(ctx: Context, series: dict, moved: list[str], default: dict) -> list:
    """A recipe that breaks the model before any detector has a baseline leaves no incident: the run's start stands
    in for it. A source that never gets down to half the gap of its first window, in a run at least as long as its
    default recipe's (the length in which the default learns this data), is held: a stall with an incident of its
    own at the end of that first window."""
    from doctor.levers import get
    w, last = ctx.window, ctx.seg[-1]["step"]
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
        if not (np.isfinite(fwd) & (fwd <= first / 2)).any():
            end = float(np.median([g[int(t)] for t in steps[-w:]]))
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
        if inc is None:
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
        inc.summary = (f"recipe.instability at step {inc.step}: {reason}; the incident began as {was} "
                       f"({inc.anomaly.describe() if inc.anomaly else '—'}), every step conforming to its specification"
                       if inc.judgement.evidence.get("conforming") else
                       f"recipe.instability at step {inc.step}: {reason}; the incident began as {was}")
        inc.symptom = CLASSES["recipe.instability"].symptom
    return sorted(out, key=lambda i: (i.seg_index, i.step))

