"""The run config a benchmark measures: conf/config.yaml composed with Hydra overrides, as train.py sees it."""
from __future__ import annotations

from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parents[1]


def compose_config(overrides: list[str]) -> DictConfig:
    """Compose the config; apply `threads` (torch intra-op threads) as train.py does."""
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=list(overrides))
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    return cfg
