"""The doctor's walk over one run's StepRecords: every segment, every incident in execution order, each classified
(doctor/classify.py: the decision tree of docs/course.md §5 and its symptom table, §10) and judged
(doctor/judge.py), the specification checks' failures beside them (doctor/conformance.py), and the headline.

    freeze the batch ID and the state → finite checks (loss / logits / grads / optimizer state)
      non-finite: localise the earliest non-finite layer and rank
      finite:     split the loss by source, length, mask and duplicates
    → LR / batch / data / length switches at that step → compare update norms
    → one single-variable fix → short run → regression

NOTE: nothing here reads the injector's "fault" events or the config's `fault` node.
"""
from __future__ import annotations

import math

from doctor.checks import NEAR, Context, source_floors
from doctor.classes import symptom
from doctor.classify import _rank, classify
from doctor.conformance import spec_incidents
from doctor.content import content_check
from doctor.diagnosis import FAULT, INSTABILITY, Diagnosis, Judgement
from doctor.invariants import continuity, system_change
from doctor.judge import judge, recover_steps
from doctor.outcome import outcome, settle
from doctor.scores import budget, deviations, guard_test
from doctor.symptoms import no_point_anomaly
from doctor.timeline import Deviation, Run, earliest, load_run, scoring_start, timeline

__all__ = ["Diagnosis", "diagnose"]

# steps after an incident before the quantities that did not move in it are searched again: the incident's own
# step and the next (NEAR), and the step after that, where the update the incident's gradient wrote shows
HOLD = 2 * NEAR + 1


def diagnose(run_dir) -> tuple[Run, Diagnosis, dict]:
    """(run, headline diagnosis, its deviations) of one run directory. Every incident, in execution order and each
    judged (doctor/judge.py), is in diagnosis.incidents; the headline is the first execution fault — a failed
    specification check (doctor/conformance.py), an invariant, a non-finite value — else the first recipe
    instability, else the slow-symptom verdict (healthy unless one holds). Each segment (split where a rollback or
    resume sends the step back) is read on its own; within one, after an incident the quantities it moved wait out
    the optimizer's memory of it and the rest are searched again HOLD steps later, so a second incident is not
    hidden behind the first."""
    run = load_run(run_dir)
    checked, note = content_check(run)
    if note:
        run.notes.append(note)
    inv = sorted(continuity(run) + checked, key=lambda x: x[0])
    start = scoring_start(run.config)
    gt = guard_test(run.config)
    # NOTE: an invariant broken at every record from some step on (one rank off its shard) is one incident,
    # at its onset: only onsets are searched after an incident
    broken = {(i, d.quantity) for i, d in inv}
    inv = [(i, d) for i, d in inv if (i - 1, d.quantity) not in broken]
    incidents, env, at = [], None, 0
    floors = data_floors(run.config)
    for k, seg in enumerate(run.segments):
        idx = range(at, at + len(seg))
        at += len(seg)
        tl = timeline(run.paths[k], run.config, floors)
        since = start if k == 0 else seg[0]["step"]
        b = budget(tl, run.config, since)
        # NOTE: from the segment's first step: the LR warm-up (scoring_start) is a transient of the loss and the
        # gradient, not of the step's time, which a component's own baseline (its previous steps) measures
        sysdev, note = system_change(run.paths[k], seg[0]["step"], b.window)
        if sysdev is None and note and env is None:
            env = note
        # NOTE: the guard's own test scores from where the guard does (its warm-up), not from the doctor's later
        # start: at least as sensitive as the guard, from its start
        gsince = min(since, max(gt.warmup, gt.min_history + 1)) if k == 0 else since
        # NOTE: exact values, bounds and invariants need no baseline: from the segment's first step, and after an
        # incident from its next step
        xsince = seg[0]["step"]
        holds: dict[str, int] = {}
        mine: list[Diagnosis] = []
        while True:
            devs = {q: d for q, d in deviations(tl, b, since, gsince, xsince, holds).items()
                    if d.step >= min(since, gsince, xsince)}
            devs.update(first_onsets(inv, idx, xsince))
            if sysdev is not None and sysdev.step >= xsince:
                devs[sysdev.quantity] = sysdev
            first = earliest(devs)
            if first is None:
                break
            ctx = Context(run, tl, devs, first.step, k, floors, start, mine, b)
            diag = classify(ctx, first)
            diag.seg_index, diag.devs = k, devs
            if diag.fault_class == "system.slow_component":
                diag.summary += f"; {note}"
            diag.judgement = judge(ctx, diag)
            mine.append(diag)
            t0 = first.step
            # NOTE: what moved in this incident waits out the optimizer's memory of it (doctor/judge.py
            # recover_steps: Adam's moments carry a gradient burst into every update for ~1/(1−β₂) steps)
            for q, d in devs.items():
                if t0 <= d.step < t0 + HOLD and q in tl:
                    holds[q] = t0 + recover_steps(ctx, tl[q])
            since, gsince, xsince = max(start, t0 + HOLD), t0 + HOLD, t0 + 1
        ctx = Context(run, tl, {}, None, k, floors, start, mine, b)
        incidents += settle(ctx, mine, outcome(ctx, mine), lambda kind, ev: finding(ctx, kind, ev))
    spec = spec_incidents(run)
    everything = sorted(spec + incidents, key=lambda i: (i.seg_index, i.step))
    faults = [i for i in everything if i.judgement.verdict == FAULT]
    unstable = [i for i in everything if i.judgement.verdict == INSTABILITY]
    head = faults[0] if faults else unstable[0] if unstable else None
    if head is not None:
        head.incidents, head.environment = everything, env
        return run, head, head.devs
    tl = timeline(run.first, run.config, floors)
    ctx = Context(run, tl, {}, None, 0, floors, start, [], budget(tl, run.config, start))
    diag = no_point_anomaly(ctx, env)
    diag.incidents = everything
    if everything and diag.fault_class == "healthy":
        steps = ", ".join(str(i.step) for i in everything)
        diag.summary = (f"healthy: no fault; {len(everything)} incident(s) (step {steps}) judged natural — the run's "
                        f"own behaviour: each recovered under steps whose checks held, nothing lasting"
                        + (f" ({env})" if env else ""))
    return run, diag, {}


def data_floors(config: dict) -> dict | None:
    """The data's exact per-source floors (synthetic data), for records that lack their batch's own."""
    try:
        return source_floors(config)
    except Exception:  # NOTE: a config the data package cannot build (an older or foreign run): no floors
        return None


def first_onsets(inv: list[tuple[int, Deviation]], idx: range, since: int) -> dict[str, Deviation]:
    """The first invariant onset per quantity among the records `idx` (one segment), from step `since`."""
    out: dict[str, Deviation] = {}
    for i, d in inv:
        if i in idx and d.step >= since and d.quantity not in out:
            out[d.quantity] = d
    return out


def finding(ctx: Context, kind: str, ev: dict) -> Diagnosis | None:
    """A recipe instability no incident began: an incident of its own, at the damage's onset (or the stall's
    series), for the outcome to settle."""
    q = ev.get("series")
    s = ctx.tl.get(q)
    t = ev.get("onset") or ev.get("best_step")
    if s is None or t is None:
        return None
    t = min((x for x in s.values if x >= t), default=None)
    rec = ctx.rec(t) if t is not None else None
    if rec is None:
        return None
    d = Deviation(q, s.spec.layer, s.order, t, s.values[t], ev.get("best"), ev.get("z", math.inf), s.layer_name,
                  "point")
    diag = Diagnosis("forward.loss_spike", f"{q} left its trajectory at step {t}", d, t, _rank(rec),
                     {"step": t, **(rec.get("batch") or {})}, symptom("forward.loss_spike"))
    diag.seg_index, diag.devs = ctx.seg_index, {q: d}
    diag.judgement = Judgement("natural", "", {"conforming": _checked(ctx, t)})
    return diag


def _checked(ctx: Context, t: int) -> bool | None:
    from doctor.judge import conforms
    c = Context(ctx.run, ctx.tl, {}, t, ctx.seg_index, ctx.floors, ctx.start, [], ctx.budget)
    return conforms(c, t)


