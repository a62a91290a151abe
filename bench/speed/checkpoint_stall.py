"""Training stall of a checkpoint save, sync vs async, and the wall time of a resume verification.

    python -m bench.speed.checkpoint_stall                      # quickstart model and a ~50M-parameter model
    python -m bench.speed.checkpoint_stall --sizes quickstart --verify-steps 50 50

stall  = time the training loop is blocked in Saver.save (sync: write + fsync + hash + publish;
         async: get_state_dict + the staging copy; the write runs in a background thread)
write  = time from the snapshot until the checkpoint is published (async: in the background thread)
slowed = extra time of the training steps that ran while the async write was in flight (the write
         competes for the same CPU cores), per save
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import ROOT
from bench.config import compose_config
from checkpoint import Saver, TrainState, step_name
from data import build_data
from data.loader import Loader
from model import Transformer
from optim import build_optimizer, build_scheduler
from optim.accumulate import count_valid_tokens, forward_backward

SIZES = {
    "quickstart": [],  # the default model (model/config.py default_model) as is
    "50m": ["model.d_model=640", "model.n_layers=10", "model.n_heads=10", "model.moe=null"],
}


def build(size: str, batch_size: int) -> TrainState:
    cfg = compose_config(["data=synthetic", "train.steps=100", *SIZES[size]])
    ds = build_data(cfg.data)
    torch.manual_seed(0)
    model = Transformer(cfg.model.for_data(ds))
    opt, _ = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim.schedule, 100)
    state = TrainState(model, opt, sched, Loader(ds, batch_size),
                       {"model": dataclasses.asdict(cfg.model), "optim": dataclasses.asdict(cfg.optim)})
    train_step(state)  # the moments exist, as in any checkpoint after step 1
    return state


def train_step(state: TrainState) -> None:
    micro = state.loader.next().micro_batches(1)
    forward_backward(state.model, micro, count_valid_tokens(micro, "cpu"), 1e-4, 1, 2)
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.step += 1


def measure(state: TrainState, mode: str, repeats: int) -> dict:
    stalls, writes, slowed = [], [], []
    with tempfile.TemporaryDirectory(dir=ROOT / "runs") as tmp:
        saver = Saver(Path(tmp), mode, keep_last=1)
        t_step = min(_timed(train_step, state) for _ in range(2))
        for i in range(repeats):
            stall = saver.save(step_name(i + 1), state.state_dict(), {"step": i + 1})
            if mode == "async":  # train while the write runs; charge the slowdown to the save
                n, t_train = 0, 0.0
                while saver.busy:
                    t_train += _timed(train_step, state)
                    n += 1
                slowed.append(max(t_train - n * t_step, 0.0))
            saver.wait()
            (_, seconds, error), = saver.finished()  # seconds: snapshot to published, as the writer saw it
            if error:
                raise RuntimeError(error.line)
            writes.append(seconds)
            stalls.append(stall)
        size_mb = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file()) / 2**20
    return {"stall": statistics.median(stalls), "write": statistics.median(writes),
            "slowed": statistics.median(slowed) if slowed else 0.0, "mb": size_mb, "step": t_step}


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def verify_wall(steps: tuple[int, int]) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "checkpoint.verify", "--steps", *map(str, steps),
                        "--out", tempfile.mkdtemp(dir=ROOT / "runs", prefix="bench-verify-"),
                        "logging.wandb=disabled"], cwd=ROOT, capture_output=True, text=True)
    verdict = r.stdout.strip().splitlines()[-1] if r.returncode == 0 else f"exit {r.returncode}: {r.stderr[-300:]}"
    return time.perf_counter() - t0, verdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="quickstart,50m")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4, help="samples per training step while measuring")
    p.add_argument("--verify-steps", nargs=2, type=int, default=(50, 50))
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: stable figures on a shared CPU)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    (ROOT / "runs").mkdir(exist_ok=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.repeats} saves")
    print(f"{'model':>10} {'params':>8} {'ckpt MB':>8} {'step ms':>8} | {'sync stall s':>12} | "
          f"{'async stall s':>13} {'async write s':>13} {'slowed s':>8} {'stall ratio':>11}")
    for size in args.sizes.split(","):
        state = build(size, args.batch_size)
        sync, asyn = measure(state, "sync", args.repeats), measure(state, "async", args.repeats)
        print(f"{size:>10} {state.model.num_params() / 1e6:>7.1f}M {sync['mb']:>8.1f} {sync['step'] * 1e3:>8.1f} | "
              f"{sync['stall']:>12.3f} | {asyn['stall']:>13.3f} {asyn['write']:>13.3f} {asyn['slowed']:>8.3f} "
              f"{asyn['stall'] / sync['stall']:>11.3f}")
    wall, verdict = verify_wall(tuple(args.verify_steps))
    A, B = args.verify_steps
    print(f"resume verify, quickstart, --steps {A} {B} (3 train.py launches): {wall:.1f} s wall; {verdict}")


if __name__ == "__main__":
    main()
