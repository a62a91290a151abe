"""clip_threshold: from step s the global-norm clip threshold is silently factor × train.max_grad_norm:
the clip coefficient falls from ~1 to ~factor and stays there, while the loss curve looks clean (Adam's
update is nearly invariant to the gradient's scale). Acts through the step's threshold
(StepState.max_grad_norm, read after before_update); train.clip=fixed only."""
from __future__ import annotations

import math
from dataclasses import dataclass

from run.config_errors import check
from stability.drills.base import PERSISTENT, Drill


@dataclass
class Config:
    factor: float = 0.003  # the threshold × factor

    def __post_init__(self) -> None:
        check(math.isfinite(self.factor) and self.factor > 0, "factor", self.factor, "must be > 0")


class ClipThreshold(Drill):
    kind = "clip_threshold"
    expects = "optim.settings"  # a threshold the config does not set: the clip check names it (spec/)
    lifetime = PERSISTENT
    points = ("before_update",)
    Config = Config

    def check(self) -> None:
        t = self.ctx.train_cfg
        if t is None:  # a test driving the drill by hand
            return
        if t.max_grad_norm is None:
            self.fail("needs a clip threshold to scale; train.max_grad_norm=null")
        if t.clip != "fixed":
            self.fail(f"scales the fixed threshold; needs train.clip=fixed, got train.clip={t.clip}")

    def before_update(self, s) -> None:
        if s.max_grad_norm is not None and self.persists(s.step, factor=self.cfg.factor,
                                                         max_grad_norm=s.max_grad_norm * self.cfg.factor):
            s.max_grad_norm *= self.cfg.factor
