"""Autoregressive decoding for a trained Transformer: a KV cache, and temperature / top-k / top-p sampling.

The KV cache keeps, per layer, the rotated keys and the values of every position seen so far, so a new
token costs one attention row instead of a forward over the whole prefix:

    memory per layer = B · T · 2 · n_kv_heads · head_dim · bytes(dtype)   (k and v, T = model.seq_len)

e.g. B=2, T=256, n_kv=4, d_head=32, fp32 → 0.5 MiB a layer. Only attention is cached: the MLP (dense or
MoE) acts on each token alone, so an MoE layer routes the new token exactly as a full forward would
(routing is per token; the balancing bias is fixed at inference) and needs no cache of its own.

Past model.seq_len the RoPE tables end; like nanoGPT the context is cropped to the last seq_len
tokens. NOTE: a cropped window shifts every position, so the cache cannot be reused: each token past
the window is one full forward of seq_len tokens (exactly what the uncached path computes). A sliding
cache would need keys re-rotated to new positions; not worth it for a sampling script.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from model.rope import apply_rope
from model.moe import MoE


@dataclass
class KVCache:
    k_LBKTd: list[Tensor]  # per layer (B, n_kv, T_max, d_head), rotated keys
    v_LBKTd: list[Tensor]
    length: int = 0        # positions filled

    @classmethod
    def empty(cls, model, batch: int, dtype: torch.dtype | None = None) -> "KVCache":
        cfg = model.cfg
        dev = model.tok_emb.weight.device
        dtype = dtype or model.tok_emb.weight.dtype
        shape = (batch, cfg.kv_heads, cfg.seq_len, cfg.head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=dev) for _ in range(cfg.n_layers)],
                   [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(cfg.n_layers)])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_LBKTd + self.v_LBKTd)


def _attend(attn, x_BTD: Tensor, cos_TF: Tensor, sin_TF: Tensor, cache: KVCache, layer: int) -> Tensor:
    """Attention of the new positions [cache.length, cache.length + T) over the cached prefix and themselves."""
    H, K, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    p0, T = cache.length, x_BTD.shape[1]
    qkv_BTX = rearrange(attn.qkv(x_BTD), "b t (h d) -> b t h d", d=d)
    qk_BTHd = apply_rope(qkv_BTX[:, :, : H + K], cos_TF[p0:p0 + T], sin_TF[p0:p0 + T])
    q_BHTd = rearrange(qk_BTHd[:, :, :H], "b t h d -> b h t d")
    cache.k_LBKTd[layer][:, :, p0:p0 + T] = rearrange(qk_BTHd[:, :, H:], "b t h d -> b h t d")
    cache.v_LBKTd[layer][:, :, p0:p0 + T] = rearrange(qkv_BTX[:, :, H + K:], "b t h d -> b h t d")
    k_BKSd = cache.k_LBKTd[layer][:, :, :p0 + T]
    v_BKSd = cache.v_LBKTd[layer][:, :, :p0 + T]
    # new query t (absolute p0 + t) sees keys s <= p0 + t
    mask_TS = torch.arange(p0 + T, device=x_BTD.device) <= (p0 + torch.arange(T, device=x_BTD.device))[:, None]
    y_BHTd = F.scaled_dot_product_attention(q_BHTd, k_BKSd, v_BKSd, attn_mask=mask_TS, enable_gqa=K != H)
    return attn.proj_out(rearrange(y_BHTd, "b h t d -> b t (h d)"))


@torch.no_grad()
def forward_cached(model, tokens_BT: Tensor, cache: KVCache) -> Tensor:
    """Logits (B, T, V) of `tokens_BT` placed after the cached prefix; appends their keys and values."""
    if cache.length + tokens_BT.shape[1] > model.cfg.seq_len:
        raise ValueError(f"KV cache: {cache.length} + {tokens_BT.shape[1]} positions > model.seq_len={model.cfg.seq_len}")
    x_BTD = model.tok_emb(tokens_BT)
    for i, block in enumerate(model.blocks):
        x_BTD = x_BTD + _attend(block.attn, block.attn_norm(x_BTD), model.rope_cos, model.rope_sin, cache, i)
        h_BTD = block.mlp_norm(x_BTD)
        x_BTD = x_BTD + (block.mlp(h_BTD).y if isinstance(block.mlp, MoE) else block.mlp(h_BTD))
    cache.length += tokens_BT.shape[1]
    return model.head(model.norm(x_BTD))


def pick(logits_BV: Tensor, temperature: float, top_k: int | None, top_p: float | None,
         generator: torch.Generator | None) -> Tensor:
    """Next ids (B,): argmax at temperature 0; otherwise a draw from softmax(logits / temperature)
    restricted to the top_k largest and to the smallest set whose probability reaches top_p."""
    if temperature == 0:
        return logits_BV.argmax(-1)
    logits_BV = logits_BV.float() / temperature
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
        cum_BV = sorted_BV.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop_BV = (cum_BV - sorted_BV.softmax(-1)) >= top_p
        logits_BV = logits_BV.scatter(-1, order_BV, sorted_BV.masked_fill(drop_BV, float("-inf")))
    probs_BV = logits_BV.softmax(-1)
    # NOTE: the draw happens on the CPU generator, so a seed gives the same ids on any device.
    return torch.multinomial(probs_BV.cpu(), 1, generator=generator).squeeze(-1).to(logits_BV.device)


@torch.no_grad()
def generate(model, prompt_BT: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0, use_cache: bool = True) -> Tensor:
    """prompt followed by max_new_tokens sampled ids, (B, T + max_new_tokens). Deterministic for a seed."""
    if temperature < 0:
        raise ValueError(f"--temperature={temperature}: must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"--top-k={top_k}: must be >= 1")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"--top-p={top_p}: must be in (0, 1]")
    if prompt_BT.shape[1] < 1:
        raise ValueError("prompt: needs at least one token")
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    T_max = model.cfg.seq_len
    out_BT = prompt_BT
    cache = KVCache.empty(model, prompt_BT.shape[0]) if use_cache else None
    for _ in range(max_new_tokens):
        window_BT = out_BT[:, -T_max:]
        if cache is not None and out_BT.shape[1] <= T_max:
            # prefill the prompt once, then one new position per step
            new_BT = out_BT[:, cache.length:]
            logits_BV = forward_cached(model, new_BT, cache)[:, -1]
        else:
            logits_BV = model(window_BT).logits[:, -1]
        out_BT = torch.cat([out_BT, pick(logits_BV, temperature, top_k, top_p, gen)[:, None]], dim=1)
    return out_BT
