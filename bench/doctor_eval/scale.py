"""The doctor's cost on long runs: a synthesised record of N steps (a healthy run of the quickstart's
shape: 12 telemetry layers, 2 sources, optimizer-state norms, per-rank inputs, per-step times), one fault
near the end; prints wall time and peak memory per N.

    python -m bench.doctor_eval.scale                    # N = 5000, 10000, 20000
    python -m bench.doctor_eval.scale --steps 20000

Each N runs in a fresh process (peak RSS is per process); OMP_NUM_THREADS=1.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import ROOT


LAYERS = ["emb"] + [f"block{i}{s}" for i in range(4) for s in (".attn", ".mlp", "")] + ["norm", "head"]


def synthesise(d: Path, n: int, fault_at: int) -> None:
    rng = random.Random(0)
    u = lambda: rng.uniform(-1, 1)  # noqa: E731
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "metrics.jsonl", "w") as f:
        tokens = 0
        for t in range(1, n + 1):
            spike = 30.0 if t >= fault_at else 1.0  # a level that steps and holds: a fault in unchecked records
            layers = {k: {"act_rms": 0.5 * (1 + 0.05 * u()) * (spike if k == "block2.mlp" else 1.0),
                          **({} if k.startswith("block") and "." not in k else
                             {"grad_rms": 0.01 * (1 + 0.1 * u()), "update_ratio": 0.01 * (1 + 0.1 * u())})}
                      for k in LAYERS}
            valid = 1500 + int(100 * u())
            tokens += valid
            rec = {"step": t, "tokens": tokens, "ckpt_id": None, "batch": {"first": 16 * (t - 1), "size": 16},
                   "source_mix": {"a": 8, "b": 8}, "valid_tokens": valid, "tokens_by_source": {"a": 750, "b": 750},
                   "inputs": {"valid_frac": 0.7 + 0.02 * u(), "label_alignment": 1.0, "top_token_frac": 0.06 + 0.005 * u(),
                              "doc_start_frac": 1.0, "entropy": 3.6 + 0.05 * u(), "foreign_frac": 0.0,
                              "kl_running": 0.3 + 0.05 * u(), "rare_frac": 0.0},
                   "loss": 2.0 + 0.05 * u(), "loss_by_source": {"a": 1.5 + 0.05 * u(), "b": 2.5 + 0.05 * u()},
                   "z_loss": 20 + u(), "aux_loss": 0.01, "logit_max": 5 + 0.1 * u(), "layers": layers,
                   "nonfinite": {"loss": False, "logits": False, "grads": False, "optim_state": False},
                   "update_ratio_max": 0.012 * (1 + 0.05 * u()), "lr": 1e-3, "grad_norm": 0.7 * (1 + 0.1 * u()),
                   "clip_coef": 1.0, "skipped": False,
                   "time_s": {"data": 0.002 * (1 + 0.1 * u()), "fwd_bwd": 0.05 * (1 + 0.1 * u()),
                              "optim": 0.01 * (1 + 0.1 * u()), "log_eval": 1e-4, "ckpt": 1e-5, "total": 0.062,
                              "cpu": 0.06},
                   "tokens_per_s": 30000.0, "memory_mb": 400.0, "world": 2, "replica": {"param_sum_spread": 0.0},
                   "guard": {"triggers": [], "rollbacks": 0}, "events": [], "eval": None, "resume": None,
                   "state": {"m/decay": 0.1 * (1 + 0.02 * u()), "v/decay": 0.01 * (1 + 0.02 * u())},
                   "ranks": {"first": [16 * (t - 1), 16 * (t - 1) + 8], "n": [8, 8], "hash": [t, t],
                             "loss": [2.0 + 0.05 * u(), 2.0 + 0.05 * u()]},
                   "fingerprint": {"model": "0a1b2c3d", "optim": "4e5f6a7b", "precision": "8c9d0e1f", "seed": "2a3b4c5d",
                                   "train": "6e7f8a9b", "data": "0c1d2e3f4a5b"}, "version": 3}
            f.write(json.dumps(rec) + "\n")
    # NOTE: no warmup, as the records' constant lr says: the doctor checks the lr against the schedule
    (d / "config.yaml").write_text("optim: {lr: 0.001, schedule: {name: constant, warmup_steps: 0}}\n"
                                   "train: {steps: %d}\n" % n)


def one(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "run"
        synthesise(d, n, fault_at=n - 100)
        size = (d / "metrics.jsonl").stat().st_size
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        from doctor.cli import doctor
        t0, c0 = time.perf_counter(), time.process_time()
        rep = doctor(d, plots=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        e = rep["earliest"] or {}
        print(json.dumps([n, f"{size / 2**20:.1f}", f"{wall:.2f}", f"{cpu:.2f}", f"{peak:.0f} (+{peak - base:.0f})",
                          f"{rep['class']} at {e.get('step')} ({e.get('quantity')})"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, nargs="*", default=[5000, 10000, 20000])
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    args = ap.parse_args(argv)
    if args.one:
        one(args.one)
        return 0
    from bench.report import Report
    out = Report("The doctor's cost on long records", "python -m bench.doctor_eval.scale", argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = [sys.executable, "-m", "bench.doctor_eval.scale", "--one"]
    rows = [json.loads(subprocess.run([*child, str(n)], cwd=ROOT, env=env, check=True, capture_output=True,
                                      text=True).stdout.strip().splitlines()[-1])
            for n in args.steps]
    out.table(["steps", "metrics.jsonl MiB", "doctor wall s", "doctor CPU s", "peak RSS MiB (doctor's share)", "finding"],
              rows)
    out.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
