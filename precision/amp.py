"""torch.autocast recipes: BF16, and FP16 with dynamic loss scaling. FP32 master weights in both.

Under autocast, matmuls (nn.Linear, F.linear, SDPA) take low-precision copies of their inputs and
weights; the parameters, their .grad and the AdamW moments stay FP32. Some paths opt out in the model
itself: the MoE router (autocast off: a BF16 near-tie flips the top-k), RoPE and the loss (upcast to
FP32 before logsumexp), the MoE combine (summed in FP32).
"""
from __future__ import annotations

import torch
from torch import nn

from optim.scaler import DynamicLossScaler
from precision.recipe import SHORT, Recipe, mixed_precision_policy, module_roles, scaler_from_cfg
from precision.step import UPDATE_ORDER
from precision.table import ModuleDecision


class AmpRecipe(Recipe):
    dtype = torch.bfloat16

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype)

    def fsdp_policy(self):
        # NOTE: reduce in FP32: a BF16 reduce-scatter over many ranks rounds every partial sum.
        return mixed_precision_policy(self.dtype, torch.float32)

    def decide(self, model: nn.Module) -> list[ModuleDecision]:
        lp = SHORT[self.dtype]
        why = {
            "embedding": ("fp32", "a lookup: autocast leaves it alone"),
            "head": (f"{lp} matmul", f"autocast; logits are upcast to fp32 before logsumexp (model/loss.py)"),
            "router": ("fp32", "model/moe.py runs the router with autocast off (top-k near-ties)"),
            "norm": ("fp32", "rms_norm is not on autocast's low-precision list; the residual stream is fp32"),
            "attention": (f"{lp} inputs", "autocast casts SDPA inputs; softmax statistics in fp32 inside the kernel"),
            "experts": (f"{lp} matmul", "F.linear under autocast"),
            "linear": (f"{lp} matmul", "autocast"),
        }
        return [ModuleDecision(n, type(m).__name__, *why[role]) for n, m, role in module_roles(model)]

    def rows(self) -> dict[str, str]:
        lp = SHORT[self.dtype]
        return {**super().rows(),
                "matmul inputs": f"{lp} (torch.autocast casts inputs and a per-forward copy of the weights)",
                "accumulation": f"fp32 inside the GEMM; outputs rounded to {lp}",
                "activations": f"{lp} matmul outputs; residual stream fp32 (fp32 embedding + {lp} branch promotes)",
                "master weights": "fp32"}


class Bf16Recipe(AmpRecipe):
    name = "bf16"
    dtype = torch.bfloat16

    def notes(self) -> list[str]:
        extra = ["bf16 autocast on CPU is ~30× slower than fp32 on this machine class"] if self.device.type == "cpu" else []
        return super().notes() + extra


class Fp16Recipe(AmpRecipe):
    name = "fp16"
    dtype = torch.float16

    def __init__(self, cfg, device="cpu"):
        super().__init__(cfg, device)
        self._scaler_cfg = cfg["loss_scale"]

    def make_scaler(self) -> DynamicLossScaler:
        return scaler_from_cfg(self._scaler_cfg)

    def rows(self) -> dict[str, str]:
        s = scaler_from_cfg(self._scaler_cfg)
        return {**super().rows(),
                "gradients": "fp16 inside backward (scaled by S), fp32 .grad; unscaled (÷S) before any use",
                "loss scaling": (f"dynamic: S0={s.scale:g}, ×{s.growth_factor:g} after {s.growth_interval} "
                                 f"finite steps, ×{s.backoff_factor:g} and skip on overflow (agreed by all ranks); "
                                 f"order: {UPDATE_ORDER}")}
