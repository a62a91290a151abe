"""The doctor's decision tree (docs/course.md §5) and symptom table (docs/course.md
§10), walked over one run's StepRecords.

    freeze the batch ID and the state → finite checks (loss / logits / grads / optimizer state)
      non-finite: localise the earliest non-finite layer and rank
      finite:     split the loss by source, length, mask and duplicates
    → LR / batch / data / length switches at that step → compare update norms
    → one single-variable fix → short run → regression

The class comes from the earliest deviating quantity (doctor/timeline.py) and the checks at its step
(doctor/checks.py); every check that does not hold becomes a rejected hypothesis with its evidence.
NOTE: nothing here reads the injector's "fault" events or the config's `fault` node.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from doctor.checks import (NEAR, Check, Context, check_finite, check_input, check_lr, check_lr_too_large,
                           check_mixture, check_replica, check_resume, check_update, corruption_kind,
                           nonfinite_layer, resume_step, source_floors, transient)
from doctor.classes import symptom
from doctor.content import content_check
from doctor.judge import Judgement, judge
from doctor.invariants import continuity, resumed, system_change
from doctor.scores import deviations, guard_test
from doctor.timeline import K, WINDOW, Deviation, Run, earliest, load_run, scoring_start, timeline
from stability.signals import family


@dataclass
class Diagnosis:
    fault_class: str
    summary: str
    anomaly: Deviation | None
    step: int | None
    rank: str | None
    batch: dict | None                  # {step, first, size}: the reproducible batch
    symptom: tuple[str, str, str] | None
    model_layer: str | None = None      # the model layer the diagnosis names (first non-finite, or the anomaly's)
    tree: list[tuple[str, str]] = field(default_factory=list)  # (decision-tree node, what the records say)
    confirmed: list[Check] = field(default_factory=list)
    rejected: list[Check] = field(default_factory=list)
    untestable: list[Check] = field(default_factory=list)
    seg_index: int = 0                  # the segment of run.segments the incident is in
    incidents: list["Diagnosis"] = field(default_factory=list)  # every incident, in order (the first is this)
    environment: str | None = None      # a machine-wide slowdown: not the run's fault
    devs: dict = field(default_factory=dict)  # the deviations the diagnosis was drawn from
    layer: str | None = None            # the timeline layer the diagnosis names, when not the quantity's own
    judgement: Judgement | None = None  # natural (the run learning) or fault, with its evidence
    source: str | None = None           # the data source the diagnosis names (a distribution shift)


HOLD = 5  # steps after an incident before the quantities that did not move in it are searched again


def diagnose(run_dir) -> tuple[Run, Diagnosis, dict]:
    """(run, headline diagnosis, its deviations) of one run directory. Every incident, in execution order
    and each judged natural or fault (doctor/judge.py), is in diagnosis.incidents; the headline is the first
    failed specification check (doctor/conformance.py: an execution fault, no statistic involved), else the
    first fault, or — when every incident was the run learning — the slow-symptom verdict (healthy unless
    one holds). Each segment (split where a rollback or resume sends the step back) is read on its own;
    within one, after an incident the quantities it moved wait a baseline window and the rest are searched
    again HOLD steps later, so a second incident is not hidden behind the first."""
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
    paths = run.paths
    floors = data_floors(run.config)
    for k, seg in enumerate(run.segments):
        idx = range(at, at + len(seg))
        at += len(seg)
        tl = timeline(paths[k], run.config, floors)
        sysdev, note = system_change(paths[k], max(start, seg[0]["step"]))
        if sysdev is None and note and env is None:
            env = note
        since = start if k == 0 else seg[0]["step"]
        # NOTE: the guard's own test scores from where the guard does (its warm-up), not from the doctor's
        # later start (twice the LR warm-up): at least as sensitive as the guard, from its start.
        gsince = min(since, max(gt.warmup, gt.min_history + 1)) if k == 0 else since
        # NOTE: exact values, bounds and invariants need no baseline: from the segment's first step, and after an
        # incident from its next step
        xsince = seg[0]["step"]
        holds: dict[str, int] = {}
        while True:
            devs = {q: d for q, d in deviations(tl, since, guard=gt, guard_start=gsince, exact_start=xsince,
                                                holds=holds).items()
                    if d.step >= min(since, gsince, xsince)}
            devs.update({q: d for q, d in first_onsets(inv, idx, xsince).items()})
            if sysdev is not None and sysdev.step >= since:
                devs[sysdev.quantity] = sysdev
            first = earliest(devs)
            if first is None:
                break
            ctx = Context(run, tl, devs, first.step, k, floors, start, [i for i in incidents if i.seg_index == k])
            diag = classify(ctx, first)
            diag.seg_index, diag.devs = k, devs
            if diag.fault_class == "system.slow_component":
                diag.summary += f"; {note}"
            diag.judgement = judge(ctx, diag)
            incidents.append(diag)
            t0 = first.step
            for q, d in devs.items():  # what moved in this incident waits until its values are a baseline again
                if t0 <= d.step < t0 + HOLD:
                    holds[q] = t0 + WINDOW
            since, gsince, xsince = max(start, t0 + HOLD), t0 + HOLD, t0 + 1
    from doctor.conformance import spec_incidents  # NOTE: here: it builds this module's Diagnosis
    spec = spec_incidents(run)
    if spec:  # the step broke its specification: an execution fault at that step, read before any statistic
        diag = spec[0]
        diag.incidents = sorted(spec + incidents, key=lambda i: (i.seg_index, i.step))
        diag.environment, diag.devs = env, {}
        return run, diag, {}
    faults = [i for i in incidents if i.judgement.verdict == "fault"]
    if faults:
        diag = faults[0]
        diag.incidents, diag.environment = incidents, env
        return run, diag, diag.devs
    tl = timeline(run.first, run.config, floors)
    ctx = Context(run, tl, {}, None, 0, floors)
    diag = no_point_anomaly(ctx, env)
    diag.incidents = incidents
    if incidents and diag.fault_class == "healthy":
        steps = ", ".join(str(i.step) for i in incidents)
        diag.summary = (f"healthy: no fault; {len(incidents)} incident(s) (step {steps}) judged natural — the run "
                        f"learning or its own noise, each returned to its band with nothing persisting"
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


def classify(ctx: Context, first: Deviation) -> Diagnosis:
    t0, q, rec = first.step, first.quantity, ctx.rec(first.step)
    world = rec.get("world", 1)
    checks = {c.name: c for c in (check_finite(ctx), check_input(ctx), check_mixture(ctx), check_lr(ctx),
                                  check_update(ctx), check_replica(ctx), check_resume(ctx), check_lr_too_large(ctx))}
    rank = "0 (single process)" if world <= 1 else f"not localised (world {world}: the record is rank 0's view)"
    layer = first.layer_name
    at_resume = next((r["step"] for r in ctx.seg if resumed(r) and r["step"] <= t0 <= r["step"] + 1), None)
    if q.startswith("input.data_fingerprint"):
        cls, why = (("objective.mixture", "the data mixture switched; each source stayed on its trajectory")
                    if checks["objective change (data mixture switch)"].holds else
                    ("data.switch", "the data mixture switched and a source's loss rose above its trajectory"))
        main = "objective change (data mixture switch)"
    elif at_resume is not None:
        cls, main = "state.resume_fault", "jump after resume"
        why = (f"the first steps after the resume at step {at_resume} ({(rec.get('resume') or {}).get('from', 'a checkpoint')})"
               f" left the run's own baseline: {first.quantity}"
               + (f" ({first.layer_name})" if first.layer_name else "") + ": the resumed state is not the saved one")
    elif q.startswith("fingerprint/"):
        cls, main = "state.config_change", None
        why = f"the run's config changed without a resume declaring it: {first.describe()}"
    elif q == "continuity.repeated_content":
        cls, main = "data.repeated_batch", "corrupted input batch"
        why = (f"the batch content of step {t0} was read before under other sample ids ({first.layer_name}): the "
               f"stream stopped varying while the cursor advanced")
    elif q.startswith("continuity."):
        cls, main = "data.continuity", "corrupted input batch"
        why = f"the data cursor broke its order at step {t0}: {first.describe()}"
    elif q.startswith("ranks."):
        cls, main = "rank.data", "corrupted input batch"
        rank = rank_apart(rec, q, first)
        why = f"one rank's inputs left the sharding or the other ranks ({q}); rank {rank}"
    elif q == "input.content" and (src := shifted_source(ctx)):
        # NOTE: content other than its ids name, with every statistic of the batch on its baseline and only one
        # source's loss stepping up after it: that source's documents changed (a silent data switch)
        cls, main = "data.distribution_shift", "corrupted input batch"
        why = (f"from step {t0} the batch is not the content its sample ids name, its statistics unchanged, and "
               f"only {src}'s loss stepped up after it: that source's data changed")
    elif q.startswith("input."):
        cls, main = "data.corrupted_batch", "corrupted input batch"
        why = f"the batch deviated before any forward ({corruption_kind(ctx)})"
    elif q.startswith("system."):
        cls, main, why = "system.slow_component", None, f"one component of the step slowed ({q.split('/')[-1]})"
    elif checks["jump after resume"].holds:
        cls, main, why = "state.resume_fault", "jump after resume", "the anomaly follows a resume"
    elif checks["non-finite numerics"].holds:
        cls, main = "numerics.nonfinite", "non-finite numerics"
        layer = nonfinite_layer(ctx) or layer
        why = f"a non-finite value with a finite input layer; first non-finite activation: {layer}"
    elif q.startswith("replica."):
        cls, main, why = "system.rank_divergence", "rank divergence", "the replicas stopped holding the same bits"
        rank = f"replicas disagree (world {world}); the record holds spreads only, not which rank"
    elif q == "lr/schedule":
        cls, main, why = "optim.lr_switch", "LR switch", "the LR left its schedule"
    elif q.startswith("state.dw/"):
        cls, main = "optim.settings", None
        why = (f"the weights of {q.split('/', 1)[1]} left their trajectory ({first.describe()}): a setting that "
               f"scales them (weight decay, an update multiplier) changed without the config saying so")
    elif checks["corrupted optimizer state"].holds or (q.startswith("state.") and not ctx.near("grad_", 0, 0)):
        cls, main = "optim.state", "corrupted optimizer state"
        why = "the update (or the optimizer state) jumped with the LR on schedule, a normal gradient and normal inputs"
        moved, every = update_layers(ctx)
        # NOTE: a state lost or altered shows in the moments' own norms (they fall); a setting that scales every
        # update leaves them on their trajectory
        lost = [d for d in ctx.near("state.", -NEAR, NEAR) if not d.quantity.startswith("state.dw/")]
        if every > 1 and moved * 2 >= every and not lost:
            cls = "optim.settings"
            why = (f"every layer's update moved together ({moved} of {every} update ratios at step {t0}) with the "
                   f"LR on schedule and a normal gradient: an optimizer setting (an LR multiplier, eps, betas) the "
                   f"records do not show")
    elif q.startswith(("grad_norm", "grad_rms", "update_ratio", "state.")):
        # NOTE: an update (or the moments) that moved with the gradient is the gradient's incident
        cls, main, why = "optim.gradient_spike", None, "the gradient (and with it the update) moved first"
    elif q.startswith("loss_by_source/") and first.kind == "sustained" and one_source(ctx, q):
        # NOTE: a model or optimizer fault moves every source's loss; one source's loss stepping up and
        # staying there, with the others, the LR, gradients and activations on their baselines, is that
        # source's content changing under the same fingerprint: a data fault inferred from the forward layer
        cls, main = "data.distribution_shift", "corrupted input batch"
        why = (f"only {q.split('/', 1)[1]}'s loss stepped up and stayed up from step {t0} (the other sources, "
               f"the LR, gradients and activations on their baselines): that source's data changed")
    elif q == "clip_coef" and clip_recovered(ctx):
        # NOTE: heavy clipping is a coefficient that stays low; one that is back at its level K steps later was a
        # gradient burst the clip bounded (the burst's own quantities may still wait out an earlier incident)
        cls, main, why = "optim.gradient_spike", None, "the gradient burst and the clip bounded it for a step or two"
    elif (sig := family(q)) is not None and sig.cls:  # the registry: the class its signal implies
        cls, main, why = sig.cls, None, f"{q} moved first: {sig.fix}"
    else:
        cls, main, why = "forward.loss_spike", None, f"the loss rose first ({q}) with normal inputs and settings"
    diag = Diagnosis(cls, f"{cls} at step {t0}: {why}", first, t0, rank,
                     {"step": t0, **rec["batch"]}, symptom(cls), layer)
    if cls == "data.distribution_shift":
        diag.layer = "input"
        diag.source = q.split("/", 1)[1] if q.startswith("loss_by_source/") else shifted_source(ctx)
    diag.tree = walk(ctx, checks, layer, rank)
    split(diag, checks.values(), main)
    return diag


def shifted_source(ctx: Context) -> str | None:
    """The one source whose loss stepped up (a sustained or change deviation) within K steps of the incident,
    when it is the only one and no input statistic moved."""
    if ctx.near("input.", -NEAR, NEAR) and any(d.quantity != "input.content" for d in ctx.near("input.", -NEAR, NEAR)):
        return None
    up = {d.quantity.split("/", 1)[1] for d in ctx.near("loss_by_source/", 0, K) if d.kind in ("sustained", "change")}
    return up.pop() if len(up) == 1 and len([k for k in ctx.tl if k.startswith("loss_by_source/")]) > 1 else None


def clip_recovered(ctx: Context) -> bool:
    """Is the clip coefficient back at its level before the incident within K steps after it?"""
    s = ctx.tl.get("clip_coef")
    before = [v for t, v in sorted(s.values.items()) if ctx.t0 - WINDOW <= t < ctx.t0] if s else []
    after = [v for t, v in sorted(s.values.items()) if ctx.t0 + K <= t < ctx.t0 + 2 * K] if s else []
    return bool(before and after) and statistics.median(after) >= 0.9 * statistics.median(before)


def update_layers(ctx: Context) -> tuple[int, int]:
    """(layers whose update ratio deviated at the incident's step or the next, layers with an update ratio)."""
    every = [k for k in ctx.tl if k.startswith("update_ratio/")]
    moved = [d for d in ctx.near("update_ratio/", 0, NEAR)]
    return len(moved), len(every)


def one_source(ctx: Context, q: str) -> bool:
    # NOTE: forward quantities only: the gradient and the update of step t0 and after are computed from that
    # loss (a changed source is a changed objective, and the update follows it); one before t0 would itself
    # have been the earliest anomaly
    others = [d for k, d in ctx.devs.items() if k != q and k.startswith(("loss_by_source/", "act_rms", "lr/",
                                                                         "logit_max"))
              and abs(d.step - ctx.t0) <= 1]
    return len([k for k in ctx.tl if k.startswith("loss_by_source/")]) > 1 and not others


def rank_apart(rec: dict, q: str, first: Deviation) -> str:
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
        rose = [d.quantity.split("/", 1)[1] for d in ctx.near("loss_by_source/", 0, 1)]
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
    """Loss of the last third above the first third's (beyond its noise) while the grad norm is flat."""
    k = len(recs) // 3
    if k < 10:
        return Check("slow worsening", None, f"too few steps ({len(recs)}) to see a trend")
    a, b = recs[:k], recs[-k:]
    la, lb = statistics.median(r["loss"] for r in a), statistics.median(r["loss"] for r in b)
    mad = statistics.median(abs(r["loss"] - la) for r in a)
    ga, gb = statistics.median(r["grad_norm"] for r in a), statistics.median(r["grad_norm"] for r in b)
    rose = lb - la > max(0.05 * abs(la), 4 * 1.4826 * mad / math.sqrt(k))
    flat = 0.5 < gb / ga < 2.0
    ev = (f"median loss {la:.4g} (steps {a[0]['step']}..{a[-1]['step']}) -> {lb:.4g} (steps {b[0]['step']}.."
          f"{b[-1]['step']}), median grad norm {ga:.3g} -> {gb:.3g}")
    return Check("slow worsening", rose and flat, ev)


def throughput_drop(recs: list[dict]) -> Check:
    """tokens/s of the last third below half the first third's, with the loss normal."""
    k = len(recs) // 3
    if k < 10:
        return Check("throughput drop", None, f"too few steps ({len(recs)})")
    a = statistics.median(r["tokens_per_s"] for r in recs[:k])
    b = statistics.median(r["tokens_per_s"] for r in recs[-k:])
    return Check("throughput drop", b < 0.5 * a, f"median tokens/s {a:.4g} -> {b:.4g} (first vs last third)")
