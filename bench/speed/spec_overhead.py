"""The specification checks' cost: the default job's step time with spec.enabled=false and at its default cadence
(every step's checks, the probe every telemetry.every steps), measured on train.py itself. Goal (issue 35):
≤ 5 % of the default job's step.

    python -m bench.speed.spec_overhead                              # 3 rounds, 40 steps an arm, threads=1
    python -m bench.speed.spec_overhead --rounds 4 --steps 60 --out docs/results/spec_overhead.md

Each arm is one train.py run of the quickstart (its own 400-step schedule, stopped by checkpoint.stop_after),
the two taking turns every round in alternating order (off, on; on, off; ...) so the drift of a shared machine
hits both alike. A step's time is the StepRecord's time_s.total (wall) and time_s.cpu (this process's CPU time:
other jobs on the machine move it less than the wall clock), over steps 2.. (step 1 warms the kernels up) without
the last (it evaluates and saves). The figure is the median over rounds of the per-round ratio on / off − 1.
Beside it, from the on arm alone, the checks' own host time (time_s.spec: every point of the step they act at,
their put and their read) over the rest of its step: a ratio inside one run, which the drift of a shared
machine between two runs (often ±10 %, more than the overhead itself) does not move. It counts the checks' hooks (the
loss_grad check's norm per layer output, the route check's and the reduce check's keeps) and leaves out their share
of the step's one read. Below it, each check's share (time_s["spec.<check>"]), on the steps that ran only the
every-step checks and on the reference steps (the probe's run counted by the first check that reads it, forward).
NOTE: on a shared 2-core machine pass threads=1 (the default here): two intra-op threads competing with other
jobs drown any overhead.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import ROOT
from bench.report import Report
from spec.check import REFERENCE
from spec.checks import registry

COMMON = ["logging.wandb=disabled", "logging.progress=false", "logging.plot=false", "checkpoint.every=0",
          "train.eval_every=1000"]


def run(out: Path, steps: int, on: bool, extra: list[str]) -> tuple[float, float, float, list[dict]]:
    """(mean wall ms, mean CPU ms, mean ms in the checks: time_s.spec) per step of one run, and its timed records."""
    cmd = [sys.executable, "train.py", f"hydra.run.dir={out}", *COMMON, f"checkpoint.stop_after={steps}",
           f"spec.enabled={str(on).lower()}", *extra]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"spec_overhead: {' '.join(cmd)} failed ({r.returncode}): {(r.stderr or r.stdout)[-500:]}")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()][1:-1]
    return (statistics.fmean(x["time_s"]["total"] for x in recs) * 1e3,
            statistics.fmean(x["time_s"]["cpu"] for x in recs) * 1e3,
            statistics.fmean(x["time_s"].get("spec", 0.0) for x in recs) * 1e3, recs)


def by_check(recs: list[dict]) -> list[list]:
    """[check, ms on an every-step-only step, ms on a reference step, ms per step over the run] from the on arm's
    records (time_s["spec.<check>"]); a reference step is one where a reference-cadence check measured (spec.miss)."""
    reference = {name for name, c in registry().items() if c.cadence == REFERENCE}
    is_ref = [bool(reference & set((r.get("spec") or {}).get("miss") or {})) for r in recs]
    keys = list(dict.fromkeys(k for r in recs for k in r["time_s"] if k.startswith("spec.")))

    def mean(key, rows):
        xs = [r["time_s"].get(key, 0.0) * 1e3 for r in rows]
        return statistics.fmean(xs) if xs else float("nan")
    rows = [[k[len("spec."):], mean(k, [r for r, f in zip(recs, is_ref) if not f]),
             mean(k, [r for r, f in zip(recs, is_ref) if f]), mean(k, recs)] for k in keys]
    return sorted(rows, key=lambda row: -row[3])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=41, help="steps an arm runs (a multiple of telemetry.every, + 1)")
    p.add_argument("--out", help="also write the figures (markdown) to this file")
    p.add_argument("overrides", nargs="*", default=["threads=1"], help="Hydra overrides for both arms")
    args = p.parse_args()
    rep = Report("The specification checks' overhead on the default job", "python -m bench.speed.spec_overhead")
    rep.add(f"{args.rounds} rounds, {args.steps} steps an arm (steps 2..{args.steps - 1} timed), overrides: "
            f"{' '.join(args.overrides) or 'none'}; the arms alternate, their order flipping every round.")
    rows, ratios, on_recs = [], {"wall": [], "cpu": [], "inside": []}, []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            order = (False, True) if k % 2 == 0 else (True, False)
            got = {on: run(Path(tmp) / f"r{k}-{on}", args.steps, on, args.overrides) for on in order}
            (w0, c0, _, _), (w1, c1, in1, recs) = got[False], got[True]
            on_recs += recs
            ratios["wall"].append(w1 / w0 - 1)
            ratios["cpu"].append(c1 / c0 - 1)
            ratios["inside"].append(in1 / (w1 - in1))
            rows.append([k + 1, f"{w0:.1f}", f"{w1:.1f}", f"{100 * (w1 / w0 - 1):+.1f} %", f"{c0:.1f}", f"{c1:.1f}",
                         f"{100 * (c1 / c0 - 1):+.1f} %", f"{in1:.1f}", f"{100 * ratios['inside'][-1]:.1f} %"])
    rep.table(["round", "off wall ms", "on wall ms", "wall", "off CPU ms", "on CPU ms", "CPU", "in checks ms",
               "in checks"], rows)
    rep.add(f"overhead, median over rounds: wall {100 * statistics.median(ratios['wall']):+.1f} %, "
            f"CPU {100 * statistics.median(ratios['cpu']):+.1f} %; the checks' own time in the on arm "
            f"{100 * statistics.median(ratios['inside']):.1f} % of the rest of its step (goal ≤ 5 %)")
    rep.add(f"By check, the on arms' timed steps ({len(on_recs)}): host ms in each check (its points and hooks) on a "
            "step that ran the every-step checks only, on a reference step, and per step over the run.")
    rep.table(["check", "ms, other steps", "ms, reference steps", "ms per step"],
              [[n, f"{a:.2f}", f"{b:.2f}", f"{c:.2f}"] for n, a, b, c in by_check(on_recs)])
    rep.write(args.out)


if __name__ == "__main__":
    main()
