"""lr: every param group's LR, right before the update, is the configured schedule's at this step.

The schedule's factor is recomputed from the config (spec/schedule.py), times optim.lr and the group's
lr_scale from its rule: never read from the scheduler. The schedule in force rides in the checkpoint with the
check, so a resume that extends the run goes on with the rule the config documents. Both sides are float64 arithmetic on the same
numbers, so 1e-12 relative is the tolerance (a few ulps of float64, a thousand times over).
"""
from __future__ import annotations

import torch

from spec.check import BEFORE, STEP, SYSTEM, UPDATE, Check, Kind
from spec.schedule import continued, fields, lr_at

TOL = 1e-12


class ScheduleCheck(Check):
    name, layer, cadence, phase = "lr", UPDATE, STEP, BEFORE
    rank = 45
    doc = "every group's LR against the configured schedule at this step"
    # NOTE: a schedule reset at a resume moves the scheduler's counter: the continuity check names it first
    kinds = {"lr": Kind("optim.lr_switch", "the named group's LR left its schedule"),
             "rank": Kind("system.rank_divergence", "one rank's optimizer runs another LR than the others (their "
                                                    "replicas part from this update on)", layer=SYSTEM)}
    rank_kind = "rank"  # failing on some ranks, not all: that rank's own setting

    def __init__(self, ctx):
        super().__init__(ctx)
        self.saved = None
        ctx.schedule = fields(ctx.cfg.optim.schedule, ctx.cfg.train.steps)  # the optimizer check reads it too

    def before_update(self, s) -> None:
        if self.saved is not None:  # the first step after a resume: the checkpoint's schedule, continued
            self.ctx.schedule, self.saved = continued(self.saved, self.ctx.cfg, s.step - 1), None
        groups = self.ctx.optimizer.param_groups
        got = torch.tensor([float(g["lr"]) for g in groups], dtype=torch.float64)
        want = torch.tensor([lr_at(self.ctx.cfg, g.get("name", f"group{i}"), s.step, self.ctx.schedule)
                             for i, g in enumerate(groups)], dtype=torch.float64)
        self.measure((got - want).abs(), TOL * want.abs() + 1e-300, "lr",
                     where=[g.get("name", f"group{i}") for i, g in enumerate(groups)])

    def state_dict(self) -> dict:
        return {"schedule": dict(self.ctx.schedule)}

    def load_state_dict(self, sd: dict) -> None:
        self.saved = sd.get("schedule")

    def rolled_back(self, cursor: int) -> None:
        self.saved = None  # a rollback is no resume: the same schedule goes on
