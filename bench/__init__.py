"""Scripts that print figures, sorted by purpose; each runs one way, from the repository root:
`python -m bench.<group>.<name>` (a shell script: `bash bench/<group>/<name>.sh`).

    tools/        what a user runs on their own runs and changes: sweep (a Hydra sweep's table), run_summary,
                  same_records (do two commits train the same run?), ab_step (their step time), profile_step,
                  stress_suite.sh (the test suite on a busy machine)
    speed/        speed and overhead benchmarks: each feature's cost, the anchor against nanoGPT (speedrun,
                  anchor_compare), throughput, host syncs, checkpoint stalls
    gpu/          the GPU checks: all.sh runs every one on a GPU machine and table.py writes their table
    doctor_eval/  the doctor's evaluation: faults planted from outside (drills), its score, its thresholds
                  against clean runs (calibrate, clean), its cost (scale), --verify (verify)
    seeds/        do the demos hold over seeds and threads: the quickstart (quickstart_grid), every drill
                  quiet before its fault (drills_quiet), every lab's effect (labs_seeds)

report.py writes every script's markdown under one header (docs/results/); config.py composes the run config a
benchmark measures; stats.py holds the statistics of claims over seeds (a mean's interval, the record rule's
test). Never timed tests: figures are printed, compared side by side.
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: scripts run from here, train.py lives here
