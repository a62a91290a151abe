"""The doctor's view of a run: its records as the four-layer timeline (docs/course.md §1), and the first
quantity that deviated (docs/course.md §1: find the first quantity that left its baseline, not the
first one an alarm fired on).

    run = load_run("runs/<run>")           # records, the first-executed trajectory, events, config
    tl = timeline(run.first, run.config)   # quantity -> Series (layer, model order, values by step)
    devs = deviations(tl)                  # quantity -> first Deviation (robust z over a trailing window)
    first = earliest(devs)                 # earliest step; ties: input < forward < backward/update < system

After a guard rollback the step numbers in metrics.jsonl go back and repeat; `run.first` is the
trajectory as first executed (up to the record whose step the next one does not exceed), so the
incident is analysed where it happened, not where a replay smoothed it over. Later segments are kept
(`run.segments`) as evidence: did the same batch fail again on replay?
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from stability.events import read_events
from stability.record import read_records

LAYERS = ("input", "forward", "backward/update", "system")
INPUT, FORWARD, BACKWARD, SYSTEM = LAYERS
WINDOW = 30       # trailing values in a baseline (the guard's detector window)
MIN_HISTORY = 10  # no score before this many baseline values
THRESHOLD = 8.0   # robust z above which a value deviates (above the guard's 6: the doctor looks at
                  # ~50 quantities, so a false alarm per quantity must be rarer)
MAD_SIGMA = 1.4826  # MAD → σ for Gaussian noise


@dataclass
class Run:
    dir: Path
    records: list[dict]           # metrics.jsonl in execution order
    segments: list[list[dict]]    # split where the step goes back (a guard rollback)
    events: list[dict]            # events.jsonl without the injector's "fault" events
    truth: list[dict]             # the injector's "fault" events: ground truth, never used to classify
    config: dict                  # resolved config.yaml ({} when absent)
    superseded: list[dict]        # metrics.superseded.jsonl (records a resume replaced)

    @property
    def first(self) -> list[dict]:
        return self.segments[0]


def load_run(run_dir) -> Run:
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise ValueError(f"run_dir={run_dir}: no such directory")
    if not path.is_file():
        raise ValueError(f"run_dir={run_dir}: no metrics.jsonl (not a run directory)")
    records = read_records(path)
    if not records:
        raise ValueError(f"run_dir={run_dir}: metrics.jsonl holds no records")
    events = read_events(run_dir / "events.jsonl")
    cfg_path = run_dir / "config.yaml"
    config = yaml.safe_load(cfg_path.read_text()) if cfg_path.is_file() else {}
    sup = run_dir / "metrics.superseded.jsonl"
    # WARN: the injector's events are the answer key of a drill: kept apart, read only for the report's
    # last line. Every diagnosis comes from the StepRecords and the guard's own events.
    return Run(run_dir, records, segment(records), [e for e in events if e.get("kind") != "fault"],
               [e for e in events if e.get("kind") == "fault"], config or {},
               read_records(sup) if sup.is_file() else [])


def segment(records: list[dict]) -> list[list[dict]]:
    """Split the execution-order records where the step does not advance (a rollback replays)."""
    out = [[records[0]]]
    for r in records[1:]:
        if r["step"] <= out[-1][-1]["step"]:
            out.append([])
        out[-1].append(r)
    return out


# ---- the timeline ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    layer: str
    direction: str = "up"    # up | down | both
    log: bool = False        # score log(x): scale-free quantities (norms, ratios, RMS)
    rel_floor: float = 0.05  # scale floor: relative moves smaller than this never deviate (log: in log units)
    abs_floor: float = 1e-12
    exact: float | None = None  # the value a healthy run holds exactly (any departure deviates)


@dataclass
class Series:
    spec: Spec
    order: int                                   # position within its timeline layer (model order)
    values: dict[int, float] = field(default_factory=dict)  # step -> value
    layer_name: str | None = None                # the model layer of a per-layer quantity


def timeline(records: list[dict], config: dict) -> dict[str, Series]:
    """Every numeric quantity of the records, keyed by name, in timeline order.

    NOTE: wall-clock quantities (tokens_per_s, step time, memory) are left out: a slow step changes no
    number, so it cannot be where a numerical incident starts; the symptom "throughput drop with a
    normal loss" reads them separately (doctor/rules.py throughput_drop).
    """
    tl: dict[str, Series] = {}

    def put(name: str, spec: Spec, step: int, value, layer_name: str | None = None) -> None:
        if value is None or isinstance(value, (dict, list, str)):
            return
        s = tl.get(name)
        if s is None:
            s = tl[name] = Series(spec, len([x for x in tl.values() if x.spec.layer == spec.layer]),
                                  layer_name=layer_name)
        s.values[step] = float(value)

    schedule = lr_schedule(config)
    for r in records:
        t = r["step"]
        # input: what the batch was, before any forward
        inp = r.get("inputs", {})
        put("input.label_alignment", Spec(INPUT, "down", exact=1.0), t, inp.get("label_alignment"))
        put("input.top_token_frac", Spec(INPUT, "up", rel_floor=0.3), t, inp.get("top_token_frac"))
        put("input.doc_start_frac", Spec(INPUT, "down", rel_floor=0.1), t, inp.get("doc_start_frac"))
        put("input.valid_frac", Spec(INPUT, "both", rel_floor=0.1), t, inp.get("valid_frac"))
        switched = "input.data_fingerprint" in r.get("guard", {}).get("triggers", [])
        put("input.data_fingerprint_changed", Spec(INPUT, exact=0.0), t, float(switched))
        # forward: activations in model order, then what is computed from them
        for name, q in r.get("layers", {}).items():
            if "act_rms" in q:
                put(f"act_rms/{name}", Spec(FORWARD, "both", log=True, rel_floor=0.3), t, q["act_rms"], name)
        for name, q in r.get("layers", {}).items():
            if "clamp_hit_rate" in q:
                put(f"clamp_hit_rate/{name}", Spec(FORWARD, abs_floor=0.01), t, q["clamp_hit_rate"], name)
        nf = r.get("nonfinite", {})
        put("nonfinite.logits", Spec(FORWARD, exact=0.0), t, float(bool(nf.get("logits"))))
        put("logit_max", Spec(FORWARD, log=True, rel_floor=0.3), t, r.get("logit_max"))
        put("z_loss", Spec(FORWARD, log=True, rel_floor=0.3), t, r.get("z_loss"))
        for src, v in r.get("loss_by_source", {}).items():
            put(f"loss_by_source/{src}", Spec(FORWARD, rel_floor=0.05), t, v)
        put("nonfinite.loss", Spec(FORWARD, exact=0.0), t, float(bool(nf.get("loss"))))
        put("loss", Spec(FORWARD, rel_floor=0.05), t, r.get("loss"))
        # backward / update: the LR the update used, gradients, then the update itself
        if schedule is not None and r.get("lr") is not None:
            expect = schedule(t)
            put("lr/schedule", Spec(BACKWARD, "both", exact=1.0, rel_floor=1e-6), t,
                r["lr"] / expect if expect else math.nan)
        # NOTE: under FP16 loss scaling an inf gradient with a finite loss is the scaler's routine
        # overflow (it skips and backs off; the guard ignores it too): not an anomaly, and no gradient
        # to score. The loss scale itself is left out for the same reason: backing off is its job.
        overflow = r.get("loss_scale") is not None and math.isfinite(r.get("loss", math.nan)) and nf.get("grads")
        if not overflow:
            put("nonfinite.grads", Spec(BACKWARD, exact=0.0), t, float(bool(nf.get("grads"))))
            for name, q in r.get("layers", {}).items():
                if "grad_rms" in q:
                    put(f"grad_rms/{name}", Spec(BACKWARD, log=True, rel_floor=0.3), t, q["grad_rms"], name)
            put("grad_norm", Spec(BACKWARD, log=True, rel_floor=0.3), t, r.get("grad_norm"))
        if not r.get("skipped"):  # a vetoed update moved nothing: its ρ = 0 says nothing about the optimizer
            for name, q in r.get("layers", {}).items():
                if "update_ratio" in q:
                    put(f"update_ratio/{name}", Spec(BACKWARD, log=True, rel_floor=0.3), t, q["update_ratio"], name)
            put("update_ratio_max", Spec(BACKWARD, log=True, rel_floor=0.3), t, r.get("update_ratio_max"))
        put("nonfinite.optim_state", Spec(BACKWARD, exact=0.0), t, float(bool(nf.get("optim_state"))))
        # system: cross-rank consistency (exactly 0 on healthy DDP)
        for name, v in r.get("replica", {}).items():
            put(f"replica.{name}", Spec(SYSTEM, exact=0.0, rel_floor=0.0, abs_floor=0.0), t, v)
    return tl


def lr_schedule(config: dict):
    """step -> the LR the config's schedule gives the update of `step` (None without optim config).

    The record's lr is the LR of the update of step t, i.e. the scheduler's factor at index t − 1
    (optim/schedule.py counts optimizer steps from 0)."""
    from optim.schedule import lr_factor
    optim, steps = config.get("optim"), config.get("train", {}).get("steps")
    if not optim or not steps or "lr" not in optim:
        return None
    sched = optim.get("schedule", {})
    return lambda t: float(optim["lr"]) * lr_factor(t - 1, int(steps), sched)


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

    def describe(self) -> str:
        where = f" ({self.layer_name})" if self.layer_name else ""
        if self.baseline is None:
            return f"{self.quantity}{where} = {self.value:.4g} at step {self.step}"
        z = "off its exact value" if math.isinf(self.z) else f"robust z {self.z:.1f}"
        return (f"{self.quantity}{where} = {self.value:.4g} at step {self.step} vs baseline "
                f"{self.baseline:.4g} ({z})")


def score(spec: Spec, history: list[float], x: float) -> tuple[float, float | None]:
    """(robust z of x against the history, baseline median). z = ±inf for a non-finite x."""
    if not math.isfinite(x):
        return math.inf, (statistics.median(history) if history else None)
    if spec.exact is not None:
        off = abs(x - spec.exact) > spec.rel_floor * max(abs(spec.exact), 1.0) + spec.abs_floor
        return (math.inf if off else 0.0), spec.exact
    if len(history) < MIN_HISTORY:
        return 0.0, None
    f = (lambda v: math.log(max(v, 1e-30))) if spec.log else (lambda v: v)
    h = [f(v) for v in history]
    med = statistics.median(h)
    mad = statistics.median(abs(v - med) for v in h)
    floor = spec.rel_floor if spec.log else spec.rel_floor * abs(med)
    z = (f(x) - med) / (MAD_SIGMA * mad + floor + spec.abs_floor)
    z = z if spec.direction == "up" else (-z if spec.direction == "down" else abs(z))
    base = math.exp(med) if spec.log else med
    return z, base


def deviations(tl: dict[str, Series], start: int = 1, threshold: float = THRESHOLD) -> dict[str, Deviation]:
    """The first deviating step of every quantity. Baseline-relative scores count from step `start`
    on (earlier values only build the baseline); a non-finite value, or a quantity off the value a
    healthy run holds exactly, counts from step 1: it needs no baseline. Like the guard's detector, a
    deviating value never joins the baseline."""
    out = {}
    for name, s in tl.items():
        hist: list[float] = []
        for t in sorted(s.values):
            x = s.values[t]
            z, base = score(s.spec, hist[-WINDOW:], x)
            absolute = s.spec.exact is not None or not math.isfinite(x)
            if (t >= start or absolute) and z > threshold:
                out[name] = Deviation(name, s.spec.layer, s.order, t, x, base, z, s.layer_name)
                break
            if math.isfinite(x):
                hist.append(x)
    return out


def earliest(devs: dict[str, Deviation]) -> Deviation | None:
    """Earliest step; ties by timeline layer (input < forward < backward/update < system), then by
    position within the layer (model order: the first layer to go wrong is the one upstream)."""
    if not devs:
        return None
    return min(devs.values(), key=lambda d: (d.step, LAYERS.index(d.layer), d.order))


def scoring_start(config: dict) -> int:
    """First step the doctor scores: early training is a transient (loss, grad norm and ρ fall by an
    order of magnitude), not a baseline; its values still build the baseline."""
    warm = (config.get("optim", {}).get("schedule", {}) or {}).get("warmup_steps") or 0
    return max(2 * int(warm), MIN_HISTORY + 1)
