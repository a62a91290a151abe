"""nan_activation: NaN / inf written into a few positions of blocks[layer].{attn,mlp}'s output on the
training forward of step s. The first non-finite activation in the step record names the layer."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from model.moe import MoEOutput
from run.config_errors import check, choice
from stability.drills.base import ONE_SHOT, Drill

NAN_VALUES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


@dataclass
class Config:
    layer: int = 0          # model.blocks[layer]
    sublayer: str = "mlp"   # attn | mlp (an MoE layer's output .y)
    value: str = "nan"      # nan | inf | -inf
    positions: int = 4      # token positions 0..positions-1 of the first sample

    def __post_init__(self) -> None:
        check(self.layer >= 0, "layer", self.layer, "must be >= 0")
        choice("sublayer", self.sublayer, ("attn", "mlp"))
        self.value = str(self.value).lower()  # str(float("-inf")) == "-inf"
        check(self.value in NAN_VALUES, "value", repr(self.value), "expected one of nan, inf, -inf")
        check(self.positions >= 1, "positions", self.positions, "must be >= 1")


class NanActivation(Drill):
    kind = "nan_activation"
    expects = "numerics.nonfinite"
    lifetime = ONE_SHOT
    points = ("before_forward",)
    Config = Config

    def __init__(self, cfg, step, ctx):
        super().__init__(cfg, step, ctx)
        self.step = 0
        self._handle = None  # the armed forward hook

    def check(self) -> None:
        n = len(self.ctx.model.blocks)
        if self.cfg.layer >= n:
            raise ValueError(f"{self.key('layer')}={self.cfg.layer}: the model has {n} blocks")

    def before_forward(self, s) -> None:
        self.step = s.step
        if self._handle is not None:  # armed at an earlier step whose training forward never ran
            self._handle.remove()
            self._handle = None
        if self.fired or s.step != self.s:
            return
        self.fired = True  # NOTE: fired in wall-clock time when armed: a rollback never re-arms it
        module = getattr(self.ctx.model.blocks[self.cfg.layer], self.cfg.sublayer)
        # prepend: hooks registered earlier (telemetry) already see the bad output
        self._handle = module.register_forward_hook(self._hook, prepend=True)

    def _hook(self, module, args, output):
        if not torch.is_grad_enabled():  # a routing-only or eval forward: wait for the training one
            return None
        self._handle.remove()
        self._handle = None
        c = self.cfg
        y_BTD = (output.y if isinstance(output, MoEOutput) else output).clone()
        k = min(c.positions, y_BTD.shape[1])
        y_BTD[0, :k] = NAN_VALUES[c.value]  # positions 0..k-1 of sample 0 always hold labels
        self.emit(self.step, layer=c.layer, sublayer=c.sublayer, value=c.value, positions=k)
        return output._replace(y=y_BTD) if isinstance(output, MoEOutput) else y_BTD
