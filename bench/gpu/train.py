"""train.py's own BF16 throughput, MFU and host syncs per step on one GPU, beside the bare step of bench/gpu/mfu.py.

    python -m bench.gpu.train --json bench/out/gpu_train.json     # on the GPU: bench.gpu.mfu's ~125M model, compiled
    python -m bench.gpu.train --out bench/out/gpu_train.md        # also the table (markdown, bench/report.py's header)
    python -m bench.gpu.train --dry-run --json /tmp/gpu_train.json  # its tiny model on the CPU, eager: the code path

train.py runs as a user starts it, in a child process, on the model, data, optimizer and BF16 recipe that
bench.gpu.mfu declares (composed from conf/ as Hydra overrides and checked equal to those declarations before
the launch), at the bare step's batch, torch.compile'd as its compiled arm is. Everything else at its
default: the StepRecord and its sinks, the guard (guard=log: its detector scores every watched signal),
per-layer telemetry every telemetry.every steps. Checkpointing is off (checkpoint.every=0): at its default a
run this short saves only at its last step, which is left out anyway, and the save's cost is
bench/speed/checkpoint_stall.py's figure.

The run's steps, in order: warm-up (the compile, the telemetry steps' second graph, and the detector's own
warm-up: it scores nothing before guard.detector.warmup, so the timed steps pay for its scoring), timed
(a multiple of telemetry.every, so the window holds a user's share of telemetry steps: the figure is a mean,
a median would hide them), sync (one telemetry period under the sync count), and a last step (its
evaluation and final save) left out.

Figures: tokens/s as the StepRecord has it (batch × seq_len / time_s.total) and as the loop runs (the wall
time between step starts: the record, the sinks and the guard's bookkeeping after time_s.total included;
the goal is judged on this one); MFU = tokens/s × bench.gpu.mfu.flops_per_token / peak. Host syncs: on
CUDA each step of the sync window runs under torch.cuda.set_sync_debug_mode("warn") and its warnings are
counted; on a CPU nothing waits, so the calls that would (READS, made from this repository's code) are
counted instead, and the JSON's syncs.method says which.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import ROOT
from bench.gpu.mfu import (DATA, H200_BF16_DENSE_TFLOPS, MFU_GOAL, MODEL, OPTIM, TINY_DATA,
                           TINY_MODEL, flops_per_token)
from bench.report import Report

VS_BARE_GOAL = 0.95  # issue 28: train.py within 5 % of the bare step's tokens/s
SYNC_GOAL = 1        # issue 28 part 1: one host transfer a step at the default settings
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")  # Tensor methods that read to the host
SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's text under set_sync_debug_mode("warn")


def hydra_value(v) -> str:
    """A Python value as Hydra's override grammar writes it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{hydra_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    return str(v)


def overrides(model: dict, data: dict, batch: int, compile_: bool, steps: int, device: str) -> list[str]:
    """train.py's command line for bench.gpu.mfu's model, data, optimizer and recipe at this batch."""
    groups = {"model": model, "data": data, "optim": OPTIM}
    out = ["model=dense_tiny", "data=synthetic", "precision=bf16", f"device={device}"]  # the dense, unclamped base
    out += [f"{g}.{k}={hydra_value(v)}" for g, d in groups.items() for k, v in d.items()]
    out += [f"train.batch_size={batch}", "train.micro_batches=1", f"train.compile={hydra_value(compile_)}",
            f"train.steps={steps}", f"train.eval_every={steps}", "train.eval_samples=64", "checkpoint.every=0"]
    return out


def check_same(cfg, model: dict, data: dict) -> None:
    """The composed run is the bare step's: model, data, optimizer and recipe equal bench.gpu.mfu's."""
    from data.config import DataConfig
    from model import ModelConfig
    from optim.config import OptimConfig
    from precision.config import PrecisionConfig

    want = {"model": ModelConfig(**model), "data": DataConfig.from_dict(data), "optim": OptimConfig.from_dict(OPTIM),
            "precision": PrecisionConfig(name="bf16")}
    for group, value in want.items():
        if getattr(cfg, group) != value:
            sys.exit(f"bench.gpu.train: the composed {group} differs from bench.gpu.mfu's (the overrides miss a key)")


# ---------------------------------------------------------------------------- the child: train.py, observed

def child(book_path: str, sync_from: int, argv: list[str]) -> None:
    """Run train.py as `python train.py argv` would, booking each step's start time and, from step
    `sync_from` on, its host syncs; the book is written to book_path when train.py returns or exits."""
    from run import omp_wait  # noqa: F401  (before torch, as train.py imports it)
    import runpy

    import torch

    from stability.callbacks import Callbacks

    book: list[dict] = []
    real_before_batch = Callbacks.before_batch

    def before_batch(self, s):
        book.append({"step": s.step, "t": time.perf_counter(), "syncs": 0})
        if s.step == sync_from:
            count_syncs(book, torch)
        return real_before_batch(self, s)

    Callbacks.before_batch = before_batch
    sys.argv = [str(ROOT / "train.py"), *argv]
    try:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    finally:
        Path(book_path).write_text(json.dumps(book))


def count_syncs(book: list[dict], torch) -> None:
    """From now on, add each host sync to the current step's count (book[-1])."""
    if torch.cuda.is_available():
        import warnings

        shown = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING not in str(message):
                return shown(message, category, filename, lineno, file, line)
            book[-1]["syncs"] += 1

        # NOTE: installed now, after Hydra's logging set-up, so nothing replaces it; "always", because
        # Python shows a warning once per call site by default and every sync must count
        warnings.showwarning = showwarning
        warnings.filterwarnings("always", message=SYNC_WARNING)
        torch.cuda.set_sync_debug_mode("warn")
        return
    torch_files = (os.path.join("torch", "_tensor.py"), os.path.join("torch", "_tensor_str.py"))

    def ours() -> bool:  # a read this repository asked for (torch's own, e.g. AdamW's host step counter, is not)
        f = sys._getframe(2)
        while f is not None and f.f_code.co_filename.endswith(torch_files):  # Tensor.__format__ reads for its caller
            f = f.f_back
        name = f.f_code.co_filename if f is not None else ""
        return name.startswith(str(ROOT)) and "site-packages" not in name

    def wrap(real):
        def read(self, *args, **kwargs):
            if ours():
                book[-1]["syncs"] += 1
            return real(self, *args, **kwargs)
        return read

    for name in READS:
        setattr(torch.Tensor, name, wrap(getattr(torch.Tensor, name)))


# ---------------------------------------------------------------------------- the parent: launch and read

def measure(args, model: dict, data: dict, device: str, every: int) -> dict:
    import torch

    from bench.config import compose_config
    from data import build_data
    from model import Transformer

    steps = args.warmup + args.steps + every + 1
    argv = overrides(model, data, args.batch_size, args.compile, steps, device) + args.overrides
    cfg = compose_config(argv)
    check_same(cfg, model, data)
    if cfg.telemetry.every != every:
        sys.exit(f"bench.gpu.train: telemetry.every={cfg.telemetry.every}: the bench measures its default, {every}")
    with torch.device("meta"):  # the parameter count only: no memory, no init
        shape = Transformer(cfg.model.for_data(build_data(cfg.data)))
    seq_len, fpt = cfg.data.seq_len, flops_per_token(shape, cfg.data.seq_len)
    sync_from = args.warmup + args.steps + 1
    with tempfile.TemporaryDirectory(prefix="gpu-train-") as tmp:
        book_path, run_dir = Path(tmp) / "book.json", Path(tmp) / "run"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "bench.gpu.train", "--child", str(book_path), str(sync_from),
                            f"hydra.run.dir={run_dir}", *argv], cwd=ROOT, env=env)
        wall = time.perf_counter() - t0
        if r.returncode:
            sys.exit(f"bench.gpu.train: train.py exited {r.returncode} (its output is above)")
        from stability.record import read_records

        recs = {x["step"]: x for x in read_records(run_dir / "metrics.jsonl")}
        book = json.loads(book_path.read_text())
    starts = {b["step"]: b["t"] for b in book}
    timed = range(args.warmup + 1, args.warmup + args.steps + 1)
    sync_steps = range(sync_from, sync_from + every)
    tokens = args.batch_size * seq_len
    rec_s = sum(recs[s]["time_s"]["total"] for s in timed)
    loop_s = starts[timed[-1] + 1] - starts[timed[0]]
    tok_s, loop_tok_s = tokens * len(timed) / rec_s, tokens * len(timed) / loop_s
    syncs = {b["step"]: b["syncs"] for b in book if b["step"] in sync_steps}
    plain = [n for s, n in syncs.items() if s % every]
    peak = args.peak_tflops * 1e12
    return {
        "what": "train.py", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dry_run": args.dry_run, "overrides": argv, "matmul_params": shape.num_params(exclude_embedding=True),
        "params": shape.num_params(), "batch": args.batch_size, "seq_len": seq_len, "compile": args.compile,
        "defaults": {"guard": cfg.guard.action, "telemetry_every": every, "checkpoint": f"every {cfg.checkpoint.every}" if cfg.checkpoint.every else "off",
                     "log_every": cfg.logging.log_every, "wandb": cfg.logging.wandb},
        "steps": {"warmup": args.warmup, "timed": len(timed), "sync": len(sync_steps), "total": steps},
        "flops_per_token": fpt, "peak_tflops": args.peak_tflops,
        "tokens_per_s": tok_s, "mfu": tok_s * fpt / peak,
        "tokens_per_s_median": tokens / statistics.median(recs[s]["time_s"]["total"] for s in timed),
        "loop_tokens_per_s": loop_tok_s, "loop_mfu": loop_tok_s * fpt / peak,
        "step_ms": {str(s): 1e3 * recs[s]["time_s"]["total"] for s in recs},
        "warmup_s": sum(recs[s]["time_s"]["total"] for s in range(1, args.warmup + 1)), "wall_s": wall,
        "syncs": {"method": ("torch.cuda.set_sync_debug_mode('warn') warnings" if device == "cuda" else
                             f"CPU: no device sync; calls of Tensor.{'/'.join(READS)} from this repository's code"),
                  "per_step": {str(s): n for s, n in syncs.items()},
                  "plain_step": statistics.median(plain) if plain else None,
                  "telemetry_step": next((n for s, n in syncs.items() if s % every == 0), None),
                  "max": max(syncs.values())},
    }


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
        return
    from stability.config import DetectorConfig, TelemetryConfig

    p = argparse.ArgumentParser(prog="python -m bench.gpu.train", description=__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=DetectorConfig().warmup,
                   help="untimed steps first (default: the detector's own warm-up, so the timed steps score)")
    p.add_argument("--steps", type=int, default=4 * TelemetryConfig().every, help="timed steps (× telemetry.every)")
    p.add_argument("--batch-size", type=int, default=64, help="the bare step's batch in bench/gpu/all.sh")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager (the bare step's eager arm)")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    p.add_argument("--dry-run", action="store_true", help="tiny model, eager, a few steps on the CPU: the code path")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "gpu_train.json")
    p.add_argument("--out", help="also write the table (markdown) to this file")
    p.add_argument("overrides", nargs="*", help="more Hydra overrides for train.py (after the bench's own)")
    args = p.parse_args()
    every = TelemetryConfig().every
    if args.dry_run:
        model, data, device = TINY_MODEL, TINY_DATA, "cpu"
        args.warmup, args.steps, args.batch_size, args.compile = 2, every, 2, False
        args.overrides = ["threads=1", *args.overrides]
    else:
        import torch

        if not torch.cuda.is_available():
            sys.exit("bench.gpu.train: needs a CUDA GPU; none found (--dry-run runs a tiny model on the CPU)")
        model, data, device = MODEL, DATA, "cuda"
    if args.steps <= 0 or args.steps % every:
        sys.exit(f"bench.gpu.train: --steps={args.steps} must be a positive multiple of telemetry.every={every}")
    rep = Report("train.py's own throughput, MFU and host syncs on one GPU", "python -m bench.gpu.train")
    r = measure(args, model, data, device, every)
    s, d = r["syncs"], r["defaults"]
    rep.add(f"train.py, {r['matmul_params'] / 1e6:.1f}M matmul params, batch {r['batch']}×{r['seq_len']}, "
            f"{'compiled' if r['compile'] else 'eager'}, guard={d['guard']}, telemetry every {every}, checkpointing "
            f"{d['checkpoint']}; {r['steps']['timed']} timed steps after {r['steps']['warmup']} warm-up steps"
            + (" (dry run: meaningless)." if args.dry_run else "."), "")
    rep.table(["tokens/s as", "tokens/s", "MFU"],
              [("the loop runs (wall time between step starts)", f"{r['loop_tokens_per_s']:.0f}",
                f"{100 * r['loop_mfu']:.1f} %"),
               ("the StepRecord has it (time_s.total)", f"{r['tokens_per_s']:.0f}", f"{100 * r['mfu']:.1f} %")])
    rep.add(f"- host syncs a step: {s['plain_step']} ({s['telemetry_step']} on a telemetry step) [{s['method']}]",
            f"- target MFU >= {100 * MFU_GOAL:.0f} %: {'met' if r['loop_mfu'] >= MFU_GOAL else 'NOT met'}; within "
            f"{100 * (1 - VS_BARE_GOAL):.0f} % of the bare step and {SYNC_GOAL} sync a step: bench/gpu/table.py")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(r, indent=1) + "\n")
    rep.write(args.out)

if __name__ == "__main__":
    main()
