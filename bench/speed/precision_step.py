"""CPU step time of each precision recipe on the quickstart (prints figures; not a timed test).

    python -m bench.speed.precision_step                       # fp32, fp8_block, fp8_tensor
    python -m bench.speed.precision_step --recipes fp32 bf16 --steps 5 train.batch_size=8

Builds the quickstart exactly as train.py does (same config), converts the model with the recipe,
then times warm steps of forward_backward + precision.optimizer_step. On a CPU the FP8 recipes run
quantise → dequantise → FP32 matmul: they measure what the emulation costs, not what FP8 saves.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from omegaconf import OmegaConf

from bench import ROOT
from bench.config import compose_config
from data import build_data
from data.loader import Loader
from model import Transformer
from optim import build_optimizer
from optim.accumulate import count_valid_tokens, forward_backward
from precision import build_recipe
from precision import optimizer_step
from precision.config import PrecisionConfig


def time_recipe(cfg, name: str, steps: int, warmup: int) -> dict:
    torch.manual_seed(cfg.seed)
    ds = build_data(cfg.data)
    model = Transformer(cfg.model.for_data(ds))
    recipe = build_recipe(PrecisionConfig(**OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "precision" / f"{name}.yaml"))))
    recipe.convert(model)
    opt, _ = build_optimizer(model, cfg.optim)
    scaler = recipe.make_scaler()
    loader = Loader(ds, cfg.train.batch_size)
    times = []
    for i in range(warmup + steps):
        mbs = loader.next().micro_batches(cfg.train.micro_batches)
        t0 = time.perf_counter()
        forward_backward(model, mbs, count_valid_tokens(mbs, "cpu"), cfg.train.z_loss, 1, len(ds.source_names),
                         autocast=recipe.autocast, loss_scale=scaler.scale if scaler else None)
        t1 = time.perf_counter()
        optimizer_step(model.parameters(), opt, scaler, cfg.train.max_grad_norm)
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append((t1 - t0, time.perf_counter() - t1))
    fb = statistics.median(t[0] for t in times)
    total = statistics.median(sum(t) for t in times)
    return {"recipe": name, "ms": 1e3 * total, "fwd_bwd_ms": 1e3 * fb, "optim_ms": 1e3 * (total - fb),
            "tokens_per_s": cfg.train.batch_size * ds.seq_len / total, "params": model.num_params()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="+", default=["fp32", "fp8_block", "fp8_tensor"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    args = p.parse_args()
    cfg = compose_config(args.overrides)
    print(f"quickstart step: batch {cfg.train.batch_size} × {cfg.data.seq_len} tokens, "
          f"{cfg.train.micro_batches} micro-batches, {torch.get_num_threads()} threads, median of {args.steps}")
    rows = [time_recipe(cfg, r, args.steps, args.warmup) for r in args.recipes]
    base = next((r["ms"] for r in rows if r["recipe"] == "fp32"), rows[0]["ms"])
    print(f"{'recipe':<12}{'ms/step':>9}{'fwd+bwd':>9}{'optim':>8}{'tokens/s':>10}{'× fp32':>8}")
    for r in rows:
        print(f"{r['recipe']:<12}{r['ms']:>9.0f}{r['fwd_bwd_ms']:>9.0f}{r['optim_ms']:>8.1f}"
              f"{r['tokens_per_s']:>10.0f}{r['ms'] / base:>8.2f}")


if __name__ == "__main__":
    main()
