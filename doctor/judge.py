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
The run's outcome — lasting damage, recurrence, a stall — turns a natural incident into a recipe instability
(doctor/outcome.py).

    j = judge(ctx, diag)             # Judgement(verdict, reason, evidence)
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable

from doctor.budget import threshold
from doctor.checks import NEAR, Context
from doctor.classes import CLASSES
from doctor.diagnosis import FAULT, NATURAL, Judgement
from doctor.scores import MIN_HISTORY, MIN_MEDIAN
from doctor.timeline import MAD_SIGMA, Series, memory
from stability.signals import family

EXACT_KINDS = ("invariant", "exact", "nonfinite", "bound", "spec")
# the variance of a median over a mean's, for Gaussian noise: a median of n has σ²·π/(2n). A step's loss (and each
# source's) is a mean over the batch's hundreds to thousands of tokens, Gaussian by the central limit theorem; a
# flatter noise would need more (the uniform's ratio is 3: its median of n has σ²·3/n), which no loss here has
MEDIAN_EFF = math.pi / 2


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
    unchecked: tuple = ()     # the checks the run ran that did not run at this step (the reference checks')


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
    checked = (f"every check that ran conformed to its specification ({', '.join(f.unchecked)} did not run at step "
               f"{f.step}: they run on some steps only — the reference checks every spec.every steps and where the "
               f"guard flags one, the prefix between them, docs/spec.md)"
               if f.conforming and f.unchecked else
               "every step conformed to its specification" if f.conforming else
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
    ran = {c for r in ctx.seg for c in ((r.get("spec") or {}).get("miss") or {})}
    unchecked = tuple(sorted(ran - set(((at.get("spec") or {}).get("miss") or {}))))
    f = Facts(a.kind, family(a.quantity), CLASSES.get(diag.fault_class), conforms(ctx, t0), rec, a.quantity, t0,
              at.get("spec"), unchecked)
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
