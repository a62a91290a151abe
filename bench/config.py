"""The run config a benchmark measures (conf/config.yaml composed with Hydra overrides and checked, as
train.py sees it) and ballast's optimizer step built from it."""
from __future__ import annotations

from collections.abc import Callable

import torch

from bench import ROOT


def compose_config(overrides: list[str]):
    """The typed run Config (run/config.py), composed and checked as train.py's is; applies `threads` as
    train.py does."""
    from run.config import compose_check

    cfg = compose_check(list(overrides), str(ROOT / "conf"))
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    return cfg


def build_train_step(cfg) -> tuple[Callable[[], None], int]:
    """(step, tokens per step): one of train.py's optimizer steps without its bookkeeping — load a batch,
    token-normalised forward/backward (compiled when train.compile is on), global-norm clip, AdamW over
    the experiment's parameter groups, schedule. Single process, fp32."""
    from data import build_data
    from data.loader import Loader
    from model import Transformer
    from optim import build_optimizer, build_scheduler, clip_grad_norm
    from optim.accumulate import count_valid_tokens, forward_backward
    from run.compile import compile_model, decide

    torch.manual_seed(cfg.seed)
    ds = build_data(cfg.data)
    model = Transformer(cfg.model.for_data(ds))
    fwd = compile_model(model) if decide(cfg.train.compile, "cpu", cfg.train.steps).on else model
    opt, _ = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim.schedule, cfg.train.steps)
    loader, tc = Loader(ds, cfg.train.batch_size), cfg.train

    def step() -> None:
        mbs = loader.next().micro_batches(tc.micro_batches)
        forward_backward(fwd, mbs, count_valid_tokens(mbs, "cpu"), tc.z_loss, 1, len(ds.source_names))
        clip_grad_norm(model.parameters(), tc.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    return step, tc.batch_size * ds.seq_len
