"""mixture_switch: from step s on the loader draws the data mixture with new weights, one per
data.sources entry. An objective change, not an optimisation fault: it stays switched after a rollback
past s (restoring a pre-switch data cursor then needs allow_data_change)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from data import DataConfig, build_data
from run.config_errors import check, fail
from stability.drills.base import PERSISTENT, Drill


@dataclass
class Config:
    weights: list[float] | None = None  # the new weights, one per data.sources entry

    def __post_init__(self) -> None:
        w = self.weights
        if not w:
            fail("weights", w, "expected a list of weights, one per data.sources entry")
        self.weights = [float(x) for x in w]
        check(all(math.isfinite(x) and x >= 0 for x in w), "weights", self.weights, "must be >= 0")
        check(sum(w) > 0, "weights", self.weights, "must not be all zero")


class MixtureSwitch(Drill):
    kind = "mixture_switch"
    expects = "objective.mixture"
    lifetime = PERSISTENT
    points = ("before_batch",)
    Config = Config

    def check(self) -> None:
        data, w = self.ctx.data_cfg or DataConfig(), self.cfg.weights  # the run's data (a test's: the default)
        if data.kind != "synthetic":
            self.fail(f"needs data.kind=synthetic with data.sources; got data.kind={data.kind}")
        if len(w) != len(data.sources):
            raise ValueError(f"{self.key('weights')}={w}: expected {len(data.sources)} weights, "
                             "one per data.sources entry")
        self._new_data = build_data(dataclasses.replace(data, sources=[dataclasses.replace(src, weight=x)
                                                                       for src, x in zip(data.sources, w)]))

    def before_batch(self, s) -> None:
        if self.fired or s.step < self.s:
            return
        loader = self.ctx.loader
        old = loader.dataset.weights.tolist()
        self._switch()
        self.emit(s.step, weights_from=old, weights_to=loader.dataset.weights.tolist(),
                  fingerprint=loader.dataset.fingerprint[:12])

    def _switch(self) -> None:
        # WARN: the loader's fingerprint changes with the weights: restoring a pre-switch loader state
        # (rollback past s, resume) meets a fingerprint mismatch unless data changes are allowed.
        self.ctx.loader.dataset = self._new_data
        self.fired = True

    def state_dict(self) -> dict:
        return {"switched": self.fired}

    def load_state_dict(self, sd: dict) -> None:
        if sd["switched"] and not self.fired:
            self._switch()
