"""The doctor's decision tree (docs/course.md §5) and symptom table (docs/course.md §10), walked over one run's
StepRecords.

    freeze the batch ID and the state → finite checks (loss / logits / grads / optimizer state)
      non-finite: localise the earliest non-finite layer and rank
      finite:     split the loss by source, length, mask and duplicates
    → LR / batch / data / length switches at that step → compare update norms
    → one single-variable fix → short run → regression

The registry decides the class: the earliest deviating quantity's Signal (stability/signals.py `cls`), or the
class its producer declares (an invariant, a specification check). Context refines it only through the RULES
below, each a declaration that reads declared properties — a Signal's `role`, timeline layer and `recover`, a
deviation's declared class and kind, the hypothesis checks of doctor/checks.py — never a quantity's name. The first
rule that applies decides; every check that does not hold becomes a rejected hypothesis with its evidence.
NOTE: nothing here reads the injector's "fault" events or the config's `fault` node.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable

from doctor.checks import (NEAR, Check, Context, check_finite, check_input, check_lr, check_lr_too_large,
                           check_mixture, check_replica, check_resume, check_update, corruption_kind,
                           nonfinite_layer, resume_step, source_floors, transient)
from doctor.classes import CLASSES, symptom
from doctor.conformance import spec_incidents
from doctor.content import content_check
from doctor.diagnosis import FAULT, INSTABILITY, Diagnosis, Judgement
from doctor.invariants import continuity, resumed, system_change
from doctor.judge import judge, outcome, recover_steps, settle
from doctor.scores import MIN_HISTORY, MIN_MEDIAN, budget, deviations, guard_test
from doctor.timeline import INPUT, MAD_SIGMA, Deviation, Run, earliest, load_run, scoring_start, timeline
from stability.signals import family

__all__ = ["Diagnosis", "diagnose", "RULES"]

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
        sysdev, note = system_change(run.paths[k], max(start, seg[0]["step"]), b.window)
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
            if sysdev is not None and sysdev.step >= since:
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
                        f"own behaviour: each recovered under steps that did what they were told, nothing lasting"
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


def _rank(rec: dict) -> str:
    world = rec.get("world", 1)
    return "0 (single process)" if world <= 1 else f"not localised (world {world}: the record is rank 0's view)"


# ---- classification: the declared rules --------------------------------------------------------------------
@dataclass
class Found:
    """What a rule decides: the class, the hypothesis check it confirms (None: none), and why, in words."""
    cls: str
    main: str | None
    why: str


@dataclass(frozen=True)
class Rule:
    name: str
    reads: str                                  # the declared properties it reads (for the reader of RULES)
    decide: Callable[[Context, Deviation, object, dict], Found | None]


RULES: list[Rule] = []


def rule(name: str, reads: str):
    def register(fn):
        RULES.append(Rule(name, reads, fn))
        return fn
    return register


@rule("a mixture switch", "Signal.role switch; the per-source verdict of labs.mixture")
def _switch(ctx, first, sig, checks):
    if sig is None or sig.role != "switch":
        return None
    main = "objective change (data mixture switch)"
    if checks[main].holds:
        return Found(sig.cls, main, "the data mixture switched; each source stayed on its trajectory")
    return Found("data.switch", main, "the data mixture switched and a source's loss rose above its trajectory")


@rule("the first steps after a resume", "the records' resume marks")
def _at_resume(ctx, first, sig, checks):
    t0 = first.step
    at = next((r["step"] for r in ctx.seg if resumed(r) and r["step"] <= t0 <= r["step"] + NEAR), None)
    if at is None:
        return None
    rec = ctx.rec(t0)
    return Found("state.resume_fault", "jump after resume",
                 f"the first steps after the resume at step {at} ({(rec.get('resume') or {}).get('from', 'a checkpoint')})"
                 f" left the run's own baseline: {first.quantity}" + (f" ({first.layer_name})" if first.layer_name else "")
                 + ": the resumed state is not the saved one")


def conforming(ctx: Context, t: int) -> bool:
    """The steps at t ran their specification checks and passed them (doctor/judge.py conforms)."""
    from doctor.judge import conforms
    return bool(conforms(ctx, t))


@rule("content other than its ids, one source's loss stepping up", "a deviation's declared class; Signal.role objective")
def _content_shift(ctx, first, sig, checks):
    if first.cls != "data.corrupted_batch" or first.kind != "invariant":
        return None
    src = shifted_source(ctx)
    if not src:
        return None
    # NOTE: content other than its ids name, with every statistic of the batch on its baseline and only one
    # source's loss stepping up after it: that source's documents changed (a silent data switch)
    return Found("data.distribution_shift", "corrupted input batch",
                 f"from step {first.step} the batch is not the content its sample ids name, its statistics unchanged, "
                 f"and only {src}'s loss stepped up after it: that source's data changed")


@rule("an invariant's or a check's declared class", "Deviation.cls")
def _declared(ctx, first, sig, checks):
    if first.cls is None:
        return None
    c = CLASSES.get(first.cls)
    main = "corrupted input batch" if first.layer == INPUT else None
    return Found(first.cls, main, f"{c.means if c else first.cls}: {first.describe()}")


@rule("the batch itself", "the timeline layer (input)")
def _input(ctx, first, sig, checks):
    if sig is None or sig.layer != INPUT:
        return None
    return Found(sig.cls or "data.corrupted_batch", "corrupted input batch",
                 f"the batch deviated before any forward ({corruption_kind(ctx)})")


@rule("a resume just before", "check: jump after resume")
def _resume_check(ctx, first, sig, checks):
    if not checks["jump after resume"].holds:
        return None
    return Found("state.resume_fault", "jump after resume", "the anomaly follows a resume")


@rule("a non-finite value", "Deviation.kind nonfinite; check: non-finite numerics")
def _nonfinite(ctx, first, sig, checks):
    if not checks["non-finite numerics"].holds and first.kind != "nonfinite":
        return None
    return Found("numerics.nonfinite", "non-finite numerics",
                 f"a non-finite value with a finite input layer; first non-finite activation: "
                 f"{nonfinite_layer(ctx) or first.layer_name}")


@rule("a quantity that cannot move on its own", "Signal.recover")
def _exact_signal(ctx, first, sig, checks):
    if sig is None or sig.recover or sig.cls is None:
        return None
    return Found(sig.cls, None, f"{first.quantity} moved first: {sig.fix}")


@rule("the update with a normal gradient, LR and inputs", "check: corrupted optimizer state; Signal.role update / state")
def _optim_state(ctx, first, sig, checks):
    if not checks["corrupted optimizer state"].holds:
        return None
    # NOTE: a state lost or altered shows in the moments' own norms (they fall); a setting that scales every
    # update leaves them on their trajectory
    moved, every = update_layers(ctx)
    lost = ctx.near_role("state", -NEAR, NEAR)
    if every > 1 and moved * 2 >= every and not lost:  # half the layers or more: not one layer's update
        return Found("optim.settings", "corrupted optimizer state",
                     f"every layer's update moved together ({moved} of {every} update ratios at step {first.step}) "
                     f"with the LR on schedule and a normal gradient: an optimizer setting (an LR multiplier, eps, "
                     f"betas) the records do not show")
    return Found("optim.state", "corrupted optimizer state",
                 "the update (or the optimizer state) jumped with the LR on schedule, a normal gradient and normal inputs")


@rule("what follows the gradient", "Signal.role gradient / update / state")
def _follows_gradient(ctx, first, sig, checks):
    if sig is None or sig.role not in ("gradient", "update", "state"):
        return None
    # NOTE: an update (or the moments) that moved with the gradient is the gradient's incident
    return Found("optim.gradient_spike", None, "the gradient (and with it the update) moved first")


@rule("one source's loss stepping up alone, its data unchecked", "Signal.role objective, per_source; the records' spec")
def _one_source(ctx, first, sig, checks):
    if sig is None or sig.role != "objective" or not sig.per_source or conforming(ctx, first.step):
        return None
    if not stepped(ctx, first) or not one_source(ctx, first):
        return None
    # NOTE: a model or optimizer fault moves every source's loss; one source's loss stepping up and staying there,
    # with the others, the LR, gradients and activations on their baselines, is that source's content changing
    # under the same fingerprint: a data fault inferred from the forward layer. Where the data check ran and passed
    # (spec/checks/data.py: every row is the content its ids name), the data did not change: this is dynamics
    src = ctx.tl[first.quantity].layer_name or first.quantity.split("/", 1)[1]
    return Found("data.distribution_shift", "corrupted input batch",
                 f"only {src}'s loss stepped up and stayed up from step {first.step} (the other sources, the LR, "
                 f"gradients and activations on their baselines): that source's data changed")


@rule("a clip that came back", "Signal.role clip")
def _clip_back(ctx, first, sig, checks):
    if sig is None or sig.role != "clip" or not clip_recovered(ctx, first.quantity):
        return None
    # NOTE: heavy clipping is a coefficient that stays low; one that is back at its level was a gradient burst
    # the clip bounded (the burst's own quantities may still wait out an earlier incident)
    return Found("optim.gradient_spike", None, "the gradient burst and the clip bounded it for a step or two")


@rule("the registry", "Signal.cls")
def _registry(ctx, first, sig, checks):
    if sig is None or sig.cls is None:
        return None
    return Found(sig.cls, None, f"{first.quantity} moved first: {sig.fix}")


@rule("the loss", "nothing: the default")
def _default(ctx, first, sig, checks):
    return Found("forward.loss_spike", None, f"the loss rose first ({first.quantity}) with normal inputs and settings")


def classify(ctx: Context, first: Deviation) -> Diagnosis:
    t0, rec = first.step, ctx.rec(first.step)
    checks = {c.name: c for c in (check_finite(ctx), check_input(ctx), check_mixture(ctx), check_lr(ctx),
                                  check_update(ctx), check_replica(ctx), check_resume(ctx), check_lr_too_large(ctx))}
    sig = family(first.quantity)
    found = next(f for r in RULES if (f := r.decide(ctx, first, sig, checks)) is not None)
    rank, layer = _rank(rec), first.layer_name
    if found.cls == "rank.data":
        rank = rank_apart(rec, first)
    if found.cls == "numerics.nonfinite":
        layer = nonfinite_layer(ctx) or layer
    diag = Diagnosis(found.cls, f"{found.cls} at step {t0}: {found.why}", first, t0, rank,
                     {"step": t0, **rec["batch"]}, symptom(found.cls), layer)
    if found.cls == "data.distribution_shift":
        diag.layer = "input"
        diag.source = (ctx.tl[first.quantity].layer_name or first.quantity.split("/", 1)[1]
                       if sig is not None and sig.per_source else shifted_source(ctx))
    diag.tree = walk(ctx, checks, layer, rank)
    split(diag, checks.values(), found.main)
    return diag


def stepped(ctx: Context, first: Deviation) -> bool:
    """Did the quantity's level step and hold: its next readings all past the midpoint between its baseline and its
    value at the incident (a median of MIN_MEDIAN readings one outlier cannot move)?"""
    s = ctx.tl.get(first.quantity)
    if s is None or first.baseline is None:
        return False
    nxt = [v for t, v in sorted(s.values.items()) if t >= first.step][:MIN_MEDIAN]
    mid = (first.value + first.baseline) / 2
    up = first.value >= first.baseline
    return len(nxt) == MIN_MEDIAN and all((v > mid) if up else (v < mid) for v in nxt)


def shifted_source(ctx: Context) -> str | None:
    """The one source whose loss stepped up (and held) within a few steps of the incident, when it is the only one
    and no input statistic moved."""
    stats = [d for d in ctx.near_layer(INPUT, -NEAR, NEAR) if d.kind != "invariant"]
    if stats:
        return None
    losses = ctx.series("objective")
    sources = {q: s for q, s in losses.items() if s.spec.per_source}
    up = {q for q, d in ctx.devs.items() if q in sources and 0 <= d.step - ctx.t0 <= MIN_MEDIAN and stepped(ctx, d)}
    if len(up) == 1 and len(sources) > 1:
        q = up.pop()
        return sources[q].layer_name or q.split("/", 1)[1]
    return None


def clip_recovered(ctx: Context, q: str) -> bool:
    """Is the clip coefficient back at its level before the incident within the optimizer's memory after it?"""
    from doctor.judge import recover_steps
    s = ctx.tl.get(q)
    if s is None:
        return False
    R = recover_steps(ctx, s)
    before = [v for t, v in sorted(s.values.items()) if ctx.t0 - ctx.window <= t < ctx.t0]
    after = [v for t, v in sorted(s.values.items()) if ctx.t0 + R <= t < ctx.t0 + 2 * R]
    # NOTE: "back": its median within the floor its signal declares of where it was (a log signal: log units)
    return bool(before and after) and math.log(statistics.median(before) / max(statistics.median(after), 1e-300)) \
        <= s.spec.rel_floor


def update_layers(ctx: Context) -> tuple[int, int]:
    """(layers whose update ratio deviated at the incident's step or the next, layers with an update ratio)."""
    every = [q for q, s in ctx.series("update").items() if s.spec.per_layer]
    moved = [d for d in ctx.near_role("update", 0, NEAR) if d.quantity in every]
    return len(moved), len(every)


def one_source(ctx: Context, first: Deviation) -> bool:
    # NOTE: forward quantities only: the gradient and the update of step t0 and after are computed from that
    # loss (a changed source is a changed objective, and the update follows it); one before t0 would itself
    # have been the earliest anomaly
    others = [d for k, d in ctx.devs.items() if k != first.quantity and (sig := family(k)) is not None
              and (sig.role in ("activation", "logits", "schedule") or (sig.role == "objective" and sig.per_source))
              and abs(d.step - ctx.t0) <= NEAR]
    return len([q for q, s in ctx.series("objective").items() if s.spec.per_source]) > 1 and not others


def rank_apart(rec: dict, first: Deviation) -> str:
    """The rank whose inputs are off: the one off the sharding, else the local loss farthest from the
    median of the ranks."""
    if first.layer_name and first.layer_name.startswith("rank "):
        return first.layer_name.split()[1]
    loss = (rec.get("ranks") or {}).get("loss") or []
    if not loss:
        return "?"
    med = statistics.median(loss)
    return str(max(range(len(loss)), key=lambda k: abs(loss[k] - med)))


def split(diag: Diagnosis, checks, main: str | None) -> None:
    for c in checks:
        if c.name == main:
            diag.confirmed.append(c)
        elif c.holds is None:
            diag.untestable.append(c)
        elif c.holds and main is None:
            diag.confirmed.append(c)
        elif not c.holds:
            diag.rejected.append(c)
        else:  # it holds too, but the earliest quantity points elsewhere
            diag.confirmed.append(Check(c.name, True, c.evidence + " (also holds; not where the incident starts)"))


def walk(ctx: Context, checks: dict, layer: str | None, rank: str) -> list[tuple[str, str]]:
    rec = ctx.rec()
    b = rec["batch"]
    finite = checks["non-finite numerics"]
    tree = [("freeze the batch ID and the state", f"step {ctx.t0}: samples [{b['first']}, {b['first'] + b['size']}), "
             f"parameters of step {ctx.t0 - 1}"),
            ("finite checks: loss / logits / gradients / optimizer state", finite.evidence)]
    if finite.holds:
        tr = transient(ctx)
        tree.append(("localise the earliest non-finite layer and rank", f"layer {layer}; rank {rank}"
                     + (f"; {tr}" if tr else "")))
    else:
        rose = [ctx.tl[d.quantity].layer_name or d.quantity for d in ctx.near_role("objective", 0, NEAR)
                if d.quantity in ctx.tl and ctx.tl[d.quantity].spec.per_source]
        tree.append(("split the loss by source, length, mask and duplicates", checks["corrupted input batch"].evidence
                     + (f"; sources whose loss rose: {', '.join(rose)}" if rose else "; no source's loss left its baseline by the doctor's threshold")))
    sizes = {r["batch"].get("size") for r in ctx.seg}
    tree.append(("LR / batch / data / length switches at that step", "; ".join(
        [checks["LR switch"].evidence, checks["objective change (data mixture switch)"].evidence,
         "batch size constant" if len(sizes) == 1 else f"batch sizes {sorted(sizes)}",
         checks["jump after resume"].evidence])))
    tree.append(("compare update norms", checks["corrupted optimizer state"].evidence))
    return tree


# ---- runs without a point anomaly: the slow symptoms ------------------------------------------------
def no_point_anomaly(ctx: Context, env: str | None = None) -> Diagnosis:
    run = ctx.run
    start = scoring_start(run.config)
    recs = [r for r in run.first if r["step"] >= start and math.isfinite(r["loss"])]
    timed = all(r.get("time_s", {}).get("fwd_bwd") is not None for r in recs)
    # NOTE: with per-component times, a throughput drop has already been judged (system_change): a
    # run-caused one is an incident with a step, a machine-wide one is `env`, never the run's fault
    thr = (Check("throughput drop", False, env or "no component of the step slowed; the step time is steady")
           if timed and recs else throughput_drop(recs))
    checks = [check_resume(ctx), slow_worsening(recs), thr]  # a resume: a known step, first
    held = [c for c in checks if c.holds]
    cls = {"slow worsening": "data.slow_worsening", "throughput drop": "system.throughput",
           "jump after resume": "state.resume_fault"}.get(held[0].name, "healthy") if held else "healthy"
    last = run.first[-1]["step"]
    scored = (f"from step {start} to {last}" if last >= start else
              f"(exact checks only: {last} steps < scoring start {start})")
    summary = f"{cls}: {held[0].evidence}" if held else f"healthy: no quantity left its baseline {scored}"
    if env and cls == "healthy":
        summary += f" ({env})"
    step = resume_step(run) if cls == "state.resume_fault" else None
    diag = Diagnosis(cls, summary, None, step, None, None, symptom(cls))
    diag.environment = env
    diag.tree = [("freeze the batch ID and the state", "no anomalous step to freeze"),
                 ("finite checks: loss / logits / gradients / optimizer state",
                  "every loss, logit, gradient and optimizer-state flag finite" if not any(
                      any(r.get("nonfinite", {}).values()) for r in run.first)
                  else "a non-finite flag below threshold"),
                 ("slow symptoms", "; ".join(c.evidence for c in checks))]
    for c in checks:
        (diag.confirmed if c.holds else diag.untestable if c.holds is None else diag.rejected).append(c)
    return diag


def slow_worsening(recs: list[dict]) -> Check:
    """Loss of the last third above the first third's, beyond its noise, while the grad norm is flat."""
    from doctor.budget import threshold
    k = len(recs) // 3  # the first and the last third: a trend's two ends, each a median's sample
    if k < MIN_HISTORY:
        return Check("slow worsening", None, f"too few steps ({len(recs)}) to see a trend")
    a, b = recs[:k], recs[-k:]
    la, lb = statistics.median(r["loss"] for r in a), statistics.median(r["loss"] for r in b)
    d = [y["loss"] - x["loss"] for x, y in zip(a, a[1:])]
    sigma = MAD_SIGMA * statistics.median(abs(x - statistics.median(d)) for x in d) / math.sqrt(2)
    se = sigma * math.sqrt(math.pi / 2 * 2 / k)  # two medians of k
    ga, gb = statistics.median(r["grad_norm"] for r in a), statistics.median(r["grad_norm"] for r in b)
    rose = se > 0 and (lb - la) / se > threshold(1, len(d), 0.0, 1)
    # NOTE: "flat": the gradient norm's median within a factor e of itself (one log unit): a gradient that grew or
    # collapsed by more is the gradient's own story, not the data's
    flat = abs(math.log(max(gb, 1e-300) / max(ga, 1e-300))) < 1.0
    ev = (f"median loss {la:.4g} (steps {a[0]['step']}..{a[-1]['step']}) -> {lb:.4g} (steps {b[0]['step']}.."
          f"{b[-1]['step']}), median grad norm {ga:.3g} -> {gb:.3g}")
    return Check("slow worsening", rose and flat, ev)


def throughput_drop(recs: list[dict]) -> Check:
    """tokens/s of the last third below half the first third's, with the loss normal (half: slower than two
    processes sharing one core, which a busy machine does on its own)."""
    k = len(recs) // 3
    if k < MIN_HISTORY:
        return Check("throughput drop", None, f"too few steps ({len(recs)})")
    a = statistics.median(r["tokens_per_s"] for r in recs[:k])
    b = statistics.median(r["tokens_per_s"] for r in recs[-k:])
    return Check("throughput drop", b < 0.5 * a, f"median tokens/s {a:.4g} -> {b:.4g} (first vs last third)")
