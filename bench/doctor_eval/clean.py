"""The doctor on clean runs: every headline should be `healthy`; false faults per 1000 scored steps.

    python -m bench.doctor_eval.clean RUN_DIR [RUN_DIR ...] [--out docs/results/doctor_clean.md]

Each directory is a finished run trained without a fault (the README's default job, dense_tiny, moe_tiny, the
drill configuration; any seed, telemetry cadence or thread count). Printed per run: the headline, the
incidents judged natural with their reasons, the scored steps; then the false-fault rate (incidents judged a
fault or a recipe instability). Nothing in the doctor is calibrated on runs: every run passed here is held out.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.report import Report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    ap.add_argument("--title", default="Clean runs")
    args = ap.parse_args(argv)
    from bench.doctor_eval.score import scored_steps
    from doctor.cli import doctor
    out = Report(args.title, "python -m bench.doctor_eval.clean", argv)
    bad = faults = steps = 0
    rows = []
    for d in map(Path, args.runs):
        rep = doctor(d, plots=False)
        n = scored_steps(d)
        steps += n
        bad += rep["class"] != "healthy"
        faults += sum(i["judgement"] != "natural" for i in rep["incidents"])  # a fault or a recipe instability
        nat = "; ".join(f"{i['step']}: {i['reason'][:90]}" for i in rep["incidents"] if i["judgement"] == "natural")
        head = rep["class"] if rep["earliest"] is None else f"**{rep['class']} at {rep['earliest']['step']}**"
        rows.append((d.name, n, head, nat or "—"))
    out.table(["run", "steps scored", "headline", "incidents judged natural (step: reason)"], rows)
    out.add(f"headline not healthy: {bad} of {len(args.runs)} runs; incidents judged a fault or an instability (all false here): "
            f"{faults}, {1000 * faults / max(steps, 1):.2f} per 1000 scored steps ({steps} scored)")
    out.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
