"""The slow symptoms of a run without a point anomaly (docs/course.md §10): a loss that worsens slowly with a flat
gradient norm, a throughput that drops with a normal loss, a jump at a resume no single step shows."""
from __future__ import annotations

import math
import statistics

from doctor.checks import Check, Context, check_resume, resume_step
from doctor.classes import symptom
from doctor.diagnosis import Diagnosis
from doctor.scores import MIN_HISTORY
from doctor.timeline import MAD_SIGMA, scoring_start


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
    # NOTE: past the budget's threshold in its noise AND by the loss signal's own floor (an effect size: a move
    # under it is below what any fix could be checked against)
    from stability.signals import SIGNALS
    rose = se > 0 and (lb - la) / se > threshold(1, len(d), 0.0, 1) and lb - la > SIGNALS["loss"].rel_floor * abs(la)
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
