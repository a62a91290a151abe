"""Activation checkpointing (train.activation_checkpointing): peak memory and step time, none vs full vs selective.

    python -m bench.speed.activation_ckpt                                   # d 256, 8 layers, B 8, T 512 (CPU-sized)
    python -m bench.speed.activation_ckpt --d-model 1024 --n-layers 16 --batch 8 --seq-len 2048 --device cuda
    python -m bench.speed.activation_ckpt --out docs/results/activation_ckpt.md

Each mode runs in a fresh process: a dense model, --steps forward+backward steps on random tokens (plus one
warm-up). Peak memory: growth over the memory held before the warm-up step, of CUDA max_memory_allocated,
or on CPU of the process's peak RSS (glibc returns large tensors to the OS, so RSS follows the live tensors;
the grads and the allocator's slack are included in every row).
Activations kept for the backward (saved tensors), counted with autograd's saved-tensor hooks in a separate
forward, are reported for none only: that is what checkpointing removes.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import ROOT
from bench.report import Report


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one(args) -> dict:
    import torch

    from model import ModelConfig, Transformer
    from model.checkpointing import set_activation_checkpointing

    torch.manual_seed(0)
    dev = torch.device(args.device)
    cfg = ModelConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.n_layers,
                      n_heads=args.d_model // 64)
    model = Transformer(cfg).to(dev)
    set_activation_checkpointing(model, args.mode)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=dev)

    def step():
        out = model(tokens, tokens)
        (out.loss_sum / out.n_valid).backward()
        model.zero_grad(set_to_none=False)  # keep the grad buffers: measure activations, not grad churn

    # NOTE: the baseline is taken before the warm-up step: glibc keeps some freed memory in its arenas, so a
    # baseline after a step would already hold part of that step's peak. Grads (4 bytes a parameter) count.
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_mb()
    step()  # warm-up: grads allocated
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if dev.type == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    return {"mode": args.mode, "step_s": statistics.median(times), "peak_mb": peak}


def saved_mb(args) -> float:
    """MB of tensors autograd saves for the backward in one forward without checkpointing."""
    import torch

    from model import ModelConfig, Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.n_layers,
                      n_heads=args.d_model // 64)
    model = Transformer(cfg).to(args.device)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=args.device)
    seen, params = {}, {p.data_ptr() for p in model.parameters()}

    def pack(t):
        if t.data_ptr() not in params:
            seen[(t.data_ptr(), t.untyped_storage().nbytes())] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, tokens)
    return sum(seen.values()) / 2**20


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", help="also write the table (markdown) to this file")
    args = p.parse_args(argv)
    if args.mode:
        print(json.dumps(one(args)))
        return 0
    rep = Report("Activation checkpointing: memory and step time", "python -m bench.speed.activation_ckpt", argv)
    base = [f"--d-model={args.d_model}", f"--n-layers={args.n_layers}", f"--batch={args.batch}",
            f"--seq-len={args.seq_len}", f"--vocab={args.vocab}", f"--steps={args.steps}", f"--device={args.device}"]
    rows = []
    for mode in ("none", "full", "selective"):
        r = subprocess.run([sys.executable, "-m", "bench.speed.activation_ckpt", *base, f"--mode={mode}"], cwd=ROOT,
                           capture_output=True, text=True)
        if r.returncode:
            print(r.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    rep.add(f"Dense d_model {args.d_model}, {args.n_layers} layers, batch {args.batch} × seq_len {args.seq_len}, "
            f"{args.device}, {args.steps} steps a mode; activations saved without checkpointing: {saved_mb(args):.0f} MB.",
            "")
    rep.table(["activation_checkpointing", "peak memory over the step MB", "step s (median)", "step time vs none"],
              [(r["mode"], f"{r['peak_mb']:.0f}", f"{r['step_s']:.3f}", f"{r['step_s'] / rows[0]['step_s']:.2f}×")
               for r in rows])
    rep.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
