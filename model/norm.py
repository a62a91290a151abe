"""RMSNorm (Zhang & Sennrich 2019) with its backward written out: y = x · r · w, r = 1/sqrt(mean(x²) + ε).

torch's RMSNorm on a CPU is composed of pow, mean, add, rsqrt and two multiplies, and autograd walks back
through each of them (seven nodes, most writing a tensor the size of the activations). In closed form, with
g the incoming gradient and D the normalised width:

    ∂L/∂w = Σ_rows r · (g ⊙ x)
    ∂L/∂x = r · (g ⊙ w) − x · r³ · ⟨g ⊙ x, w⟩ / D        (the component along x removed, then scaled)

g ⊙ x is written once; both reductions of it are matrix-vector products, which read it without writing
anything. The forward is torch's composite op for op (the same bits: a Hugging Face Qwen3 norm computes
them too); the gradient is the same math in another order, so it differs from autograd's in the last bits
(labs/gradients.py checks it against finite differences in float64).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from model.rope import at_least_fp32


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.to(at_least_fp32(x.dtype))  # a low-precision residual stream is normalised in fp32
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(xf, r, weight)  # x itself: the residual stream keeps it alive anyway
        ctx.x_dtype = x.dtype
        return (xf * r).mul_(weight).to(x.dtype)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, r, weight = ctx.saved_tensors
        g = g.to(x.dtype)
        gx = g * x
        w = weight.to(x.dtype)
        # ⟨g ⊙ x, w⟩ per row; one gain (D,): a matrix-vector product, read without writing
        dot = (gx @ w if w.dim() == 1 else (gx * w).sum(-1)).unsqueeze(-1)
        dx = (g * w).mul_(r).addcmul_(x, r.pow(3) * dot, value=-1.0 / x.shape[-1])
        dw = None
        if ctx.needs_input_grad[1]:  # Σ_rows r · (g ⊙ x), summed to the gain's shape
            dw = ((r.reshape(1, -1) @ gx.reshape(-1, x.shape[-1])).reshape(weight.shape) if w.dim() == 1
                  else (gx * r).sum_to_size(weight.shape))
            dw = dw.to(weight.dtype)
        return dx.to(ctx.x_dtype), dw, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x², last dim) + eps) · weight, weight of shape (x.shape[-1],) or one gain per row of a
    trailing block (e.g. (heads, head_dim): QK-norm's q and k heads in one call)."""
    if torch.compiler.is_compiling():  # inductor fuses the plain ops (and derives their backward) itself
        xf = x.to(at_least_fp32(x.dtype))
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)
    return _RMSNormFn.apply(x, weight, eps)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (its parameter, init and repr) computed by rms_norm."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, torch.finfo(at_least_fp32(x.dtype)).eps if self.eps is None else self.eps)
