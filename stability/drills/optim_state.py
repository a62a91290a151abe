"""optim_state: right after the optimizer step s, Adam's second moment v (exp_avg_sq) is zeroed or scaled.

With v := 0 the next update's denominator is √((1−β2)·g²/(1−β2^t)) instead of ≈ rms(g): the update
grows ~1/√(1−β2) (4.5× at β2=0.95), and to m̂/ε wherever the next gradient is 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from run.config_errors import check, choice
from stability.drills.base import ONE_SHOT, Drill


@dataclass
class Config:
    mode: str = "zero"        # zero: v := 0 | scale: v := v × scale
    scale: float = 1e-6       # mode=scale only
    param: str | None = None  # a parameter-name substring (e.g. blocks.1.mlp) or null for all

    def __post_init__(self) -> None:
        choice("mode", self.mode, ("zero", "scale"))
        check(math.isfinite(self.scale) and self.scale > 0, "scale", self.scale, "must be > 0")
        check(self.param is None or self.param != "", "param", repr(self.param),
              "expected a parameter-name substring or null")


class OptimState(Drill):
    kind = "optim_state"
    expects = "optim.state"
    lifetime = ONE_SHOT
    points = ("after_update",)
    Config = Config

    def check(self) -> None:
        sub = self.cfg.param
        if sub and not any(sub in n for n, _ in self.ctx.model.named_parameters()):
            raise ValueError(f"{self.key('param')}={sub}: matches no parameter name")

    @torch.no_grad()
    def after_update(self, s) -> None:
        if self.fired or s.step != self.s:
            return
        self.fired = True
        names = {id(p): n for n, p in self.ctx.model.named_parameters()}
        mode, scale, sub = self.cfg.mode, self.cfg.scale, self.cfg.param
        tensors = elements = 0
        for p, st in self.ctx.optimizer.state.items():
            v = st.get("exp_avg_sq")
            if v is None or (sub and sub not in names.get(id(p), "")):
                continue
            if mode == "zero":
                v.zero_()
            else:
                v.mul_(scale)
            tensors, elements = tensors + 1, elements + v.numel()
        self.emit(s.step, mode=mode, scale=scale if mode == "scale" else None, param=sub,
                  tensors=tensors, elements=elements)
