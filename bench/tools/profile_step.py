"""Where does a training step's time go? torch.profiler over a few steps of any experiment.

    python -m bench.tools.profile_step +experiment=shakespeare_char data.path=$TINYSHAKESPEARE
    python -m bench.tools.profile_step --out docs/results/profile_step.md threads=1 +experiment=shakespeare_char data.path=$TINYSHAKESPEARE

Builds the same objects train.py builds (same config; compiled when train.compile is on), warms up, then
profiles `--steps` steps of forward/backward + clip + AdamW and prints the operators by self CPU time.
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.config import build_train_step, compose_config
from bench.report import Report


def main(overrides: list[str], steps: int = 20, warmup: int = 10, out: str | None = None) -> None:
    rep = Report("Where a step's time goes", "python -m bench.tools.profile_step")
    step, tokens = build_train_step(compose_config(overrides))
    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dt = (time.perf_counter() - t0) / steps
    rep.add(f"{dt * 1e3:.1f} ms/step unprofiled ({tokens / dt / 1e3:.2f}k tokens/s), {torch.get_num_threads()} threads; "
            f"the operators of {steps} profiled steps by self CPU time:", "")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    rep.block(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    rep.write(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the figures (markdown) to this file")
    known, overrides = ap.parse_known_args()
    main(overrides, out=known.out)
