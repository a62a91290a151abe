"""What a fault drill is: one class in one module of stability/drills/, registered by defining it.

    class LrSpike(Drill):
        kind = "lr_spike"                      # fault.kind, and conf/fault/lr_spike.yaml (the Hydra option)
        expects = "optim.lr_switch"            # the doctor class it should produce (tests and bench read it,
                                               # never the doctor)
        lifetime = TRANSIENT                   # what a rollback or a resume replays (LIFETIMES)
        points = ("before_update", "after_update")   # where in the step it acts (stability/callbacks.py)
        Config = LrSpikeConfig                 # its keys beside kind and step: defaults and range checks,
                                               # set as fault.lr_spike.<key> (its own namespace)

A drill acts only at its declared points: the class is refused at import if it defines a hook it does
not declare or declares one it does not define. Each hook gets the step's StepState (`s.step`,
`s.first_id`, `s.batch`, `s.max_grad_norm`, ...); `wrap(wrapped)` runs once, after parallel wrapping.
A drill's keys live in its own namespace, `fault.<kind>.<key>`, so two drills may give one key name
different types. Its Config names a key bare in its checks (`check(self.factor > 0, "factor", ...)`):
the schema (stability/config.py) prefixes `fault.<kind>.`. Build-time checks that need the model or the
data go in `check()`; every error is one line naming the key, `self.key(name)`. `state_dict` /
`load_state_dict` are for resuming a process only (the guard's rollback keeps the drill out of its
snapshot: a rollback never re-arms or forgets a fault).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

# Lifetimes: how a fault lives in time, the lesson of a rollback drill.
ONE_SHOT = "one-shot"      # fires the first time step s is reached, never again (a rollback replaying s included)
TRANSIENT = "transient"    # a window of steps from s, once in wall-clock time: a rollback does not replay it
BATCH = "the batch"        # lives in the data: keyed by the step-s batch ID; a replay of that batch meets it again
PERSISTENT = "persistent"  # on from the first time step s is reached, for good (also after a rollback to before s)
LIFETIMES = (ONE_SHOT, TRANSIENT, BATCH, PERSISTENT)
POINTS = ("before_batch", "on_batch", "before_forward", "before_update", "after_update", "wrap")

REGISTRY: dict[str, type["Drill"]] = {}  # kind -> class, filled as the modules are imported (stability/drills/__init__.py)


@dataclass
class NoKeys:
    """The config of a drill that reads nothing beside kind and step."""


@dataclass
class Context:
    """What a drill may act on: the run's components (None where a test leaves one out)."""
    model: Any = None
    optimizer: Any = None
    loader: Any = None
    data_cfg: Any = None   # the run's DataConfig (mixture_switch rebuilds the data from it)
    train_cfg: Any = None  # the run's TrainConfig (clip_threshold reads max_grad_norm and clip)
    rank: int = 0
    world: int = 1


class Drill:
    kind: ClassVar[str]
    expects: ClassVar[str]
    lifetime: ClassVar[str]
    points: ClassVar[tuple[str, ...]]
    Config: ClassVar[type] = NoKeys
    min_world: ClassVar[int] = 1  # processes the drill needs (a launcher reads it)

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        if "kind" not in cls.__dict__:  # an intermediate base (BatchDrill)
            return
        defined = {p for p in POINTS if getattr(cls, p) is not getattr(Drill, p)}
        problems = []
        if cls.lifetime not in LIFETIMES:
            problems.append(f"lifetime {cls.lifetime!r} not in {LIFETIMES}")
        if defined != set(cls.points):
            problems.append(f"declares points {sorted(cls.points)} but defines {sorted(defined)}")
        if not dataclasses.is_dataclass(cls.Config):
            problems.append("Config must be a dataclass")
        if cls.kind in REGISTRY:
            problems.append("is declared twice")
        if problems:  # NOTE: a raise, not an assert: python -O must not register a broken drill
            raise TypeError(f"fault.kind={cls.kind}: {'; '.join(problems)}")
        REGISTRY[cls.kind] = cls

    def __init__(self, cfg, step: int, ctx: Context):
        self.cfg, self.s, self.ctx = cfg, step, ctx
        self.fired = False
        self.events: list[dict] = []

    def check(self) -> None:
        """Refuse, in one line naming the key, what needs the model, the data or the launch."""

    # ---- the step's points (only the declared ones are ever called) -------------------------------------
    def before_batch(self, s) -> None: ...
    def on_batch(self, s) -> None: ...
    def before_forward(self, s) -> None: ...
    def before_update(self, s) -> None: ...
    def after_update(self, s) -> None: ...
    def wrap(self, wrapped) -> None: ...

    # ---- resume ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"fired": self.fired}

    def load_state_dict(self, sd: dict) -> None:
        self.fired = sd["fired"]

    # ---- helpers -----------------------------------------------------------------------------------------
    def emit(self, step: int, **info) -> None:
        # NOTE: decided from global quantities only, so every rank emits the same events.
        self.events.append({"step": step, "kind": "fault", "fault": self.kind, **info})

    def persists(self, step: int, **info) -> bool:
        """PERSISTENT: on from the first time step s is reached (its event then), on for good after."""
        if not self.fired and step >= self.s:
            self.fired = True
            self.emit(step, **info)
        return self.fired

    def key(self, name: str) -> str:
        """The full name of one of this drill's keys, for an error message: fault.<kind>.<name>."""
        return f"fault.{self.kind}.{name}"

    def fail(self, why: str) -> None:
        raise ValueError(f"fault.kind={self.kind}: {why}")
