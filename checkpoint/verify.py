"""Prove that resuming continues the run you would have had.

    python -m checkpoint.verify +experiment=quickstart --steps 50 50
    python -m checkpoint.verify --steps 50 50 --nproc 2 1                  # world size 2 -> 1
    python -m checkpoint.verify --steps 50 50 --data-change data.seed=7    # a declared data change

Runs A+B steps straight; then A steps, save, and B steps in a *fresh process* (resume=latest). Prints
per step the batch ids, lr and loss of both, then compares the final checkpoints tensor by tensor
(every parameter, buffer and optimizer moment). Exit status 1 past the tolerance. Any other argument
is a Hydra override passed to every train.py run.

Tolerance (--rtol): 0 (bit-identical) by default on one process; 1e-6 relative on several (gloo
reduction order); 1e-4 across a world-size change, where the same global batch is summed in another
order. Batch ids and lr must always match exactly. Under --data-change only the first A steps
compare losses; the run must first be refused without resume.allow_data_change.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]


def launch(run_dir: Path, overrides: list[str], nproc: int, log: Path) -> subprocess.CompletedProcess:
    args = [f"hydra.run.dir={run_dir}", *overrides]
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([*launcher, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    log.write_text(f"$ {' '.join([*launcher, 'train.py', *args])}\n{r.stdout}\n{r.stderr}")
    return r


def must(r: subprocess.CompletedProcess, what: str, log: Path) -> None:
    if r.returncode != 0:
        sys.exit(f"verify: the {what} run failed (exit {r.returncode}); see {log}\n{r.stderr[-2000:]}")


def records(run_dir: Path) -> dict[int, dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return {r["step"]: r for r in map(json.loads, f)}


def rel(a: float, b: float) -> float:
    return 0.0 if a == b else abs(a - b) / max(abs(a), abs(b), 1e-30)


def compare_steps(straight: dict, resumed: dict, A: int, total: int, rtol: float, losses_from_b: bool) -> bool:
    ok = True
    print(f"{'step':>5} {'part':>4}  {'batch first':>17}  {'lr':>21}  {'loss straight':>14} {'loss resumed':>14} "
          f"{'rel diff':>9}")
    for s in range(1, total + 1):
        x, y = straight.get(s), resumed.get(s)
        if x is None or y is None:
            print(f"{s:>5}  missing in the {'straight' if x is None else 'resumed'} run")
            ok = False
            continue
        d = rel(x["loss"], y["loss"])
        checked = s <= A or losses_from_b
        row_ok = x["batch"] == y["batch"] and x["lr"] == y["lr"] and (not checked or d <= rtol)
        ok &= row_ok
        mark = "" if row_ok else "  <-- MISMATCH"
        note = "" if checked else " (new data: not compared)"
        print(f"{s:>5} {'A' if s <= A else 'B':>4}  {x['batch']['first']:>8}={y['batch']['first']:<8}  "
              f"{x['lr']:.3e}={y['lr']:.3e}  {x['loss']:>14.8f} {y['loss']:>14.8f} {d:>9.2e}{note}{mark}")
    return ok


def compare_final(a_dir: Path, b_dir: Path, rtol: float) -> bool:
    from checkpoint.state import read_tensors

    a, b = read_tensors(a_dir), read_tensors(b_dir)
    if set(a) != set(b):
        print(f"final state: tensor names differ: {sorted(set(a) ^ set(b))[:3]}")
        return False
    worst, name, identical = 0.0, "", 0
    for k in sorted(a):
        x, y = a[k].double(), b[k].double()
        if x.shape != y.shape:
            print(f"final state: {k} has shape {tuple(x.shape)} vs {tuple(y.shape)}")
            return False
        identical += bool(a[k].equal(b[k]))
        scale = max(x.abs().max().item(), y.abs().max().item(), 1e-30) if x.numel() else 1.0
        d = (x - y).abs().max().item() / scale if x.numel() else 0.0
        if d > worst:
            worst, name = d, k
    n_model = sum(k.startswith("model.") for k in a)
    print(f"final state: {len(a)} tensors ({n_model} model, {len(a) - n_model} optimizer), "
          f"{identical} bit-identical; max rel diff {worst:.2e}" + (f" ({name})" if name else ""))
    return worst <= rtol


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m checkpoint.verify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", nargs=2, type=int, required=True, metavar=("A", "B"),
                   help="steps before the save, steps after the resume")
    p.add_argument("--nproc", nargs=2, type=int, default=(1, 1), metavar=("N_A", "N_B"),
                   help="processes for the straight run and part A, and for part B")
    p.add_argument("--data-change", action="append", default=None, metavar="OVERRIDE",
                   help="an override that changes the data for part B (e.g. data.seed=7); repeatable")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance on losses and final tensors")
    p.add_argument("--out", type=Path, default=None, help="work directory (default runs/verify-<time>)")
    args, overrides = p.parse_known_args(argv)
    A, B = args.steps
    n_a, n_b = args.nproc
    if A < 1 or B < 1 or n_a < 1 or n_b < 1:
        p.error("--steps and --nproc take positive integers")
    rtol = args.rtol if args.rtol is not None else (0.0 if n_a == n_b == 1 else 1e-6 if n_a == n_b else 1e-4)
    out = args.out or ROOT / "runs" / f"verify-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    total = A + B
    common = [*overrides, f"train.steps={total}", "logging.progress=false", "logging.plot=false"]
    t0 = time.perf_counter()

    straight, resumed = out / "straight", out / "resumed"
    phases = 4 if args.data_change else 3

    def phase(i: int, what: str, log: Path) -> Path:  # one line per run: each is minutes on a CPU
        print(f"verify [{i}/{phases}] {what} (log {log}; {time.perf_counter() - t0:.0f} s so far)", flush=True)
        return log

    log = phase(1, f"the straight run: {total} steps on {n_a} process(es)", out / "straight.log")
    must(launch(straight, [*common, f"checkpoint.every={total}"], n_a, log), "straight", log)
    log = phase(2, f"part A: {A} steps, then save", out / "part_a.log")
    must(launch(resumed, [*common, f"checkpoint.stop_after={A}"], n_a, log), "part A", log)

    part_b = [*common, f"checkpoint.every={total}"]
    if n_b != n_a:  # keep the samples per micro-batch, so each micro-batch is the same computation
        micro = OmegaConf.load(resumed / "config.yaml").train.micro_batches
        if (micro * n_a) % n_b:
            sys.exit(f"verify: train.micro_batches={micro} x {n_a} processes cannot be split over {n_b}")
        part_b.append(f"train.micro_batches={micro * n_a // n_b}")
    refused = None
    if args.data_change:
        log = phase(3, "part B on new data, undeclared: must be refused", out / "part_b_refused.log")
        r = launch(resumed, [*part_b, *args.data_change, "resume.path=latest"], n_b, log)
        refused = r.returncode != 0 and "allow_data_change" in r.stderr
        part_b += [*args.data_change, "resume.path=latest", "resume.allow_data_change=true"]
    else:
        part_b.append("resume=latest")
    log = phase(phases, f"part B: resume in a fresh process, {B} steps on {n_b} process(es)", out / "part_b.log")
    must(launch(resumed, part_b, n_b, log), "part B (resumed)", log)

    print(f"verify: {A}+{B} steps straight ({n_a} proc) vs {A} -> save -> fresh process -> {B} ({n_a} -> {n_b} proc)"
          f"{' with a data change' if args.data_change else ''}; rtol {rtol:g}; runs under {out}")
    ok = compare_steps(records(straight), records(resumed), A, total, rtol, losses_from_b=not args.data_change)
    if args.data_change:
        print(f"data change refused without resume.allow_data_change: {'yes' if refused else 'NO'}")
        ok &= bool(refused)
        print("final state: not compared (part B trained on other data)")
    else:
        from checkpoint.publish import step_name

        final = step_name(total)
        ok &= compare_final(straight / "checkpoints" / final, resumed / "checkpoints" / final, rtol)
    print(f"{'PASS' if ok else 'FAIL'} in {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
