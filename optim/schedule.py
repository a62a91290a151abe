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

Plain arithmetic, no torch at import: the doctor recomputes a run's expected lr from its config.yaml.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from optim.config import ScheduleConfig
from run.config_errors import typed

def _phases(cfg: Mapping | ScheduleConfig, total_steps: int) -> tuple[str, int, int, int, float]:
    """(name, W, s₀, D, r) of a schedule over total_steps; the schema checks it (optim/config.py)."""
    cfg = ScheduleConfig.from_dict(cfg)
    warmup, decay = cfg.fit(total_steps)
    start = total_steps - decay if cfg.name == "wsd" else warmup
    return cfg.name, warmup, start, decay, float(cfg.min_lr_ratio)


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
    return _factor(step, *_phases(cfg, total_steps))


def factor_fn(cfg: Mapping, total_steps: int) -> Callable[[int], float]:
    """step -> lr_factor(step, total_steps, cfg), the config parsed and checked once, not at every step."""
    phases = _phases(cfg, total_steps)
    return lambda step: _factor(step, *phases)


def build_scheduler(optimizer, cfg: ScheduleConfig, total_steps: int):
    """LambdaLR applying lr_factor to every group's own lr (so lr_scale survives).

    NOTE: LambdaLR's state_dict is the step counter (last_epoch) and base lrs; the factor is recomputed
    from the config, so resume is exact as long as the schedule config and train.steps are unchanged.
    """
    # NOTE: torch imported here: lr_factor is pure arithmetic, and the doctor reads it without torch
    from torch.optim.lr_scheduler import LambdaLR
    return LambdaLR(optimizer, factor_fn(typed(cfg, ScheduleConfig, "build_scheduler"), total_steps))  # checked up front, not at the first step
