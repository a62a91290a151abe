"""Where does a training step's time go? torch.profiler over a few steps of any experiment.

    python -m bench.profile_step +experiment=shakespeare_char data.path=../shared/data/tinyshakespeare.txt

Builds the same objects train.py builds (same config; compiled when train.compile is on), warms up, then
profiles `--steps` steps of forward/backward + clip + AdamW and prints the operators by self CPU time.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.config import compose_config  # noqa: E402
from data import build_data  # noqa: E402
from data.loader import Loader  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from optim import build_optimizer, build_scheduler, clip_grad_norm  # noqa: E402
from optim.accumulate import count_valid_tokens, forward_backward  # noqa: E402


def main(overrides: list[str], steps: int = 20, warmup: int = 10) -> None:
    cfg = compose_config(overrides)
    torch.manual_seed(cfg.seed)
    ds = build_data(OmegaConf.to_container(cfg.data, resolve=True))
    model = Transformer(ModelConfig.from_dict({**OmegaConf.to_container(cfg.model, resolve=True),
                                               "vocab_size": ds.vocab_size, "seq_len": ds.seq_len}))
    fwd = torch.compile(model) if cfg.train.compile else model
    opt, _ = build_optimizer(model, OmegaConf.to_container(cfg.optim, resolve=True))
    sched = build_scheduler(opt, OmegaConf.to_container(cfg.optim.schedule, resolve=True), cfg.train.steps)
    loader = Loader(ds, cfg.train.batch_size)

    def step():
        mbs = loader.next().micro_batches(cfg.train.micro_batches)
        forward_backward(fwd, mbs, count_valid_tokens(mbs, "cpu"), cfg.train.z_loss, 1, len(ds.source_names))
        clip_grad_norm(model.parameters(), cfg.train.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dt = (time.perf_counter() - t0) / steps
    print(f"{dt * 1e3:.1f} ms/step unprofiled ({cfg.train.batch_size * ds.seq_len / dt / 1e3:.2f}k tokens/s), "
          f"{torch.get_num_threads()} threads")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main(sys.argv[1:])
