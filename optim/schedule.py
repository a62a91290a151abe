"""Learning-rate schedules as a pure factor of the step: lr(s) = peak_lr · lr_factor(s, T, cfg).

Config (the `optim.schedule` node; T = train.steps comes from the trainer):

    {name: cosine, warmup_steps: 100, min_lr_ratio: 0.1, decay_steps: null}   # wsd: decay_fraction: 0.2

Step s counts optimizer steps from 0; the run's last step is T − 1. With W warmup steps, D decay steps
and r = min_lr_ratio:

    warmup   s < W:   f = (s + 1) / W                       first step 1/W (> 0), step W−1 at 1.0
    decay:            p = clamp((s − s₀ + 1) / D, 0, 1)     step s₀ already one step in, s₀+D−1 at r
        cosine        f = r + (1 − r) · ½(1 + cos πp)       s₀ = W, D = decay_steps or T − W
        linear        f = 1 − (1 − r) · p                   s₀ = W, D = decay_steps or T − W
        wsd           f = 1 before s₀, then linear          D = decay_steps or round(decay_fraction·T),
                                                            s₀ = T − D (the last D steps decay)
        constant      f = 1

NOTE: neither phase wastes a step: warmup never sits at 0 and the last step already trains at r·peak.
Steps past the end hold at r (cosine, linear, wsd), so a longer resumed run does not restart the cycle.
A schedule longer than the run is clamped to it (optim/config.py ScheduleConfig.fit); the run says so once.

The schedule is a Schedule object: LambdaLR saves a callable's attributes with its state, so a checkpoint
carries the schedule it trained under, horizon T included, and a resume continues that one. A resume that
declares another train.steps (README: "200 more steps") changes where the run stops, not the LR of the steps
already trained (continued()):
    - the schedule over the new T gives every trained step its LR (wsd in its stable phase, constant): it is
      taken, and the decay moves to the new end (wsd's point: a stable phase can be extended at will);
    - otherwise (cosine, linear, or wsd past its decay's start) T is kept and the added steps train at its
      final LR r·peak: a re-stretched cosine would jump the LR back up, and the loss with it (a re-warmed
      decay is a new schedule: declare optim.schedule too).
A declared change of optim.schedule or optim.lr takes the new schedule from the resume on, as written.

Plain arithmetic, no torch at import: the doctor recomputes a run's expected lr from its records.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from optim.config import ScheduleConfig
from run.config_errors import typed

class Schedule:
    """step -> lr factor of one run's schedule, fitted to its horizon `steps` (the callable LambdaLR applies).

    Its attributes are plain values: LambdaLR's state_dict saves them, and describe() is the StepRecord's
    `schedule` (with the peak lr) from which the doctor recomputes the LR each step was meant to have."""

    def __init__(self, cfg: Mapping | ScheduleConfig, total_steps: int):
        cfg = ScheduleConfig.from_dict(cfg)
        warmup, decay = cfg.fit(total_steps)
        self.name, self.steps, self.warmup, self.decay = cfg.name, int(total_steps), warmup, decay
        self.min_lr_ratio = float(cfg.min_lr_ratio)

    @classmethod
    def from_record(cls, d: Mapping) -> "Schedule":
        """A Schedule from describe()'s fields (a record's `schedule`, LambdaLR's saved attributes)."""
        self = cls.__new__(cls)
        self.name, self.steps, self.warmup = str(d["name"]), int(d["steps"]), int(d["warmup"])
        self.decay, self.min_lr_ratio = int(d["decay"]), float(d["min_lr_ratio"])
        return self

    def __call__(self, step: int) -> float:
        start = self.steps - self.decay if self.name == "wsd" else self.warmup
        return _factor(step, self.name, self.warmup, start, self.decay, self.min_lr_ratio)

    def __eq__(self, other) -> bool:
        return isinstance(other, Schedule) and vars(self) == vars(other)

    def describe(self, peak_lr: float | None = None) -> dict:
        return {**({"lr": peak_lr} if peak_lr is not None else {}), **vars(self)}

    def __str__(self) -> str:
        where = f", decay {self.decay}" if self.name != "constant" else ""
        return f"{self.name} over {self.steps} steps (warmup {self.warmup}{where}, min_lr_ratio {self.min_lr_ratio:g})"


def _factor(step: int, name: str, warmup: int, start: int, decay: int, ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    if name == "constant" or step < start:
        return 1.0
    p = min(max((step - start + 1) / decay, 0.0), 1.0)
    if name == "cosine":
        return ratio + (1.0 - ratio) * 0.5 * (1.0 + math.cos(math.pi * p))
    return 1.0 - (1.0 - ratio) * p  # linear and the decay tail of wsd


def lr_factor(step: int, total_steps: int, cfg: Mapping) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based) of a `total_steps` run."""
    return Schedule(cfg, total_steps)(step)


def factor_fn(cfg: Mapping, total_steps: int) -> Callable[[int], float]:
    """step -> lr_factor(step, total_steps, cfg), the config parsed and checked once, not at every step."""
    return Schedule(cfg, total_steps)


def build_scheduler(optimizer, cfg: ScheduleConfig, total_steps: int):
    """LambdaLR applying the Schedule's factor to every group's own lr (so lr_scale survives).

    NOTE: LambdaLR's state_dict is the step counter (last_epoch), the base lrs and the Schedule's attributes:
    a resume restores all three, whatever the config says now; continued() decides what a declared change does.
    """
    # NOTE: torch imported here: the schedule is pure arithmetic, and the doctor reads it without torch
    from torch.optim.lr_scheduler import LambdaLR
    return LambdaLR(optimizer, Schedule(typed(cfg, ScheduleConfig, "build_scheduler"), total_steps))  # checked up front


def schedule_of(scheduler) -> Schedule:
    return scheduler.lr_lambdas[0]


def peak_lr(scheduler) -> float:
    """optim.lr as the scheduler applies it: group 0's base lr without its lr_scale."""
    return scheduler.base_lrs[0] / scheduler.optimizer.param_groups[0].get("lr_scale", 1.0)


def record(scheduler) -> dict:
    """The StepRecord's `schedule`: the peak lr and the Schedule this step trained under."""
    return schedule_of(scheduler).describe(peak_lr(scheduler))


def follow(scheduler, schedule: Schedule, base_lrs: list[float] | None = None) -> None:
    """From the scheduler's current step on, every group's LR is base_lr · schedule(step): the LR of the next
    update too (the one LambdaLR set at its last step was the previous schedule's)."""
    base = list(scheduler.base_lrs if base_lrs is None else base_lrs)
    scheduler.lr_lambdas = [schedule] * len(base)
    scheduler.base_lrs = base
    for group, b in zip(scheduler.optimizer.param_groups, base):
        group["initial_lr"], group["lr"] = b, b * schedule(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]


def continued(saved: Schedule, configured: Schedule, step: int, declared: bool,
              peak: float = 1.0) -> tuple[Schedule, str | None]:
    """The schedule a resume after `step` updates continues on, and the line that says so (None: unchanged).

    saved: the checkpoint's; configured: the config's now (over the new train.steps); declared: optim.schedule
    itself was declared changed (a new shape, taken as written); peak: optim.lr, for the line. Updates 1..step
    used factors 0..step-1."""
    if configured == saved:
        return saved, None
    if declared:
        return configured, f"resume: the LR schedule changes at step {step + 1} (declared): {saved} -> {configured}"
    if all(configured(i) == saved(i) for i in range(step)):
        moved = (f"; its decay moves to steps {configured.steps - configured.decay + 1}-{configured.steps}"
                 if configured.name == "wsd" else "")
        return configured, (f"resume: train.steps {saved.steps} -> {configured.steps}: the LR schedule over "
                            f"{configured.steps} steps gives every step already trained the same LR, so the run "
                            f"goes on it: {configured}{moved}")
    last = saved.steps
    rest = (f"steps {max(step, last) + 1}-{configured.steps} train at its final LR {peak * saved(last - 1):.2e}"
            if configured.steps > last else f"the run stops at step {configured.steps}, before its end")
    return saved, (f"resume: train.steps {last} -> {configured.steps}: the LR schedule keeps its {last}-step "
                   f"horizon, so the LR goes on where it was; {rest} (a schedule over {configured.steps} steps "
                   f"would change the LR of steps already trained)")


def resumed(scheduler, configured: Schedule, base: list[float], step: int,
            declared: bool) -> tuple[list[str], tuple | None]:
    """After a resume loaded the checkpoint's schedule and base LRs into `scheduler`: continue on what
    continued() decides, with the config's base LRs (optim.lr × lr_scale: a declared optim.lr applies from
    here). Returns the lines that say so, and (schedule, base) when they moved from the checkpoint's (None)."""
    schedule, line = continued(schedule_of(scheduler), configured, step, declared, peak_lr(scheduler))
    lines = [line] if line else []
    if base != list(scheduler.base_lrs):
        # NOTE: the config's, declared (optim.lr) or not: a checkpoint whose base LRs are not its config's is corrected
        lines.append(f"resume: the base LRs change at step {step + 1} to the config's (optim.lr × lr_scale): "
                     f"{', '.join(f'{b:g}' for b in scheduler.base_lrs)} -> {', '.join(f'{b:g}' for b in base)}")
    if not lines:
        return [], None
    follow(scheduler, schedule, base)
    return lines, (schedule, base)
