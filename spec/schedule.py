"""The learning-rate schedule as the config defines it, written here again from its definition (optim/schedule.py
documents it): the schedule check's oracle, so a scheduler that drifts (a patched LambdaLR, a reset counter, an
LR rewritten in a param group) cannot also move the answer.

    warmup  s < W: (s + 1)/W        then, with p = clamp((s − s₀ + 1)/D, 0, 1) and r = min_lr_ratio:
    cosine  r + (1 − r)·½(1 + cos πp)      linear / wsd's tail  1 − (1 − r)·p      constant  1
    s₀ = W (wsd: T − D); (W, D) = the config's schedule clamped to its horizon T (ScheduleConfig.fit)

Step s counts optimizer steps from 0: the loop's step t trains at factor(t − 1). A schedule is its fields
{name, steps (the horizon T), warmup, decay, min_lr_ratio}: the config's over train.steps for a new run; after
a resume, the one the checkpoint's specification carried, continued by the documented rule for a declared
change (optim/schedule.py continued(): a longer run keeps a decaying schedule's horizon).
"""
from __future__ import annotations

import math


def fields(sched_cfg, total_steps: int) -> dict:
    """The schedule the config gives a run of `total_steps` (clamped to it: ScheduleConfig.fit)."""
    warmup, decay = sched_cfg.fit(total_steps)
    return {"name": sched_cfg.name, "steps": int(total_steps), "warmup": warmup, "decay": decay,
            "min_lr_ratio": float(sched_cfg.min_lr_ratio)}


def factor(s: int, f: dict) -> float:
    if s < f["warmup"]:
        return (s + 1) / f["warmup"]
    if f["name"] == "constant":
        return 1.0
    start = f["steps"] - f["decay"] if f["name"] == "wsd" else f["warmup"]
    if s < start:
        return 1.0
    p = min(max((s - start + 1) / f["decay"], 0.0), 1.0)
    r = f["min_lr_ratio"]
    if f["name"] == "cosine":
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


def lr_at(cfg, group_name: str, step: int, sched: dict | None = None) -> float:
    """The LR `group_name` trains at in the loop's step `step` (1-based): optim.lr × its lr_scale × the schedule's
    factor (`sched`: the schedule in force, default the config's over train.steps)."""
    sched = sched or fields(cfg.optim.schedule, cfg.train.steps)
    return float(cfg.optim.lr) * group_settings(cfg, group_name)[0] * factor(step - 1, sched)


def continued(saved: dict, cfg, updates: int) -> dict:
    """The schedule a resume after `updates` steps goes on with: the rule optim/schedule.py documents, applied
    to the checkpoint's specification and the config now (a declared optim.schedule change is taken as written)."""
    from optim.schedule import Schedule, continued as rule
    declared = any(str(k).startswith("optim.schedule") for k in (getattr(cfg.resume, "allow_config_change", None)
                                                                 or []))
    now = Schedule.from_record(fields(cfg.optim.schedule, cfg.train.steps))
    chosen, _ = rule(Schedule.from_record(saved), now, updates, declared)
    return {k: getattr(chosen, k) for k in ("name", "steps", "warmup", "decay", "min_lr_ratio")}
