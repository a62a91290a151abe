"""Autoregressive decoding for a trained Transformer: a KV cache, and temperature / top-k / top-p sampling.

The KV cache (model/kv_cache.py) keeps, per layer, the rotated keys and the values of every position seen so
far, so a new token costs one attention row instead of a forward over the whole prefix. The cached forward is
the model's own (Transformer.forward(cache=...)): the same blocks, the same attention, so every model option
decodes as it trains (tests/test_sample.py runs each). An MoE layer routes the new token exactly as a full
forward would (routing is per token; the balancing bias is fixed at inference) and needs no cache of its own.

Past model.seq_len the RoPE tables end; like nanoGPT the context is cropped to the last seq_len
tokens. NOTE: a cropped window shifts every position, so the cache cannot be reused: each token past
the window is one full forward of seq_len tokens (exactly what the uncached path computes). A sliding
cache would need keys re-rotated to new positions; not worth it for a sampling script.
"""
from __future__ import annotations

import torch
from torch import Tensor

from model.kv_cache import KVCache


@torch.no_grad()
def forward_cached(model, tokens_BT: Tensor, cache: KVCache) -> Tensor:
    """Logits (B, T, V) of `tokens_BT` placed after the cached prefix; appends their keys and values."""
    return model(tokens_BT, cache=cache).logits


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
