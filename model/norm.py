"""RMSNorm (Zhang & Sennrich 2019) with its gradient written out: the same module as nn.RMSNorm (its weight,
eps, state dict and isinstance), a shorter step.

    r = 1/√(mean_d(x²) + ε)      y = x·r·g                                   (per row of D features)
    ∂L/∂g = Σ_rows dy·x·r
    ∂L/∂x = r·(dy·g) − x·r³·mean_d(dy·g·x)      (the chain rule through r: ∂r/∂x = −r³·x/D)

Autograd differentiates torch.rms_norm op by op (a power, a mean, a reciprocal square root, two products, each
a pass over the activations with its own buffer, and their backwards); here the forward is three passes, r (one
number a row) is kept for the backward, and both row sums of the backward, Σ_d dy·g·x and Σ_rows dy·x·r, are
matrix-vector products of the one product P = dy·x: ∂L/∂g = Pᵀ·r and mean_d(dy·g·x) = P·g / D.

Under torch.compile the plain expression is used instead: inductor fuses it into one kernel each way. The sums
run in at least FP32 (a BF16 q or k under autocast is normed in FP32 and cast back, as torch.rms_norm does);
tests/test_model_kernels.py holds it to torch.rms_norm and to finite differences in FP64.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from model.rope import at_least_fp32


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, g: Tensor, eps: float) -> Tensor:
        D = x.shape[-1]
        dtype = at_least_fp32(torch.promote_types(x.dtype, g.dtype))
        x_ND = rearrange(x, "... d -> (...) d").to(dtype)
        # mean(x²) as ‖x‖²/D: one pass over the row, not a square then a mean
        r_N1 = torch.linalg.vector_norm(x_ND, dim=-1, keepdim=True).square_().div_(D).add_(eps).rsqrt_()
        y_ND = (x_ND * g.to(dtype)).mul_(r_N1)
        ctx.save_for_backward(x, g, r_N1)
        return y_ND.to(x.dtype).view(x.shape)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, g, r_N1 = ctx.saved_tensors
        D, dtype = x.shape[-1], r_N1.dtype
        x_ND = rearrange(x, "... d -> (...) d").to(dtype)
        dy_ND = rearrange(dy, "... d -> (...) d").to(dtype)
        g_D = g.to(dtype)
        P_ND = dy_ND * x_ND
        dg_D = P_ND.T @ r_N1[:, 0]                        # Σ_rows dy·x·r
        k_N1 = (P_ND @ g_D)[:, None].mul_(r_N1.pow(3)).div_(D)  # r³·mean_d(dy·g·x)
        dx_ND = (dy_ND * g_D).mul_(r_N1).addcmul_(x_ND, k_N1, value=-1)
        return dx_ND.to(x.dtype).view(x.shape), dg_D.to(g.dtype), None


def rms_norm(x: Tensor, g: Tensor, eps: float) -> Tensor:
    """x·g/√(mean(x²) + ε) over the last dimension."""
    if torch.compiler.is_compiling():
        return F.rms_norm(x, (x.shape[-1],), g, eps)
    return _RMSNorm.apply(x, g, eps)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm over the last dimension, with a gain, through rms_norm above."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, torch.finfo(x.dtype).eps if self.eps is None else self.eps)
