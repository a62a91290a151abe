"""Rotary position embedding (Su et al. 2021, RoFormer): the angle tables and the rotation of q and k,
and the at-least-fp32 rule they (and the loss and the router) compute in."""
from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """fp32 for low-precision dtypes, unchanged for fp64 (so float64 gradchecks stay exact)."""
    return torch.promote_types(dtype, torch.float32)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (T, head_dim/2): angle(t, i) = t · theta^(-2i/head_dim)."""
    inv_freq_F = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle_TF = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq_F)
    return angle_TF.cos().float(), angle_TF.sin().float()


def apply_rope(x_BTHd: Tensor, cos_TF: Tensor, sin_TF: Tensor) -> Tensor:
    """Rotate each pair (x[2i], x[2i+1]) by the angle t·θ_i: (x[2i] + j·x[2i+1]) · e^{j·t·θ_i}.

    Eager: one complex multiply, a third of the cost of the real-arithmetic form (mul, mul, sub, mul,
    mul, add, stack) forward and backward. Under torch.compile the real form is used instead, because
    inductor cannot generate code for complex ops but fuses the real ones into one kernel.
    NOTE: computed in at least fp32 and cast back: a bf16 angle table loses the position of late tokens.
    """
    T = x_BTHd.shape[1]
    dtype = at_least_fp32(torch.promote_types(x_BTHd.dtype, cos_TF.dtype))
    pairs = rearrange(x_BTHd.to(dtype), "b t h (f two) -> b t h f two", two=2)
    cos_T1F = rearrange(cos_TF[:T].to(dtype), "t f -> t 1 f")
    sin_T1F = rearrange(sin_TF[:T].to(dtype), "t f -> t 1 f")
    if torch.compiler.is_compiling():
        x0, x1 = pairs.unbind(-1)
        out = torch.stack((x0 * cos_T1F - x1 * sin_T1F, x0 * sin_T1F + x1 * cos_T1F), dim=-1)
    else:
        out = torch.view_as_real(torch.view_as_complex(pairs) * torch.complex(cos_T1F, sin_T1F))
    return rearrange(out, "b t h f two -> b t h (f two)").to(x_BTHd.dtype)
