"""Every random stream a rank owns: Python, NumPy, torch CPU and each CUDA device.

Nothing in the step draws random numbers today (samples are pure functions of their id, init is
seeded), but dropout, noisy routing or a sampled eval would; resuming must hand them back the
stream they would have continued, or "the same run" silently stops being the same run.
"""
from __future__ import annotations

import random

import numpy as np
import torch


def capture() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # NOTE: only this rank's device (init_distributed made it current), so the state moves with the rank.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
