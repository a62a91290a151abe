"""Optimizer side of a step: parameter-group contract, AdamW, lr schedules, global-norm clipping.

NOTE: the names below load on first use (PEP 562 module __getattr__), because importing any submodule
runs this file first: the schedule (optim/schedule.py) and the schema (optim/config.py) are plain
arithmetic that the doctor imports without torch.
"""
from importlib import import_module

_HOME = {"build_optimizer": "optim.adamw", "clip_grad_norm": "optim.clip", "build_param_groups": "optim.groups",
         "format_table": "optim.groups", "param_kinds": "optim.groups", "build_scheduler": "optim.schedule",
         "lr_factor": "optim.schedule"}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'optim' has no attribute {name!r}")
    return getattr(import_module(_HOME[name]), name)
