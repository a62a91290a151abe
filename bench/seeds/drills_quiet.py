"""Is every fault drill quiet before its injection? Each drill (conf/experiment/drill_*.yaml and
moe_spike_drill) trains at its own size over seeds x threads, stopped by checkpoint.stop_after one step
before its fault (the lr schedule still spans train.steps, so every step up to there is the full drill's);
a row lists the guard's triggers and actions before the injection step. Any is a false alarm: the drill
would then not test what it says.

    OMP_NUM_THREADS=1 python -m bench.seeds.drills_quiet                                 # every drill, seeds 0-2, 1 and 2 threads
    python -m bench.seeds.drills_quiet --drills drill_labels_shuffle moe_spike_drill --seeds 0 1 2 3 --threads 1
    python -m bench.seeds.drills_quiet --drills drill_lr_spike -- optim.lr=2e-3          # overrides after --
    python -m bench.seeds.drills_quiet --out docs/results/drills_quiet.md

A drill whose module needs 2+ processes (stability/drills/, min_world) runs under torchrun, the others on one; --jobs (default 2) runs at a time.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import ROOT
from bench.report import Report
from bench.seeds.quickstart_grid import QUIET, map_jobs

DRILLS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("drill_*.yaml")) + ["moe_spike_drill"]


def fault_step(drill: str, overrides: list[str]) -> int:
    """The drill's injection step as its config resolves it (Hydra compose, nothing trained)."""
    from run.config import compose_check

    return compose_check([f"+experiment={drill}", *overrides], str(ROOT / "conf")).fault.step


def one(drill: str, seed: int, threads: int, extra: list[str], root: Path, step: int) -> dict:
    """Train `drill` up to the step before its injection (`step`); the guard's events before that step."""
    run_dir = root / f"{drill}-s{seed}-t{threads}"
    args = [f"hydra.run.dir={run_dir}", f"+experiment={drill}", f"seed={seed}", f"threads={threads}",
            f"checkpoint.stop_after={step - 1}", *QUIET, *extra]
    from stability.drills import registry

    kind = drill.removeprefix("drill_")
    nproc = registry()[kind].min_world if kind in registry() else 1  # moe_spike_drill: one process
    launch = [sys.executable, "train.py"] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "disabled"}
    r = subprocess.run([*launch, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    row = {"drill": drill, "seed": seed, "threads": threads, "fault_step": step}
    if r.returncode != 0:
        return {**row, "error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]}
    ev_path = run_dir / "events.jsonl"
    events = [json.loads(x) for x in ev_path.read_text().splitlines()] if ev_path.exists() else []
    early = [e for e in events if e["step"] < step and e["kind"] != "fault"]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {**row, "early": [f"{e['step']}:{e['kind']}" + (f"({e['metric']})" if e["kind"] == "trigger" else "")
                             for e in early],
            "max_gnorm": max(x["grad_norm"] for x in recs), "last_step": recs[-1]["step"]}


def run_grid(drills: list[str], seeds: list[int], threads: list[int], extra: list[str], root: Path,
             jobs: int = 2, show=None) -> list[dict]:
    points = list(itertools.product(drills, seeds, threads))
    steps = {d: fault_step(d, extra) for d in drills}  # NOTE: here, not in the threads: Hydra's compose is global state
    return map_jobs(lambda p: one(*p, extra, root, steps[p[0]]), points, jobs, show)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drills", nargs="*", default=DRILLS)
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    p.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--keep", type=Path, help="keep the run directories here")
    p.add_argument("--out", help="also write the table (markdown) to this file")
    p.add_argument("overrides", nargs="*", help="after --: train.py overrides")
    args = p.parse_args()
    rep = Report("Fault drills before their injection", "python -m bench.seeds.drills_quiet")
    root = args.keep or Path(tempfile.mkdtemp(prefix="drills_quiet-"))
    print(f"dirs under {root}", flush=True)
    rep.add(f"{len(args.drills) * len(args.seeds) * len(args.threads)} runs, each stopped one step before its fault; "
            "the guard's triggers and actions before it (none: quiet).", "")
    rep.columns("drill", "seed", "threads", "fault step", "largest ‖g‖", "before the fault")

    def show(row: dict) -> None:
        head = (row["drill"], row["seed"], row["threads"], row["fault_step"])
        if "error" in row:
            rep.row(*head, "", f"ERROR {row['error']}")
        else:
            rep.row(*head, f"{row['max_gnorm']:.1f}", " ".join(row["early"]) or "quiet")

    rows = run_grid(args.drills, args.seeds, args.threads, args.overrides, root, args.jobs, show)
    bad = [r for r in rows if "error" in r or r["early"]]
    rep.add("", f"{len(rows) - len(bad)}/{len(rows)} quiet before their injection")
    rep.write(args.out)


if __name__ == "__main__":
    main()
