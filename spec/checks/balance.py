"""balance: each MoE layer's aux-loss-free balancing bias followed its rule (DeepSeek-V3 §2.1.2):

    b' = b + γ·sign(mean(load) − load)      with the step's global loads, γ = model.moe.bias_update_speed

from the bias the previous step left, unchanged on a skipped step. FP32 arithmetic: 4·u32 of the terms'
magnitude is the tolerance.
"""
from __future__ import annotations

import torch

from spec.check import AFTER, STEP, UPDATE, Check, Kind, on_device
from spec.tolerance import U32


class BalanceCheck(Check):
    name, layer, cadence, phase = "balance", UPDATE, STEP, AFTER
    rank = 55
    doc = "each MoE layer's balancing bias against b + γ·sign(mean(load) − load) from the step's loads"
    kinds = {"rule": Kind("moe.balancing", "the named MoE layer's balancing bias did not follow its rule")}

    @classmethod
    def applies(cls, ctx) -> bool:
        return bool(ctx.model.moe_layers())

    def __init__(self, ctx):
        super().__init__(ctx)
        self.layers = ctx.model.moe_layers()
        self.where = [f"moe{i}" for i, _ in self.layers]
        self.start: dict[int, torch.Tensor] | None = None

    def before_batch(self, s) -> None:
        if self.start is None:
            self.start = {i: m.bias_E.detach().double().clone() for i, m in self.layers}

    def end_step(self, s) -> None:
        coef_dev = self.ctx.coef_spec.device
        skipped = ~self.ctx.norm_finite | on_device(bool(s.vetoed), coef_dev, torch.bool)
        errs, tols = [], []
        for i, m in self.layers:
            b0, b1 = self.start[i], m.bias_E.detach().double()
            gamma = float(self.ctx.cfg.model.moe.bias_update_speed)
            load = s.loads[i].double().to(b0.device)
            want = b0 + gamma * torch.sign(load.mean() - load) if gamma else b0
            want = torch.where(skipped.to(b0.device), b0, want)
            err = (b1 - want).abs()
            tol = 4 * U32 * (b0.abs() + gamma) + 1e-300
            j = (err / tol).argmax().reshape(1)  # index_select: a 0-d index tensor is read to the host
            errs.append(err.index_select(0, j)[0])
            tols.append(tol.index_select(0, j)[0])
        self.measure(torch.stack(errs), torch.stack(tols), "rule", where=self.where)
        self.start = {i: m.bias_E.detach().double().clone() for i, m in self.layers}

    def rolled_back(self, cursor: int) -> None:
        self.start = None

    def load_state_dict(self, sd: dict) -> None:
        self.start = None
