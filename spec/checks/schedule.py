"""lr: every param group's LR, right before the update, is the configured schedule's at this step.

The schedule's factor is recomputed from the config (spec/schedule.py), times optim.lr and the group's
lr_scale from its rule: never read from the scheduler. Both sides are float64 arithmetic on the same
numbers, so 1e-12 relative is the tolerance (a few ulps of float64, a thousand times over).
"""
from __future__ import annotations

import torch

from spec.check import BEFORE, STEP, UPDATE, Check, Kind
from spec.schedule import lr_at

TOL = 1e-12


class ScheduleCheck(Check):
    name, layer, cadence, phase = "lr", UPDATE, STEP, BEFORE
    rank = 45
    doc = "every group's LR against the configured schedule at this step"
    kinds = {"lr": Kind("optim.lr_switch", "the named group's LR left its schedule"),
             "resume": Kind("state.resume_fault", "the schedule after the resume is not the saved one")}

    def __init__(self, ctx):
        super().__init__(ctx)
        self.resumed = False

    def before_update(self, s) -> None:
        groups = self.ctx.optimizer.param_groups
        got = torch.tensor([float(g["lr"]) for g in groups], dtype=torch.float64)
        want = torch.tensor([lr_at(self.ctx.cfg, g.get("name", f"group{i}"), s.step) for i, g in enumerate(groups)],
                            dtype=torch.float64)
        kind = "resume" if self.resumed else "lr"
        self.measure((got - want).abs(), TOL * want.abs() + 1e-300, kind,
                     where=[g.get("name", f"group{i}") for i, g in enumerate(groups)])
        self.resumed = False

    def load_state_dict(self, sd: dict) -> None:
        self.resumed = True

    def rolled_back(self, cursor: int) -> None:
        self.resumed = False  # the snapshot's state came back with load_state_dict: a rollback is no resume
