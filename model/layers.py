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


def apply_rope(x_BHTd: Tensor, cos_TF: Tensor, sin_TF: Tensor) -> Tensor:
    """Rotate the pairs (x[i], x[i + d/2]) by the position angle ("rotate-half" layout).

    NOTE: computed in at least fp32 and cast back: a bf16 angle table loses the position of late tokens.
    """
    T = x_BHTd.shape[-2]
    dtype = at_least_fp32(torch.promote_types(x_BHTd.dtype, cos_TF.dtype))
    x1, x2 = x_BHTd.to(dtype).chunk(2, dim=-1)
    cos, sin = cos_TF[:T].to(dtype), sin_TF[:T].to(dtype)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x_BHTd.dtype)


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
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x_BTD).split([q_dim, kv_dim, kv_dim], dim=-1)
        q_BHTd = rearrange(q, "b t (h d) -> b h t d", d=self.head_dim)
        k_BKTd = rearrange(k, "b t (h d) -> b h t d", d=self.head_dim)
        v_BKTd = rearrange(v, "b t (h d) -> b h t d", d=self.head_dim)
        q_BHTd, k_BKTd = apply_rope(q_BHTd, cos_TF, sin_TF), apply_rope(k_BKTd, cos_TF, sin_TF)
        # NOTE: enable_gqa lets SDPA share each kv head across n_heads/n_kv_heads query heads
        # without materialising the repeated k, v.
        y_BHTd = F.scaled_dot_product_attention(
            q_BHTd, k_BKTd, v_BKTd, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.proj_out(rearrange(y_BHTd, "b h t d -> b t (h d)"))
