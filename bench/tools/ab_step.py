"""Step time of train.py, the working tree against a ref commit, runs interleaved (prints figures).

    python -m bench.tools.ab_step main                                     # the default job, 3 rounds of 30 steps
    python -m bench.tools.ab_step main --arms "" telemetry.every=0 telemetry.every=1 --rounds 3 --out FILE.md

Each run is train.py as a user starts it, one thread, stopped after --steps by checkpoint.stop_after; REF
runs in a temporary `git worktree`. Its figure is the median over steps 3..steps-1 of StepRecord
time_s.cpu (this process's CPU time: other jobs on a shared machine move it less than wall time) and of
time_s.total; the first steps warm caches and the last one evaluates. Arms (each a space-separated list
of overrides, "" for the default job) and the two sides take turns run by run, the order rotating every
round, so a drifting machine hits all alike. Per arm: each side's median over rounds, and the working
tree's ratio to REF within each round (median, range). Against the first arm, each other arm's cost on the
same side (e.g. telemetry every step against telemetry off).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import ROOT
from bench.report import Report

QUIET = ["threads=1", "logging.progress=false", "logging.wandb=disabled", "logging.plot=false"]


def one(checkout: Path, out: Path, steps: int, overrides: list[str]) -> tuple[float, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # each side imports its own checkout (train.py runs from its root)
    r = subprocess.run([sys.executable, "train.py", f"hydra.run.dir={out}", f"checkpoint.stop_after={steps}",
                        *QUIET, *overrides], cwd=checkout, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"bench.tools.ab_step: {' '.join(overrides)} failed in {checkout}: {r.stderr[-2000:]}")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()][2:-1]
    return (statistics.median(x["time_s"]["cpu"] for x in recs) * 1e3,
            statistics.median(x["time_s"]["total"] for x in recs) * 1e3)


def spread(xs: list[float]) -> str:
    return f"{100 * statistics.median(xs):+.1f} % [{100 * min(xs):+.1f}, {100 * max(xs):+.1f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tools.ab_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("ref", help="the commit to compare the working tree with (e.g. main)")
    ap.add_argument("--arms", nargs="+", default=[""], help='override lists, "" = the default job')
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, help="also write the tables as markdown here")
    a = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    sides = ["ref", "now"]
    got = {(arm, side): [] for arm in a.arms for side in sides}  # (cpu ms, wall ms) per run
    with tempfile.TemporaryDirectory(prefix="ab-step-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), a.ref], cwd=ROOT, check=True)
        try:
            runs = [(arm, side) for arm in a.arms for side in sides]
            for r in range(a.rounds):
                for i, (arm, side) in enumerate(runs[r % len(runs):] + runs[:r % len(runs)]):
                    out = Path(tmp) / f"r{r}-{i}"
                    got[arm, side].append(one(base if side == "ref" else ROOT, out, a.steps, arm.split()))
                    print(f"round {r} | {arm or 'default'} | {side}: {got[arm, side][-1][0]:.0f} ms CPU a step",
                          flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    ref = subprocess.run(["git", "rev-parse", "--short=12", a.ref], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    rep = Report("Step time, working tree vs ref", "python -m bench.tools.ab_step", argv)
    rep.add(f"{a.ref} ({ref}) against the working tree, threads=1; {a.rounds} rounds of {a.steps}-step runs, the "
            f"median of steps 3..{a.steps - 1} per run; the ratio is per round (median, range).", "")
    rep.table(["arm", "ref CPU ms/step", "now CPU ms/step", "now / ref CPU", "ref wall ms", "now wall ms"],
              [(arm or "default", f"{statistics.median(x[0] for x in got[arm, 'ref']):.0f}",
                f"{statistics.median(x[0] for x in got[arm, 'now']):.0f}",
                spread([n[0] / r[0] - 1 for r, n in zip(got[arm, "ref"], got[arm, "now"])]),
                f"{statistics.median(x[1] for x in got[arm, 'ref']):.0f}",
                f"{statistics.median(x[1] for x in got[arm, 'now']):.0f}") for arm in a.arms])
    if len(a.arms) > 1:
        first = a.arms[0]
        rep.add(f"Each arm against `{first or 'default'}` on the same side (CPU time, per round):", "")
        rep.table(["arm", "ref", "now"],
                  [(arm or "default", *(spread([x[0] / y[0] - 1 for x, y in zip(got[arm, side], got[first, side])])
                                        for side in sides)) for arm in a.arms[1:]])
    rep.write(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
