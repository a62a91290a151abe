"""The doctor's view of a run: its records as the four-layer timeline (docs/course.md §1), and the first
quantity that deviated (docs/course.md §1: find the first quantity that left its baseline, not the
first one an alarm fired on).

    run = load_run("runs/<run>")           # records, the first-executed trajectory, events, config
    tl = timeline(run.first, run.config)   # quantity -> Series (layer, model order, values by step)
    devs = deviations(tl, budget(tl, ...))  # doctor/scores.py: quantity -> its first Deviation
    first = earliest(devs)                 # earliest step; ties: input < forward < backward/update < system

After a guard rollback (or a resume from an older checkpoint) the step numbers in metrics.jsonl go
back and repeat; the records split there into segments (`run.segments`, execution order; `run.first`
is the first). Every segment is read: each may hold incidents (doctor/rules.py diagnose), and a
later segment is also evidence about an earlier one (did the same batch fail again on replay?).

The tests that say a quantity left its baseline (the point test on the series' own noise model, the guard's own)
are in doctor/scores.py, their thresholds from the run's false-alarm budget (doctor/budget.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import yaml

from optim.schedule import Schedule, factor_fn  # plain arithmetic: the optim package loads torch only on use
from stability.events import read_events
from stability.signals import (BACKWARD, FORWARD, GUARD_FLOOR, INPUT, LAYERS, SIGNALS, SYSTEM,  # noqa: F401
                               ReadContext, Signal, family)  # (the layer names: re-exported for doctor/)
from stability.record import (RECORD_VERSION, V2_FIELDS, V3_FIELDS, V4_FIELDS, V4_SUBFIELDS, V5_FIELDS,
                              read_records_partial)

MAD_SIGMA = 1.4826  # MAD → σ for Gaussian noise: 1 / Φ⁻¹(3/4)
HIST_WARM = 10    # steps after a resume before the input histogram's kl / rare share are read again: the
                  # running histogram (stability/inputs.py) restarts empty, and a batch's KL against k batches
                  # carries their sampling error, 1/k of its own: from k = 10 on, within 10 % of a warm one
MIX_P = 0.01      # a batch's source mix less probable than this under the declared weights explains its tokens:
                  # one batch in a hundred is that unusual by chance, and its token statistics are then read as
                  # the mix's, not the data's


# what a resume says of a change it was told of (checkpoint/resume.py, optim/schedule.py continued(),
# checkpoint/checkpointer.py): the config and data changes declared, and the schedule's answer to them
DECLARED = ("resume: config changed", "resume: data changed", "resume: train.steps", "resume: the LR schedule",
            "resume: the base LRs")


@dataclass
class Run:
    dir: Path
    records: list[dict]           # metrics.jsonl in execution order
    segments: list[list[dict]]    # split where the step goes back (a guard rollback)
    events: list[dict]            # events.jsonl without the injector's "fault" events
    truth: list[dict]             # the injector's "fault" events: ground truth, never used to classify
    config: dict                  # resolved config.yaml ({} when absent)
    superseded: list[dict]        # metrics.superseded.jsonl (records a resume replaced)
    notes: list[str] = field(default_factory=list)  # what the records lack (truncated, older version)

    @cached_property
    def declared(self) -> list[str]:
        """The changes a resume declared (resume.allow_*_change) and what it did with them (the LR schedule),
        as the run said them, with their step: the report names them, so a change is never read as a fault."""
        return [f"step {r['step']}: {e}" for r in self.records for e in r.get("events", [])
                if str(e).startswith(DECLARED)]

    @property
    def first(self) -> list[dict]:
        return self.segments[0]

    @cached_property
    def paths(self) -> list[list[dict]]:
        """Per segment, the trajectory the model lived up to its end: the earlier path's records before
        the segment's first step, then the segment (a replay after a rollback at step 70 to 60 has steps
        1..59 of the first pass as its history: its baseline is not rebuilt from nothing)."""
        out = [self.segments[0]]
        for seg in self.segments[1:]:
            out.append([r for r in out[-1] if r["step"] < seg[0]["step"]] + seg)
        return out


def load_run(run_dir) -> Run:
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise ValueError(f"run_dir={run_dir}: no such directory")
    if not path.is_file():
        raise ValueError(f"run_dir={run_dir}: no metrics.jsonl (not a run directory)")
    records, note = read_records_partial(path)
    if not records:
        raise ValueError(f"run_dir={run_dir}: metrics.jsonl holds no complete record")
    notes = [note] if note else []
    old = sorted({r.get("version", 1) for r in records if r.get("version", 1) < RECORD_VERSION})
    if old:
        lacks = (([*V2_FIELDS, "inputs.entropy/kl_running/rare_frac", "time_s.cpu"] if old[0] < 2 else [])
                 + (list(V3_FIELDS) if old[0] < 3 else []) + ([*V4_FIELDS, *V4_SUBFIELDS] if old[0] < 4 else [])
                 + list(V5_FIELDS))
        notes.append(f"{path}: record version {old[0]} < {RECORD_VERSION}: no {', '.join(lacks)}; "
                     f"their checks are skipped (the LR is judged against config.yaml's schedule)")
    events = read_events(run_dir / "events.jsonl")
    cfg_path = run_dir / "config.yaml"
    config = yaml.safe_load(cfg_path.read_text()) if cfg_path.is_file() else {}
    sup = run_dir / "metrics.superseded.jsonl"
    # WARN: the injector's events are the answer key of a drill: kept apart, read only for the report's
    # last line. Every diagnosis comes from the StepRecords and the guard's own events.
    return Run(run_dir, records, segment(records), [e for e in events if e.get("kind") != "fault"],
               [e for e in events if e.get("kind") == "fault"], config or {},
               read_records_partial(sup)[0] if sup.is_file() else [], notes)


def segment(records: list[dict]) -> list[list[dict]]:
    """Split the execution-order records where the step does not advance (a rollback replays)."""
    out = [[records[0]]]
    for r in records[1:]:
        if r["step"] <= out[-1][-1]["step"]:
            out.append([])
        out[-1].append(r)
    return out


# ---- the timeline ------------------------------------------------------------------------------------
@dataclass
class Series:
    spec: Signal
    order: int                                   # position within its timeline layer (model order)
    values: dict[int, float] = field(default_factory=dict)  # step -> value
    layer_name: str | None = None                # the model layer of a per-layer quantity
    counts: dict[int, float] = field(default_factory=dict)  # step -> tokens the value is a mean of (if so)
    cache: dict = field(default_factory=dict, repr=False)  # scores() by guard settings: a run with several
    # incidents is searched several times from different starts, and a quantity's statistics do not depend
    # on where the search starts: each is computed once (linear in steps, whatever the incident count)


def mix_weights(config: dict) -> dict[str, float]:
    """The declared mixture: source name -> normalised weight ({} for data without sources)."""
    srcs = (config.get("data") or {}).get("sources") or []
    w = {(s.get("name") or s.get("kind")): float(s.get("weight", 1.0)) for s in srcs}
    total = sum(w.values())
    return {k: v / total for k, v in w.items()} if total > 0 else {}


def typical_mix(mix: dict, weights: dict) -> bool:
    """Is the batch's document count per source consistent with the declared weights (Pearson χ² test at
    MIX_P, Wilson–Hilferty quantile)? A batch of 16 documents with 9 from a 0.25 source (p ≈ 0.004) moves
    the token distribution by its composition alone: its KL against the running histogram was 0.40
    against a median of 0.055 on a clean quickstart run, a false input alarm."""
    n = sum(mix.values())
    live = {k: v for k, v in weights.items() if v > 0}
    if n == 0 or len(live) < 2 or set(mix) - set(live):
        return True  # nothing to compare (or a source the config does not declare: other checks say so)
    chi2 = sum((mix.get(k, 0) - n * w) ** 2 / (n * w) for k, w in live.items())
    k = len(live) - 1
    from doctor.budget import norm_isf
    z = norm_isf(MIX_P)  # the standard normal's 1 − MIX_P quantile
    return chi2 <= k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3


def timeline(records: list[dict], config: dict, floors: dict | None = None) -> dict[str, Series]:
    """Every registered signal of the records (stability/signals.py), keyed by series name, in timeline
    order: within a timeline layer, series are ordered as first read (declaration order, model order).

    NOTE: wall-clock quantities (tokens_per_s, step time, memory) are not signals: a slow step changes no
    number, so it cannot be where a numerical incident starts; doctor/invariants.py system_change reads
    them as shares of the step. Exact invariants (sample ids, tokens, sharding, content) are there too.
    `floors`: the data's exact per-source floors, for records that lack their batch's own (before v4).
    """
    tl: dict[str, Series] = {}
    per_layer = dict.fromkeys(LAYERS, 0)
    from stability.config import DetectorConfig
    gfloor = float((((config.get("guard") or {}).get("detector") or {}).get(
        "log_floor", DetectorConfig.__dataclass_fields__["log_floor"].default)))
    specs: dict[str, Signal] = {}
    for sig in SIGNALS.values():  # GUARD_FLOOR: one step of a guard-watched quantity is judged at its noise floor
        specs[sig.name] = replace(sig, point_floor=gfloor) if sig.point_floor == GUARD_FLOOR else sig
    schedule = lr_schedule(config)
    # NOTE: a record (version 5) names the schedule it trained under, and is judged against it. An older one is
    # judged against config.yaml's, which is the last process's: those from before a declared config change (a
    # resume with resume.allow_config_change, e.g. a longer train.steps) followed another, and are not compared
    declared = max((i for i, r in enumerate(records) if any(str(e).startswith("resume: config changed")
                                                            for e in r.get("events", []))), default=0)
    restart = -HIST_WARM  # the step of the last process start (a resume)
    weights = mix_weights(config)
    ctx = ReadContext(floors=floors)
    for i_rec, r in enumerate(records):
        t = r["step"]
        if r.get("resume") or any(str(e).startswith("resumed from") for e in r.get("events", [])):
            restart = t
        ctx.typical = typical_mix(r.get("source_mix") or {}, weights)
        ctx.warm = t - restart >= HIST_WARM
        nf = r.get("nonfinite", {})
        ctx.overflow = bool(r.get("loss_scale") is not None and math.isfinite(r.get("loss", math.nan)) and nf.get("grads"))
        ctx.lr_expected = (None if r.get("lr") is None else scheduled_lr(r) if r.get("schedule") else
                           schedule(t) if schedule is not None and i_rec >= declared else None)
        ctx.prev = records[i_rec - 1] if i_rec and records[i_rec - 1]["step"] == t - 1 else None
        for name, sig in specs.items():
            for series, value, layer_name, count in sig.read(r, ctx):
                if value is None:
                    continue
                s = tl.get(series)
                if s is None:
                    s = tl[series] = Series(sig, per_layer[sig.layer], layer_name=layer_name)
                    per_layer[sig.layer] += 1
                s.values[t] = float(value)
                if count:
                    s.counts[t] = float(count)
    return tl


def scheduled_lr(rec: dict) -> float:
    """The LR the record's own schedule gives the update of its step (the factor at index step − 1)."""
    sched = rec["schedule"]
    return float(sched["lr"]) * Schedule.from_record(sched)(rec["step"] - 1)


def lr_schedule(config: dict):
    """step -> the LR the config's schedule gives the update of `step` (None without optim config).

    The record's lr is the LR of the update of step t, i.e. the scheduler's factor at index t − 1
    (optim/schedule.py counts optimizer steps from 0)."""
    optim, steps = config.get("optim"), config.get("train", {}).get("steps")
    if not optim or not steps or "lr" not in optim:
        return None
    factor = factor_fn(optim.get("schedule", {}), int(steps))
    return lambda t: float(optim["lr"]) * factor(t - 1)


# ---- deviations ---------------------------------------------------------------------------------------
@dataclass
class Deviation:
    quantity: str
    layer: str               # timeline layer
    order: int               # within the timeline layer
    step: int
    value: float
    baseline: float | None   # trailing median (None for a non-finite value without history)
    z: float                 # robust z (inf: non-finite or off an exact value)
    layer_name: str | None = None
    kind: str = "point"      # point | guard | exact | bound | nonfinite | invariant | spec
    cls: str | None = None   # the class its producer declares (an invariant, a check); None: its Signal's

    def describe(self) -> str:
        where = f" ({self.layer_name})" if self.layer_name else ""
        if self.baseline is None:
            return f"{self.quantity}{where} = {self.value:.4g} at step {self.step}"
        if self.kind == "spec":
            return (f"{self.quantity}{where} missed its specification at step {self.step}: {self.value:.3g}× the "
                    f"tolerance its precision recipe allows")
        if self.kind == "bound":
            return (f"{self.quantity}{where} = {self.value:.4g} at step {self.step}, past its bound "
                    f"{self.baseline:.4g}: better than the exact floor allows")
        z = ("off its exact value" if math.isinf(self.z) else
             "its baseline without spread: any move is out of it" if self.z > 1e6 else
             f"the guard's own test: robust z {self.z:.1f}" if self.kind == "guard" else
             f"innovation robust z {self.z:.1f}")
        return (f"{self.quantity}{where} = {self.value:.4g} at step {self.step} vs baseline "
                f"{self.baseline:.4g} ({z})")


def earliest(devs: dict[str, Deviation]) -> Deviation | None:
    """Earliest step; ties by timeline layer (input < forward < backward/update < system), then by
    position within the layer. Where several model layers of one per-layer quantity deviate at that step,
    the one that moved most (largest z): many layers moving at once are one cause, and the layer nearest
    it moves most (first in model order would name the embedding whenever the whole model moved). A
    non-finite or exact departure keeps model order: the first layer to go wrong is the one upstream."""
    if not devs:
        return None
    first = min(devs.values(), key=lambda d: (d.step, LAYERS.index(d.layer), d.order))
    if first.layer_name is None or math.isinf(first.z):
        return first
    fam = family(first.quantity)
    peers = [d for d in devs.values() if d.step == first.step and d.layer == first.layer and d.layer_name
             and family(d.quantity) is fam and math.isfinite(d.z)]
    return max(peers, key=lambda d: (d.z, -d.order))


def scoring_start(config: dict) -> int:
    """First step the doctor scores: the LR warm-up and then the optimizer's memory of it (its slowest moment
    forgets over 1/(1 − β) steps: AdamW's β₂, Muon's momentum) are a transient — the loss, the gradient norm
    and ρ fall by an order of magnitude — not a baseline; their values still build the baseline. Never before
    the guard's own warm-up (guard.detector.warmup): the guard is blind there too."""
    optim = config.get("optim") or {}
    warm = (optim.get("schedule") or {}).get("warmup_steps") or 0
    guard = ((config.get("guard") or {}).get("detector") or {}).get("warmup") or 0
    return max(int(warm) + memory(optim), int(guard), 1)


def memory(optim: dict) -> int:
    """Steps the optimizer's slowest moving average remembers: 1/(1 − β) (0 without an optim config)."""
    beta = ((optim.get("muon") or {}).get("momentum") if optim.get("name") == "muon" else
            (optim.get("betas") or [None, None])[1])
    return round(1.0 / (1.0 - float(beta))) if beta is not None and float(beta) < 1 else 0
