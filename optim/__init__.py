"""Optimizer side of a step: parameter-group contract, AdamW, lr schedules, global-norm clipping."""

from optim.adamw import build_optimizer
from optim.clip import clip_grad_norm
from optim.groups import build_param_groups, format_table, param_kinds
from optim.schedule import build_scheduler, lr_factor

__all__ = ["build_optimizer", "build_param_groups", "build_scheduler", "clip_grad_norm", "format_table",
           "lr_factor", "param_kinds"]
