"""QK-clip (Kimi K2's MuonClip, for any optimizer): keep every head's largest attention logit ≤ τ.

After the optimizer step, per layer and query head h, with S_h the largest pre-softmax logit
q_t·k_s/√d (s ≤ t) of head h on the step's batch under the UPDATED weights:

    γ_h = min(1, τ / S_h)
    MHA (a k head per q head):  W_q[h] ← √γ_h · W_q[h],  W_k[h] ← √γ_h · W_k[h]   (Kimi's split)
    GQA (G q heads share k):     W_q[h] ← γ_h · W_q[h],   W_k untouched

so head h's logits scale by exactly γ_h and S_h becomes ≤ τ. NOTE: with GQA a shared k head cannot
take a per-head factor without moving its other G − 1 heads, so the whole factor goes on the q rows —
as Kimi K2 does for the key component MLA shares across heads (its rotary k): heads under τ keep their
weights and logits bit-identical.

How S is measured: one no-grad re-forward of the trunk (blocks only, no output head) on the step's
tokens after the update; at each attention layer a pre-hook computes S_H from that layer's input and
the current W_q, W_k, clips, and lets the layer run with the clipped weights. The layers after it
therefore see the inputs the clipped model produces, and after after_update() every head's logit on
that batch is ≤ τ up to float32 rounding (tests/test_qk_clip.py). Kimi instead reuses S from the step's
own forward (pre-update weights), which is free inside a fused kernel but bounds the previous weights'
logits, not the new ones. Cost here: one forward without backward or head, in float32 (~⅓ of a step).
Under DDP, S_H is MAX-all-reduced so every replica applies the same factors.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from model.attention import head_logit_max
from optim.config import QKClipConfig
from parallel.dist import all_reduce_max

SEQ_CHUNK = 8  # sequences per QKᵀ block: bounds the (chunk, H, T, T) score tensor


class QKClip:
    """model: the bare Transformer (not a DDP wrapper). Call after_update(tokens) after each optimizer step."""

    def __init__(self, model: nn.Module, cfg: QKClipConfig):
        """cfg: optim.qk_clip, checked by the schema (tau > 0 or null)."""
        tau = self.tau = None if cfg.tau is None else float(cfg.tau)
        if self.tau is None:
            raise ValueError("optim.qk_clip.tau=None: build QKClip only when QK-clip is on")
        if getattr(model.cfg, "qk_norm", False):
            raise ValueError(f"optim.qk_clip.tau={tau}: model.qk_norm=true normalises q and k after W_q, W_k, "
                             "so scaling them cannot bound the logit; use one of the two")
        for n, p in model.named_parameters():
            if hasattr(p, "device_mesh"):
                raise ValueError(f"optim.qk_clip.tau={tau}: parameter {n} is sharded (parallel=fsdp); "
                                 "QK-clip supports plain and DDP-replicated models")
        self.model = model
        self.attns = [b.attn for b in model.blocks]
        self._log: dict = {}

    @torch.no_grad()
    def measure(self, tokens: list[Tensor]) -> list[Tensor]:
        """(H,) max logit per layer on `tokens` (a list of (B, T) micro-batches), nothing changed."""
        return self._pass(tokens, clip=False)

    @torch.no_grad()
    def after_update(self, tokens: list[Tensor]) -> dict:
        """Clip every head over τ; returns {"heads_clipped", "factors": {"block{i}.h{h}": γ}, "logit_max":
        {"block{i}": max_h S before the clip}} for the StepRecord."""
        self._log = {"heads_clipped": 0, "factors": {}, "logit_max": {}}
        self._pass(tokens, clip=True)
        return self._log

    def _pass(self, tokens: list[Tensor], clip: bool) -> list[Tensor]:
        m = self.model
        seen: list[Tensor] = []
        hooks = [a.register_forward_pre_hook(self._hook(i, seen, clip)) for i, a in enumerate(self.attns)]
        try:
            # NOTE: all micro-batches as one batch: a clip at layer i then precedes every sequence's pass
            # through the layers after it (per micro-batch, a later clip would change the inputs an
            # earlier micro-batch's deeper layers were measured on).
            x = m.tok_emb(torch.cat(list(tokens)))
            for block in m.blocks:
                x, _ = block(x, m.rope_cos, m.rope_sin, None)
        finally:
            for h in hooks:
                h.remove()
        return seen

    def _hook(self, i: int, seen: list, clip: bool):
        def hook(attn, args):
            x_BTD, cos_TF, sin_TF = args
            S_H = torch.full((attn.n_heads,), -math.inf, device=x_BTD.device)
            for x_bTD in x_BTD.split(SEQ_CHUNK):
                q, k, _ = attn.qk(x_bTD, cos_TF, sin_TF)
                S_H = torch.maximum(S_H, head_logit_max(q, k))
            S_H = all_reduce_max(S_H)
            seen.append(S_H)
            if clip:
                self._clip(i, attn, S_H)
        return hook

    def _clip(self, i: int, attn, S_H: Tensor) -> None:
        H, K, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
        key = f"block{i}"
        self._log["logit_max"][key] = max(self._log["logit_max"].get(key, -math.inf), S_H.max().item())
        over = S_H > self.tau
        if not over.any():
            return
        gamma_H = torch.where(over, self.tau / S_H, torch.ones_like(S_H))
        rows = torch.ones(attn.qkv.weight.shape[0], device=S_H.device)
        if K == H:  # MHA: Kimi's symmetric split
            rows[: H * d] = gamma_H.sqrt().repeat_interleave(d)
            rows[H * d: 2 * H * d] = gamma_H.sqrt().repeat_interleave(d)
        else:  # GQA: the whole factor on the q rows (the k head is shared)
            rows[: H * d] = gamma_H.repeat_interleave(d)
        # NOTE: × 1.0 is exact, so the rows of heads under τ stay bit-identical.
        attn.qkv.weight.mul_(rows.to(attn.qkv.weight.dtype)[:, None])
        for h in over.nonzero().flatten().tolist():
            self._log["factors"][f"{key}.h{h}"] = min(self._log["factors"].get(f"{key}.h{h}", 1.0), gamma_H[h].item())
        self._log["heads_clipped"] = len(self._log["factors"])
