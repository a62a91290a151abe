"""Causal grouped-query self-attention (GQA) with RoPE on q and k (model/rope.py), optional QK-norm, and
the per-head max-logit probe."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from model.config import ModelConfig
from model.kv_cache import LayerKV
from model.norm import RMSNorm
from model.rope import apply_rope


def head_logit_max(q_BHTd: Tensor, k_BKTd: Tensor) -> Tensor:
    """(H,) float32: max over batch and causal pairs (s ≤ t) of the pre-softmax logit q_t·k_s/√d, per
    query head. GQA: query head h reads kv head h // (H/K), as SDPA's enable_gqa does.

    NOTE: the max is taken before the 1/√d scale: rounding is monotone, so max(fl(c·s)) = fl(c·max(s))
    for c > 0, bit for bit, and the scale touches H numbers instead of every score.
    """
    K, d = k_BKTd.shape[1], q_BHTd.shape[-1]
    q_BKGTd = rearrange(q_BHTd.float(), "b (k g) t d -> b k g t d", k=K)
    s_BKGTS = torch.einsum("bkgtd,bksd->bkgts", q_BKGTd, k_BKTd.float())
    T, dev = s_BKGTS.shape[-1], s_BKGTS.device
    m_KG = None
    if dev.type == "cpu" and not torch.compiler.is_compiling():
        # NOTE: a boolean masked_fill is not vectorised on a CPU, an add is. Adding −0.0 leaves every
        # value as it is (−0 too) and −inf masks a future score, unless that score is +inf or NaN: then the
        # max is non-finite and the masked_fill below decides, as it always does off the CPU (the check
        # reads a number back: a device sync per layer there). Out of place: under selective activation
        # checkpointing the matmul's output is a cached tensor that must not be mutated.
        m_KG = (s_BKGTS + _causal_bias(T)).amax(dim=(0, 3, 4))
        if not bool(torch.isfinite(m_KG).all()):
            m_KG = None
    if m_KG is None:
        future_TS = torch.ones(T, T, dtype=torch.bool, device=dev).triu(1)
        m_KG = s_BKGTS.masked_fill(future_TS, -torch.inf).amax(dim=(0, 3, 4))
    return rearrange(m_KG, "k g -> (k g)") * d ** -0.5


_CAUSAL_BIAS: dict[int, Tensor] = {}


def _causal_bias(T: int) -> Tensor:
    """(T, T) float32 on the CPU: −0.0 where s ≤ t, −inf where s > t (cached per T)."""
    bias = _CAUSAL_BIAS.get(T)
    if bias is None:
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        bias = _CAUSAL_BIAS[T] = torch.full((T, T), -0.0).masked_fill_(future, -torch.inf)
    return bias


class Attention(nn.Module):
    """Causal GQA self-attention with RoPE and optional QK-norm.

    QK-norm (model.qk_norm): RMSNorm over head_dim of each q head and each k head, before RoPE, with one
    gain vector for q and one for k shared by all heads (Qwen3 / Gemma 3 placement).
    NOTE: per head rather than OLMo 2's norm over the whole q (and k) projection: a whole-projection
    norm couples the heads (one head's large q shrinks every other head's), and per head the logit of
    head h is bounded by |g_q|·|g_k|·√d_head on its own — the same per-head quantity QK-clip controls.
    Before RoPE because RoPE is a rotation: it keeps the normalised norms, and the norm then sees the
    projection's raw output as its gain was meant to scale.

    Logit probe: with `probe_logits = True`, every grad-enabled forward folds the per-head max logit of
    its FIRST sequence into `logit_max_H` (telemetry: one B-th of the QKᵀ matmul, from the q and k the
    forward computed anyway; bench/speed/attn_logit_probe.py measures it).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=False)
        self.proj_out = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.probe_logits = False
        self.causal = True  # False lets every position attend to the future (a fault drill: causal_leak)
        self._logit_parts: list[Tensor] = []  # one (H,) max per probed forward

    def init_weights(self, std: float, resid_std: float) -> None:
        nn.init.normal_(self.qkv.weight, std=std)
        nn.init.normal_(self.proj_out.weight, std=resid_std)  # writes into the residual stream
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()

    def qkv_row_splits(self) -> list[int]:
        """Rows of qkv.weight that are q, k and v (Muon orthogonalises each separately)."""
        H, K, d = self.n_heads, self.n_kv_heads, self.head_dim
        return [H * d, K * d, K * d]

    def qk(self, x_BTD: Tensor, cos_TF: Tensor, sin_TF: Tensor, qkv_BTX: Tensor | None = None):
        """(q (B, H, T, d), k (B, K, T, d), v (B, K, T, d)): normed (QK-norm) and rotated q, k."""
        H, K = self.n_heads, self.n_kv_heads
        if qkv_BTX is None:
            qkv_BTX = rearrange(self.qkv(x_BTD), "b t (h d) -> b t h d", d=self.head_dim)
        # NOTE: split, never slices: a slice's backward writes its gradient into a zero-filled buffer of
        # the whole input and the slices' buffers are then added; split's backward is one concatenation.
        qk_BTHd, v_BTKd = qkv_BTX.split([H + K, K], dim=2)
        if self.q_norm is not None:
            q_BTHd, k_BTKd = qk_BTHd.split([H, K], dim=2)
            qk_BTHd = torch.cat([self.q_norm(q_BTHd), self.k_norm(k_BTKd)], dim=2)
        # NOTE: q and k share one RoPE call (their heads are adjacent in the fused projection).
        q_BTHd, k_BTKd = apply_rope(qk_BTHd, cos_TF, sin_TF).split([H, K], dim=2)
        q_BHTd = rearrange(q_BTHd, "b t h d -> b h t d")
        k_BKTd = rearrange(k_BTKd, "b t h d -> b h t d")
        v_BKTd = rearrange(v_BTKd, "b t h d -> b h t d")
        return q_BHTd, k_BKTd, v_BKTd

    @property
    def logit_max_H(self) -> Tensor | None:
        """(H,) largest pre-softmax logit per head over the forwards probed since the last reset."""
        return torch.stack(self._logit_parts).amax(0) if self._logit_parts else None

    @logit_max_H.setter
    def logit_max_H(self, value: Tensor | None) -> None:  # None resets the probe
        self._logit_parts = [] if value is None else [value]

    def forward(self, x_BTD: Tensor, cos_TF: Tensor, sin_TF: Tensor, kv: LayerKV | None = None) -> Tensor:
        """kv: this layer's KV cache (decoding, model/kv_cache.py): x holds the positions after the cached
        ones, cos/sin start at the first of them; their keys and values join the cache, and each query
        attends to the cached prefix and to itself and the new positions before it (a causal model)."""
        H, K = self.n_heads, self.n_kv_heads
        q_BHTd, k_BKTd, v_BKTd = self.qk(x_BTD, cos_TF, sin_TF)
        if self.probe_logits and torch.is_grad_enabled():
            with torch.no_grad():
                m_H = head_logit_max(q_BHTd[:1], k_BKTd[:1])
            # NOTE: appended, folded only when read: the same ops run whatever came before, so an activation
            # checkpoint's recompute replays this forward op for op (a recomputed forward appends its max
            # again; the max of a repeated value is the value)
            self._logit_parts.append(m_H)
        # NOTE: enable_gqa lets SDPA share each kv head across n_heads/n_kv_heads query heads
        # without materialising the repeated k, v.
        if kv is None:
            y_BHTd = F.scaled_dot_product_attention(q_BHTd, k_BKTd, v_BKTd, is_causal=self.causal, enable_gqa=K != H)
        else:
            k_BKSd, v_BKSd, mask_TS = kv.extend(k_BKTd, v_BKTd)
            y_BHTd = F.scaled_dot_product_attention(q_BHTd, k_BKSd, v_BKSd, attn_mask=mask_TS, enable_gqa=K != H)
        return self.proj_out(rearrange(y_BHTd, "b h t d -> b t (h d)"))
