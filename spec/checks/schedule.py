"""lr: every param group's LR, right before the update, is the configured schedule's at this step.

The schedule's factor is recomputed from the config (spec/schedule.py), times optim.lr and the group's
lr_scale from its rule: never read from the scheduler. The schedule in force rides in the checkpoint with the
check, so a resume that extends the run goes on with the rule the config documents. Both sides are float64 arithmetic on the same
numbers, so 1e-12 relative is the tolerance (a few ulps of float64, a thousand times over).
"""
from __future__ import annotations

import torch

from spec.check import BEFORE, STEP, UPDATE, Check, Kind
from spec.schedule import continued, fields, lr_at

TOL = 1e-12


class ScheduleCheck(Check):
    name, layer, cadence, phase = "lr", UPDATE, STEP, BEFORE
    rank = 45
    doc = "every group's LR against the configured schedule at this step"
    kinds = {"lr": Kind("optim.lr_switch", "the named group's LR left its schedule"),
             "resume": Kind("state.resume_fault", "the schedule after the resume is not the saved one")}

    def __init__(self, ctx):
        super().__init__(ctx)
        self.resumed, self.saved = False, None
        ctx.schedule = fields(ctx.cfg.optim.schedule, ctx.cfg.train.steps)  # the optimizer check reads it too

    def before_update(self, s) -> None:
        if self.saved is not None:  # the first step after a resume: the checkpoint's schedule, continued
            self.ctx.schedule, self.saved = continued(self.saved, self.ctx.cfg, s.step - 1), None
        groups = self.ctx.optimizer.param_groups
        got = torch.tensor([float(g["lr"]) for g in groups], dtype=torch.float64)
        want = torch.tensor([lr_at(self.ctx.cfg, g.get("name", f"group{i}"), s.step, self.ctx.schedule)
                             for i, g in enumerate(groups)], dtype=torch.float64)
        kind = "resume" if self.resumed else "lr"
        self.measure((got - want).abs(), TOL * want.abs() + 1e-300, kind,
                     where=[g.get("name", f"group{i}") for i, g in enumerate(groups)])
        self.resumed = False

    def state_dict(self) -> dict:
        return {"schedule": dict(self.ctx.schedule)}

    def load_state_dict(self, sd: dict) -> None:
        self.resumed, self.saved = True, sd.get("schedule")

    def rolled_back(self, cursor: int) -> None:
        self.resumed, self.saved = False, None  # a rollback is no resume: the same schedule goes on
