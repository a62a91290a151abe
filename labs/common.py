"""Shared lab pieces: a small training run built from the real repository parts (no second trainer).

The step is train.py's: token-normalised forward_backward under the recipe's autocast, then
precision.optimizer_step (unscale → agreed finite check → clip → step or skip). Two runs with the same
seed see the same initial weights and the same batches, so their losses differ only by the recipe.
"""
from __future__ import annotations

import contextlib
import time

import torch

from data import DataConfig, build_data
from data.loader import Loader, eval_batches
from model import ModelConfig, Transformer
from optim import build_optimizer, build_scheduler
from optim.accumulate import count_valid_tokens, forward_backward
from optim.config import OptimConfig
from precision import build_recipe, optimizer_step
from precision.config import PrecisionConfig

OPTIM = {"lr": 3.0e-3, "betas": [0.9, 0.95], "eps": 1.0e-8, "weight_decay": 0.1,
         "groups": [{"name": "no_decay", "kinds": ["bias", "norm", "embedding", "router"], "weight_decay": 0.0}],
         "schedule": {"name": "cosine", "warmup_steps": 30, "min_lr_ratio": 0.1, "decay_fraction": 0.2}}


def optim_config(steps: int) -> OptimConfig:
    """OPTIM through its schema, the warmup a tenth of a short run (at most 30 steps)."""
    return OptimConfig.from_dict({**OPTIM, "schedule": {**OPTIM["schedule"], "warmup_steps": min(30, steps // 10)}})


@contextlib.contextmanager
def single_thread():
    """One intra-op thread for the duration (restored after).

    NOTE: the labs' models are tiny: a matmul has nothing to split, and on a shared 2-core machine the
    second OpenMP thread only spin-waits for a busy core (measured: 40-step training 45 s with 2 threads
    under load, 2.7 s with 1).
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@torch.no_grad()
def eval_loss(model, batches, autocast, names) -> tuple[float, dict[str, float]]:
    """Loss per valid token on the fixed validation batches: overall and by source."""
    S = len(names)
    loss_S, n_S = torch.zeros(S, dtype=torch.float64), torch.zeros(S, dtype=torch.float64)
    for b in batches:
        with autocast():
            out = model(b.tokens, b.labels)
        loss_S.index_add_(0, b.sources, out.loss_sum_B.double())
        n_S.index_add_(0, b.sources, out.n_valid_B.double())
    return (loss_S.sum() / n_S.sum()).item(), {n: (loss_S[i] / n_S[i]).item() for i, n in enumerate(names) if n_S[i]}


def train_small(model_cfg: ModelConfig, data_cfg: dict, precision: PrecisionConfig, steps: int, batch_size: int, seed: int,
                eval_samples: int = 128, max_grad_norm: float = 1.0, dataset=None, on_step=None) -> dict:
    """Train `steps` steps from seed; return the train-loss curve, final eval loss, floor and timing.

    dataset: a prebuilt dataset (e.g. a wrapper that injects a label bug) instead of build_data(data_cfg).
    on_step(step, model, optimizer, loader): called before each step s = 0..steps-1 draws its batch, to
    change the data (loader.dataset.set_weights) or inject a fault (optimizer.param_groups, .state).
    NOTE: a changed lr lasts one step: scheduler.step() recomputes every lr from its base afterwards.
    """
    dataset = build_data(DataConfig.from_dict(data_cfg)) if dataset is None else dataset
    torch.manual_seed(seed)
    model = Transformer(model_cfg.for_data(dataset))
    recipe = build_recipe(precision)
    recipe.convert(model)
    optim = optim_config(steps)
    optimizer, _ = build_optimizer(model, optim)
    scheduler = build_scheduler(optimizer, optim.schedule, steps)
    scaler = recipe.make_scaler()
    loader = Loader(dataset, batch_size)
    evals = eval_batches(dataset, eval_samples, min(64, eval_samples))
    names = dataset.source_names
    losses, by_source, t0 = [], {n: [] for n in names}, time.perf_counter()
    tokens_by_source = {n: [] for n in names}
    for step in range(steps):
        if on_step is not None:
            on_step(step, model, optimizer, loader)
        micro = loader.next().micro_batches(1)
        n_valid = count_valid_tokens(micro, "cpu")
        sums = forward_backward(model, micro, n_valid, 1e-4, 1, len(dataset.source_names),
                                autocast=recipe.autocast, loss_scale=scaler.scale if scaler else None)
        optimizer_step(model.parameters(), optimizer, scaler, max_grad_norm)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        for layer, moe in model.moe_layers():
            moe.update_bias(sums.moe_load[layer])
        losses.append(sums.loss_sum.item() / n_valid.item())
        for i, n in enumerate(names):
            tokens = sums.tokens_by_source[i].item()
            tokens_by_source[n].append(int(tokens))
            by_source[n].append(sums.loss_by_source[i].item() / tokens if tokens else float("nan"))
    seconds = time.perf_counter() - t0
    ev, ev_by_source = eval_loss(model, evals, recipe.autocast, names)
    return {"precision": recipe.name, "train_loss": losses, "train_loss_by_source": by_source,
            "train_tokens_by_source": tokens_by_source, "eval_loss": ev,
            "eval_by_source": ev_by_source, "floor": getattr(dataset, "expected_floor", lambda: None)(),
            "floor_by_source": getattr(dataset, "floor_by_source", lambda: {})(),
            "seconds": seconds, "steps": steps, "params": model.num_params()}
