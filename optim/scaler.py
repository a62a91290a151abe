"""Dynamic loss scaling for FP16: keep small gradients above FP16's underflow, back off on overflow.

FP16 has 5 exponent bits: its smallest normal is 2^-14 and its largest finite value 65504, so the
gradients of a loss averaged over thousands of tokens underflow to zero. Back-propagating S·L instead of
L moves every gradient up by log2(S) binades; the optimizer must see g = ∇(S·L)/S.

    overflow (any non-finite gradient on any rank):  skip the step,  S ← max(S · backoff, min_scale)
    `growth_interval` finite steps in a row:          S ← S · growth

NOTE: S stays a power of two when init, growth and backoff are (the defaults): then ×S and ×1/S are
exact in floating point and the unscaled gradient is bit-identical to the unscaled-loss gradient
wherever neither over- nor underflowed.
The step order that uses this class lives in precision/step.py (unscale → agreed finite check → clip →
step or skip → update).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from optim.config import LossScaleConfig


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0):
        LossScaleConfig(init_scale, growth_factor, backoff_factor, growth_interval, min_scale)  # the schema's checks
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.min_scale = growth_interval, float(min_scale)
        self.good_steps = 0     # finite steps since the last change of scale
        self.skipped_steps = 0  # overflow steps over the whole run

    @torch.no_grad()
    def unscale_(self, params: Iterable[torch.Tensor]) -> None:
        """g ← g / S in place, on every gradient (a DTensor's local shard included)."""
        grads = [p.grad for p in params if p.grad is not None]
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, found_inf: bool) -> None:
        """After the step: back off (and count a skip) on overflow, grow after a clean interval."""
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            # WARN: no upper bound on purpose: the next overflow halves it again; capping it would hide
            # a run whose gradients keep shrinking.
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self.good_steps = float(sd["scale"]), int(sd["good_steps"])
        self.skipped_steps = int(sd["skipped_steps"])
