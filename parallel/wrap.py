"""Data-parallel wrapping chosen by config (`parallel.mode`)."""
from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from parallel.dist import Dist

MODES = ("auto", "none", "ddp")


def wrap_model(model: torch.nn.Module, mode: str, dist: Dist) -> torch.nn.Module:
    """Return the module the step calls. `auto` = DDP when there is more than one process.

    NOTE: broadcast_buffers=False. Every buffer is either a constant (RoPE tables) or updated from
    all-reduced statistics (MoE balancing bias), so ranks never disagree and the per-forward broadcast
    would be pure overhead. find_unused_parameters stays off: the MoE layer runs every expert, even on
    zero tokens, so every parameter is in every graph.
    """
    if mode not in MODES:
        raise ValueError(f"parallel.mode={mode}: expected one of {', '.join(MODES)}")
    if mode == "none" or (mode == "auto" and dist.world == 1):
        if dist.world > 1:
            raise ValueError(f"parallel.mode=none with {dist.world} processes: gradients would never be reduced")
        return model
    device_ids = [dist.device.index] if dist.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, broadcast_buffers=False, gradient_as_bucket_view=True)


def no_sync(wrapped: torch.nn.Module, last: bool):
    """Skip DDP's gradient all-reduce on every micro-batch but the last: one reduction per step."""
    if isinstance(wrapped, DDP) and not last:
        return wrapped.no_sync()
    return contextlib.nullcontext()
