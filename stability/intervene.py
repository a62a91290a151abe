"""One deliberate change to one step: the doctor's counterfactuals and its verified fixes (doctor/verify.py).

    python train.py ... intervene.kind=batch intervene.step=80 intervene.first_id=1280
    python train.py ... intervene.kind=moments intervene.step=81
    python train.py ... intervene.kind=lr intervene.step=80

A diagnosis is tested by changing one thing and replaying (docs/course.md §5: two hypotheses refuted, one
single-variable fix). Each kind changes exactly one input of the step, at the step's named points
(stability/callbacks.py), after a drill acted (a drill is the fault under test, never what is changed):

    batch    step `step` trains on the global batch that starts at sample `first_id` instead of the one the
             cursor holds (the loader serves that window; the ids after it follow from there). With the
             ids of a neighbouring step: "is it the batch?"; with the incident's own batch one step
             earlier (a run resumed one checkpoint before): "is it the state?"
    moments  after step `step`, Adam's moments (exp_avg, exp_avg_sq) are the ones its update wrote: whatever
             rewrote them after the optimizer step (before the record and the next step) is undone. "Is it
             the optimizer state?", and, continued, the fix "a restored state"
    lr       from `step` on, every group's LR is its schedule's (whatever rewrote it before the update):
             "is it the schedule?", and the fix "keep the LR on its schedule"

Every act is an event of the run (kind `intervene`), so the records say what was changed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from run.config_errors import check, choice
from stability.callbacks import Callback, StepState

KINDS = ("none", "batch", "moments", "lr")


@dataclass
class InterveneConfig:
    kind: str = "none"          # none | batch | moments | lr
    step: int | None = None     # the step it changes (lr: from this step on)
    first_id: int | None = None  # kind=batch: the first global sample id of the batch step `step` trains on

    def __post_init__(self) -> None:
        choice("intervene.kind", self.kind, KINDS)
        if self.kind == "none":
            return
        check(self.step is not None and self.step >= 1, "intervene.step", self.step,
              f"must be a step >= 1 for intervene.kind={self.kind}")
        if self.kind == "batch":
            check(self.first_id is not None and self.first_id >= 0, "intervene.first_id", self.first_id,
                  "must be a sample id >= 0 for intervene.kind=batch")
        check(self.kind == "batch" or self.first_id is None, "intervene.first_id", self.first_id,
              f"is read by intervene.kind=batch only, not {self.kind}")


class Intervene(Callback):
    """The configured change, attached to the step (built only when intervene.kind is not none)."""
    # after a drill at every point (the drill is the fault under test): before telemetry snapshots θ, and
    # after the update's last writer (an optimizer-state drill acts at after_update 30)
    order = {"before_batch": 5, "before_update": 10, "after_update": 35}

    def __init__(self, cfg: InterveneConfig, optimizer, scheduler, loader, events):
        self.cfg, self.optimizer, self.scheduler, self.loader, self.events = cfg, optimizer, scheduler, loader, events
        self._moments: dict | None = None  # kind=moments: the moments as the optimizer step wrote them
        self._hook = None

    def before_batch(self, s: StepState) -> None:
        c = self.cfg
        if c.kind == "batch" and s.step == c.step:
            was = self.loader.samples_consumed
            self.loader.samples_consumed = c.first_id
            self.events.emit(s.step, "intervene", f"step {s.step} trains on the batch at sample "
                             f"{c.first_id} instead of {was}", change="batch", first_id=c.first_id, instead_of=was)

    def before_update(self, s: StepState) -> None:
        c = self.cfg
        if c.kind == "moments" and s.step == c.step:
            # NOTE: a post-step hook reads the moments between optimizer.step() and every after_update writer
            self._hook = self.optimizer.register_step_post_hook(self._snapshot)
        elif c.kind == "lr" and s.step >= c.step:
            planned = self.scheduler.get_last_lr()
            moved = [g["lr"] != lr for g, lr in zip(self.optimizer.param_groups, planned)]
            for g, lr in zip(self.optimizer.param_groups, planned):
                g["lr"] = lr
            if any(moved):
                self.events.emit(s.step, "intervene", f"step {s.step}'s LR put back on its schedule "
                                 f"({sum(moved)} group(s) had another)", change="lr", groups=sum(moved))

    @torch.no_grad()
    def _snapshot(self, optimizer, *_) -> None:
        self._moments = {p: {k: st[k].clone() for k in ("exp_avg", "exp_avg_sq") if k in st}
                         for p, st in optimizer.state.items()}
        self._hook.remove()

    @torch.no_grad()
    def after_update(self, s: StepState) -> None:
        c = self.cfg
        if c.kind != "moments" or s.step != c.step:
            return
        if self._moments is None:  # the update was vetoed: no moments were written to restore
            self._hook.remove()
            return
        changed = 0
        for p, saved in self._moments.items():
            for k, v in saved.items():
                now = self.optimizer.state[p][k]
                changed += int((now != v).sum())
                now.copy_(v)
        self._moments = None
        self.events.emit(s.step, "intervene", f"the moments as step {s.step}'s update wrote them: {changed} "
                         f"element(s) rewritten after it restored", change="moments", elements=changed)
