"""The default job's step time alone on the machine and beside busy processes, by how OpenMP threads wait.

    python -m bench.speed.threads                        # load 0 and 6, 16 steps a run, each variant twice
    python -m bench.speed.threads --loads 0 6 --steps 16 --repeats 2 --out docs/results/threads.md

Each run is `python train.py` as a user starts it (torch's default thread count unless the variant sets
one), stopped after --steps by checkpoint.stop_after; the figure is the median StepRecord time_s.total over
its steps 4.. (the first ones compile and warm caches). The load is N processes spinning in a shell loop,
started before the runs of that load and killed after them. Variants alternate run by run, so a drift in
the machine's state hits each alike. The loss at the last step is printed too: the wait policy changes
when threads sleep, never what they compute.
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
from bench.report import Report

SPIN_DEFAULT = "300000"  # libgomp's own default spin count (GOMP_SPINCOUNT unset, OMP_WAIT_POLICY unset)
VARIANTS = {  # name: (environment, overrides)
    "gomp default spin (before)": ({"GOMP_SPINCOUNT": SPIN_DEFAULT}, []),
    "GOMP_SPINCOUNT=1000 (train.py now)": ({}, []),
    "OMP_WAIT_POLICY=PASSIVE": ({"OMP_WAIT_POLICY": "PASSIVE"}, []),
    "threads=1": ({}, ["threads=1"]),
}
QUIET = ["logging.progress=false", "logging.wandb=disabled", "logging.plot=false", "checkpoint.every=0"]


def one(env_extra: dict, overrides: list[str], steps: int, out: Path) -> tuple[float, float, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(env_extra, WANDB_MODE="disabled")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "train.py", f"hydra.run.dir={out}", f"checkpoint.stop_after={steps}",
                        *QUIET, *overrides], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"bench.speed.threads: train.py failed: {r.stderr.strip().splitlines()[-1:]}")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(x["time_s"]["total"] for x in recs[3:]) * 1e3, wall, recs[-1]["loss"]


def busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.speed.threads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", type=int, nargs="+", default=[0, 6], help="busy processes beside the run")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, help="also write the table as markdown here")
    a = ap.parse_args(argv)
    rep = Report("Threads on a shared machine", "python -m bench.speed.threads", argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for load in a.loads:
            spinners = busy(load)
            try:
                got: dict[str, list] = {v: [] for v in VARIANTS}
                for r in range(a.repeats):
                    for name, (env_extra, over) in VARIANTS.items():
                        out = Path(tmp) / f"load{load}-run{r}-{list(VARIANTS).index(name)}"
                        got[name].append(one(env_extra, over, a.steps, out))
                        print(f"load {load} | {name}: {got[name][-1][0]:.0f} ms a step", flush=True)
            finally:
                for p in spinners:
                    p.kill()
            rows += [(load, name, [g[0] for g in v], v[-1][2]) for name, v in got.items()]
    rep.add(f"The default job, {a.steps} steps a run, median step time of steps 4..{a.steps}, {a.repeats} runs a "
            "variant, alternating; busy processes spin beside it.", "")
    rep.table(["busy processes", "variant", "median step (ms), each run", "loss at the last step"],
              [(load, name, " / ".join(f"{t:.0f}" for t in ts), f"{loss:.6f}") for load, name, ts, loss in rows])
    rep.write(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
