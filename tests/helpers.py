"""Shared test utilities: run train.py as a user would, in a subprocess, into a temporary run dir."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Small enough for a few seconds of CPU per run.
TINY = ["train.steps=6", "train.eval_every=3", "train.eval_samples=32", "train.eval_batch_size=16",
        "train.batch_size=8", "train.micro_batches=2", "logging.wandb=disabled", "logging.progress=false",
        "logging.plot=true", "data.seq_len=32", "data.min_doc_len=4", "model.d_model=32", "model.n_heads=2",
        "model.n_layers=2", "threads=1", "optim.schedule.warmup_steps=2"]


def env() -> dict:
    e = dict(os.environ)
    e.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1",
             OMP_NUM_THREADS="1")
    return e


def run_train(run_dir: Path, *overrides: str, nproc: int = 1, timeout: float = 300) -> subprocess.CompletedProcess:
    args = [f"hydra.run.dir={run_dir}", *overrides]
    if nproc == 1:
        cmd = [sys.executable, "train.py", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "train.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
