"""A trained model out of a run directory, for inference tools (sampling, export): no optimizer, no loader.

The run's config.yaml rebuilds the model and the dataset (the dataset owns the tokenizer: a char vocabulary
or a BPE is a function of the run's training text); the weights come from the latest complete checkpoint
(or a named one), checked against its marker.
"""
from __future__ import annotations

from pathlib import Path

import yaml


def run_config(run_dir: Path) -> dict:
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no config.yaml (not a run directory)")
    return yaml.safe_load(path.read_text())


def find_checkpoint(run_dir: Path, config: dict, checkpoint: str | None = None) -> Path:
    """The named checkpoint, else the newest complete one of the run (falling back past broken ones)."""
    from checkpoint import publish

    root = Path(config.get("checkpoint", {}).get("dir") or Path(run_dir) / "checkpoints")
    if checkpoint is not None:
        path = Path(checkpoint)
        reason = publish.check(path)
        if reason:
            raise ValueError(f"--checkpoint={checkpoint}: not a complete checkpoint: {reason}")
        return path
    if not root.is_dir() or not publish.list_steps(root):
        raise ValueError(f"{run_dir}: the run has no checkpoints (train with checkpoint.every=N to save some)")
    try:
        return publish.resolve(publish.LATEST, root)[0]
    except ValueError as e:
        raise ValueError(f"{run_dir}: {str(e).removeprefix('resume=latest: ')}") from None


def load_model(run_dir, checkpoint: str | None = None, device: str = "cpu"):
    """(model in eval mode, dataset, checkpoint path, config) of a run."""
    import torch

    from checkpoint.state import read_tensors
    from data import build_data
    from model import Transformer
    from run.config import Config

    config = run_config(Path(run_dir))
    path = find_checkpoint(Path(run_dir), config, checkpoint)
    typed = Config.from_dict(config)
    dataset = build_data(typed.data)
    model = Transformer(typed.model.for_data(dataset))
    sd = {k[len("model."):]: v for k, v in read_tensors(path).items() if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # NOTE: a tied head is one tensor under two names; the checkpoint may hold either name only.
    missing = [k for k in missing if not (k == "head.weight" and model.cfg.tie_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not match config.yaml's model "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.to(torch.device(device)).eval(), dataset, path, config
