"""Step time with per-layer telemetry off, at its default every 10 steps, and on every step, on the
quickstart (prints figures). Targets (issue 16): every-10 <= 2 %, every step <= 5 % of the step time.

    python -m bench.speed.telemetry_overhead threads=1            # 4 rounds of three 10-step blocks
    python -m bench.speed.telemetry_overhead --rounds 6 --block 10 threads=1 train.batch_size=16
    python -m bench.speed.telemetry_overhead --rounds 2 --paired 200 threads=1   # + 200 off/on step pairs
    python -m bench.speed.telemetry_overhead --paired 120 --out docs/results/telemetry_overhead.md threads=1

NOTE: on a shared 2-core machine pass threads=1: two intra-op threads fighting other jobs for the
cores made a step 30× slower here (22 s instead of 0.7 s), which drowns any overhead.

Builds the quickstart as train.py does (conf/config.yaml: mixed_tiny model, synthetic data, batch 16,
2 micro-batches) and times forward_backward → optimizer_step → zero_grad, with the telemetry calls
train.py makes around them. The arms take turns in blocks (the order rotating every round) on ONE model
and optimizer, so slow drift of a shared machine (±20 % here) hits all alike. Every step of a block
counts its own step number, so a 10-step block holds exactly one telemetry step of the every-10 arm:
its figure is the block's MEAN (a median would hide that step), like the other arms' beside it. Beside wall
time it reports this process's CPU time per step, which other jobs on the machine move less than wall time (with
threads=1 it is the step's compute; with more threads it also counts spinning).
The every-step extras (moe_summary, nonfinite_flags) run either way and are timed on their own.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.config import compose_config
from bench.report import Report
from data import build_data
from data.loader import Loader
from model import Transformer
from optim import build_optimizer
from optim.accumulate import count_valid_tokens, forward_backward
from precision import optimizer_step
from stability.config import TelemetryConfig
from stability.telemetry import Telemetry, moe_summary, nonfinite_flags


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4, help="rounds of one block per arm")
    p.add_argument("--block", type=int, default=10, help="steps per block (a multiple of 10)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--paired", type=int, default=0, metavar="N",
                   help="also N pairs of single steps, telemetry off then on, alternating: the median of the "
                        "per-pair CPU-time difference (a tighter figure than block means on a drifting machine)")
    p.add_argument("--out", help="also write the figures (markdown) to this file")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    args = p.parse_args()
    rep = Report("Per-layer telemetry: step time off, every 10 steps, every step",
                 "python -m bench.speed.telemetry_overhead")
    cfg = compose_config(args.overrides)
    tc = cfg.train
    torch.manual_seed(cfg.seed)
    ds = build_data(cfg.data)
    model = Transformer(cfg.model.for_data(ds))
    opt, _ = build_optimizer(model, cfg.optim)
    loader = Loader(ds, tc.batch_size)
    arms = {"off": Telemetry(model, TelemetryConfig(every=0)), "every10": Telemetry(model, TelemetryConfig(every=10)),
            "every1": Telemetry(model, TelemetryConfig(every=1))}
    names = list(arms)

    def one_step(tel: Telemetry, n: int) -> tuple[float, float]:
        micro = loader.next().micro_batches(tc.micro_batches)
        n_valid = count_valid_tokens(micro, "cpu")
        t0, c0 = time.perf_counter(), time.process_time()
        tel.start(n)
        forward_backward(model, micro, n_valid, tc.z_loss, 1, len(ds.source_names))
        tel.before_update()
        res = optimizer_step(model.parameters(), opt, None, tc.max_grad_norm)
        tel.finish(res.coef)
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, time.process_time() - c0

    for n in range(args.warmup):
        one_step(arms["every1" if n % 2 else "off"], n + 1)
    block_mean: dict[str, list[list[float]]] = {a: [] for a in names}  # (wall, cpu) mean per block
    for r in range(args.rounds):
        for arm in names[r % 3:] + names[:r % 3]:
            block = [one_step(arms[arm], i) for i in range(1, args.block + 1)]
            block_mean[arm].append([statistics.fmean(t[j] for t in block) for j in (0, 1)])

    with torch.no_grad():
        loads = model(loader.next().tokens).moe_load
    t0 = time.perf_counter()
    for _ in range(100):
        moe_summary(loads)
        nonfinite_flags(2.0, 30.0, 1.0)
    extras_us = (time.perf_counter() - t0) / 100 * 1e6

    rep.add(f"The quickstart: batch {tc.batch_size} × {ds.seq_len} tokens, {tc.micro_batches} micro-batches, "
            f"{model.num_params() / 1e6:.2f}M params, {torch.get_num_threads()} threads; {args.rounds} rounds of "
            f"{args.block}-step blocks per arm (block means; overhead = median over rounds of arm / off in that round, "
            "range in brackets).", "")
    cells = []
    for j, what in enumerate(("wall", "cpu")):
        off = [b[j] for b in block_mean["off"]]
        row = [what, f"{1e3 * statistics.median(off):.1f}"]
        for arm in names[1:]:
            ratios = [b[j] / o - 1 for b, o in zip(block_mean[arm], off)]
            row.append(f"{1e3 * statistics.median(b[j] for b in block_mean[arm]):.1f} ms, "
                       f"{100 * statistics.median(ratios):+.1f} % [{100 * min(ratios):+.1f}, {100 * max(ratios):+.1f}]")
        cells.append(row)
    rep.table(["time", "off ms/step", *names[1:]], cells)
    rep.add(f"- moe_summary + nonfinite_flags: {extras_us:.0f} µs/step (run every step in either arm)")
    if args.paired:
        # NOTE: one off step and one telemetry step back to back, the order alternating per pair: the drift of
        # a shared machine moves both halves of a pair alike, and the median of the differences drops outliers
        diff, off_t = [], []
        for i in range(args.paired):
            order = ("off", "every1") if i % 2 else ("every1", "off")
            t = {arm: one_step(arms[arm], 1)[1] for arm in order}
            diff.append(t["every1"] - t["off"])
            off_t.append(t["off"])
        d, o = statistics.median(diff), statistics.median(off_t)
        q = statistics.quantiles(diff, n=4)
        rep.add(f"- paired ({args.paired} pairs, CPU time): off {1e3 * o:.1f} ms/step; a telemetry step costs "
              f"{1e3 * d:+.1f} ms (quartiles {1e3 * q[0]:+.1f}, {1e3 * q[2]:+.1f}) = every step {100 * d / o:+.1f} %, "
              f"every 10 {10 * d / o:+.1f} %")
    rep.write(args.out)


if __name__ == "__main__":
    main()
