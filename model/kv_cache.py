"""The KV cache of autoregressive decoding (model/generate.py): per layer, the rotated keys and the values of
every position seen so far, so a new token costs one attention row instead of a forward over the prefix.

    memory per layer = B · T · 2 · n_kv_heads · head_dim · bytes(dtype)   (k and v, T = model.seq_len)

e.g. B=2, T=256, n_kv=4, d_head=32, fp32 → 0.5 MiB a layer. Only attention is cached: the MLP (dense or
MoE) acts on each token alone. The model's own forward reads it (Transformer.forward(cache=...)): the
block and its attention are the ones training runs, given a layer's view (`layer(i)`) to extend and read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class KVCache:
    k_LBKTd: list[Tensor]  # per layer (B, n_kv, T_max, d_head), rotated keys
    v_LBKTd: list[Tensor]
    length: int = 0        # positions filled (the forward that fills more advances it)

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

    def layer(self, i: int) -> "LayerKV":
        return LayerKV(self, i)


@dataclass
class LayerKV:
    """One layer's part of the cache, as its attention sees it."""
    cache: KVCache
    i: int

    def extend(self, k_BKTd: Tensor, v_BKTd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Store the keys and values of the new positions [length, length + T); returns every key and value
        so far, (B, K, length + T, d), and the causal mask (T, length + T): new query t, at absolute
        position length + t, sees the keys s <= length + t."""
        p0, T = self.cache.length, k_BKTd.shape[2]
        k_all, v_all = self.cache.k_LBKTd[self.i], self.cache.v_LBKTd[self.i]
        k_all[:, :, p0:p0 + T] = k_BKTd
        v_all[:, :, p0:p0 + T] = v_BKTd
        dev = k_BKTd.device
        mask_TS = torch.arange(p0 + T, device=dev) <= (p0 + torch.arange(T, device=dev))[:, None]
        return k_all[:, :, :p0 + T], v_all[:, :, :p0 + T], mask_TS
