"""ballast's shakespeare_char step against the anchor's model, interleaved in one process.

    python -m bench.anchor_compare [--steps 300] [overrides...]      # e.g. train.compile=false

The issue's anchor (nanoGPT, 4 layers × 4 heads × width 128, context 64, batch 12, CPU, eager) was timed
on these machines at 62.7 ms/step; this machine's speed drifts by ±15 % from hour to hour, so a figure
from another moment is no yardstick. Here a GPT-2-style model of that configuration (LayerNorm without
bias, learned positions, GELU MLP of width 4·d, tied head, SDPA causal attention; foreach AdamW and
clip_grad_norm_, as nanoGPT runs on CPU) alternates step by step with ballast's step (the experiment's
model, optimizer groups, global-norm clip; compiled when train.compile is on), on the same batches.
Both see the same machine at the same moments; the medians and their ratio are the comparison.
Not measured here: train.py's bookkeeping (StepRecord, guard, input stats) — bench/shakespeare_char.sh.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import rearrange
from omegaconf import OmegaConf
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.config import build_train_step, compose_config  # noqa: E402
from data import build_data  # noqa: E402
from data.loader import Loader  # noqa: E402


class AnchorBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_attn, self.ln_mlp = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
        self.qkv, self.out = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc, self.proj = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x_BTD):
        q, k, v = rearrange(self.qkv(self.ln_attn(x_BTD)), "b t (three h d) -> three b h t d", three=3, h=self.heads)
        y_BHTd = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x_BTD = x_BTD + self.out(rearrange(y_BHTd, "b h t d -> b t (h d)"))
        return x_BTD + self.proj(F.gelu(self.fc(self.ln_mlp(x_BTD))))


class AnchorGPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d: int, layers: int, heads: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(AnchorBlock(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d, bias=False), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens_BT, labels_BT):
        x = self.tok(tokens_BT) + self.pos(torch.arange(tokens_BT.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(rearrange(logits, "b t v -> (b t) v"), rearrange(labels_BT, "b t -> (b t)"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = compose_config(["+experiment=shakespeare_char", f"data.path={ROOT.parent / 'shared/data/tinyshakespeare.txt'}",
                          *args.overrides])
    step_ours, positions = build_train_step(cfg)
    ds = build_data(OmegaConf.to_container(cfg.data, resolve=True))
    mc, tc = cfg.model, cfg.train
    anchor = AnchorGPT(ds.vocab_size, ds.seq_len, mc.d_model, mc.n_layers, mc.n_heads)
    matrices = [p for p in anchor.parameters() if p.dim() >= 2]
    vectors = [p for p in anchor.parameters() if p.dim() < 2]
    anchor_opt = torch.optim.AdamW([{"params": matrices, "weight_decay": cfg.optim.weight_decay},
                                    {"params": vectors, "weight_decay": 0.0}], lr=cfg.optim.lr,
                                   betas=tuple(cfg.optim.betas))
    anchor_loader = Loader(ds, tc.batch_size)

    def anchor_step():
        b = anchor_loader.next()
        anchor(b.tokens, b.labels).backward()
        torch.nn.utils.clip_grad_norm_(anchor.parameters(), tc.max_grad_norm)
        anchor_opt.step()
        anchor_opt.zero_grad(set_to_none=True)

    for _ in range(15):  # warm-up, and the cold compile when on
        step_ours()
        anchor_step()
    times = {"ballast": [], "anchor": []}
    for _ in range(args.steps):
        for name, fn in (("ballast", step_ours), ("anchor", anchor_step)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    for name in ("ballast", "anchor"):
        print(f"{name:8s} median {med[name] * 1e3:6.1f} ms/step  {positions / med[name] / 1e3:5.2f}k tokens/s")
    print(f"ballast (compile={bool(tc.compile)}) / anchor step time: {med['ballast'] / med['anchor']:.3f}, "
          f"{args.steps} interleaved steps, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
