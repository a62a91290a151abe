"""Schemas of the stability groups: `telemetry`, `guard` (detector, rollback, anticipatory) and `fault`.

Each default is the default run's value; conf/guard/*.yaml and conf/fault/*.yaml keep only what an
option changes. A component takes its dataclass (a test or lab builds one directly). run/config.py
registers these with Hydra as parts of the root config.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from typing import Any, Mapping, Optional, get_type_hints

from run.config_errors import ConfigError, check, choice, from_mapping, unused_keys
from stability.drills import NONE, registry
from stability.signals import SIGNALS, guard_defaults

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
    window: int = 30       # accepted values kept per metric: short, because loss and ρ drift as training goes
    threshold: float = 6.0  # robust z above which a value is a spike
    min_history: int = 20  # no z-score before this many accepted values (non-finite fires at once)
    cooldown: int = 10     # steps after a trigger in which further spikes of that metric are not acted on
    warmup: int = 50       # no z-score before this step: early training is a transient, not a baseline
    # NOTE: the spread assumed at least for a log metric, in log units: a scale-free quantity (grad norm,
    # update ratio) jitters step to step however steady its history looks, and a MAD measured on a calm
    # stretch says otherwise; at 0.2 and threshold 6 a move smaller than ×e^1.2 ≈ ×3.3 never fires, so a
    # natural blip of two or three times on a calm plateau is not a spike (bench/seeds/drills_quiet.py).
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


@dataclass
class _FaultKindStep:
    kind: str = "none"
    step: int | None = None     # the optimizer step the fault fires at: required unless kind=none

    def __post_init__(self) -> None:
        nodes = self.nodes()
        for kind, node in nodes.items():  # a drill's node given as a mapping (a test, a lab): typed as Hydra types it
            if not isinstance(getattr(self, kind), node):
                setattr(self, kind, from_mapping(node, dict(getattr(self, kind) or {}), f"fault.{kind}"))
        choice("fault.kind", self.kind, [NONE, *nodes])
        if self.kind == NONE:
            return
        for kind in nodes:  # another drill's key set here would be silently ignored
            if kind != self.kind:
                unused_keys(getattr(self, kind), (), f"fault.{kind}", f"fault.kind={self.kind}")
        if self.step is None:
            raise ConfigError(f"fault.step: missing (required for fault.kind={self.kind})")
        check(self.step >= 1, "fault.step", self.step, "must be >= 1")
        self.drill_config()  # the drill's own checks

    @classmethod
    def nodes(cls) -> dict[str, type]:
        """kind -> the dataclass of fault.<kind> (one per drill of the schema)."""
        return {f.name: f.type for f in fields(cls) if f.name not in ("kind", "step")}

    def drill_config(self):
        """The drill's own Config from the keys set under fault.<kind> (the others: the drill's defaults)."""
        keys = getattr(self, self.kind)
        return drill_config(self.kind, {f.name: getattr(keys, f.name) for f in fields(keys)
                                        if getattr(keys, f.name) is not None})

    def resolved(self) -> dict:
        """kind, step and the keys this kind reads, its defaults filled in (kind none: just the kind)."""
        if self.kind == NONE:
            return {"kind": NONE}
        return {"kind": self.kind, "step": self.step, self.kind: dict(sorted(asdict(self.drill_config()).items()))}


def read_saved(saved: Mapping) -> dict:
    """A saved `fault` node in this schema. A run saved before each drill had its own namespace wrote
    every drill's keys flat (fault.factor): those its kind reads move under fault.<kind>, the rest (null,
    or read by no drill of that kind) never reached the run and are dropped."""
    kind, drills = saved.get("kind", NONE), registry()
    flat = {k: v for k, v in saved.items() if k not in {"kind", "step", *drills}}
    node = {k: v for k, v in saved.items() if k not in flat}
    if flat and kind in drills:
        own = {f.name for f in fields(drills[kind].Config)}
        moved = {k: v for k, v in flat.items() if k in own and v is not None}
        node[kind] = {**moved, **(node.get(kind) or {})}
    return node


def drill_config(kind: str, keys: dict):
    """Drill `kind`'s Config from `keys` (the rest: its defaults), through OmegaConf's type checks and the
    Config's own; its errors name the key in the drill's namespace, `fault.<kind>.<key>=value: rule` (a
    drill's Config names its keys bare: it need not know where the schema puts it)."""
    where = f"fault.{kind}"
    try:
        return from_mapping(registry()[kind].Config, keys, where)
    except ConfigError as e:
        line = str(e)
        raise ConfigError(line if line.startswith(f"{where}.") else f"{where}.{line}") from None


def _namespace(kind: str, config: type) -> type:
    """fault.<kind>: the drill's keys, each typed as its Config declares it, default None (= the drill's
    own default), so a key set away from the kind it belongs to can be told from one left alone."""
    hints = get_type_hints(config)
    return make_dataclass(f"{kind}_keys", [(f.name, Optional[hints[f.name]], field(default=None))
                                            for f in fields(config)])


def fault_schema(drills: Mapping[str, type]) -> type:
    """The `fault` group's dataclass for these drills (kind -> class): kind, step, and one node per drill,
    `fault.<kind>.<key>`, so two drills may give one key name different types."""
    reserved = {f.name for f in fields(_FaultKindStep)}
    clash = sorted(reserved & set(drills))
    if clash:  # a drill module named kind or step would shadow the group's own key
        raise TypeError(f"fault.kind={clash[0]}: a drill cannot be named after a fault key ({', '.join(reserved)})")
    nodes = {kind: _namespace(kind, drill.Config) for kind, drill in drills.items()}
    schema = make_dataclass("FaultConfig", [(kind, node, field(default_factory=node)) for kind, node in nodes.items()],
                            bases=(_FaultKindStep,))
    schema.__doc__ = """One deliberate fault at optimizer step `step` (stability/faults.py, stability/drills/):
    `fault.kind`, `fault.step`, and the drill's own keys under `fault.<kind>` (fault.lr_spike.factor=50).
    kind=none ignores every other key, so one override (fault.kind=none) turns any drill into its clean twin."""
    return schema


# NOTE: a dataclass made from the registry: a new drill's keys join the schema without an edit here.
FaultConfig = fault_schema(registry())
