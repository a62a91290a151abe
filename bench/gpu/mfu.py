"""BF16 training throughput and MFU of a ~125M dense model on one GPU (H200 peak: 989 TFLOPS bf16 dense).

    python -m bench.gpu.mfu                  # eager and torch.compile'd, ~1-2 min on an H200
    python -m bench.gpu.mfu --dry-run        # a tiny model for a few steps on the CPU: checks the code runs

Model: d_model 768, 18 layers, 12 heads, SwiGLU 2048 (127M parameters in matmuls; every dimension a
multiple of 128), context 1024, on the embedded synthetic data; AdamW (fused on CUDA), global-norm clip,
bf16 autocast with FP32 master weights: ballast's step (optim.accumulate.forward_backward +
precision.optimizer_step), without the StepRecord's bookkeeping.

FLOPs per token (the PaLM appendix-B count): 6·N for the matmul parameters N (the tied LM head counted
as a matmul: V·d) plus causal attention's 6·L·T·d (QKᵀ and AV, forward and backward, half the T×T
matrix). MFU = tokens/s × FLOPs per token / peak. Prints one row per arm; --out writes them (markdown),
--json the raw figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench import ROOT
from bench.report import Report

H200_BF16_DENSE_TFLOPS = 989.0  # NVIDIA H200 SXM datasheet, bf16 tensor core, dense (no sparsity)
MFU_GOAL = 0.40  # issue 16: a ~125M dense model's BF16 step at >= 40 % of peak
# NOTE: the model, data and optimizer here are also train.py's in bench/gpu/train.py (it compares the two)
MODEL = {"d_model": 768, "n_layers": 18, "n_heads": 12, "mlp_hidden": 2048, "tie_embeddings": True}
DATA = {"kind": "synthetic", "seq_len": 1024, "min_doc_len": 64, "seed": 1234,
        "sources": [{"name": "markov", "kind": "markov", "weight": 0.5, "alphabet": 64, "order": 2, "support": 4,
                     "concentration": 0.5},
                    {"name": "copy", "kind": "copy", "weight": 0.5, "alphabet": 64, "segment": 32}]}
OPTIM = {"lr": 6.0e-4, "betas": [0.9, 0.95], "eps": 1.0e-8, "weight_decay": 0.1,
         "groups": [{"name": "no_decay", "kinds": ["bias", "norm", "embedding", "router"], "weight_decay": 0.0}]}
TINY_MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 2, "mlp_hidden": 128, "tie_embeddings": True}
TINY_DATA = {**DATA, "seq_len": 64, "min_doc_len": 8}


def flops_per_token(model, seq_len: int) -> float:
    cfg = model.cfg
    n_matmul = model.num_params(exclude_embedding=True) + cfg.vocab_size * cfg.d_model  # + the tied head GEMM
    return 6 * n_matmul + 6 * cfg.n_layers * seq_len * cfg.d_model


def run(arm: str, args, model_cfg: dict, data_cfg: dict, device) -> dict:
    import torch

    from data import DataConfig, build_data
    from data.loader import Loader
    from model import ModelConfig, Transformer
    from optim import build_optimizer
    from optim.accumulate import count_valid_tokens, forward_backward
    from optim.config import OptimConfig
    from precision import build_recipe, optimizer_step
    from precision.config import PrecisionConfig

    ds = build_data(DataConfig.from_dict(data_cfg))
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**model_cfg).for_data(ds)).to(device)
    recipe = build_recipe(PrecisionConfig(name="bf16"), device)
    fwd = torch.compile(model) if arm == "compiled" else model
    opt, _ = build_optimizer(model, OptimConfig.from_dict(OPTIM))
    loader = Loader(ds, args.batch_size)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times, losses = [], []
    t_first = time.perf_counter()
    for i in range(args.warmup + args.steps):
        micro = [mb.to(device) for mb in loader.next().micro_batches(1)]
        sync()
        t0 = time.perf_counter()
        sums = forward_backward(fwd, micro, count_valid_tokens(micro, device), 1e-4, 1, len(ds.source_names),
                                autocast=recipe.autocast)
        optimizer_step(model.parameters(), opt, None, 1.0)
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        if i == args.warmup - 1:
            warm_s = time.perf_counter() - t_first
        losses.append(float(sums.loss_sum) / max(1, int(sums.tokens_by_source.sum())))
    step_s = statistics.median(times)
    tok_s = args.batch_size * ds.seq_len / step_s
    fpt = flops_per_token(model, ds.seq_len)
    return {"arm": arm, "params": model.num_params(), "matmul_params": model.num_params(exclude_embedding=True),
            "batch": args.batch_size, "seq_len": ds.seq_len, "step_ms": 1e3 * step_s, "tokens_per_s": tok_s,
            "flops_per_token": fpt, "tflops": tok_s * fpt / 1e12,
            "mfu": tok_s * fpt / (args.peak_tflops * 1e12), "warmup_s": warm_s, "last_loss": losses[-1],
            "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps per arm")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (the compile happens here)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--arms", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    p.add_argument("--dry-run", action="store_true", help="tiny model, 3 steps, on the CPU: the code runs")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "gpu_mfu.json")
    p.add_argument("--out", help="also write the table (markdown) to this file")
    args = p.parse_args()
    import torch

    rep = Report("BF16 training throughput and MFU on one GPU", "python -m bench.gpu.mfu")
    if args.dry_run:
        device, model_cfg, data_cfg = torch.device("cpu"), TINY_MODEL, TINY_DATA
        args.steps, args.warmup, args.batch_size, args.arms = 2, 1, 2, ["eager"]
    elif not torch.cuda.is_available():
        sys.exit("bench.gpu.mfu: needs a CUDA GPU; none found (--dry-run runs a tiny model on the CPU)")
    else:
        device, model_cfg, data_cfg = torch.device("cuda"), MODEL, DATA
        torch.backends.cuda.matmul.allow_tf32 = True
        rep.add(f"torch {torch.__version__}, CUDA {torch.version.cuda}, peak {args.peak_tflops:.0f} TFLOPS bf16 dense.", "")
    rep.columns("arm", "matmul params", "batch", "ms/step", "tokens/s", "TFLOPS", "MFU", "warm-up s", "last loss")
    results = []
    for arm in args.arms:
        r = run(arm, args, model_cfg, data_cfg, device)
        results.append(r)
        rep.row(arm, f"{r['matmul_params'] / 1e6:.1f}M", f"{r['batch']}×{r['seq_len']}", f"{r['step_ms']:.1f}",
                f"{r['tokens_per_s']:.0f}", f"{r['tflops']:.1f}", f"{100 * r['mfu']:.1f} %", f"{r['warmup_s']:.0f}",
                f"{r['last_loss']:.3f}")
    best = max(results, key=lambda r: r["mfu"])
    rep.add("", f"MFU {100 * best['mfu']:.1f} % ({best['arm']}); target >= {100 * MFU_GOAL:.0f} %: "
            f"{'met' if best['mfu'] >= MFU_GOAL else 'NOT met'}" + (" (dry run: meaningless)" if args.dry_run else ""))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    rep.write(args.out)


if __name__ == "__main__":
    main()
