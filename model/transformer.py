"""Decoder-only transformer: pre-norm blocks of attention and a dense or MoE SwiGLU MLP."""
from __future__ import annotations

import math

import torch
from einops import rearrange
from torch import Tensor, nn

from model import checkpointing
from model.config import ModelConfig
from model.attention import Attention
from model.kv_cache import KVCache, LayerKV
from model.rope import rope_tables
from model.loss import IGNORE_INDEX, ModelOutput, token_losses
from model.moe import MoE, MoEOutput
from model.norm import RMSNorm
from model.swiglu import SwiGLU


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        if cfg.is_moe_layer(index):
            self.mlp = MoE(cfg.moe, cfg.d_model, cfg.swiglu_clamp)
        else:
            self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden, cfg.swiglu_clamp)
        self.checkpointing = "none"  # model/checkpointing.py: none | full | selective

    def forward(self, x_BTD: Tensor, cos_TF: Tensor, sin_TF: Tensor, route_ids_BTk: Tensor | None,
                valid_BT: Tensor | None = None, router_only: bool = False, kv: LayerKV | None = None):
        """(x, MoEOutput or None); with router_only (an MoE block, compute_routes): the (B·T, k) ids alone;
        with kv (decoding): x holds the positions after the cached ones, whose keys and values join kv.
        NOTE: through forward even then: an FSDP2 unit gathers its parameters only around a call."""
        return checkpointing.run(self._forward, self.checkpointing, x_BTD, cos_TF, sin_TF, route_ids_BTk, valid_BT,
                                 router_only, kv)

    def _forward(self, x_BTD: Tensor, cos_TF: Tensor, sin_TF: Tensor, route_ids_BTk: Tensor | None,
                 valid_BT: Tensor | None, router_only: bool, kv: LayerKV | None):
        """The block, the one forward training, activation checkpointing's recompute, the routing-only
        forward and KV-cached decoding all run: a variant of the block changes here and nowhere else."""
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), cos_TF, sin_TF, kv=kv)
        h_BTD = self.mlp_norm(x_BTD)
        if router_only:  # the ids this MoE block's forward would choose, and nothing after its router runs
            return self.mlp.select(h_BTD)
        if isinstance(self.mlp, MoE):
            ids_Nk = None if route_ids_BTk is None else rearrange(route_ids_BTk, "b t k -> (b t) k")
            moe = self.mlp(h_BTD, ids_Nk, None if valid_BT is None else rearrange(valid_BT, "b t -> (b t)"))
            return x_BTD + moe.y, moe
        return x_BTD + self.mlp(h_BTD), None


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.check_sizes()  # the ranges were checked when cfg was built
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        # NOTE: non-persistent: derived from the config, so never worth a checkpoint entry.
        cos_TF, sin_TF = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos_TF, persistent=False)
        self.register_buffer("rope_sin", sin_TF, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, init_std) everywhere; projections into the residual stream get init_std/sqrt(2·n_layers).

        GPT-2 scaling: the residual stream sums 2·n_layers such outputs, so each one is shrunk to keep
        the variance of the final residual independent of depth.
        """
        std = self.cfg.init_std
        resid_std = std / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.tok_emb.weight, std=std)
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.head.weight, std=std)
        for block in self.blocks:
            block.attn.init_weights(std, resid_std)
            block.mlp.init_weights(std, resid_std)
            block.attn_norm.reset_parameters()
            block.mlp_norm.reset_parameters()
        self.norm.reset_parameters()

    def _trunk(self, tokens_BT: Tensor, routes: dict[int, Tensor] | None, valid_BT: Tensor | None = None,
               cache: KVCache | None = None):
        p0, T = (0 if cache is None else cache.length), tokens_BT.shape[1]
        if p0 + T > self.cfg.seq_len:
            where = f"input length {T}" if cache is None else f"KV cache: {p0} + {T} positions"
            raise ValueError(f"{where} > model.seq_len={self.cfg.seq_len}")
        routes = routes or {}
        stray = sorted(set(routes) - {i for i, _ in self.moe_layers()})
        if stray:
            raise ValueError(f"routes given for layer {stray[0]}, which is not an MoE layer")
        x_BTD = self.tok_emb(tokens_BT)
        cos_TF, sin_TF = self.rope_cos[p0:], self.rope_sin[p0:]  # the positions of tokens_BT
        moe_outs: dict[int, MoEOutput] = {}
        for i, block in enumerate(self.blocks):
            # NOTE: an MoE layer missing from `routes` routes itself.
            x_BTD, moe = block(x_BTD, cos_TF, sin_TF, routes.get(i), valid_BT,
                               kv=None if cache is None else cache.layer(i))
            if moe is not None:
                moe_outs[i] = moe
        if cache is not None:
            cache.length += T
        return self.norm(x_BTD), moe_outs

    def forward(self, tokens_BT: Tensor, labels_BT: Tensor | None = None,
                routes: dict[int, Tensor] | None = None, return_logits: bool = False,
                routes_only: bool = False, cache: KVCache | None = None) -> ModelOutput | dict[int, Tensor]:
        """routes: {layer: expert ids (B, T, k)} replaces top-k selection at those layers.
        cache (decoding, model/generate.py): tokens_BT follow the cache's positions; their keys and values
        join it and its length advances.

        With labels, only positions with a label (!= IGNORE_INDEX) count in the MoE loads and losses.
        routes_only: the routing-only forward (compute_routes) through forward(), so that a wrapper's
        hooks run: FSDP2 all-gathers the sharded parameters only around a call of the wrapped module.
        """
        if routes_only:
            return self.compute_routes(tokens_BT)
        valid_BT = None if labels_BT is None else labels_BT != IGNORE_INDEX
        x_BTD, moe_outs = self._trunk(tokens_BT, routes, valid_BT, cache)
        logits_BTV = self.head(x_BTD)
        dev, B = tokens_BT.device, tokens_BT.shape[0]
        zero = torch.zeros((), dtype=torch.float32, device=dev)
        aux = sum((m.aux_loss for m in moe_outs.values()), zero)
        if labels_BT is None:
            losses = None
            loss_sum = z_sum = zero
            n_valid = torch.zeros((), dtype=torch.int64, device=dev)
            n_valid_B = torch.zeros(B, dtype=torch.int64, device=dev)
            loss_sum_B = torch.zeros(B, dtype=torch.float32, device=dev)
        else:
            losses = token_losses(logits_BTV, labels_BT)
            loss_sum, z_sum, n_valid = losses.loss_sum, losses.z_sum, losses.n_valid
            loss_sum_B, n_valid_B = losses.loss_sum_B, losses.n_valid_B
        return ModelOutput(
            loss_sum=loss_sum, z_sum=z_sum, aux_loss=aux, n_valid=n_valid,
            loss_sum_B=loss_sum_B, n_valid_B=n_valid_B,
            logit_max=logits_BTV.detach().abs().max().float(),
            moe_load={i: m.load_E for i, m in moe_outs.items()},
            moe_aux={i: torch.stack([m.balance_loss, m.router_z]).detach() for i, m in moe_outs.items()},
            moe_out_sq={i: m.out_sq_E for i, m in moe_outs.items() if m.out_sq_E is not None},
            logits=logits_BTV if (return_logits or losses is None) else None,
        )

    @torch.no_grad()
    def compute_routes(self, tokens_BT: Tensor) -> dict[int, Tensor]:
        """The routing-only forward: top-k expert ids (B, T, k) chosen at each MoE layer, the same ids
        forward() would choose (the same ops on the same rows; tests/test_model.py).

        It stops at the last MoE layer's router: that layer's experts, the blocks after it, the final
        norm and the LM head decide no route, so they never run (bench/speed/anticipatory_overhead.py).
        WARN: on an FSDP2-sharded model call model(tokens, routes_only=True) instead: called directly
        this reads the sharded DTensors (aten.embedding got mixed torch.Tensor and DTensor)."""
        B, T = tokens_BT.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"input length {T} > model.seq_len={self.cfg.seq_len}")
        moe = [i for i, _ in self.moe_layers()]
        routes: dict[int, Tensor] = {}
        x_BTD = self.tok_emb(tokens_BT)
        for i, block in enumerate(self.blocks[: moe[-1] + 1] if moe else ()):
            if i == moe[-1]:
                ids_Nk = block(x_BTD, self.rope_cos, self.rope_sin, None, router_only=True)
            else:
                x_BTD, out = block(x_BTD, self.rope_cos, self.rope_sin, None)
                ids_Nk = None if out is None else out.route_ids_Nk
            if ids_Nk is not None:
                routes[i] = rearrange(ids_Nk, "(b t) k -> b t k", b=B)
        return routes

    def moe_layers(self) -> list[tuple[int, MoE]]:
        return [(i, b.mlp) for i, b in enumerate(self.blocks) if isinstance(b.mlp, MoE)]

    def swiglus(self) -> list[tuple[str, nn.Module]]:
        """Every module with SwiGLU clamp telemetry (record_stats, clamp_hits, clamp_total)."""
        return [(n, m) for n, m in self.named_modules() if hasattr(m, "record_stats")]

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Unique parameters (a tied head counts once); optionally without the token embedding."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_emb.weight.numel() if exclude_embedding else n
