"""The signal registry: every quantity a StepRecord carries that the guard or the doctor can score,
declared once (docs/design.md §7).

A Signal says where its values live in a record (`read`), which layer of the course's timeline it belongs
to (input → forward → backward/update → system), how it is scored (log scale, anomalous direction, noise
floors, an exact value a healthy run holds), when in the step the online guard can see it (`phase`), and
what it means when it is the first quantity that moved: the fault class and the fix hint. Telemetry writes
the fields (tests/test_signals.py checks that every key a record holds is declared here), the guard takes
any signal by name (`guard.detector.metrics.<name>`), and the doctor builds its timeline by iterating this
registry — so a new signal is one `declare(...)` plus its computation.

    for sig in SIGNALS.values():                 # declaration order is timeline order within a layer
        for name, value, model_layer, count in sig.read(record, ctx): ...

NOTE: plain Python, no torch: the doctor reads records without the training stack.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

# the readers (stability/readers.py); SWITCH_TRIGGER and per_layer, field_ are also what the guard and a new signal take
from stability.readers import (SWITCH_TRIGGER, _by_source, _eval_deficit, _fingerprint_switch, _floor_deficit,  # noqa: F401
                               _load_entropy, _lr_schedule, _moe, _not_overflow, _not_skipped, _num, _out_rms_min,
                               _rank_loss_spread, _replica, _typical, _warm, _warm_typical, field_, flag, inputs_,
                               per_layer, state_)

LAYERS = ("input", "forward", "backward/update", "system")
INPUT, FORWARD, BACKWARD, SYSTEM = LAYERS
GUARD_FLOOR = "guard"  # point_floor placeholder: the run's guard.detector.log_floor
# what a quantity is, as the doctor's declared rules read it (doctor/classify.py RULES, doctor/judge.py): never its name
ROLES = ("input",       # a statistic of the batch before any forward
         "switch",      # the data mixture switched (the guard's input.data_fingerprint trigger)
         "rank",        # one rank's inputs against the others'
         "activation",  # a layer's output
         "attention",   # a block's attention logits
         "logits",      # the output logits and their normaliser
         "objective",   # the loss the run minimises (total, or by source): where damage is measured
         "floor",       # the loss against its exact floor
         "nonfinite",   # a non-finite flag (Signal.flags: the value it reports)
         "schedule",    # the LR against its schedule
         "gradient",    # the gradient's norm (run-level or one layer's)
         "clip",        # the clip coefficient
         "update",      # the update against the weights (ρ)
         "state",       # the optimizer state after the update
         "setting",     # a setting the weights' trajectory reveals
         "routing",     # an MoE layer's routing health
         "replica",     # cross-rank consistency
         "precision",   # the precision recipe's own state (the FP16 loss scale)
         "spec")        # a specification check's finding (spec/)


@dataclass
class ReadContext:
    """What a reader needs beside the record (doctor/timeline.py fills it per record; the guard leaves
    the defaults): whether the batch's source mix is typical of the declared weights, whether the input
    histogram is warm after a (re)start, whether an FP16 overflow explains a non-finite gradient, and the
    LR the schedule gives this step (None: not compared)."""
    typical: bool = True
    warm: bool = True
    overflow: bool = False
    lr_expected: float | None = None
    floors: dict | None = None  # exact per-source floors of the run's data (synthetic data only)
    prev: dict | None = None    # the record of the step before, on the same path (None at a start or a jump)


Reading = tuple  # (series name, value, model layer or None, count or None)


@dataclass(frozen=True)
class Signal:
    name: str                     # the family: a series is `name` or `name/<member>` (a layer, a source, a group)
    layer: str                    # timeline layer
    read: Callable[[dict, ReadContext], Iterable[Reading]] = field(compare=False, repr=False)
    cls: str | None = None        # the doctor class it implies when it moves first (None: decided by context)
    fix: str = ""                 # what to look at when it moved first
    doc: str = ""
    direction: str = "up"         # up | down | both: which moves are anomalous
    log: bool = False             # scored on log(x): scale-free quantities (norms, ratios, RMS)
    rel_floor: float = 0.05       # relative moves below this never deviate (log units for a log signal): 5 %, the
    #                               least move worth a report for a norm, a ratio or an RMS
    abs_floor: float = 1e-12      # keeps a zero spread from dividing by zero (a float64 value's own resolution)
    exact: float | None = None    # the value a healthy run holds exactly (any departure deviates)
    point: str | None = None      # the one-step test's direction when it differs from `direction` ("none": off)
    point_floor: float | str = 0.0  # the one-step test's noise floor (log units); GUARD_FLOOR: the guard's
    needs: str | None = None      # a run-level series that must deviate at the same step for this one to count
    per_layer: bool = False       # one series per model layer (the doctor's stricter change threshold)
    guard_default: bool = False   # watched by the online guard unless the config says otherwise
    phase: str = "after"          # when the guard can score it: before (can veto the update) | after
    recover: bool = True          # a deviation of it may be natural (it can return to its band on its own)
    bound: float | str | None = None  # a healthy run never exceeds this (one-sided invariant; BUDGET: the doctor's
    #                                   false-alarm budget sets it) ...
    confirm: int = 1              # ... for this many consecutive values
    scored: bool = True           # False: in the timeline (plots, a replay's reading), never scored by the doctor's
    #                               statistics: a specification check judges it exactly (spec/)
    role: str | None = None       # what it is (ROLES): the doctor's rules read this, never the name
    per_source: bool = False      # one series per data source (a source's loss)
    lever: str | None = None      # the recipe lever that bounds it (doctor/levers.py), when a conforming run takes
    #                               damage and it moved first
    flags: str | None = None      # a non-finite flag: the signal whose value it reports non-finite
    vouched: str | None = None    # the specification check (spec/) that, run and passed at its step, says the step
    #                               did what it was told: a deviation of this quantity is then the run's own (an
    #                               unusual batch of the data, not a corrupted one)


SIGNALS: dict[str, Signal] = {}


def declare(name: str, layer: str, read, **kw) -> Signal:
    if name in SIGNALS:
        raise ValueError(f"signal {name!r} declared twice")
    if kw.get("role") is not None and kw["role"] not in ROLES:
        raise ValueError(f"signal {name!r}: role {kw['role']!r} is not one of {ROLES}")
    sig = SIGNALS[name] = Signal(name, layer, read, **kw)
    return sig


def family(series: str) -> Signal | None:
    """The Signal a series name belongs to (`act_rms/block0.mlp` -> act_rms, `replica.params` -> replica)."""
    head = series.split("/", 1)[0]
    return SIGNALS.get(head) or SIGNALS.get(head.split(".", 1)[0])


def guard_defaults() -> dict[str, dict]:
    """The guard's default metrics: {name: {"direction", "log"}} of the signals declared guard_default."""
    # NOTE: the step's own scalars first (loss, then by source), then the gradient, then after the update
    picked = sorted((s for s in SIGNALS.values() if s.guard_default), key=lambda s: (s.phase != "before", s.name != "loss"))
    return {s.name: {"direction": s.direction if s.direction != "down" else "both", "log": s.log} for s in picked}


def guard_values(rec: dict, names: Iterable[str], phase: str, ctx: ReadContext | None = None
                 ) -> tuple[dict[str, float], dict[str, float]]:
    """(values, counts) of the named signals readable at `phase` from a partial record (the guard's view:
    what the step knows before or after its update). A signal the guard watches but cannot see at that
    phase is simply absent."""
    vals, counts, ctx = {}, {}, ctx or ReadContext()
    for n in names:
        sig = SIGNALS.get(n)
        if sig is None or sig.phase != phase:
            continue
        for series, v, _, c in sig.read(rec, ctx):
            vals[series] = v
            if c:
                counts[series] = c
    return vals, counts


# ---- the registry, in timeline order ----------------------------------------------------------------
# NOTE on the floors. `rel_floor` (`abs_floor`) is the least move a test counts — an effect size, not a threshold:
# it matters only where a series' own noise (its MAD) is near zero, which a statistic of a batch can be when its
# value is quantised or saturated (a share that is 1.0 every step). The doctor's thresholds come from the run's
# false-alarm budget (doctor/budget.py); a floor never lowers one.
# input: what the batch was, before any forward. NOTE: two-sided where noise and repetition move a
# statistic opposite ways; both are a batch unlike the run's.
CORRUPT = "data.corrupted_batch"
declare("input.label_alignment", INPUT, inputs_("label_alignment"), cls=CORRUPT, direction="down", exact=1.0,
        doc="labels[t] == tokens[t+1] where both are real", fix="labels misaligned or shuffled (labels[t] != tokens[t+1])",
        recover=False, role="input")
# NOTE: the token-distribution statistics of a batch whose source mix is itself improbable under the declared
# weights are explained by that mix (the fingerprint and per-source losses judge a mixture change).
# Floors: a share of the batch counts when it moves by a quarter (top token), a tenth (document starts, valid
# positions, the rare and KL shares) or 2 % (entropy, in nats over a ~log 64 range): one document more or less of a
# 16-document batch moves a share by 1/16 ≈ 6 %, which the top-token share's many ties amplify
declare("input.top_token_frac", INPUT, inputs_("top_token_frac", _typical), cls=CORRUPT, direction="both",
        rel_floor=0.25, recover=False, role="input", vouched="data",
        fix="the most frequent token's share moved (repeated / degenerate text, or noise)")
declare("input.doc_start_frac", INPUT, inputs_("doc_start_frac"), cls=CORRUPT, direction="both", rel_floor=0.1,
        recover=False, role="input", vouched="data", fix="rows that start no document: one overlong, unsegmented document")
declare("input.valid_frac", INPUT, inputs_("valid_frac"), cls=CORRUPT, direction="both", rel_floor=0.1,
        recover=False, role="input", vouched="data", fix="the share of valid label positions moved (padding / mask / length change)")
declare("input.entropy", INPUT, inputs_("entropy", _typical), cls=CORRUPT, direction="both", rel_floor=0.02,
        recover=False, role="input", vouched="data", fix="the batch's token entropy moved (noise raises it, repetition lowers it)")
# WARN: the running histogram starts empty in every process (it is not in the checkpoint): after a resume
# every token is "rare" for a few steps, so kl and the rare share wait HIST_WARM steps (ReadContext.warm).
# abs_floor: 0.02 nats of KL, 3 % of the batch rare: below one document's worth of a 16-document batch
declare("input.kl_running", INPUT, inputs_("kl_running", _warm_typical), cls=CORRUPT, rel_floor=0.1, abs_floor=0.02,
        recover=False, role="input", vouched="data", fix="the batch's token histogram left the run's running histogram (another distribution)")
declare("input.foreign_frac", INPUT, inputs_("foreign_frac"), cls=CORRUPT, exact=0.0, rel_floor=0.0, abs_floor=0.0,
        recover=False, role="input", fix="tokens outside their document's vocabulary block (noise, foreign or spliced text)")
declare("input.rare_frac", INPUT, inputs_("rare_frac", _warm), cls=CORRUPT, rel_floor=0.1, abs_floor=0.03,
        recover=False, role="input", vouched="data", fix="tokens the run has (almost) never seen (out-of-vocabulary / foreign text)")
declare("input.data_fingerprint_changed", INPUT, _fingerprint_switch, cls="objective.mixture", exact=0.0,
        recover=False, role="switch", doc="the guard's input.data_fingerprint trigger (a mixture switch)",
        fix="the data mixture weights")
declare("ranks.loss_spread", INPUT, _rank_loss_spread, cls="rank.data", log=True, rel_floor=0.05, recover=False,
        role="rank", vouched="data", fix="one rank's local loss apart from the others' (its data, not the model's)")
# forward: activations in model order, then what is computed from them
declare("act_rms", FORWARD, per_layer("act_rms"), cls="numerics.activation_outlier", direction="both", log=True,
        point="up", per_layer=True, role="activation", lever="lr",
        fix="the named layer's output grew: its inputs, norm, clamp")
# abs_floor: one clamped pre-activation in a hundred
declare("clamp_hit_rate", FORWARD, per_layer("clamp_hit_rate"), cls="numerics.activation_outlier", abs_floor=0.01,
        per_layer=True, role="activation", lever="lr",
        fix="the SwiGLU clamp bites more often: the MLP's pre-activations grew")
# NOTE: attention sharpens as the model learns, and one step's max over a few heads is noisy (a block can flip
# between two levels): its moves are judged by what the run did after them; the growth QK-norm / QK-clip exist for
# is a level that climbs and does damage (doctor/outcome.py, doctor/levers.py)
declare("attn_logit_max", FORWARD, per_layer("attn_logit_max"), cls="numerics.attention_logits", log=True,
        per_layer=True, role="attention", lever="qk",
        fix="the attention logits of the named block grew (QK-norm / QK-clip bound them)")
declare("nonfinite.logits", FORWARD, flag("logits"), cls="numerics.nonfinite", exact=0.0, recover=False,
        phase="before", role="nonfinite", flags="logit_max", fix="a non-finite logit")
declare("logit_max", FORWARD, field_("logit_max"), cls="numerics.activation_outlier", direction="both", log=True,
        point="up", phase="before", role="logits", lever="z_loss", fix="the output logits grew (z-loss bounds them)")
declare("z_loss", FORWARD, field_("z_loss"), cls="numerics.activation_outlier", log=True, phase="before",
        role="logits", lever="z_loss", fix="the softmax normaliser drifted (z-loss coefficient)")
# NOTE: a per-source loss is a mean over that source's tokens in the batch: its one-step tests scale by
# √(n / n̄) below the usual count (the record's tokens_by_source), as the guard does. rel_floor 0.01: a loss move
# under 1 % is below what any fix could be checked against
declare("loss_by_source", FORWARD, _by_source("loss_by_source"), cls="forward.loss_spike", rel_floor=0.01,
        guard_default=True, phase="before", role="objective", per_source=True, lever="lr",
        fix="the loss of one source rose")
# NOTE: the floor is exact (known data): a loss below it, beyond batch noise, is a model that sees what it
# predicts. One-sided and needing no baseline: the deficit in standard errors stays under the budget's bound
# (BUDGET: doctor/budget.py) for `confirm` consecutive steps — a leak is in the code and holds every step, and three
# independent batches make the bound the cube root of a single batch's
LEAK = "the model sees what it predicts: a causal-mask, label or eval/train leak"
BUDGET = "budget"  # bound placeholder: the doctor's false-alarm budget sets it
declare("below_floor", FORWARD, _floor_deficit, cls="forward.below_floor", recover=False, phase="before",
        bound=BUDGET, confirm=3, role="floor", per_source=True,
        doc="(exact floor − loss)·√n / S_TOK per source: > 0 is better than any model can do", fix=LEAK)
declare("eval_below_floor", FORWARD, _eval_deficit, cls="forward.below_floor", recover=False, bound=BUDGET,
        role="floor", doc="the evaluation's loss against its exact floor, in standard errors", fix=LEAK)
declare("nonfinite.loss", FORWARD, flag("loss"), cls="numerics.nonfinite", exact=0.0, recover=False, phase="before",
        role="nonfinite", flags="loss", fix="a non-finite loss")
declare("loss", FORWARD, field_("loss"), cls="forward.loss_spike", rel_floor=0.01, guard_default=True,
        phase="before", role="objective", lever="lr", fix="the loss rose with normal inputs and settings")
# backward / update: the LR the update used, gradients, then the update itself. The LR is exact to 1e-6: it is
# read back from a float32-rounded parameter group (ε = 1.2e-7), a few roundings at most
declare("lr", BACKWARD, _lr_schedule, cls="optim.lr_switch", direction="both", exact=1.0, rel_floor=1e-6,
        recover=False, phase="before", role="schedule", fix="the LR left its schedule")
# NOTE: under FP16 loss scaling an inf gradient with a finite loss is the scaler's routine overflow (it skips
# and backs off; the guard ignores it too): not an anomaly, and no gradient to score
declare("nonfinite.grads", BACKWARD, flag("grads", _not_overflow), cls="numerics.nonfinite", exact=0.0,
        recover=False, phase="before", role="nonfinite", flags="grad_norm", fix="a non-finite gradient")
# NOTE: one layer's gradient RMS is heavy-tailed on a clean run (an attention layer can burst for one step
# with the loss and the global norm within their noise): it says where, and counts only at a step
# where the run's gradient norm deviates too
declare("grad_rms", BACKWARD, per_layer("grad_rms", _not_overflow), cls="optim.gradient_spike", direction="both",
        log=True, point="up", needs="grad_norm", per_layer=True, role="gradient", lever="clip",
        fix="the named layer's gradient burst")
declare("grad_norm", BACKWARD, field_("grad_norm", _not_overflow), cls="optim.gradient_spike", log=True,
        point_floor=GUARD_FLOOR, guard_default=True, phase="before", role="gradient", lever="clip",
        fix="the gradient moved first")
# NOTE: one clipped step is the gradient's incident: the gradient norm that caused it moves at the same step and
# comes first in the timeline (declared before it); heavy clipping is a coefficient that falls and stays low
declare("clip_coef", BACKWARD, field_("clip_coef", _not_overflow), cls="optim.heavy_clipping", direction="down",
        log=True, role="clip", lever="clip",
        doc="min(1, c/‖g‖): under constant heavy clipping a clean loss curve hides a recipe problem",
        fix="the clip threshold against the gradient's own scale (train.max_grad_norm, the loss / gradient scale)")
# NOTE: one step of a layer's ratio is judged at the guard's floor, as update_ratio_max is: it follows its
# gradient's bursts; a shift of the optimizer moves every layer's
declare("update_ratio", BACKWARD, per_layer("update_ratio", _not_skipped), cls="optim.state", direction="both",
        log=True, point="up", point_floor=GUARD_FLOOR, per_layer=True, role="update", lever="lr",
        fix="the update of the named layer jumped against its gradient")
declare("update_ratio_max", BACKWARD, field_("update_ratio_max", _not_skipped), cls="optim.state", log=True,
        point_floor=GUARD_FLOOR, guard_default=True, role="update", lever="lr",
        fix="the update jumped against the gradient")
declare("nonfinite.optim_state", BACKWARD, flag("optim_state"), cls="numerics.nonfinite", exact=0.0, recover=False,
        role="nonfinite", fix="a non-finite optimizer moment")
# optimizer state after the update: what a resume must restore exactly; after the gradients in order, so a
# gradient spike that moves m wins the tie. NOTE: downward only: ‖v‖ cannot fall faster than β₂ a step and ‖m‖,
# the balancing bias, only as fast as their EMAs forget: a fall past that is state lost or altered. A rise
# follows the gradient, whose own quantities judge it. FLOOR_STATE: log units, 1 − β₂ = 0.05 a step is the
# fastest ‖v‖ can forget (β₂ = 0.95, the recipe's): three steps of it
FLOOR_STATE = 0.15
declare("state", BACKWARD, state_(("m", "v", "moe_bias")), cls="optim.state", direction="down", log=True,
        rel_floor=FLOOR_STATE, recover=False, role="state", vouched="optimizer", doc="‖m‖, ‖v‖ per param group, ‖bias‖ per MoE layer",
        fix="the optimizer state fell faster than its EMA can forget: lost or altered")
# NOTE: ‖θ‖ per group moves by lr·wd·‖θ‖ of decay plus the updates each step: its per-step log change is a
# steady small number, and a jump of it is a setting (weight decay, an update multiplier) that changed
# without the config saying so. The level itself drifts with training and is not scored.
def _weight_change(r, c):
    prev = (c.prev or {}).get("state") or {}
    if r.get("skipped") or c.prev is None:
        return []
    out = []
    for k, v in (r.get("state") or {}).items():
        p = prev.get(k)
        if k.startswith("w/") and _num(v) and _num(p) and v > 0 and p > 0:
            out.append((f"state.dw/{k[2:]}", math.log(v / p), None, None))
    return out


# abs_floor 1e-4: lr·wd at the recipe's peak (2e-3 × 0.1 = 2e-4 a step) halved: a move of the per-step log change
# smaller than half the decay itself is not a setting that changed
declare("state.dw", BACKWARD, _weight_change, cls="optim.settings", direction="both", rel_floor=0.0, abs_floor=1e-4,
        recover=False, role="setting", vouched="optimizer",
        doc="log(‖θ_t‖ / ‖θ_t−1‖) per param group (record v4 state.w/<group>)",
        fix="the weights' step-to-step change left its trajectory (a silent weight decay or update multiplier)")
# MoE health per layer, every step (record.moe): the effective number of experts in use and the smallest
# expert's output against the layer's median. Floors in log units: 0.15 ≈ one expert of 8 falling out of use
# (log 8/7 = 0.13); 0.3: an expert's output below ¾ of the median's
declare("moe.experts_used", FORWARD, _moe("moe.experts_used", _load_entropy), cls="moe.load_collapse",
        direction="down", log=True, rel_floor=0.15, per_layer=True, recover=False, role="routing", vouched="route",
        doc="exp(entropy) of the expert load: E when balanced, k when routing collapsed onto k experts",
        fix="the router of the named layer: balancing bias / aux loss, router logits, a forced route")
declare("moe.out_rms_min", FORWARD, _moe("moe.out_rms_min", _out_rms_min), cls="moe.dead_expert",
        direction="down", log=True, rel_floor=0.3, per_layer=True, recover=False, role="routing", vouched="forward",
        doc="the smallest expert output RMS / the layer's median", fix="the expert whose output vanished")
# system: cross-rank consistency (exactly 0 on healthy DDP)
declare("replica", SYSTEM, _replica, cls="system.rank_divergence", exact=0.0, rel_floor=0.0, abs_floor=0.0,
        recover=False, role="replica", fix="the replicas stopped holding the same bits")
# the precision recipe's own state: the FP16 loss scale backs off on every overflow, routinely; never scored, read
# as evidence when a conforming run took damage (doctor/levers.py)
declare("loss_scale", BACKWARD, field_("loss_scale"), scored=False, log=True, role="precision", lever="precision",
        doc="the FP16 loss scale (None under other recipes)", fix="the loss scale against the gradient's range")
# the specification checks (spec/, record v5): each check's worst err/tol, and the measured difference of every layer
# of the training path against the FP64 reference — the recipe's numerical error, per layer, on reference steps.
# Judged by their checks (doctor/conformance.py), never by a statistic here.
def _spec_miss(r, c):
    return [(f"spec.{k}", v, None, None) for k, v in ((r.get("spec") or {}).get("miss") or {}).items() if _num(v)]


def _spec_layers(key: str):
    """spec[key][<model layer>], per layer (the checks' per-layer measurements)."""
    def read(r, c):
        return [(f"{key}/{k}", v, k, None) for k, v in ((r.get("spec") or {}).get(key) or {}).items() if _num(v)]
    return read


declare("spec", SYSTEM, _spec_miss, scored=False, log=True, recover=False, role="spec",
        doc="each specification check's worst err/tol this step (above 1: it failed)",
        fix="the check's own finding (record spec.fail): where it missed and by how much")
declare("ref_err", FORWARD, _spec_layers("ref_err"), scored=False, log=True, per_layer=True, recover=False, role="spec",
        doc="‖training path − FP64 reference‖ / ‖reference‖ per layer on the probe: the recipe's numerical error",
        fix="the named layer's rounding against its precision recipe")
declare("prefix_err", FORWARD, _spec_layers("prefix_err"), scored=False, log=True, per_layer=True, recover=False,
        role="spec", doc="‖training path − FP64 reference‖ / ‖reference‖ per layer on a row's first and last positions, "
                         "every step between the reference steps (the prefix check's): the series that dates a failure of the "
                         "exact check (doctor/conformance.py)",
        fix="the named layer's rounding against its precision recipe")
declare("out_rms", FORWARD, _spec_layers("out_rms"), scored=False, log=True, per_layer=True, recover=False, role="spec",
        doc="every layer's output RMS over the step's batch, every step (the loss_grad check's hooks): the series "
            "that dates a failure of the forward check, which runs on reference steps only (doctor/conformance.py)",
        fix="the named layer's output level")
declare("param_grad_norm", BACKWARD, _spec_layers("param_grad_norm"), scored=False, log=True, per_layer=True,
        recover=False, role="spec", doc="every parameter's gradient norm, every step (the clip check's): the series "
                                        "that dates a failure of the gradient check, which runs on reference steps only",
        fix="the named parameter's gradient level")
