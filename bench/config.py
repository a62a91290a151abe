"""The run config a benchmark measures (conf/config.yaml composed with Hydra overrides, as train.py sees
it) and ballast's optimizer step built from it."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parents[1]


def compose_config(overrides: list[str]) -> DictConfig:
    """Compose the config (checked by the schema, as train.py's is); apply `threads` as train.py does."""
    from run.config import register, validate

    register()
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=list(overrides))
    validate(cfg)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    return cfg


def build_train_step(cfg: DictConfig) -> tuple[Callable[[], None], int]:
    """(step, tokens per step): one of train.py's optimizer steps without its bookkeeping — load a batch,
    token-normalised forward/backward (compiled when train.compile is on), global-norm clip, AdamW over
    the experiment's parameter groups, schedule. Single process, fp32."""
    from data import build_data
    from data.loader import Loader
    from model import ModelConfig, Transformer
    from optim import build_optimizer, build_scheduler, clip_grad_norm
    from optim.accumulate import count_valid_tokens, forward_backward

    torch.manual_seed(cfg.seed)
    ds = build_data(OmegaConf.to_container(cfg.data, resolve=True))
    model = Transformer(ModelConfig.from_dict({**OmegaConf.to_container(cfg.model, resolve=True),
                                               "vocab_size": ds.vocab_size, "seq_len": ds.seq_len}))
    fwd = torch.compile(model) if cfg.train.compile else model
    opt, _ = build_optimizer(model, OmegaConf.to_container(cfg.optim, resolve=True))
    sched = build_scheduler(opt, OmegaConf.to_container(cfg.optim.schedule, resolve=True), cfg.train.steps)
    loader, tc = Loader(ds, cfg.train.batch_size), cfg.train

    def step() -> None:
        mbs = loader.next().micro_batches(tc.micro_batches)
        forward_backward(fwd, mbs, count_valid_tokens(mbs, "cpu"), tc.z_loss, 1, len(ds.source_names))
        clip_grad_norm(model.parameters(), tc.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    return step, tc.batch_size * ds.seq_len
