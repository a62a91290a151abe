"""ballast's whole training-loop step against nanoGPT's own step, interleaved in one process.

    NANOGPT_DIR=/path/to/nanoGPT python -m bench.speed.anchor_compare [--steps 200] [--compile] [overrides...]
    NANOGPT_DIR=... python -m bench.speed.anchor_compare +experiment=speedrun threads=1
    NANOGPT_DIR=... python -m bench.speed.anchor_compare --raw [--compile] threads=1   # the bare steps, no bookkeeping
    NANOGPT_DIR=... python -m bench.speed.anchor_compare --out docs/results/anchor_compare.md threads=1

The anchor is nanoGPT itself (bench/speed/nanogpt.py: its model.py and configure_optimizers from the checkout,
its README's CPU configuration, its batch draw from its train.bin). ballast runs train.py's real loop
(`train(run)`, run/build.py: StepRecord, telemetry, guard and sinks at the experiment's settings; default
+experiment=shakespeare_char); after each ballast step one nanoGPT step runs inside a last sink, so the
two alternate step by step and see the machine at the same moments. ballast's step is the wall time
between the end of one nanoGPT step and the next record reaching the sink: the whole loop iteration,
bookkeeping and the other sinks included. Steps that evaluate and the first `--warmup` (the compile when
on) are left out of both medians. --compile compiles both models (train.compile=true for ballast).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import ROOT
from bench.speed import nanogpt
from bench.report import Report

DATA = os.environ.get("TINYSHAKESPEARE", "tinyshakespeare.txt")  # README: Running


class AnchorSink:
    """The last sink: times the ballast iteration that just ended, then runs and times one anchor step."""

    def __init__(self, anchor_step, warmup: int):
        self.anchor_step, self.warmup = anchor_step, warmup
        self.ours: list[float] = []
        self.anchor: list[float] = []
        self.ours_cpu: list[float] = []
        self.anchor_cpu: list[float] = []
        self.parts: list[dict[str, float]] = []  # the StepRecord's own time_s of each kept ballast step
        self.t_end: float | None = None
        self.c_end: float | None = None

    def write(self, rec) -> None:
        now, cnow = time.perf_counter(), time.process_time()
        keep = rec.step > self.warmup and rec.eval is None
        if keep and self.t_end is not None:
            self.ours.append(now - self.t_end)
            self.ours_cpu.append(cnow - self.c_end)
            self.parts.append(dict(rec.time_s))
        t0, c0 = time.perf_counter(), time.process_time()
        self.anchor_step()
        t1, c1 = time.perf_counter(), time.process_time()
        if keep:
            self.anchor.append(t1 - t0)
            self.anchor_cpu.append(c1 - c0)
        self.t_end, self.c_end = time.perf_counter(), time.process_time()

    def close(self) -> None:
        """The sink protocol's close: the timings live in memory, nothing to flush."""


def build_ballast_run(overrides: list[str], run_dir: Path):
    """A Run exactly as train.py's main() builds it (run/build.py), from Hydra overrides."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from parallel import init_distributed
    from run.build import build_run
    from run.config import register

    register()
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[*overrides, f"hydra.run.dir={run_dir}"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return build_run(cfg, init_distributed(cfg.device))


def medians_by_round(xs: list[float], rounds: int) -> list[float]:
    n = len(xs) // rounds
    return [statistics.median(xs[i * n:(i + 1) * n]) for i in range(rounds)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="interleaved steps (each side)")
    ap.add_argument("--warmup", type=int, default=15, help="first steps left out (the compile when on)")
    ap.add_argument("--rounds", type=int, default=4, help="consecutive blocks the medians are also given for")
    ap.add_argument("--compile", action="store_true", help="compile both models")
    ap.add_argument("--nanogpt", default=None, help="nanoGPT checkout (default $NANOGPT_DIR)")
    ap.add_argument("--raw", action="store_true",
                    help="ballast's bare step instead (bench/config.py: batch, forward/backward, clip, AdamW, "
                         "schedule; no StepRecord, telemetry, guard or sinks): the model and optimizer alone")
    ap.add_argument("--out", help="also write the figures (markdown) to this file")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for ballast (default +experiment=shakespeare_char)")
    args = ap.parse_args()
    rep = Report("train.py's step against nanoGPT's, interleaved", "python -m bench.speed.anchor_compare")
    root = nanogpt.nanogpt_dir(args.nanogpt)
    over = list(args.overrides)
    if not any(o.startswith("+experiment=") for o in over):
        over.insert(0, "+experiment=shakespeare_char")
    if not any(o.startswith("data.path=") for o in over):
        over.append(f"data.path={DATA}")
    steps = args.steps + args.warmup
    # NOTE: stop_after, not train.steps: the run keeps the experiment's schedule (lr, warm-up) step for step
    over += [f"checkpoint.stop_after={steps}", "train.eval_every=1000000", "logging.wandb=disabled",
             "logging.progress=false", "logging.plot=false", "logging.log_every=0", "train.eval_samples=240",
             "train.eval_batch_size=240",
             f"train.compile={str(args.compile).lower()}"]
    if args.raw:
        compare_raw(root, over, args, rep)
        return rep.write(args.out)
    from run.lifecycle import Interrupts
    from train import train  # train.py's loop

    with tempfile.TemporaryDirectory(prefix="anchor_compare-") as tmp:
        run = build_ballast_run(over, Path(tmp) / "run")
        model, opt = nanogpt.build(root, run.dataset.vocab_size)
        fwd = torch.compile(model) if args.compile else model
        sink = AnchorSink(nanogpt.make_step(model, opt, nanogpt.Batches(root), fwd), args.warmup)
        run.sinks.append(sink)
        try:
            with Interrupts(run.dist) as stop:
                train(run, stop)
        finally:
            run.close()
    ours, anchor = sink.ours, sink.anchor
    k = min(len(ours), len(anchor))
    ours, anchor = ours[:k], anchor[:k]
    n_ours = run.model.num_params()
    n_anchor = sum(p.numel() for p in model.parameters())
    tokens = nanogpt.CPU_COMMAND["batch_size"] * nanogpt.CPU_COMMAND["block_size"]
    rep.add(f"- parameters: ballast {n_ours:,} | nanoGPT {n_anchor:,} (tied wte and wpe included) | "
          f"ratio {n_ours / n_anchor:.3f}")
    rep.add(f"- {k} interleaved steps each, {torch.get_num_threads()} threads, compile={args.compile}")
    for name, xs in (("ballast", ours), ("nanoGPT", anchor)):
        m = statistics.median(xs)
        rounds = " ".join(f"{r * 1e3:.1f}" for r in medians_by_round(xs, args.rounds))
        rep.add(f"- {name}: median {m * 1e3:.1f} ms/step, {tokens / m / 1e3:.2f}k tokens/s; by round: {rounds}")
    oc, ac = statistics.median(sink.ours_cpu[:k]), statistics.median(sink.anchor_cpu[:k])
    # NOTE: process CPU time: with threads=1 it is the step's own compute, which other jobs on a shared
    # machine move far less than wall time (with more threads it also counts their spinning)
    rep.add(f"- CPU time per step: ballast {oc * 1e3:.1f} ms | nanoGPT {ac * 1e3:.1f} ms | ballast speed / nanoGPT "
          f"speed {ac / oc:.3f}")
    # Where ballast's iteration goes: the StepRecord's own phases (train.py), and what lies outside them
    # (building the record, the sinks before this one); nanoGPT's figure is its whole step.
    keys = [k_ for k_ in ("data", "route", "fwd_bwd", "optim", "log_eval", "ckpt", "total") if k_ in sink.parts[0]]
    parts = {k_: statistics.median(p[k_] for p in sink.parts[:k]) for k_ in keys}
    outside = statistics.median(ours) - parts["total"]
    rep.add("- ballast iteration, median per phase (ms): " + " | ".join(f"{k_} {v * 1e3:.2f}" for k_, v in parts.items())
          + f" | record + sinks (outside total) {outside * 1e3:.2f} ms")
    pair = statistics.median(a / o for o, a in zip(ours, anchor))
    by_round = [a / o for o, a in zip(medians_by_round(ours, args.rounds), medians_by_round(anchor, args.rounds))]
    rep.add(f"- ballast speed / nanoGPT speed: {statistics.median(anchor) / statistics.median(ours):.3f} "
            f"(median of per-step pairs {pair:.3f}; by round {' '.join(f'{r:.3f}' for r in by_round)})")
    rep.write(args.out)


def compare_raw(root: Path, over: list[str], args, rep: Report) -> None:
    """ballast's bare step against nanoGPT's, one each in turn (the order swapping every pair), CPU time."""

    from bench.config import build_train_step, compose_config
    from data import build_data

    cfg = compose_config(over)
    vocab = build_data(cfg.data).vocab_size
    ours_step, _ = build_train_step(cfg)
    model, opt = nanogpt.build(root, vocab)
    fwd = torch.compile(model) if args.compile else model
    anchor_step = nanogpt.make_step(model, opt, nanogpt.Batches(root), fwd)
    times: dict[str, list[float]] = {"ballast": [], "nanoGPT": []}
    pair = [("ballast", ours_step), ("nanoGPT", anchor_step)]
    for i in range(args.warmup + args.steps):
        for name, f in pair if i % 2 else pair[::-1]:
            c0 = time.process_time()
            f()
            if i >= args.warmup:
                times[name].append(time.process_time() - c0)
    o, a = statistics.median(times["ballast"]), statistics.median(times["nanoGPT"])
    rep.add(f"- bare steps (no StepRecord, telemetry, guard, sinks), {args.steps} pairs, {torch.get_num_threads()} "
          f"threads, compile={args.compile}: CPU time per step ballast {o * 1e3:.1f} ms | nanoGPT {a * 1e3:.1f} ms "
          f"| ballast speed / nanoGPT speed {a / o:.3f}")


if __name__ == "__main__":
    main()
