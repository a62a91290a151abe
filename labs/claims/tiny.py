"""The tiny setup every claim lab shares: model, data, optimizer and train.py's step, at toy size.

One step is train.py's (docs/design.md §3): micro-batches → count_valid_tokens → forward_backward (token
normalised, optional z-loss and loss scale) → precision.optimizer_step (unscale → finite check → clip →
step or skip) → scheduler.step → zero_grad. Nothing here re-derives what those functions do.
"""
from __future__ import annotations

import math

import torch

from data import DataConfig, build_data
from data.loader import Loader
from model import ModelConfig, Transformer
from optim import build_optimizer, build_scheduler
from optim.accumulate import count_valid_tokens, forward_backward
from optim.config import OptimConfig
from precision import optimizer_step

# Two sources of very different difficulty; documents of uniform random length in [min_doc_len, 33],
# so samples (and micro-batches) carry unequal numbers of valid label tokens.
DATA = {"kind": "synthetic", "seq_len": 32, "min_doc_len": 4,
        "sources": [{"name": "markov", "kind": "markov", "weight": 0.5, "alphabet": 16, "order": 1,
                     "support": 3, "concentration": 0.5},
                    {"name": "copy", "kind": "copy", "weight": 0.5, "alphabet": 16, "segment": 6}]}
MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 2}
BATCH, MICRO = 8, 2
CONSTANT = {"name": "constant", "warmup_steps": 0}
COSINE = {"name": "cosine", "warmup_steps": 0, "min_lr_ratio": 0.1}


def optim_cfg(lr: float, schedule: dict = CONSTANT) -> OptimConfig:
    # NOTE: constant by default: most claims are about one step's arithmetic or about the LR itself,
    # and a warmup would blur both. A lab that compares end-of-run losses decays (less step noise).
    return OptimConfig.from_dict({"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                  "groups": [{"name": "no_decay", "kinds": ["norm", "embedding"], "weight_decay": 0.0}],
                                  "schedule": schedule})


def build(seed: int, data: dict | None = None, model: dict | None = None, init_seed: int | None = None):
    """(dataset, model): data seed `seed`, init seed `init_seed` (default: `seed`)."""
    dataset = build_data(DataConfig.from_dict({**DATA, **(data or {}), "seed": seed}))
    torch.manual_seed(seed if init_seed is None else init_seed)
    net = Transformer(ModelConfig(**{**MODEL, **(model or {})}).for_data(dataset))
    return dataset, net


def make_optimizer(model, lr: float, steps: int = 1, schedule: dict = CONSTANT):
    """The repository's AdamW over its parameter groups, and the scheduler (optim/)."""
    cfg = optim_cfg(lr, schedule)
    optimizer, _ = build_optimizer(model, cfg)
    return optimizer, build_scheduler(optimizer, cfg.schedule, steps)


def train_step(model, optimizer, scheduler, loader: Loader, max_grad_norm: float | None, z_coef: float = 0.0,
               scaler=None, micro: int = MICRO, telemetry=None, step: int = 0) -> dict:
    """One train.py step; returns the per-token loss, RMS of log Z, pre-clip norm, clip coef, skipped,
    and with a stability.telemetry.Telemetry its per-layer record for `step` (train.py's call order)."""
    first = loader.samples_consumed
    batch = loader.next()
    mbs = batch.micro_batches(micro)
    n_valid = count_valid_tokens(mbs, "cpu")
    if telemetry is not None:
        telemetry.start(step)
    sums = forward_backward(model, mbs, n_valid, z_coef, 1, len(loader.dataset.source_names),
                            loss_scale=scaler.scale if scaler is not None else None)
    if telemetry is not None:
        telemetry.before_update()
    res = optimizer_step(model.parameters(), optimizer, scaler, max_grad_norm)
    tel = telemetry.finish(res.coef) if telemetry is not None else {}
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    n = n_valid.item()
    return {"first_sample": first, "loss": sums.loss_sum.item() / n, "lse_rms": math.sqrt(sums.z_sum.item() / n),
            "logit_max": sums.logit_max.item(), "norm": res.norm.item(), "coef": res.coef.item(),
            "skipped": res.skipped, "telemetry": tel}


def first_index(flags) -> int | None:
    return next((i for i, f in enumerate(flags) if f), None)


def check_lines(checks: dict[str, bool]) -> list[str]:
    return [f"[{'ok' if v else 'FAIL'}] {k}" for k, v in checks.items()]


def figure(ncols: int, width: float = 5.5):
    """A matplotlib (Agg) figure with `ncols` axes side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, 4), squeeze=False)
    return fig, list(axes[0])


def save(fig, path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
