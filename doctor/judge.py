"""Judgement: is an incident a fault, or the run learning? (docs/design.md §7)

A deviation is not yet a fault. An incident is judged `natural` only when all of this holds:
  - what moved first can move on its own (its Signal's `recover`; never an input statistic, an invariant,
    a non-finite value or the optimizer state falling), and its class is one a clean run shows too (a spike
    class: doctor/classes.py `natural`; an update shrinking after a gradient burst is that burst's aftermath),
  - the deviating quantities returned to their band within RECOVER steps, or a level they moved to stayed
    while the run was learning (a layer's activations grow as an induction head forms),
  - the loss did not stay above where it was before the incident (no damage that persists),
  - and it coincides with the run learning: a source's loss starts falling towards its floor around the
    step (an onset: the fall after is steeper than before), the LR warm-up ends there, or a source sat on
    a plateau far above its exact floor that the run left later (a phase transition still to come) — or
    only the online guard's more sensitive test flagged it, the doctor's own calibrated tests reading noise,
    or the same quantity bursts and returns like this elsewhere in the run (its own heavy tail).
Otherwise it is a `fault`, and the evidence says which condition failed. The course notes' distinction:
a bad batch the run recovers from and a state poisoned for good need different handling, and a spike
that comes with a phase transition of learning is neither.

    j = judge(ctx, diag)   # Judgement(verdict, reason, evidence)
"""
from __future__ import annotations

import math
import statistics

import numpy as np
from dataclasses import dataclass, field

from doctor.checks import Context
from doctor.classes import CLASSES
from doctor.scores import guard_test
from doctor.timeline import CHANGE, CHANGE_LAYER, MAD_SIGMA, SUSTAINED, THRESHOLD, WINDOW, Series
from stability.signals import family

RECOVER = 10     # steps within which a transient is back in its band (a telemetry step later for sparse layers)
BAND_Z = 4.0     # in its band: the directed robust z against the window before the incident is below this
PERSIST_Z = 4.0  # a level persists: the median after the recovery window is this far out of the band
LEARN = 20       # steps either side of the incident in which a learning transition coincides with it
ONSET = 2.0      # an onset of learning: the loss falls at least this many times faster after than before
FALL_MIN = 0.05  # nats: the least fall of a source's loss over LEARN steps that counts as learning
FALL_GAP = 0.1   # ... and the least share of its gap to the exact floor (when the floor is known)
WARMUP_NEAR = 3  # steps from the end of the LR warm-up within which an incident coincides with it
SUDDEN = 0.6     # a level reached with this share of its move in one reading is a step change, not growth
PLATEAU = 0.3    # nats above its exact floor: a source the run has yet to learn
NEAR_LIMIT = 0.7  # a move elsewhere in the run at this share of its test's threshold is the same kind of move ...
AGAIN = 2         # ... and this many of them make it the run's own heavy tail


@dataclass
class Judgement:
    verdict: str                 # natural | fault
    reason: str                  # one line
    evidence: dict = field(default_factory=dict)


def _values(s: Series, lo: int, hi: int) -> list[tuple[int, float]]:
    return [(t, v) for t, v in sorted(s.values.items()) if lo <= t < hi and math.isfinite(v)]


def _y(s: Series, v: float) -> float:
    return math.log(max(v, 1e-30)) if s.spec.log else v


def _band(s: Series, t0: int) -> tuple[float, float] | None:
    """(median, noise scale) of the series over its last WINDOW readings before t0 (steps, or telemetry
    steps for a per-layer series), on its scoring scale."""
    ys = [_y(s, v) for _, v in _values(s, -1, t0)][-WINDOW:]
    if len(ys) < 5:
        return None
    med = statistics.median(ys)
    mad = statistics.median(abs(y - med) for y in ys)
    floor = s.spec.rel_floor if s.spec.log else s.spec.rel_floor * abs(med)
    pf = s.spec.point_floor if isinstance(s.spec.point_floor, float) else 0.0
    return med, max(MAD_SIGMA * mad, floor, pf if s.spec.log else 0.0) + s.spec.abs_floor


def _z(s: Series, v: float, med: float, scale: float, sign: float) -> float:
    return sign * (_y(s, v) - med) / scale


def recovery(s: Series, t0: int, last: int) -> dict | None:
    """How one deviating series behaved after t0: the steps until it was back in its band (and stayed for
    the next two values), and the level it held after the recovery window (None: no band to judge by)."""
    band = _band(s, t0)
    at = s.values.get(t0)
    if band is None or at is None or not math.isfinite(at):
        return None  # too few readings before it to say what its band was
    med, scale = band
    sign = 1.0 if _y(s, at) >= med else -1.0
    after = _values(s, t0 + 1, last + 1)
    back = None
    for i, (t, v) in enumerate(after):
        nxt = after[i:i + 3]
        if len(nxt) == 3 and all(_z(s, x, med, scale, sign) < BAND_Z for _, x in nxt):
            back = t - t0
            break
    late = [v for _, v in _values(s, t0 + RECOVER, t0 + RECOVER + WINDOW)]
    level = (_z(s, statistics.median(late), med, scale, sign) if len(late) >= 5 else None)
    # NOTE: how much of the move happened at t0 itself, against its value one reading before: a layer
    # that grows as the model learns gets there over several readings; a fault moves it in one
    prev = [v for _, v in _values(s, t0 - WINDOW, t0)][-1:]
    jump = _z(s, at, _y(s, prev[0]), scale, sign) if prev else None
    end = late or [v for _, v in after]
    total = _z(s, statistics.median(end), med, scale, sign) if end else None
    sudden = jump is not None and total is not None and total > 0 and jump > SUDDEN * total
    return {"returned": back, "level_z": level, "direction": "up" if sign > 0 else "down", "sudden": sudden,
            "after": len(after)}


def learning(ctx: Context, t0: int) -> tuple[str | None, str | None]:
    """(onset, falling): a source's loss starting to fall around t0 (it falls more over the LEARN steps
    centred LEARN after t0 than it did over the LEARN before), and a source's loss falling towards its floor
    at all around t0 — each as one line of evidence, or None. NOTE: the look-ahead is centred a window after
    the step: the gradient finds a new direction (an induction head) steps before the loss shows it."""
    floors = ctx.floors or {}
    onset = falling = None
    by_source = any(q.startswith("loss_by_source/") for q in ctx.tl)
    for q, s in ctx.tl.items():
        # NOTE: per source where the run has sources: the total moves with each batch's composition
        if not (q.startswith("loss_by_source/") if by_source else q == "loss"):
            continue
        src = q.split("/", 1)[1] if "/" in q else None
        pre = [v for _, v in _values(s, t0 - 2 * LEARN, t0 - LEARN)]
        before = [v for _, v in _values(s, t0 - LEARN, t0)]
        after = [v for _, v in _values(s, t0 + LEARN // 2, t0 + LEARN // 2 + LEARN)]
        if len(before) < 5 or len(after) < 5:
            continue
        a, b = statistics.median(before), statistics.median(after)
        fall = a - b
        gap = a - floors[src] if src in floors else None
        need = max(FALL_MIN, FALL_GAP * gap) if gap is not None and gap > 0 else FALL_MIN
        if fall < need:
            continue
        what = (f"{src or 'the'} loss falling from {a:.3f} (steps {t0 - LEARN}..{t0 - 1}) to {b:.3f} (steps "
                f"{t0 + LEARN // 2}..{t0 + LEARN // 2 + LEARN - 1})" + (f", floor {floors[src]:.3f}" if src in floors else ""))
        falling = falling or what
        prior = a - statistics.median(pre) if len(pre) >= 5 else None
        # NOTE: before the incident the loss was flat or fell slower: the run started learning here
        if prior is None or -prior * ONSET <= fall:
            onset = onset or what + (f", after {prior:+.3f} over the {LEARN} steps before" if prior is not None else "")
    warm = (((ctx.run.config.get("optim") or {}).get("schedule") or {}).get("warmup_steps")) or 0
    if warm and abs(t0 - int(warm)) <= WARMUP_NEAR:
        onset = onset or f"the LR warm-up ends at step {warm}"
        falling = falling or onset
    return onset, falling


def pending(ctx: Context, t0: int) -> str | None:
    """A source the run had yet to learn at t0 and learned later: its loss sat more than PLATEAU nats above
    its exact floor around t0 and closed at least half that gap by the run's end. A plateau before a phase
    transition (the copy source at log V before its induction head) is where a model's first sharp
    gradients come; one the run goes on to leave is the run learning, not a fault."""
    floors = ctx.floors or {}
    last = ctx.seg[-1]["step"]
    for q, s in ctx.tl.items():
        src = q.split("/", 1)[1] if q.startswith("loss_by_source/") else None
        if src not in floors:
            continue
        at = [v for _, v in _values(s, t0 - LEARN, t0)]
        end = [v for _, v in _values(s, last - LEARN + 1, last + 1)]
        if len(at) < 5 or len(end) < 5 or last - t0 < 2 * LEARN:
            continue
        gap, left = statistics.median(at) - floors[src], statistics.median(end) - floors[src]
        if gap > PLATEAU and left < gap / 2:
            return (f"{src} was yet to be learned: its loss {gap:+.3f} nats from its floor around step {t0}, "
                    f"{left:+.3f} at the run's end (step {last})")
    return None


def aftermath(ctx: Context, a, rec: dict) -> str | None:
    """An update that shrank within the optimizer's memory of a gradient burst: Adam's ‖v‖ took the burst's g²
    and forgets it over ~1/(1−β₂) steps, so that layer's updates fall meanwhile. The burst's own incident is
    judged on its own; this one is its consequence, not a second fault."""
    if not a.quantity.startswith("update_ratio") or rec[a.quantity]["direction"] != "down":
        return None
    burst = [i for i in ctx.earlier if i.anomaly is not None and 0 < a.step - i.step <= WINDOW and
             any(q.startswith(("grad_norm", "grad_rms")) and d.value > (d.baseline or math.inf)
                 for q, d in i.devs.items() if i.step <= d.step <= i.step + 1)]
    if not burst:
        return None
    return (f"{a.quantity} fell at step {a.step}, {a.step - burst[-1].step} steps after the gradient burst at step "
            f"{burst[-1].step}: Adam's second moment still holds that burst and shrinks the update until it forgets "
            f"it (~1/(1−β₂) steps)")


def recurrent(ctx: Context, a) -> list[int]:
    """Other steps of the run at which the same series moved the same way (the test that flagged this incident,
    or a one-step test, at NEAR_LIMIT of its threshold or more), away from this incident — AGAIN of them or
    none: a quantity that bursts and returns again and again with nothing persisting is the run's own heavy
    tail (an attention layer's gradient, a bimodal logit max), not one fault."""
    s = ctx.tl.get(a.quantity)
    sc = next(iter(s.cache.values()), None) if s is not None else None
    if sc is None:
        return []
    steps = sc.steps[:sc.nf]
    limits = {"point": THRESHOLD, "guard": guard_test(ctx.run.config).threshold,
              "change": max(CHANGE, CHANGE_LAYER) if sc.per_layer else CHANGE, "sustained": SUSTAINED}
    # the test that flagged this incident, the one-step and the level tests: the same kind of move elsewhere
    kinds = {"point", "guard", "change", a.kind} & set(sc.z) & set(limits)
    hit = np.zeros(len(steps), dtype=bool)
    for k in kinds:
        hit |= sc.z[k][:len(steps)] > NEAR_LIMIT * limits[k]
    far = abs(steps - a.step) > RECOVER
    again = [int(t) for t in steps[hit & far & (steps >= ctx.start)]]
    return again if len(again) >= AGAIN else []


def own_noise(ctx: Context, a) -> bool:
    """Did only the guard's own, more sensitive test flag it (the doctor's own tests, calibrated on clean
    runs, stayed under their thresholds at that step)?"""
    if a.kind != "guard":
        return False
    s = ctx.tl.get(a.quantity)
    sc = next(iter(s.cache.values()), None) if s is not None else None
    if sc is None:
        return False
    idx = [i for i, t in enumerate(sc.steps[:sc.nf].tolist()) if t == a.step]
    if not idx:
        return False
    i = idx[0]
    return all(not (sc.z[k][i] > lim) for k, lim in (("point", THRESHOLD), ("change", CHANGE), ("sustained", SUSTAINED))
               if k in sc.z)


def loss_damage(ctx: Context, t0: int) -> str | None:
    """The loss (total, or any source's) held above its pre-incident level after the recovery window."""
    for q, s in ctx.tl.items():
        if not (q == "loss" or q.startswith("loss_by_source/")):
            continue
        before = [v for _, v in _values(s, t0 - WINDOW, t0)]
        late = [v for _, v in _values(s, t0 + RECOVER, t0 + RECOVER + WINDOW)]
        if len(before) < 10 or len(late) < 10:
            continue
        med = statistics.median(before)
        mad = statistics.median(abs(v - med) for v in before)
        up = statistics.median(late) - med
        if up > max(PERSIST_Z * MAD_SIGMA * mad / math.sqrt(len(late)), 0.02 * abs(med), FALL_MIN):
            return (f"{q} held at {statistics.median(late):.4g} over steps {t0 + RECOVER}..{t0 + RECOVER + WINDOW - 1} "
                    f"against {med:.4g} before the incident")
    return None


def judge(ctx: Context, diag) -> Judgement:
    a, t0 = diag.anomaly, diag.step
    last = ctx.seg[-1]["step"]
    sig = family(a.quantity) if a is not None else None
    ev: dict = {}
    if a is None or t0 is None:
        return Judgement("fault", "no anomalous step", ev)
    if a.kind in ("invariant", "exact", "nonfinite") or sig is None or not sig.recover:
        why = ("an exact invariant broke" if a.kind in ("invariant", "exact") else
               "a non-finite value" if a.kind == "nonfinite" else f"{a.quantity} does not move this way on its own")
        return Judgement("fault", f"{why}: {a.quantity} at step {t0}", ev)
    cls = CLASSES.get(diag.fault_class)
    natural_class = cls is not None and cls.natural
    moved = {q: d for q, d in diag.devs.items() if t0 <= d.step <= t0 + 1 and q in ctx.tl and d.kind not in
             ("invariant", "exact", "nonfinite")}
    moved.setdefault(a.quantity, a)
    rec = {q: r for q, d in moved.items() if q in ctx.tl and (r := recovery(ctx.tl[q], d.step, last)) is not None}
    if not rec:
        return Judgement("fault", f"{a.quantity} at step {t0}: too few readings before it to judge its recovery", ev)
    ev["recovery"] = {q: r for q, r in rec.items()}
    onset, falling = learning(ctx, t0)
    ev["learning"] = onset or falling
    damage = loss_damage(ctx, t0)
    ev["loss_damage"] = damage
    # per-layer series are read every telemetry step: a return is allowed one cadence later
    cadence = max((_cadence(ctx.tl[q]) for q in rec), default=1)
    # NOTE: within three readings of the run's end a return cannot be seen: neither stuck nor returned
    unseen = [q for q, r in rec.items() if r["returned"] is None and r.get("after", 0) < 3]
    stuck = [q for q, r in rec.items() if q not in unseen and (r["returned"] is None or r["returned"] > RECOVER + cadence)]
    persists = [q for q, r in rec.items() if r["level_z"] is not None and r["level_z"] > PERSIST_Z]
    # NOTE: a quantity that counts only beside a run-level one (its Signal's `needs`: one layer's gradient RMS
    # beside the gradient norm) persists only when that one does too
    backed = {q for q in stuck + persists if not _unbacked(ctx, q, rec, stuck + persists)}
    stuck, persists = [q for q in stuck if q in backed], [q for q in persists if q in backed]
    if damage:
        return Judgement("fault", f"damage persists: {damage}", ev)
    again = recurrent(ctx, a)
    ev["recurrent"] = again
    tail = (f"{a.quantity} bursts like this on its own in this run (also at step {', '.join(map(str, again[:5]))}"
            f"{', ...' if len(again) > 5 else ''}): the run's own heavy tail") if again else None
    # NOTE: a quantity whose one-step anomalies are upward only (its Signal's `point`) that dipped and came back is
    # no outlier: only a level that persists makes a fall anomalous
    dip = (f"{a.quantity} fell and came back" if sig.point == "up" and rec[a.quantity]["direction"] == "down"
           else None)
    after = aftermath(ctx, a, rec)
    ev["aftermath"] = after
    if after:
        return Judgement("natural", after, ev)
    if not natural_class:
        return Judgement("fault", f"{diag.fault_class}: {cls.means if cls else 'a fault class'} — a fault whatever "
                         f"happens after it", ev)
    if stuck or persists:
        q = (stuck + persists)[0]
        late = rec[q]["returned"]
        held = (f"came back to its band only {late} steps after step {t0}" if q in stuck and late is not None else
                "had not returned to its band" + (f" by the run's end (step {last})" if last - t0 <= RECOVER + cadence
                                                  else f" {RECOVER + cadence} steps after step {t0}")
                if q in stuck else f"held a new level after step {t0}")
        # a step change that held (its level measured after the recovery window, or it never came back), not
        # one that came back late while the run learned
        sudden = [x for x in stuck + persists if rec[x].get("sudden") and (x in persists or rec[x]["returned"] is None)]
        if sudden:
            return Judgement("fault", f"{sudden[0]} stepped to a new level at step {t0} in one reading and held it", ev)
        ahead = falling or pending(ctx, t0)
        if ahead:  # NOTE: a model that learns changes its internals: a level moves as the loss falls
            return Judgement("natural", f"{q} {held}, without a step change, while the run learned ({ahead}); "
                             f"the loss took no damage", ev)
        if not persists and all(rec[x]["returned"] is not None for x in stuck) and (tail or dip):
            return Judgement("natural", f"{q} {held}, nothing persists, and {tail or dip}", ev)
        return Judgement("fault", f"{q} {held}, with no source's loss falling", ev)
    if unseen:
        if own_noise(ctx, a):
            return Judgement("natural", f"at the run's end (step {last}), and only the online guard's more sensitive "
                             f"test flagged it: the doctor's own tests read the run's noise", ev)
        return Judgement("fault", f"{unseen[0]} deviated at the run's end (step {last}): no return to its band can "
                         f"be seen", ev)
    # how long it took, over the quantities that count on their own (a `needs` one follows its run-level one)
    back = max(r["returned"] for q, r in rec.items() if r["returned"] is not None and not _unbacked(ctx, q, rec, []))
    ok = f"back in its band within {back} step(s), nothing persists"
    if onset:
        return Judgement("natural", f"{ok}, at a learning transition: {onset}", ev)
    ahead = pending(ctx, t0)
    ev["pending"] = ahead
    if ahead:
        return Judgement("natural", f"{ok}, while the run was still learning: {ahead}", ev)
    if own_noise(ctx, a):
        return Judgement("natural", f"{ok}, and only the online guard's more sensitive test flagged it: the doctor's "
                         f"own tests, calibrated on clean runs, read it as the run's noise", ev)
    if tail or dip:
        return Judgement("natural", f"{ok}, and {tail or dip}", ev)
    return Judgement("fault", f"back in its band, but at no learning transition (no source's loss starts falling "
                     f"within {LEARN} steps, no warm-up end) and unlike anything else in the run: a fault the run "
                     f"recovered from", ev)


def _unbacked(ctx: Context, q: str, rec: dict, held: list[str]) -> bool:
    need = ctx.tl[q].spec.needs
    return bool(need) and need in rec and need not in held


def _cadence(s: Series) -> int:
    steps = sorted(s.values)
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    return statistics.median(gaps) if gaps else 1
