"""The learning-rate schedule as the config defines it, written here again from its definition (optim/schedule.py
documents it): the schedule check's oracle, so a scheduler that drifts (a patched LambdaLR, a reset counter, an
LR rewritten in a param group) cannot also move the answer.

    warmup  s < W: (s + 1)/W        then, with p = clamp((s − s₀ + 1)/D, 0, 1) and r = min_lr_ratio:
    cosine  r + (1 − r)·½(1 + cos πp)      linear / wsd's tail  1 − (1 − r)·p      constant  1
    s₀ = W (wsd: T − D); (W, D) = the config's schedule clamped to the run (ScheduleConfig.fit)

Step s counts optimizer steps from 0: the loop's step t trains at factor(t − 1).
"""
from __future__ import annotations

import math


def factor(s: int, sched, total_steps: int) -> float:
    warmup, decay = sched.fit(total_steps)
    if s < warmup:
        return (s + 1) / warmup
    if sched.name == "constant":
        return 1.0
    start = total_steps - decay if sched.name == "wsd" else warmup
    if s < start:
        return 1.0
    p = min(max((s - start + 1) / decay, 0.0), 1.0)
    r = float(sched.min_lr_ratio)
    if sched.name == "cosine":
        return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * p))
    return 1.0 - (1.0 - r) * p


def group_settings(cfg, group_name: str) -> tuple[float, float]:
    """(lr_scale, weight_decay) of a param group by its name, from the config's rules (optim.groups); Muon's
    groups are named <rule>/muon and <rule>/adamw."""
    base = group_name.split("/", 1)[0]
    for i, rule in enumerate(cfg.optim.groups):
        if (rule.name or f"group{i}") == base:
            wd = cfg.optim.weight_decay if rule.weight_decay is None else rule.weight_decay
            return float(rule.lr_scale), float(wd)
    return 1.0, float(cfg.optim.weight_decay)


def lr_at(cfg, group_name: str, step: int) -> float:
    """The LR the config gives `group_name` at the loop's step `step` (1-based)."""
    return float(cfg.optim.lr) * group_settings(cfg, group_name)[0] * factor(step - 1, cfg.optim.schedule,
                                                                             cfg.train.steps)
