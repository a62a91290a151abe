"""The doctor reads the step's specification checks first (record v5 `spec`, spec/monitor.py).

A failed check is an execution fault at its step: the step did not do what its specification says, whatever
the run did afterwards, so no threshold of the doctor's is involved — the check measured how far it missed
against the tolerance its precision recipe allows, and declared the class its way of failing implies. Within a
step the first failure in the registry's order (the state the step started from, its data, forward, gradient,
update, system) is the one that broke first. A check that keeps failing step after step at the same place is
one incident, at its onset; so are two checks of one family failing in turn at a place (a failure's `family`:
the prefix check, every step between the reference steps, checks the forward check's layers on the first and last
positions of a row of the step's own batch).

A check that runs on reference steps only (the FP64 reference's: every spec.every steps) finds a fault up to
spec.every − 1 steps after it began. Where the check declares a per-step series of its places (its "series": the
forward check's, every layer's output RMS; the exact check's, every layer's miss on the steps between, which the
prefix check records; the gradient check's, every parameter's gradient norm), the failure is
dated within (the step it last held, the step it failed]: at the step from which the failing place's log series
stands off its course by a step that lasts to the failure (a parabola fitted with the step over the 2·gap steps
before the gap and the gap's own: a smooth trend is the parabola, `level_shift`) — when it clears the prediction
bound the false-alarm budget sets for as many candidate steps as the gap holds (doctor/budget.py). A check that
failed beside it at the same step and held at a step of the gap bounds the onset after that step: a check fails
only for a fault, so the fault had not begun there (the route check, every step, holding while the forward check's
gates were not compared); and so does a check of its family that held in the gap (its `between`: the prefix
check, which fails at the fault's own step where it sees it). Otherwise it stays at the step the check failed: the
first step the records show it, as
when its check runs every step, or ran at the step before on the guard's demand (spec/monitor.py on_demand).
"""
from __future__ import annotations

import math

import numpy as np

from doctor.budget import ALPHA, t_isf
from doctor.checks import Check
from doctor.classes import symptom
from doctor.diagnosis import Judgement
from doctor.diagnosis import Diagnosis
from doctor.timeline import LAYERS, Deviation, Run


def spec_incidents(run: Run) -> list[Diagnosis]:
    """Every onset of a failed specification check, in execution order (segment, step). A failure that goes on with
    one of the segment's incidents after steps that held is that incident again, not a new one: the same
    specification broken the same way at the same place (a fault the prefix check meets on some rows only, and
    misses on the others)."""
    out: list[Diagnosis] = []
    for k, seg in enumerate(run.segments):
        seen: list[dict] = []  # the segment's failures so far, of every incident
        for i, rec in enumerate(seg):
            fails = (rec.get("spec") or {}).get("fail") or []
            if not fails:
                continue
            f = fails[0]
            if not any(same_incident(g, f) for g in seen):
                out.append(incident(rec, f, k, len(fails), earliest_onset(seg, i, fails)))
            seen.append(f)
    return out


def same_incident(a: dict, b: dict) -> bool:
    """Whether failure b, at a step after failure a, goes on with a's incident: the same check failing the same way at
    the same place, or a check of its family at that place (spec/checks/prefix.py checks the forward check's layers
    on the steps between: how the layer missed is the forward check's to class, on its own steps)."""
    if a.get("where") != b.get("where"):
        return False
    if a["check"] == b["check"]:
        return a.get("kind") == b.get("kind")
    return (a.get("family") or a["check"]) == (b.get("family") or b["check"])


def earliest_onset(seg: list[dict], i: int, fails: list[dict]) -> tuple[dict, int, dict] | None:
    """The onset of the step's first failure, from its own series or from that of a failure beside it at the same
    place, whichever dates it earlier (each check fails only for a fault, so each series that stands off its course
    shows the fault at that place already acting): (the onset's record, the step its check last held, the failure
    whose series dated it); None: dated at its own step. A rounding of a layer's values (bf16) can fail the forward
    check, whose series (the output RMS) it leaves in place, beside the exact check, whose series (the prefix check's
    miss between the reference steps) it moves by orders of magnitude."""
    place = fails[0].get("where")
    dated = [(*d, g) for g in fails if g.get("where") == place and (d := onset(seg, i, g)) is not None]
    return min(dated, key=lambda d: d[0]["step"]) if dated else None


def onset(seg: list[dict], i: int, f: dict) -> tuple[dict, int] | None:
    """(the onset's record, the step the check last held) of the failure `f` at seg[i] when the check did not run
    at the step before and its series dates it (this module's doc); None: dated at its own step."""
    check, series, where = f["check"], f.get("series"), f.get("where")
    held = None
    for j in range(i - 1, -1, -1):
        miss = ((seg[j].get("spec") or {}).get("miss") or {}).get(check)
        if miss is not None:
            held = j if isinstance(miss, (int, float)) and miss <= 1 else None
            break
    if held is None or not series or where is None:
        return None
    lo, hi = seg[held]["step"], seg[i]["step"]
    # the checks that failed beside it at its step and ran within the gap: where one of them held, the fault had not
    # begun yet (a check is exact: it fails only for a fault), so the onset is after the last such step
    # so do the checks of its family that check its places on the steps it does not run (`between`)
    beside = ({g["check"] for g in (seg[i].get("spec") or {}).get("fail") or []} | set(f.get("between") or [])) - {check}
    clean = next((j for j in range(i - 1, held, -1)
                  if any(isinstance(m, (int, float)) and m <= 1
                         for m in (((seg[j].get("spec") or {}).get("miss") or {}).get(c) for c in beside))), held)
    candidates = seg[clean + 1:i + 1]  # the records of the gap the onset can be in
    gap = len(candidates)
    if gap <= 1:
        return None
    # the place's log series over 2·gap steps before the candidates and the candidates; a series may be a number of
    # the record itself (the step's aux_loss)
    window = seg[max(0, clean - 2 * gap):i + 1]
    y = {r["step"]: _value(r, series, where) for r in window}
    y = {t: math.log(v) if v > 0 else -math.inf for t, v in y.items()
         if isinstance(v, (int, float)) and math.isfinite(v) and v >= 0}
    first = seg[clean]["step"]
    # a positive value that became exactly 0 changed without bound: dated there
    zero = next((t for t in sorted(y)
                 if first < t <= hi and y[t] == -math.inf and math.isfinite(y.get(t - 1, -math.inf))), None)
    if zero is not None:
        return (next(r for r in candidates if r["step"] == zero), lo) if zero != hi else None
    shift = level_shift({t: v for t, v in y.items() if t <= first and math.isfinite(v)},
                        {t: v for t, v in y.items() if first < t <= hi and math.isfinite(v)}, gap)
    if shift is None or shift == hi:  # at the failing step itself: nothing to date
        return None
    return next(r for r in candidates if r["step"] == shift), lo


def level_shift(before: dict[int, float], inside: dict[int, float], gap: int) -> int | None:
    """The step s of the gap from which the series stands off its course by a step, when it does beyond the budget's
    bound; None otherwise.

    The model, over the window (the steps before the gap and the gap's): y_t = a + b·t + c·t² + δ·[t ≥ s] + ε, ε
    independent with one spread. The smooth course is a parabola, fitted with the shift: a trend and its bending (the
    warm-up's fast rise levelling off) are not a shift, and every step from s to the failure counts, not one
    step-to-step change. For each candidate s, least squares; the change point is the s of the least residual sum;
    it is dated when its δ's t statistic clears t(α/(2·gap), n − 4): two-sided, Bonferroni over the gap's
    candidates, at the run's false-alarm budget (doctor/budget.py)."""
    if len(before) < 4 or not inside:  # the course and a spread from the steps before the gap
        return None
    t = np.array([*before, *inside], dtype=float)
    y = np.array([*before.values(), *inside.values()])
    n, u = len(t), (t - t.mean()) / max(t.std(), 1.0)
    best = None
    for s in sorted(inside):
        X = np.stack([np.ones(n), u, u * u, (t >= s).astype(float)], axis=1)
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
        rss = float(((y - X @ coef) ** 2).sum())
        if best is None or rss < best[1]:
            best = (s, rss, coef[3], X)
    s, rss, delta, X = best
    var = rss / (n - 4) * np.linalg.pinv(X.T @ X)[3, 3]
    z = abs(delta) / math.sqrt(var) if var > 0 else (math.inf if delta != 0 else 0.0)
    return s if z > t_isf(ALPHA / (2 * gap), n - 4) else None


def _value(rec: dict, series: str, where: str):
    """The failing place's value in a record: spec[series][where], or the record's own number `series`."""
    spec = (rec.get("spec") or {}).get(series)
    return spec.get(where) if isinstance(spec, dict) else rec.get(series)


def incident(rec: dict, f: dict, seg_index: int, n_failed: int,
             dated: tuple[dict, int, dict] | None = None) -> Diagnosis:
    """The failure `f` of the record `rec`, at its onset's record when `dated` (earliest_onset()) found one."""
    found, cls, layer = rec["step"], f["class"], f["layer"]
    where = f.get("where")
    start = dated[0] if dated is not None else rec
    t = start["step"]
    by = dated[2] if dated is not None else f
    when = (f"from step {t} (check {by['check']} held at step {dated[1]}, its last run before step {found}, where it "
            f"failed; {where}'s {by.get('series')} jumped at step {t})" if dated is not None else f"at step {t}")
    miss = f["miss"] if isinstance(f["miss"], (int, float)) else float("inf")
    rank = "0 (single process)" if rec.get("world", 1) <= 1 else f"rank {f.get('rank')} (world {rec.get('world')})"
    dev = Deviation(f"spec.{f['check']}", layer, LAYERS.index(layer), t, miss, 1.0, math.inf, where, kind="spec")
    others = f"; {n_failed - 1} more check(s) failed at this step after it" if n_failed > 1 else ""
    on = f" on rank {f.get('rank')}" if rec.get("world", 1) > 1 else ""
    summary = (f"{cls} {when}: the step broke its specification — check {f['check']} ({f.get('kind')}) at "
               f"{where}{on}: off by {_fmt(f.get('err'))} where the recipe allows {_fmt(f.get('tol'))} ({_fmt(miss)}× its "
               f"tolerance){others}. {f.get('fix', '')}".rstrip())
    diag = Diagnosis(cls, summary, dev, t, rank, {"step": t, **(start.get("batch") or {})}, symptom(cls),
                     model_layer=where, layer=layer)
    diag.seg_index = seg_index
    diag.judgement = Judgement("fault", f"an execution fault: the step did not do what its specification says "
                                        f"(check {f['check']}, {_fmt(miss)}× its tolerance) — a fault whatever the "
                                        f"run does after it", {"check": f["check"], "kind": f.get("kind"),
                                                               "where": where, "err": f.get("err"),
                                                               "tol": f.get("tol"), "miss": miss})
    diag.tree = [("specification", f"check {f['check']} failed at step {found} ({where}): {_fmt(miss)}× its "
                                   f"tolerance")]
    if dated is not None:
        diag.tree.append(("onset", f"{where}'s {by.get('series')} shifted at step {t}, after check {by['check']} held "
                                   f"at step {dated[1]}"))
    # the checks that held at this step are the hypotheses the record rejects, each with how close it came
    held = {c: m for c, m in ((rec.get("spec") or {}).get("miss") or {}).items()
            if isinstance(m, (int, float)) and m <= 1}
    diag.rejected = [Check(f"spec.{c}", False, f"check {c} held at step {found}: {_fmt(m)}× its tolerance")
                     for c, m in held.items()]
    diag.confirmed = [Check(f"spec.{f['check']}", True, summary)]
    return diag


def _fmt(x) -> str:
    if x is None:
        return "—"
    try:
        return f"{float(x):.3g}"
    except (TypeError, ValueError):
        return str(x)
