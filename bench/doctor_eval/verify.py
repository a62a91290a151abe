"""What `python -m doctor RUN --verify` says and costs on the default job: its clean run (a natural incident),
a blind incident of `labs.incident` (a fault planted and scrubbed from the run's files), and the default job on a
recipe moved off its default (25× the LR, no warm-up: a recipe instability, whose lever the fix's rerun proves).

    python -m bench.doctor_eval.verify [--seed 12] [--cases clean blind recipe] [--out docs/results/doctor_verify.md]

Trains each case's run, verifies each and prints (and with --out
writes, bench/report.py) the verify lines, the replayed steps and the seconds each run took, under a header
naming the machine, the date and the commit. The records themselves are bit-reproducible; the seconds are this machine's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import ROOT
from bench.report import Report
QUIET = ["logging.progress=false", "logging.wandb=disabled", "logging.plot=false"]
RECIPE = ["optim.lr=5e-2", "optim.schedule.warmup_steps=0"]  # the default job's LR ×25, without its warm-up


def sh(*cmd: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode not in (0, 2):
        raise SystemExit(f"bench.doctor_eval.verify: {' '.join(cmd)} failed ({r.returncode}): {r.stderr[-500:]}")
    return r


def verify(run_dir: Path) -> tuple[list[str], dict, float]:
    t0 = time.perf_counter()
    r = sh("-m", "doctor", str(run_dir), "--verify", "--no-plots")
    lines = [x for x in r.stdout.splitlines() if x.startswith("verify: ") and "step(s) (" not in x]
    return lines, json.loads((run_dir / "report.json").read_text())["verified"], time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.doctor_eval.verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=12, help="the blind incident's seed (labs.incident new --seed)")
    ap.add_argument("--cases", nargs="+", choices=("clean", "blind", "recipe"), default=["clean", "blind", "recipe"])
    ap.add_argument("--out", type=Path, help="also write the result as markdown here")
    a = ap.parse_args(argv)
    rep = Report("The doctor's proof on the default job", "python -m bench.doctor_eval.verify", argv)
    with tempfile.TemporaryDirectory() as tmp:
        clean, blind, recipe = Path(tmp) / "quickstart", Path(tmp) / f"incident-{a.seed}", Path(tmp) / "recipe"
        cases = {"clean": ("The default run (`python train.py`)", clean, "python -m doctor runs/<run> --verify",
                           lambda: sh("train.py", f"hydra.run.dir={clean}", *QUIET)),
                 "blind": (f"A blind incident (`python -m labs.incident new --seed {a.seed}`)", blind,
                           f"python -m doctor runs/incident-{a.seed} --verify",
                           lambda: sh("-m", "labs.incident", "new", "--seed", str(a.seed), "--out", str(blind))),
                 "recipe": (f"A recipe moved off its default (`python train.py {' '.join(RECIPE)}`)", recipe,
                            "python -m doctor runs/<run> --verify",
                            lambda: sh("train.py", f"hydra.run.dir={recipe}", *QUIET, *RECIPE))}
        for name in a.cases:
            title, d, cmd, train = cases[name]
            train()
            lines, v, secs = verify(d)
            runs = v.get("runs", [])
            each = ", ".join(f"{r['name']} {r['seconds']:.0f} s" for r in runs)
            rep.add(f"## {title}", "")
            rep.block("\n".join([f"$ {cmd}", *lines]))
            rep.add(f"Cost: {v.get('replayed_steps', 0)} replayed steps in {len(runs)} train.py runs ({each}); "
                    f"{secs:.0f} s in all.", "")
    rep.write(a.out)
    return 0

if __name__ == "__main__":
    sys.exit(main())
