"""Rotary position embedding and causal grouped-query self-attention."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from model.config import ModelConfig


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


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=False)
        self.proj_out = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)

    def init_weights(self, std: float, resid_std: float) -> None:
        nn.init.normal_(self.qkv.weight, std=std)
        nn.init.normal_(self.proj_out.weight, std=resid_std)  # writes into the residual stream

    def forward(self, x_BTD: Tensor, cos_TF: Tensor, sin_TF: Tensor) -> Tensor:
        H, K = self.n_heads, self.n_kv_heads
        qkv_BTX = rearrange(self.qkv(x_BTD), "b t (h d) -> b t h d", d=self.head_dim)
        # NOTE: q and k share one RoPE call (their heads are adjacent in the fused projection).
        qk_BTHd = apply_rope(qkv_BTX[:, :, : H + K], cos_TF, sin_TF)
        q_BHTd = rearrange(qk_BTHd[:, :, :H], "b t h d -> b h t d")
        k_BKTd = rearrange(qk_BTHd[:, :, H:], "b t h d -> b h t d")
        v_BKTd = rearrange(qkv_BTX[:, :, H + K:], "b t h d -> b h t d")
        # NOTE: enable_gqa lets SDPA share each kv head across n_heads/n_kv_heads query heads
        # without materialising the repeated k, v.
        y_BHTd = F.scaled_dot_product_attention(q_BHTd, k_BKTd, v_BKTd, is_causal=True, enable_gqa=K != H)
        return self.proj_out(rearrange(y_BHTd, "b h t d -> b t (h d)"))
