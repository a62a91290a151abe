"""The doctor reads the step's specification checks first (record v5 `spec`, spec/monitor.py).

A failed check is an execution fault at its step: the step did not do what its specification says, whatever
the run did afterwards, so no threshold of the doctor's is involved — the check measured how far it missed
against the tolerance its precision recipe allows, and declared the class its way of failing implies. Within a
step the first failure in the registry's order (the state the step started from, its data, forward, gradient,
update, system) is the one that broke first. A check that keeps failing step after step at the same place is
one incident, at its onset.
"""
from __future__ import annotations

import math

from doctor.checks import Check
from doctor.classes import symptom
from doctor.diagnosis import Judgement
from doctor.diagnosis import Diagnosis
from doctor.timeline import LAYERS, Deviation, Run


def spec_incidents(run: Run) -> list[Diagnosis]:
    """Every onset of a failed specification check, in execution order (segment, step)."""
    out: list[Diagnosis] = []
    for k, seg in enumerate(run.segments):
        last: tuple | None = None
        for rec in seg:
            fails = (rec.get("spec") or {}).get("fail") or []
            if not fails:
                last = None
                continue
            f = fails[0]
            key = (f["check"], f.get("where"), f.get("kind"))
            if key != last:
                out.append(incident(rec, f, k, len(fails)))
            last = key
    return out


def incident(rec: dict, f: dict, seg_index: int, n_failed: int) -> Diagnosis:
    t, cls, layer = rec["step"], f["class"], f["layer"]
    where = f.get("where")
    miss = f["miss"] if isinstance(f["miss"], (int, float)) else float("inf")
    rank = "0 (single process)" if rec.get("world", 1) <= 1 else f"rank {f.get('rank')} (world {rec.get('world')})"
    dev = Deviation(f"spec.{f['check']}", layer, LAYERS.index(layer), t, miss, 1.0, math.inf, where, kind="spec")
    others = f"; {n_failed - 1} more check(s) failed at this step after it" if n_failed > 1 else ""
    on = f" on rank {f.get('rank')}" if rec.get("world", 1) > 1 else ""
    summary = (f"{cls} at step {t}: the step broke its specification — check {f['check']} ({f.get('kind')}) at "
               f"{where}{on}: off by {_fmt(f.get('err'))} where the recipe allows {_fmt(f.get('tol'))} ({_fmt(miss)}× its "
               f"tolerance){others}. {f.get('fix', '')}".rstrip())
    diag = Diagnosis(cls, summary, dev, t, rank, {"step": t, **(rec.get("batch") or {})}, symptom(cls),
                     model_layer=where, layer=layer)
    diag.seg_index = seg_index
    diag.judgement = Judgement("fault", f"an execution fault: the step did not do what its specification says "
                                        f"(check {f['check']}, {_fmt(miss)}× its tolerance) — a fault whatever the "
                                        f"run does after it", {"check": f["check"], "kind": f.get("kind"),
                                                               "where": where, "err": f.get("err"),
                                                               "tol": f.get("tol"), "miss": miss})
    diag.tree = [("specification", f"check {f['check']} failed at step {t} ({where}): {_fmt(miss)}× its tolerance")]
    # the checks that held at this step are the hypotheses the record rejects, each with how close it came
    held = {c: m for c, m in ((rec.get("spec") or {}).get("miss") or {}).items()
            if isinstance(m, (int, float)) and m <= 1}
    diag.rejected = [Check(f"spec.{c}", False, f"check {c} held at step {t}: {_fmt(m)}× its tolerance")
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
