"""The `checkpoint` group's and the root `resume` key's schemas (checkpoint/checkpointer.py reads them)."""
from __future__ import annotations

from dataclasses import dataclass, field

from run.config_errors import check, choice

MODES = ("async", "sync")


@dataclass
class CheckpointConfig:
    """Atomic publish, async save, retention. Resume with `resume=latest`."""
    every: int = 100                # save every N steps and at the last step; 0 = never (an interrupt still saves)
    dir: str | None = None          # null = <run dir>/checkpoints
    mode: str = "async"             # async: copy the state at the snapshot point, write in a background thread | sync
    keep_last: int = 3              # retention: the newest K checkpoints ...
    keep_every: int | None = None   # ... plus every step divisible by M (null = none)
    verify_hashes: bool = True      # sha256 every file before loading (a checkpoint without a valid marker is never read)
    stop_after: int | None = None   # save and exit after this step (a planned preemption; the lr schedule still spans train.steps)

    def __post_init__(self) -> None:
        check(self.every >= 0, "checkpoint.every", self.every, "must be an integer >= 0")
        choice("checkpoint.mode", self.mode, MODES)
        check(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, "must be an integer >= 1")
        check(self.keep_every is None or self.keep_every >= 1, "checkpoint.keep_every", self.keep_every,
              "must be an integer >= 1 or null")
        check(self.stop_after is None or self.stop_after >= 1, "checkpoint.stop_after", self.stop_after,
              "must be an integer >= 1 or null")

    def check_steps(self, steps: int) -> None:
        check(self.stop_after is None or self.stop_after <= steps, "checkpoint.stop_after", self.stop_after,
              f"beyond train.steps={steps}")


@dataclass
class ResumeConfig:
    """The full form of `resume` (the shorthand `resume=latest` / `resume=<path>` is a string)."""
    path: str | None = None          # latest (this run dir's checkpoints/latest) or a checkpoint path
    allow_data_change: bool = False  # the data fingerprint may differ (logged as an event)
    allow_config_change: list[str] = field(default_factory=list)  # run-defining keys that may differ, e.g. [train.steps]
