"""Fault injection for stability drills: one deliberate fault, at a known step, chosen by `fault=<kind>`.

Each drill plants one cause of a loss spike from docs/course.md §1 (data switch, corrupted text, label
misalignment, overlong sequences, activation outliers, a wrong gradient reduction, corrupted optimizer
state, a silently changed optimizer setting, leaked or repeated data, collapsed experts), so the
detector, guard and doctor can be shown to find it. Each is one module of stability/drills/ (what it
does, its keys, its lifetime, the doctor class it should produce); `python -m stability.faults` lists them.

Time, the lesson of a rollback drill (stability/drills/base.py, LIFETIMES):
- one-shot and transient faults live in wall-clock time: they fire the first time step s is reached
  and never again, even when a rollback replays step s.
- a data fault lives in the data: it is keyed by the batch ID (first global sample id) the run's plan
  puts at step s, (s − 1) · batch size; a rollback that replays that batch meets the same bad data
  (same corruption: it is seeded by the sample ids), one that skips the window never sees it again.
- a persistent fault (mixture_switch, an objective change, and the settings / data / routing faults)
  is on from the first time step s is reached, and stays on after a rollback to before s.
WARN: so a guard rollback must not restore this object's state (keep it out of the rollback snapshot).
state_dict / load_state_dict are for resuming a process: a resumed run neither refires a one-shot nor
forgets the bad batch id.

FaultInjector's calls, at step t (first_id = loader.samples_consumed before next()):
    before_batch(t); batch = loader.next(); batch = corrupt(t, first_id, batch); before_forward(t)
    forward/backward; before_update(t); optimizer step; after_update(t); pop_events()
and wrap(wrapped) once, after parallel.wrap_model. FaultDrill makes those calls from the step's callback
points (stability/callbacks.py) with the step's own state, so train.py names no fault.
"""
from __future__ import annotations

from stability.callbacks import Callback, StepState
from stability.config import FaultConfig
from stability.drills import NONE, Context, registry


class FaultInjector:
    """One run's fault (kind "none": every call returns at once). Built on every rank after the
    optimizer and loader; errors that need the model or the data (layer, param, weights) surface here."""

    def __init__(self, fc: FaultConfig, *, model=None, optimizer=None, loader=None, data_cfg=None, train_cfg=None,
                 dist=None):
        """fc: fault.*, checked by the schema (stability/config.py, from the drills' Configs); data_cfg,
        train_cfg: the run's DataConfig and TrainConfig (None where a test drives a drill by hand)."""
        self.cfg = fc.resolved()
        self.kind, self.s = self.cfg["kind"], self.cfg.get("step")
        rank, world = (dist.rank, dist.world) if dist is not None else (0, 1)
        self.step = 0  # the step last given to a per-step call
        self.drill = None
        if self.kind != NONE:
            ctx = Context(model=model, optimizer=optimizer, loader=loader, data_cfg=data_cfg, train_cfg=train_cfg,
                          rank=rank, world=world)
            self.drill = registry()[self.kind](fc.drill_config(), self.s, ctx)
            self.drill.check()

    def at(self, point: str, s: StepState) -> None:
        """Run the drill's hook for `point` of the step (only where the drill declares it)."""
        self.step = s.step
        if self.drill is not None and point in self.drill.points:
            getattr(self.drill, point)(s)

    # ---- the same, by step number (tests and labs drive a drill without a StepState) --------------------
    def before_batch(self, step: int) -> None:
        self.at("before_batch", StepState(step))

    def corrupt(self, step: int, first_id: int, batch):
        """The batch to train at this step (this rank's shard), corrupted where the drill says."""
        s = StepState(step, first_id=first_id, batch=batch)
        self.at("on_batch", s)
        return s.batch

    def before_forward(self, step: int) -> None:
        self.at("before_forward", StepState(step))

    def before_update(self, step: int) -> None:
        self.at("before_update", StepState(step))

    def after_update(self, step: int) -> None:
        self.at("after_update", StepState(step))

    def wrap(self, wrapped) -> None:
        """Once, after parallel.wrap_model (missing_reduce hooks DDP's gradient communication)."""
        if self.drill is not None and "wrap" in self.drill.points:
            self.drill.wrap(wrapped)

    def pop_events(self) -> list[dict]:
        if self.drill is None:
            return []
        events, self.drill.events = self.drill.events, []
        return events

    # ---- resume --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"kind": self.kind, **(self.drill.state_dict() if self.drill is not None else {})}

    def load_state_dict(self, sd: dict) -> None:
        # NOTE: state saved under another kind (e.g. a clean run resumed into a drill) starts fresh.
        if sd.get("kind") != self.kind or self.drill is None:
            return
        self.drill.load_state_dict(sd)


class FaultDrill(Callback):
    """The injector attached to the step: one object, and the loop never asks which fault it is.

    Its events go to the run's EventLog as soon as the fault fires, in the same story as the guard's.
    A drill is meant to be quiet before its injection; when the guard already acted (a natural spike on
    this seed or CPU), the fault's event says so (`preceded_by`), and the console line with it, so nobody
    reads the run's incidents as the drill's alone.
    """
    # first on the way in (the batch is corrupted, a hook armed, before routing or telemetry see the step);
    # last out: an optimizer-state drill corrupts the moments after telemetry measured the clean update
    order = {"before_batch": 0, "on_batch": 0, "before_forward": 0, "before_update": 0, "after_update": 30}

    def __init__(self, injector: FaultInjector, optimizer, events, guard=None):
        self.inj, self.optimizer, self.events, self.guard = injector, optimizer, events, guard
        self._checked = False  # the quiet-before-injection check is made at the first fault event
        # NOTE: a drill that acts after the update may raise its first event there, and the check then reads
        # the guard's verdict on this very step (Callback.reads_verdict)
        self.reads_verdict = injector.drill is not None and "after_update" in injector.drill.points

    def before_batch(self, s: StepState) -> None:
        self.inj.at("before_batch", s)
        self._emit()

    def on_batch(self, s: StepState) -> None:
        self.inj.at("on_batch", s)
        self._emit()

    def before_forward(self, s: StepState) -> None:
        self.inj.at("before_forward", s)

    def before_update(self, s: StepState) -> None:
        self._emit()  # a NaN hook fired during the forward
        self.inj.at("before_update", s)
        self._emit()

    def after_update(self, s: StepState) -> None:
        self.inj.at("after_update", s)
        self._emit()

    def _emit(self) -> None:
        for e in self.inj.pop_events():
            info = {k: v for k, v in e.items() if k not in ("step", "kind")}
            summary = ", ".join(f"{k}={v}" for k, v in info.items())
            det = getattr(self.guard, "detector", None)
            if not self._checked and det is not None:
                self._checked = True
                # NOTE: acted-on triggers before the injection; after a resume into a drill that already
                # fired, the drill's own triggers (at or after its step) are not a warning
                if det.fired and det.last_trigger_step is not None and det.last_trigger_step < e["step"]:
                    info["preceded_by"] = {"guard_triggers": det.fired, "last_trigger_step": det.last_trigger_step}
                    summary += (f"; WARN: the drill was not quiet before its injection: the guard acted on "
                                f"{det.fired} trigger(s) already (last at step {det.last_trigger_step}), so "
                                f"this run's incidents are not the drill's alone")
            self.events.emit(e["step"], "fault", summary, **info)


if __name__ == "__main__":  # the drills, as the registry declares them, and their keys' defaults
    from dataclasses import fields

    for kind, d in registry().items():
        keys = " ".join(f"{f.name}={f.default}" for f in fields(d.Config))  # set as fault.<kind>.<key>
        print(f"{kind:<16}{d.lifetime:<12}{d.expects:<26}{', '.join(d.points):<38}{keys}".rstrip())
