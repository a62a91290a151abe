"""Step time with per-layer telemetry on every step vs off, on the quickstart (prints figures).

    python -m bench.telemetry_overhead threads=1            # 4 off/on pairs of 10-step blocks
    python -m bench.telemetry_overhead --pairs 6 --block 10 threads=1 train.batch_size=16

NOTE: on a shared 2-core machine pass threads=1: two intra-op threads fighting other jobs for the
cores made a step 30× slower here (22 s instead of 0.7 s), which drowns any overhead.

Builds the quickstart as train.py does (conf/config.yaml: mixed_tiny model, synthetic data, batch 16,
2 micro-batches) and times forward_backward → optimizer_step → zero_grad, with the telemetry calls
train.py makes around them. Off and on alternate in blocks on ONE model and optimizer, so slow drift of
a shared machine (±20 % here) hits both arms alike; the figures are medians over steps. Beside wall
time it reports this process's CPU time per step, which other jobs on the machine move less than wall time (with
threads=1 it is the step's compute; with more threads it also counts spinning).
The every-step extras (moe_summary, nonfinite_flags) run either way and are timed on their own.
"""
from __future__ import annotations

import argparse
import statistics
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
from optim import build_optimizer  # noqa: E402
from optim.accumulate import count_valid_tokens, forward_backward  # noqa: E402
from precision import optimizer_step  # noqa: E402
from stability.telemetry import Telemetry, moe_summary, nonfinite_flags  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=4, help="off/on block pairs")
    p.add_argument("--block", type=int, default=10, help="steps per block")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    args = p.parse_args()
    cfg = compose_config(args.overrides)
    tc = cfg.train
    torch.manual_seed(cfg.seed)
    ds = build_data(OmegaConf.to_container(cfg.data, resolve=True))
    model = Transformer(ModelConfig.from_dict({**OmegaConf.to_container(cfg.model, resolve=True),
                                               "vocab_size": ds.vocab_size, "seq_len": ds.seq_len}))
    opt, _ = build_optimizer(model, OmegaConf.to_container(cfg.optim, resolve=True))
    loader = Loader(ds, tc.batch_size)
    arms = {"off": Telemetry(model, every=0), "on": Telemetry(model, every=1)}

    def one_step(tel: Telemetry, n: int) -> tuple[float, float]:
        micro = loader.next().micro_batches(tc.micro_batches)
        n_valid = count_valid_tokens(micro, "cpu")
        t0, c0 = time.perf_counter(), time.process_time()
        tel.start(n)
        forward_backward(model, micro, n_valid, tc.z_loss, 1, len(ds.source_names))
        tel.before_update()
        res = optimizer_step(model.parameters(), opt, None, tc.max_grad_norm)
        tel.finish(res.coef, opt)
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, time.process_time() - c0

    for n in range(args.warmup):
        one_step(arms["on" if n % 2 else "off"], n + 1)
    times: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    pair_ratios = []  # (wall, cpu) of on/off block medians, per pair
    n = args.warmup
    for pair in range(args.pairs):
        block_med = {}
        # NOTE: ABBA order (off on, on off, ...): a linear drift of the machine cancels over two pairs.
        for arm in ("off", "on") if pair % 2 == 0 else ("on", "off"):
            block = [one_step(arms[arm], n := n + 1) for _ in range(args.block)]
            times[arm] += block
            block_med[arm] = [statistics.median(t[j] for t in block) for j in (0, 1)]
        pair_ratios.append([block_med["on"][j] / block_med["off"][j] for j in (0, 1)])

    with torch.no_grad():
        loads = model(loader.next().tokens).moe_load
    t0 = time.perf_counter()
    for _ in range(100):
        moe_summary(loads)
        nonfinite_flags(2.0, 30.0, 1.0)
    extras_us = (time.perf_counter() - t0) / 100 * 1e6

    print(f"quickstart: batch {tc.batch_size} × {ds.seq_len} tokens, {tc.micro_batches} micro-batches, "
          f"{model.num_params() / 1e6:.2f}M params, {torch.get_num_threads()} threads; "
          f"{args.pairs} off/on pairs of {args.block}-step blocks (medians)")
    print(f"{'':10}{'off ms/step':>13}{'on ms/step':>12}{'overhead':>10}{'pairwise':>10}")
    for j, what in enumerate(("wall", "cpu")):
        off = statistics.median(t[j] for t in times["off"])
        on = statistics.median(t[j] for t in times["on"])
        pairwise = statistics.median(r[j] for r in pair_ratios)
        print(f"{what:10}{1e3 * off:>13.1f}{1e3 * on:>12.1f}{100 * (on / off - 1):>+9.1f}%"
              f"{100 * (pairwise - 1):>+9.1f}%")
    print(f"moe_summary + nonfinite_flags: {extras_us:.0f} µs/step (run every step in either arm)")


if __name__ == "__main__":
    main()
