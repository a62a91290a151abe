"""lr_spike: every param group's lr × factor for `steps` optimizer steps from s, the first time those
steps are reached; a rollback does not replay the spike (one that lands inside the window cuts it short).
The scheduled LRs are restored exactly after the update: the schedule continues from them."""
from __future__ import annotations

import math
from dataclasses import dataclass

from run.config_errors import check
from stability.drills.base import TRANSIENT, Drill


@dataclass
class Config:
    factor: float = 10.0  # every group's lr × factor ...
    steps: int = 1        # ... for this many optimizer steps

    def __post_init__(self) -> None:
        check(math.isfinite(self.factor) and self.factor > 0, "factor", self.factor, "must be > 0")
        check(self.steps >= 1, "steps", self.steps, "must be >= 1")


class LrSpike(Drill):
    kind = "lr_spike"
    expects = "optim.lr_switch"
    lifetime = TRANSIENT
    points = ("before_update", "after_update")
    Config = Config

    def __init__(self, cfg, step, ctx):
        super().__init__(cfg, step, ctx)
        self.spike_last: int | None = None  # the last spiked step
        self.spike_over = False
        self._planned: list[float] = []  # the scheduled LRs of this step

    def factor(self, step: int) -> float:
        """The lr multiplier of the update of `step` (call once per step)."""
        if self.spike_over:
            return 1.0
        last, window = self.spike_last, (self.s, self.s + self.cfg.steps - 1)
        in_window = window[0] <= step <= window[1]
        if last is not None and (step != last + 1 or not in_window):  # ran out, or the clock went back
            self.spike_over = True
            return 1.0
        if not in_window:
            return 1.0
        self.spike_last, self.fired = step, True
        self.emit(step, factor=self.cfg.factor, window=list(window))
        return self.cfg.factor

    def before_update(self, s) -> None:
        f = self.factor(s.step)
        groups = self.ctx.optimizer.param_groups
        self._planned = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] *= f

    def after_update(self, s) -> None:
        # NOTE: the scheduled LRs exactly (not lr / factor, which can round)
        for g, lr in zip(self.ctx.optimizer.param_groups, self._planned):
            g["lr"] = lr

    def state_dict(self) -> dict:
        return {"fired": self.fired, "spike_last": self.spike_last, "spike_over": self.spike_over}

    def load_state_dict(self, sd: dict) -> None:
        self.fired, self.spike_last, self.spike_over = sd["fired"], sd["spike_last"], sd["spike_over"]
