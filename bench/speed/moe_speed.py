"""MoE step time against a dense model with the same active FLOPs, interleaved in one process.

    python -m bench.speed.moe_speed [--steps 30] [--d 256] [--experts 8] [--top-k 2] [--threads 2]
    python -m bench.speed.moe_speed --device cuda --d 1024 --batch 16 --seq 1024   # GPU: bf16 autocast
    python -m bench.speed.moe_speed --steps 20 --threads 1 --out docs/results/moe_speed.md
    python -m bench.speed.moe_speed --json bench/out/gpu_moe.json                  # also the figures as JSON

Models (4 layers, every layer after the first MoE): experts of width H, top-k routing plus a shared
expert, so a token runs (k + 1) SwiGLU MLPs of width H; the dense twin's MLP has width (k + 1)·H, the same
active FLOPs per token (the router's d×E GEMM aside). Arms, one forward+backward+AdamW step each, taken in
turn so every arm sees the machine at the same moments:
    dense             the dense twin, eager
    moe_loop          MoE with the per-expert loop (one host sync per MoE layer), eager: the reference
    moe_grouped       MoE with the grouped GEMM (no host sync), eager: the default
    moe_compiled      MoE grouped, torch.compile'd (one graph for every load pattern)
Prints the median step time of each arm and its ratio to dense. On a GPU (--device cuda) every arm runs
under bf16 autocast (the grouped kernel is bf16-only there) and each step ends in a synchronize.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.report import Report
from model import ModelConfig, MoEConfig, Transformer


def build(args, moe: bool, grouped: bool = True) -> Transformer:
    torch.manual_seed(0)
    H = args.d // 2
    cfg = ModelConfig(vocab_size=256, seq_len=args.seq, d_model=args.d, n_layers=4, n_heads=args.d // 64,
                      mlp_hidden=(args.top_k + 1) * H,
                      moe=MoEConfig(n_experts=args.experts, top_k=args.top_k, expert_hidden=H, shared_expert=True,
                                    first_dense=1) if moe else None)
    model = Transformer(cfg).to(args.device)
    for _, m in model.moe_layers():
        m.experts.grouped = grouped
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.speed.moe_speed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    ap.add_argument("--json", type=Path, help="also write the figures as JSON here (bench/gpu/table.py reads them)")
    args = ap.parse_args(argv)
    rep = Report("MoE step time against a dense twin of equal active FLOPs", "python -m bench.speed.moe_speed", argv)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    arms = {"dense": build(args, False), "moe_loop": build(args, True, grouped=False),
            "moe_grouped": build(args, True)}
    if not args.no_compile:
        arms["moe_compiled"] = torch.compile(build(args, True))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in arms.items()}
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(1, 256, (args.batch, args.seq + 1), generator=g).to(dev) for _ in range(args.steps + 3)]

    def step(name: str, b: torch.Tensor) -> float:
        sync()
        t = time.perf_counter()
        with autocast():
            out = arms[name](b[:, :-1], b[:, 1:])
        (out.loss_sum / out.n_valid + out.aux_loss).backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t

    for b in batches[:3]:  # warm-up (and the compile)
        for name in arms:
            step(name, b)
    times = {k: [] for k in arms}
    for b in batches[3:]:
        for name in arms:
            times[name].append(step(name, b))
    n = sum(p.numel() for p in arms["dense"].parameters())
    ms = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    vs_dense = {name: x / ms["dense"] for name, x in ms.items()}
    rep.add(f"d={args.d}, {args.experts} experts top-{args.top_k} + shared (H={args.d // 2}), batch {args.batch}×{args.seq}, "
            f"{args.device}{' bf16 autocast' if cuda else f', {args.threads} thread(s)'}, {args.steps} interleaved steps; "
            f"dense twin {n / 1e6:.2f}M params.", "")
    rep.table(["arm", "median ms/step", "× dense"],
              [(name, f"{ms[name]:.1f}", f"{vs_dense[name]:.2f}×") for name in ms])
    rep.write(args.out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "out")}
        args.json.write_text(json.dumps({**settings, "dense_params": n, "ms": ms, "vs_dense": vs_dense},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
