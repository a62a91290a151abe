"""The doctor's hypothesis checks: each one names a cause of a loss spike (docs/course.md §1) and says,
from the StepRecords alone, whether the step of the earliest anomaly supports it, with the numbers.

    ctx = Context(run, tl, devs, t0)      # t0: the step of the earliest anomaly (None: no anomaly)
    check_lr(ctx) -> Check(name, holds, evidence)

`holds` is True (the records support it), False (they reject it: the evidence says why) or None (the
run cannot tell: e.g. rank divergence in a single-process run).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from doctor.classes import CLASSES
from doctor.diagnosis import Check
from doctor.scores import MIN_HISTORY, MIN_MEDIAN
from doctor.timeline import INPUT, MAD_SIGMA, Deviation, Run, Series
from stability.signals import family

NEAR = 1  # a deviation this many steps from t0 belongs to the same incident: the step's own quantities are
#           recorded with the step, its update's consequences at the next one


@dataclass
class Context:
    run: Run
    tl: dict[str, Series]
    devs: dict[str, Deviation]
    t0: int | None
    seg_index: int = 0          # the segment (run.segments) the incident is in
    floors: dict | None = None  # the data's exact per-source floors (synthetic data)
    start: int = 0              # the doctor's first scored step
    earlier: list = field(default_factory=list)  # the incidents found before this one in its segment
    budget: object = None       # the run's detection budget (doctor/scores.py Budget): its window, its tests

    @property
    def seg(self) -> list[dict]:
        """The incident's trajectory: its segment with the history it was replayed from (Run.paths)."""
        return self.run.paths[self.seg_index]

    def rec(self, t: int | None = None) -> dict | None:
        t = self.t0 if t is None else t
        return next((r for r in self.seg if r["step"] == t), None)

    @property
    def window(self) -> int:
        """The run's baseline window (its guard's: doctor/scores.py Budget)."""
        if self.budget is not None:
            return self.budget.window
        from stability.config import DetectorConfig
        return DetectorConfig.__dataclass_fields__["window"].default

    def near(self, q: str, lo: int = -NEAR, hi: int = NEAR) -> list[Deviation]:
        """Deviations of the quantity q (a series, or every series of the family q) within [t0 + lo, t0 + hi]."""
        return [d for k, d in self.devs.items() if (k == q or (family(k) is not None and family(k).name == q))
                and self.t0 + lo <= d.step <= self.t0 + hi]

    def near_role(self, role: str, lo: int = -NEAR, hi: int = NEAR) -> list[Deviation]:
        """Deviations of quantities whose Signal declares `role` (stability/signals.py ROLES) within [t0 + lo, t0 + hi]."""
        return [d for q, d in self.devs.items() if (sig := family(q)) is not None and sig.role == role
                and self.t0 + lo <= d.step <= self.t0 + hi]

    def near_layer(self, layer: str, lo: int = -NEAR, hi: int = NEAR) -> list[Deviation]:
        """Deviations in one timeline layer within [t0 + lo, t0 + hi]."""
        return [d for d in self.devs.values() if d.layer == layer and self.t0 + lo <= d.step <= self.t0 + hi]

    def series(self, role: str) -> dict[str, Series]:
        """The timeline's series whose Signal declares `role`."""
        return {q: s for q, s in self.tl.items() if s.spec.role == role}

    def baseline(self, q: str, t: int | None = None) -> float | None:
        """Median of quantity q over the baseline window before t (default t0)."""
        t = self.t0 if t is None else t
        s = self.tl.get(q)
        vals = [v for k, v in sorted(s.values.items()) if k < t and math.isfinite(v)][-self.window:] if s else []
        return statistics.median(vals) if vals else None

    def value(self, q: str, t: int | None = None) -> float | None:
        s = self.tl.get(q)
        return s.values.get(self.t0 if t is None else t) if s else None


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def _vs(ctx: Context, q: str) -> str:
    return f"{q} {_fmt(ctx.value(q))} (baseline {_fmt(ctx.baseline(q))})"


# ---- the input layer ------------------------------------------------------------------------------
def meaning(d: Deviation) -> str:
    """What a deviation of the input layer means: its Signal's hint, or the class its producer declared."""
    sig = family(d.quantity)
    if sig is not None and sig.fix:
        return sig.fix
    c = CLASSES.get(d.cls or "")
    return c.means if c else d.describe()


def input_deviations(ctx: Context) -> list[Deviation]:
    """The input layer's deviations at t0 or the step before, in timeline order (an invariant first)."""
    return sorted(ctx.near_layer(INPUT, -NEAR, 0), key=lambda d: (d.step, d.order))


def check_input(ctx: Context) -> Check:
    """Split the loss by source, length, mask and duplicates: did the batch itself deviate?"""
    vals = ", ".join(_vs(ctx, q) for q, s in ctx.tl.items() if s.spec.layer == INPUT and s.spec.role == "input")
    bad = input_deviations(ctx)
    if bad:
        return Check("corrupted input batch", True, f"{meaning(bad[0])}; at step {ctx.t0}: {vals}")
    return Check("corrupted input batch", False, f"the input layer at step {ctx.t0} is within its baseline: {vals}")


def corruption_kind(ctx: Context) -> str | None:
    bad = input_deviations(ctx)
    return meaning(bad[0]) if bad else None


def check_mixture(ctx: Context) -> Check:
    """A data manifest / mixture switch at the step, and whether each source stayed on its trajectory."""
    switched = ctx.near_role("switch", -NEAR, 0)
    if not switched:
        return Check("objective change (data mixture switch)", False,
                     f"the data manifest did not change at steps {ctx.t0 - NEAR}..{ctx.t0} "
                     f"(no input.data_fingerprint trigger)")
    t = switched[0].step
    verdict, ev = per_source_verdict(ctx, t)
    return Check("objective change (data mixture switch)", verdict != "optimisation broke",
                 f"the data manifest changed at step {t}; {ev}")


def per_source_verdict(ctx: Context, t: int) -> tuple[str, str]:
    """labs.mixture's test: per-source losses on their trajectories while the mixture floor moved
    ('objective changed'), or some source rose above its trajectory ('optimisation broke')."""
    from labs.mixture import classify, evidence, spread, window
    recs = [r for r in ctx.seg if all(math.isfinite(v) for v in r.get("loss_by_source", {}).values())]
    i = next((k for k, r in enumerate(recs) if r["step"] >= t), len(recs))
    lo = max(0, i - ctx.window)  # the baseline window before the switch, and at least a median's worth on each side
    if i - lo < MIN_MEDIAN or len(recs) - i < MIN_MEDIAN:
        return "untestable", "too few steps around the switch to compare per-source losses"
    # NOTE: the floors the diagnosis already built (doctor/rules.py), not the data rebuilt once more
    floors = (ctx.floors if ctx.floors is not None else source_floors(ctx.run.config)) or \
        {s: 0.0 for s in recs[i - 1]["loss_by_source"]}
    before, after = window(recs, lo, i), window(recs, i, len(recs))
    noise = spread(recs[lo:i], floors)
    noise["mix_floor"] = noise["mix_floor"] or 1e-12  # NOTE: zero floors (real text): no floor-shift test (ε: no 0/0)
    try:
        ev = evidence(before, after, floors, noise)
        verdict = classify(before, after, floors, noise)
    except (KeyError, ZeroDivisionError):
        return "untestable", "a source is missing from the windows around the switch"
    rises = ", ".join(f"{s} {v:+.1f} SE" for s, v in ev["rise_se"].items())

    def share(w):
        return {s: round(n / sum(w["tokens_by_source"].values()), 2) for s, n in w["tokens_by_source"].items()}
    return verdict, (f"per-source loss change after the switch: {rises}; token shares {share(before)} -> "
                     f"{share(after)}; mixture floor shift {ev['mix_shift_se']:+.1f} SE; "
                     f"labs.mixture.classify: {verdict}")


def source_floors(config: dict) -> dict | None:
    """Exact per-source loss floors of a synthetic mixture (None for real text)."""
    data = config.get("data") or {}
    if data.get("kind") != "synthetic":
        return None
    from data import DataConfig, build_data
    from data.config import read_keys
    return build_data(DataConfig.from_dict(read_keys(data))).floor_by_source()


# ---- numerics -------------------------------------------------------------------------------------
def check_finite(ctx: Context) -> Check:
    """Finite checks: loss / logits / gradient / optimizer state, and the first non-finite activation."""
    rec = ctx.rec()
    flags = rec.get("nonfinite", {})
    bad = [k for k, v in flags.items() if v]
    layer = first_nonfinite(rec.get("layers", {}))
    if bad or layer:
        where = f"; first non-finite activation (model order): {layer}" if layer else \
            "; no per-layer telemetry names the layer (telemetry.every > 1?)"
        return Check("non-finite numerics", True,
                     f"non-finite at step {ctx.t0}: {', '.join(bad) or 'activations'}{where}")
    return Check("non-finite numerics", False,
                 f"loss, logits, gradients and optimizer state finite at step {ctx.t0} "
                 f"(loss {rec['loss']:.4g}, grad norm {rec['grad_norm']:.4g})")


def first_nonfinite(layers: dict[str, dict[str, float]]) -> str | None:
    """The earliest layer (model order) whose activation RMS is inf/NaN: where a NaN was born.
    NOTE: stability.telemetry.first_nonfinite's rule, restated so the doctor does not import the
    training stack (torch.distributed, FSDP) just to read a JSON file."""
    return next((k for k, v in layers.items() if "act_rms" in v and not math.isfinite(v["act_rms"])), None)


def nonfinite_layer(ctx: Context) -> str | None:
    return first_nonfinite(ctx.rec().get("layers", {}))


def transient(ctx: Context) -> str | None:
    """Evidence from later segments: the same batch replayed after a rollback, and what it did."""
    rec = ctx.rec()
    for seg in ctx.run.segments[ctx.seg_index + 1:]:
        again = next((r for r in seg if r["batch"].get("first") == rec["batch"].get("first")), None)
        if again is not None:
            ok = math.isfinite(again["loss"]) and not any(again.get("nonfinite", {}).values())
            return (f"the same batch (first sample {rec['batch']['first']}) replayed after the rollback at step "
                    f"{again['step']}: loss {again['loss']:.4g}"
                    + (" (finite: the fault did not recur)" if ok else " (failed again)"))
    return None


# ---- settings and the update ------------------------------------------------------------------------
def check_lr(ctx: Context) -> Check:
    """Did the LR leave its schedule at the step? (record lr vs optim.schedule in config.yaml)"""
    s = next(iter(ctx.series("schedule").values()), None)
    if s is None:
        return Check("LR switch", None, "no optim.schedule in config.yaml: the LR cannot be compared with it")
    off = ctx.near_role("schedule", -NEAR, 0)
    if off:  # NOTE: the step that left it, which need not be t0 (nor be compared at t0)
        d = min(off, key=lambda d: d.step)
        return Check("LR switch", True, f"lr {_fmt((ctx.rec(d.step) or {}).get('lr'))} at step {d.step} is "
                                        f"{d.value:.4g}× its schedule value")
    r = s.values.get(ctx.t0)
    if r is None:
        return Check("LR switch", None, f"step {ctx.t0}'s lr has no schedule to compare with (a record without "
                                        f"one, after a declared change)")
    return Check("LR switch", False, f"lr {ctx.rec()['lr']:.4g} at step {ctx.t0} is on its schedule (ratio {r:.9g})")


def check_update(ctx: Context) -> Check:
    """Compare update norms: did ρ jump without a matching gradient, LR or input to explain it?"""
    rho = ctx.near_role("update", 0, NEAR)
    lr, inp = ctx.near_role("schedule", -NEAR, 0), ctx.near_layer(INPUT, -NEAR, 0)
    ev = f"{_vs(ctx, 'update_ratio_max')}, {_vs(ctx, 'grad_norm')}"
    if rho:
        t = min(d.step for d in rho)
        # NOTE: only a gradient of the update's own step or before explains it: the next step's gradient is
        # computed with the parameters that update wrote (a bad update's consequence, not its cause)
        grad = [d for d in ctx.near_role("gradient", -NEAR, NEAR) if d.step <= t]
        ev = f"at step {t}: {_vs_at(ctx, 'update_ratio_max', t)}, {_vs_at(ctx, 'grad_norm', t)}"
        # NOTE: a loss that deviated at the update's step or before was computed before that update: the
        # update cannot have caused it, and a new objective (one source's data changed) moves the update
        loss = [d for d in ctx.near_role("objective", -NEAR, NEAR) if d.step <= t]
        if not (grad or lr or inp or loss):
            return Check("corrupted optimizer state", True,
                         f"the update jumped while the gradient, the LR, the inputs and the loss stayed normal: {ev}")
        why = ("the gradient" if grad else "the LR" if lr else "the input batch" if inp else
               f"the loss before it ({loss[0].quantity} at step {loss[0].step})")
        return Check("corrupted optimizer state", False, f"the update jumped, but {why} explains it: {ev}")
    return Check("corrupted optimizer state", False, f"no update-ratio jump at steps {ctx.t0}..{ctx.t0 + NEAR}: {ev}")


def _vs_at(ctx: Context, q: str, t: int) -> str:
    return f"{q} {_fmt(ctx.value(q, t))} (baseline {_fmt(ctx.baseline(q, t))})"


def check_replica(ctx: Context) -> Check:
    rec = ctx.rec()
    world = rec.get("world", 1)
    if world <= 1 or not rec.get("replica"):
        why = "single process" if world <= 1 else "no replica checksums (FSDP shards differ by design)"
        return Check("rank divergence", None, f"not testable: {why}")
    near = ctx.near_role("replica", -NEAR, 0)
    spreads = ", ".join(f"{k} {v:.4g}" for k, v in rec["replica"].items())
    if near:
        # the misdiagnosis of the symptom table is "random fluctuation": replicas hold the same bits
        zero = sum(1 for r in ctx.seg if r["step"] < near[0].step and r.get("replica")
                   and not any(r["replica"].values()))
        return Check("rank divergence", True, f"the {world} replicas disagree from step {near[0].step}: {spreads}; "
                     f"exactly 0 on the {zero} steps before (healthy DDP holds the same bits: not a fluctuation)")
    return Check("rank divergence", False, f"the {world} replicas agree exactly at step {ctx.t0}: {spreads}")


def check_resume(ctx: Context) -> Check:
    r = resume_step(ctx.run)
    if r is None:
        return Check("jump after resume", False, "the run never resumed (no 'resumed from' in the records)")
    if ctx.t0 is not None:
        if r <= ctx.t0 <= r + 2 * NEAR:  # the resumed step, its update's consequence, and that one's
            old = next((x for x in ctx.run.superseded if x["step"] == ctx.t0), None)
            was = f"; the superseded first run had loss {old['loss']:.4g} at that step" if old else ""
            return Check("jump after resume", True, f"resumed at step {r}; the anomaly follows at step {ctx.t0}{was}")
        return Check("jump after resume", False, f"resumed at step {r}; the anomaly is at step {ctx.t0}")
    # no point anomaly: a level shift of the loss at the resume step (the medians of the optimizer's memory of steps
    # either side, against the step-to-step noise: one-sided, at the budget's threshold for one test)
    from doctor.budget import threshold
    from doctor.timeline import memory
    m = max(memory(ctx.run.config.get("optim") or {}), MIN_HISTORY)
    losses = {x["step"]: x["loss"] for x in ctx.seg if math.isfinite(x["loss"])}
    before = [v for t, v in sorted(losses.items()) if r - m <= t < r]
    after = [v for t, v in sorted(losses.items()) if r <= t < r + m]
    if len(before) < MIN_HISTORY or len(after) < MIN_HISTORY:
        return Check("jump after resume", None, f"resumed at step {r}; too few steps around it to compare")
    mb, ma = statistics.median(before), statistics.median(after)
    d = [b - a for a, b in zip(before, before[1:])]
    noise = MAD_SIGMA * statistics.median(abs(x - statistics.median(d)) for x in d) / math.sqrt(2)
    se = noise * math.sqrt(math.pi / 2 * (1 / len(before) + 1 / len(after)))  # two medians
    jump = se > 0 and (ma - mb) / se > threshold(1, len(d))
    return Check("jump after resume", jump, f"resumed at step {r}: median loss {mb:.4g} over the {len(before)} steps "
                 f"before, {ma:.4g} over the {len(after)} after")


def resume_step(run: Run) -> int | None:
    """The first step run by a resumed process (its first record carries the 'resumed from' note)."""
    for r in run.records:
        if any(str(e).startswith("resumed from") for e in r.get("events", [])):
            return r["step"]
    return None


def check_lr_too_large(ctx: Context) -> Check:
    """The common misdiagnosis (symptom table): 'the LR is too large'. It would show before the
    incident: a rising loss or grad norm, or clipping on most steps."""
    before = [r for r in ctx.seg if ctx.t0 - ctx.window <= r["step"] < ctx.t0]
    if len(before) < 2 * MIN_MEDIAN:  # two halves, a median of each
        return Check("LR too large in general", None, "too few steps before the anomaly")
    half = len(before) // 2
    g0 = statistics.median(r["grad_norm"] for r in before[:half])
    g1 = statistics.median(r["grad_norm"] for r in before[half:])
    clipped = sum(r.get("clip_coef", 1.0) < 1.0 for r in before) / len(before)
    ev = (f"over steps {before[0]['step']}..{before[-1]['step']} the median grad norm went {g0:.3g} -> {g1:.3g} "
          f"and {clipped:.0%} of steps were clipped")
    # NOTE: the misdiagnosis's own signs: a gradient norm that doubled (one octave) over the window before, or
    # clipping on most of its steps
    return Check("LR too large in general", g1 > 2 * g0 or clipped > 0.5, ev)
