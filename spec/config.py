"""The `spec` group's schema: the step's specification checks (spec/monitor.py). On by default."""
from __future__ import annotations

from dataclasses import dataclass

from run.config_errors import check


@dataclass
class SpecConfig:
    enabled: bool = True     # check every step against its specification (spec/); false: no check runs
    # the reference checks (the probe's forward and gradient against the FP64 reference, the router's choice) run
    # at step 1 and every `every` steps; null: telemetry.every (10 when telemetry is off)
    every: int | None = None

    def __post_init__(self) -> None:
        check(self.every is None or self.every >= 1, "spec.every", self.every, "must be an integer >= 1 or null")
