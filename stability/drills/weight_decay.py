"""weight_decay: from step s every param group's weight_decay is × factor for each update, silently:
the config, the schedule and the record's lr are as they were, and a group without decay stays at 0.
The planned values are restored after each update, so a checkpoint holds the configured ones."""
from __future__ import annotations

import math
from dataclasses import dataclass

from run.config_errors import check
from stability.drills.base import PERSISTENT, Drill


@dataclass
class Config:
    factor: float = 100.0  # every group's weight_decay × factor

    def __post_init__(self) -> None:
        check(math.isfinite(self.factor) and self.factor >= 0, "factor", self.factor, "must be >= 0")


class WeightDecay(Drill):
    kind = "weight_decay"
    expects = "optim.settings"
    lifetime = PERSISTENT
    points = ("before_update", "after_update")
    Config = Config

    def __init__(self, cfg, step, ctx):
        super().__init__(cfg, step, ctx)
        self._planned: list[float] | None = None

    def before_update(self, s) -> None:
        if not self.persists(s.step, factor=self.cfg.factor):
            return
        groups = [g for g in self.ctx.optimizer.param_groups if "weight_decay" in g]
        self._planned = [g["weight_decay"] for g in groups]
        for g in groups:
            g["weight_decay"] *= self.cfg.factor

    def after_update(self, s) -> None:
        if self._planned is None:
            return
        groups = [g for g in self.ctx.optimizer.param_groups if "weight_decay" in g]
        for g, wd in zip(groups, self._planned):
            g["weight_decay"] = wd
        self._planned = None
