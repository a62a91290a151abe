"""Schemas of the stability groups: `telemetry`, `guard` (detector, rollback, anticipatory) and `fault`.

Defaults are the components' own (a guard or fault built from a partial dict in a test or lab gets
them too); conf/guard/*.yaml and conf/fault/*.yaml keep only what an option changes. run/config.py
registers these with Hydra as parts of the root config.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from stability.signals import SIGNALS, guard_defaults
from run.schema import ConfigError, check, choice, fail, from_mapping, unused_keys

ACTIONS = ("log", "skip", "rollback")
DIRECTIONS = ("up", "both")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class TelemetryConfig:
    every: int = 10  # per-layer telemetry (activation/grad RMS, update ratio ρ, clamp hits) every N steps; 0 = off

    def __post_init__(self) -> None:
        check(self.every >= 0, "telemetry.every", self.every, "must be an integer >= 0 (0 = off)")


@dataclass
class LoggingConfig:
    """Where StepRecords go besides metrics.jsonl (stability/sinks.py)."""
    log_every: int = 50          # a compact console line every N steps; 0 = none
    progress: bool = True        # tqdm progress bar
    wandb: str = "offline"       # offline | online | disabled (offline writes under the run dir)
    wandb_project: str = "ballast"
    plot: bool = True            # loss.png at the end

    def __post_init__(self) -> None:
        check(self.log_every >= 0, "logging.log_every", self.log_every, "must be >= 0 (0 = none)")
        choice("logging.wandb", self.wandb, WANDB_MODES)


@dataclass
class MetricSpec:
    direction: str = "up"  # up: only a rise is a spike | both
    log: bool = False      # score log(x): for scale-free metrics (grad norm, update ratio)


def _default_metrics() -> dict[str, MetricSpec]:
    """The signals the registry marks guard_default (stability/signals.py)."""
    return {name: MetricSpec(**spec) for name, spec in guard_defaults().items()}


@dataclass
class DetectorConfig:
    """Robust rolling z-score per metric (stability/detector.py)."""
    # NOTE: Any, not MetricSpec: a signal added from the command line (+guard.detector.metrics.NAME={log:true})
    # arrives as a plain dict, which OmegaConf refuses into a typed dict of dataclasses; __post_init__ types it
    metrics: dict[str, Any] = field(default_factory=_default_metrics)
    window: int = 50       # accepted values kept per metric
    threshold: float = 6.0  # robust z above which a value is a spike
    min_history: int = 20  # no z-score before this many accepted values (non-finite fires at once)
    cooldown: int = 10     # steps after a trigger in which further spikes of that metric are not acted on
    warmup: int = 0        # no z-score before this step: early training is a transient, not a baseline
    # NOTE: the spread assumed at least for a log metric, in log units: a scale-free quantity (grad norm,
    # update ratio) jitters step to step however steady its history looks, and a MAD measured on a calm
    # stretch says otherwise; at 0.2 and threshold 6 a move smaller than ×e^1.2 ≈ ×3.3 never fires. The
    # drills measured ×2.3-×2.5 grad-norm blips with z ≈ 8 on plateaus before their injection.
    log_floor: float = 0.2

    def __post_init__(self) -> None:
        p = "guard.detector"
        check(self.window >= 3, f"{p}.window", self.window, "must be >= 3")
        check(3 <= self.min_history <= self.window, f"{p}.min_history", self.min_history,
              f"must be in [3, window={self.window}]")
        check(self.threshold > 0, f"{p}.threshold", self.threshold, "must be > 0")
        check(self.cooldown >= 0, f"{p}.cooldown", self.cooldown, "must be >= 0")
        check(self.warmup >= 0, f"{p}.warmup", self.warmup, "must be >= 0")
        check(math.isfinite(self.log_floor) and self.log_floor >= 0, f"{p}.log_floor", self.log_floor, "must be >= 0")
        if not self.metrics:
            raise ConfigError(f"{p}.metrics: empty; watch at least one metric (e.g. loss)")
        self.metrics = {n: m if isinstance(m, MetricSpec) else from_mapping(MetricSpec, dict(m or {}), f"{p}.metrics.{n}")
                        for n, m in self.metrics.items()}
        for name, spec in self.metrics.items():
            if name not in SIGNALS:
                raise ConfigError(f"{p}.metrics.{name}: not a registered signal (stability/signals.py); "
                                  f"one of {', '.join(SIGNALS)}")
            choice(f"{p}.metrics.{name}.direction", spec.direction, DIRECTIONS)

    @classmethod
    def from_dict(cls, d: Mapping) -> "DetectorConfig":
        if isinstance(d, cls):
            return d
        d = _plain(d)
        metrics = d.pop("metrics", None)
        cfg = from_mapping(cls, d, "guard.detector")
        if metrics is None:
            return cfg
        # NOTE: a given metrics dict replaces the default set (OmegaConf would merge the two)
        return replace(cfg, metrics={name: from_mapping(MetricSpec, spec or {}, f"guard.detector.metrics.{name}")
                                     for name, spec in dict(metrics).items()})


@dataclass
class RollbackConfig:
    source: str = "memory"  # memory: a ring of in-process snapshots | disk: the newest complete checkpoint
    snapshot_every: int = 5  # healthy steps between in-memory snapshots
    keep: int = 4           # snapshots in the ring
    margin: int = 1         # roll back to a snapshot at least this many steps before the trigger
    data: str = "replay"    # replay the same batches | skip the offending window
    max_rollbacks: int = 3  # per incident; then its further spikes are vetoed (skips) instead of looping

    def __post_init__(self) -> None:
        choice("guard.rollback.source", self.source, ("memory", "disk"))
        choice("guard.rollback.data", self.data, ("replay", "skip"))
        for key in ("snapshot_every", "keep", "max_rollbacks"):
            check(getattr(self, key) >= 1, f"guard.rollback.{key}", getattr(self, key), "must be >= 1")
        check(self.margin >= 0, "guard.rollback.margin", self.margin, "must be >= 0")


@dataclass
class AnticipatoryConfig:
    """MoE models only (DeepSeek-V4): on after a rollback, off once quiet."""
    enabled: bool = True
    delay: int = 2        # Δt: expert ids chosen with the parameters of Δt steps earlier
    window: int = 60      # at most this many steps on
    quiet_steps: int = 20  # off once the detector has been quiet this many steps (and it ran that long)

    def __post_init__(self) -> None:
        check(self.delay >= 0, "guard.anticipatory.delay", self.delay, "must be an integer >= 0")
        for key in ("window", "quiet_steps"):
            check(getattr(self, key) >= 1, f"guard.anticipatory.{key}", getattr(self, key), "must be >= 1")


@dataclass
class GuardConfig:
    """guard=log | skip | rollback picks what a spike does (stability/guard.py)."""
    action: str = "log"
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    replica_tol: float = 0.0  # DDP replicas must agree exactly (telemetry's cross-rank spreads)
    rollback: RollbackConfig = field(default_factory=RollbackConfig)
    anticipatory: AnticipatoryConfig = field(default_factory=AnticipatoryConfig)

    def __post_init__(self) -> None:
        choice("guard.action", self.action, ACTIONS)
        check(self.replica_tol >= 0, "guard.replica_tol", self.replica_tol, "must be >= 0")

    @classmethod
    def from_dict(cls, d: Mapping) -> "GuardConfig":
        if isinstance(d, cls):
            return d
        d = _plain(d)
        detector = DetectorConfig.from_dict(d.pop("detector", None) or {})
        return replace(from_mapping(cls, d, "guard"), detector=detector)


FAULT_KINDS = {  # the keys each kind reads, beside kind and step
    "none": set(), "nan_activation": {"layer", "sublayer", "value", "positions"},
    "labels_shuffle": {"seed"}, "repeat_token": {"token"}, "overlong_doc": {"seed"},
    "lr_spike": {"factor", "steps"}, "optim_state": {"mode", "scale", "param"},
    "missing_reduce": {"rank"}, "mixture_switch": {"weights"},
}
NAN_VALUES = ("nan", "inf", "-inf")


@dataclass
class FaultConfig:
    """One deliberate fault at optimizer step `step` (stability/faults.py). kind=none ignores every other
    key, so one override (fault.kind=none) turns any drill into its clean twin."""
    kind: str = "none"
    step: int | None = None     # the optimizer step the fault fires at: required unless kind=none
    layer: int = 0              # nan_activation: model.blocks[layer]
    sublayer: str = "mlp"       # nan_activation: attn | mlp (an MoE layer's output .y)
    value: str = "nan"          # nan_activation: nan | inf | -inf
    positions: int = 4          # nan_activation: token positions 0..positions-1 of the first sample
    seed: int = 0               # labels_shuffle, overlong_doc: the corruption is seeded by (seed, sample id)
    token: int | None = None    # repeat_token: null = the most frequent label id of that (global) batch
    factor: float = 10.0        # lr_spike: every group's lr × factor ...
    steps: int = 1              # lr_spike: ... for this many optimizer steps
    mode: str = "zero"          # optim_state: zero: v := 0 | scale: v := v × scale
    scale: float = 1e-6         # optim_state, mode=scale only
    param: str | None = None    # optim_state: a parameter-name substring (e.g. blocks.1.mlp) or null for all
    rank: int = 1               # missing_reduce: the rank that keeps its local gradient
    weights: list[float] | None = None  # mixture_switch: the new weights, one per data.sources entry

    def __post_init__(self) -> None:
        choice("fault.kind", self.kind, FAULT_KINDS)
        if self.kind == "none":
            return
        unused_keys(self, {"kind", "step"} | FAULT_KINDS[self.kind], "fault", f"fault.kind={self.kind}")
        if self.step is None:
            raise ConfigError(f"fault.step: missing (required for fault.kind={self.kind})")
        check(self.step >= 1, "fault.step", self.step, "must be >= 1")
        k = self.kind
        if k == "nan_activation":
            check(self.layer >= 0, "fault.layer", self.layer, "must be >= 0")
            choice("fault.sublayer", self.sublayer, ("attn", "mlp"))
            self.value = str(self.value).lower()  # str(float("-inf")) == "-inf"
            check(self.value in NAN_VALUES, "fault.value", repr(self.value), "expected one of nan, inf, -inf")
            check(self.positions >= 1, "fault.positions", self.positions, "must be >= 1")
        elif k in ("labels_shuffle", "overlong_doc"):
            check(self.seed >= 0, "fault.seed", self.seed, "must be >= 0")
        elif k == "repeat_token":
            check(self.token is None or self.token >= 0, "fault.token", self.token, "must be >= 0 or null")
        elif k == "lr_spike":
            check(math.isfinite(self.factor) and self.factor > 0, "fault.factor", self.factor, "must be > 0")
            check(self.steps >= 1, "fault.steps", self.steps, "must be >= 1")
        elif k == "optim_state":
            choice("fault.mode", self.mode, ("zero", "scale"))
            check(math.isfinite(self.scale) and self.scale > 0, "fault.scale", self.scale, "must be > 0")
            check(self.param is None or self.param != "", "fault.param", repr(self.param),
                  "expected a parameter-name substring or null")
        elif k == "missing_reduce":
            check(self.rank >= 0, "fault.rank", self.rank, "must be >= 0")
        else:  # mixture_switch
            w = self.weights
            if not w:
                fail("fault.weights", w, "expected a list of weights, one per data.sources entry")
            check(all(math.isfinite(x) and x >= 0 for x in w), "fault.weights", w, "must be >= 0")
            check(sum(w) > 0, "fault.weights", w, "must not be all zero")

    @classmethod
    def from_dict(cls, d: Mapping | None) -> "FaultConfig":
        return from_mapping(cls, d or {"kind": "none"}, "fault")

    def resolved(self) -> dict:
        """kind, step and the keys this kind reads (kind none: just the kind)."""
        if self.kind == "none":
            return {"kind": "none"}
        out = {"kind": self.kind, "step": self.step}
        for key in sorted(FAULT_KINDS[self.kind]):
            out[key] = getattr(self, key)
        if self.weights is not None and "weights" in out:
            out["weights"] = [float(x) for x in self.weights]
        return out


def _plain(d) -> dict:
    return dict(OmegaConf.to_container(d, resolve=True) if isinstance(d, DictConfig) else d)
