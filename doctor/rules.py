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

from doctor.checks import (Check, Context, check_finite, check_input, check_lr, check_lr_too_large,
                                     check_mixture, check_replica, check_resume, check_update, corruption_kind,
                                     nonfinite_layer, resume_step, transient)
from doctor.timeline import (Deviation, Run, deviations, earliest, load_run, scoring_start,
                                       timeline)

# symptom-table rows: (symptom, what to check first, what it is easily mistaken for)
SYMPTOMS = {
    "numerics.nonfinite": ("one-step NaN (单步突然 NaN)", "the current batch, loss scale, reductions and kernels",
                           "an LR that is too large in general"),
    "state.resume_jump": ("jump right after resume (resume 后立即跳变)",
                          "optimizer / scheduler state, RNG, data cursor", "a new data distribution"),
    "system.rank_divergence": ("only some ranks diverge (只有某些 rank 发散)",
                               "the collective, shard ownership, a bad device", "ordinary random fluctuation"),
    "data.slow_worsening": ("slow worsening with a flat grad norm (loss 缓慢恶化且 norm 平稳)",
                            "data mixture, duplication rate, labels or mask", "numerical overflow"),
    "system.throughput": ("throughput drop with a normal loss (吞吐下降但 loss 正常)",
                          "shapes, routing load, communication and recomputation", "optimizer degradation"),
}


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


def diagnose(run_dir) -> tuple[Run, Diagnosis, dict]:
    """(run, diagnosis, deviations) of one run directory."""
    run = load_run(run_dir)
    tl = timeline(run.first, run.config)
    devs = deviations(tl, scoring_start(run.config))
    first = earliest(devs)
    ctx = Context(run, tl, devs, first.step if first else None)
    diag = classify(ctx, first) if first else no_point_anomaly(ctx)
    return run, diag, devs


def classify(ctx: Context, first: Deviation) -> Diagnosis:
    t0, q, rec = first.step, first.quantity, ctx.rec(first.step)
    world = rec.get("world", 1)
    checks = {c.name: c for c in (check_finite(ctx), check_input(ctx), check_mixture(ctx), check_lr(ctx),
                                  check_update(ctx), check_replica(ctx), check_resume(ctx), check_lr_too_large(ctx))}
    rank = "0 (single process)" if world <= 1 else f"not localised (world {world}: the record is rank 0's view)"
    layer = first.layer_name
    if q.startswith("input.data_fingerprint"):
        cls, why = (("objective.mixture", "the data mixture switched; each source stayed on its trajectory")
                    if checks["objective change (data mixture switch)"].holds else
                    ("data.switch", "the data mixture switched and a source's loss rose above its trajectory"))
        main = "objective change (data mixture switch)"
    elif q.startswith("input."):
        cls, main = "data.corrupted_batch", "corrupted input batch"
        why = f"the batch deviated before any forward ({corruption_kind(ctx)})"
    elif checks["jump after resume"].holds:
        cls, main, why = "state.resume_jump", "jump after resume", "the anomaly follows a resume"
    elif checks["non-finite numerics"].holds:
        cls, main = "numerics.nonfinite", "non-finite numerics"
        layer = nonfinite_layer(ctx) or layer
        why = f"a non-finite value with a finite input layer; first non-finite activation: {layer}"
    elif q.startswith("replica."):
        cls, main, why = "system.rank_divergence", "rank divergence", "the replicas stopped holding the same bits"
        rank = f"replicas disagree (world {world}); the record holds spreads only, not which rank"
    elif q == "lr/schedule":
        cls, main, why = "optim.lr_switch", "LR switch", "the LR left its schedule"
    elif checks["corrupted optimizer state"].holds:
        cls, main = "optim.state", "corrupted optimizer state"
        why = "the update ratio jumped with the LR on schedule, a normal gradient and normal inputs"
    elif q.startswith(("grad_norm", "grad_rms", "update_ratio")):
        cls, main, why = "optim.gradient_spike", None, "the gradient (and with it the update) spiked"
    elif q.startswith(("act_rms", "clamp_hit_rate", "logit_max", "z_loss")):
        cls, main, why = "numerics.activation_outlier", None, f"an activation grew first ({q})"
    else:
        cls, main, why = "forward.loss_spike", None, f"the loss rose first ({q}) with normal inputs and settings"
    diag = Diagnosis(cls, f"{cls} at step {t0}: {why}", first, t0, rank,
                     {"step": t0, **rec["batch"]}, SYMPTOMS.get(cls), layer)
    diag.tree = walk(ctx, checks, layer, rank)
    split(diag, checks.values(), main)
    return diag


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
    sizes = {r["batch"].get("size") for r in ctx.run.first}
    tree.append(("LR / batch / data / length switches at that step", "; ".join(
        [checks["LR switch"].evidence, checks["objective change (data mixture switch)"].evidence,
         "batch size constant" if len(sizes) == 1 else f"batch sizes {sorted(sizes)}",
         checks["jump after resume"].evidence])))
    tree.append(("compare update norms", checks["corrupted optimizer state"].evidence))
    return tree


# ---- runs without a point anomaly: the slow symptoms ------------------------------------------------
def no_point_anomaly(ctx: Context) -> Diagnosis:
    run = ctx.run
    start = scoring_start(run.config)
    recs = [r for r in run.first if r["step"] >= start and math.isfinite(r["loss"])]
    checks = [check_resume(ctx), slow_worsening(recs), throughput_drop(recs)]  # a resume: a known step, first
    held = [c for c in checks if c.holds]
    cls = {"slow worsening": "data.slow_worsening", "throughput drop": "system.throughput",
           "jump after resume": "state.resume_jump"}.get(held[0].name, "healthy") if held else "healthy"
    last = run.first[-1]["step"]
    scored = (f"from step {start} to {last}" if last >= start else
              f"(exact checks only: {last} steps < scoring start {start})")
    summary = f"{cls}: {held[0].evidence}" if held else f"healthy: no quantity left its baseline {scored}"
    step = resume_step(run) if cls == "state.resume_jump" else None
    diag = Diagnosis(cls, summary, None, step, None, None, SYMPTOMS.get(cls))
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
