"""update_scale: from step s every parameter's update is × factor, θ ← θ_before + factor·(θ_after − θ_before),
while the LR, the gradient and the recorded lr stay as they were: a bug in the optimizer's arithmetic,
not in its settings. Applied inside optimizer.step (a step post-hook), so per-layer telemetry measures
the update actually applied."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from run.config_errors import check
from stability.drills.base import PERSISTENT, Drill


@dataclass
class Config:
    factor: float = 10.0  # every update × factor

    def __post_init__(self) -> None:
        check(math.isfinite(self.factor) and self.factor > 0, "factor", self.factor, "must be > 0")


class UpdateScale(Drill):
    kind = "update_scale"
    expects = "optim.settings"
    lifetime = PERSISTENT
    points = ("before_update", "after_update")
    Config = Config

    def __init__(self, cfg, step, ctx):
        super().__init__(cfg, step, ctx)
        self._before: list[torch.Tensor] | None = None  # θ before this step's update
        ctx.optimizer.register_step_post_hook(self._scale)

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.ctx.optimizer.param_groups for p in g["params"]]

    @torch.no_grad()
    def before_update(self, s) -> None:
        if self.persists(s.step, factor=self.cfg.factor):
            self._before = [p.detach().clone() for p in self._params()]

    @torch.no_grad()
    def _scale(self, optimizer, args, kwargs) -> None:
        if self._before is None:
            return
        for p, b in zip(self._params(), self._before):
            p.sub_(b).mul_(self.cfg.factor).add_(b)
        self._before = None

    def after_update(self, s) -> None:
        self._before = None  # a skipped or vetoed step never ran optimizer.step
