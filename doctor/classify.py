"""Classification by declared rules (docs/course.md §5 decision tree, §10 symptom table): the registry decides the
class — the earliest deviating quantity's Signal (`cls`), or the class its producer declares (an invariant, a
specification check) — and context refines it only through RULES, each a declaration that reads declared
properties (a Signal's `role`, timeline layer and `recover`, a deviation's declared class and kind, the hypothesis
checks of doctor/checks.py, the records' conformance), never a quantity's name. The first rule that applies
decides; every check that does not hold becomes a rejected hypothesis with its evidence.

    diag = classify(ctx, first)      # a Diagnosis: class, why, the decision-tree walk, confirmed / rejected checks
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable

from doctor.checks import (NEAR, Check, Context, check_finite, check_input, check_lr, check_lr_too_large,
                           check_mixture, check_replica, check_resume, check_update, corruption_kind,
                           nonfinite_layer, transient)
from doctor.classes import CLASSES, symptom
from doctor.diagnosis import Diagnosis
from doctor.invariants import resumed
from doctor.scores import MIN_MEDIAN
from doctor.timeline import INPUT, Deviation
from stability.signals import family


def _rank(rec: dict) -> str:
    world = rec.get("world", 1)
    return "0 (single process)" if world <= 1 else f"not localised (world {world}: the record is rank 0's view)"


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


