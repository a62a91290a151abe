"""The quickstart's effect, off the edge: the copy source's induction head forms early and the run ends at
the exact floor, on every seed (bench/seeds/quickstart_grid.py trains each point with train.py as a user runs it).

`-m slow` (two 300-step trainings): the recipe's mechanism at a smaller size (SHORT: the same model, mixture,
optimizer and schedule shape on shorter documents), on 2 seeds, and the README's follow-ups on it. `-m sweep`: the full recipe over the README's grid of
5 seeds x 2 data seeds x {1, 2} threads, every point at its floor, the head formed before 60 % of the run.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.seeds import quickstart_grid as grid
from helpers import HANG_S, ROOT, env
from stability.record import read_records

TOL = 0.05  # nats: the README's claim, for both the copy source and the whole mixture
FORMS_BY = 0.6  # the head forms before this fraction of the schedule: the margin from the edge


def check(rows: list[dict]) -> None:
    bad = [r for r in rows if not grid.passes(r, TOL) or not r["forms"] or r["forms"] > FORMS_BY * r["steps"]]
    assert not bad, bad


# Shorter documents (seq_len 32: one fresh segment of 12, its copy, a fresh tail), 300 steps, one
# micro-batch (the same 16 samples a step) and one evaluation: long enough for the copy source's head to
# form and the run to end near its floor (bench/seeds/quickstart_grid.py measures the grid), short enough for a
# test.
SHORT_STEPS = 300
SHORT = ["data.seq_len=32", "train.micro_batches=1", "train.eval_every=300"]


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory) -> dict:
    """seed -> (its grid row, its run directory), trained once for the tests below."""
    out = {}
    for seed in (0, 1):
        root = tmp_path_factory.mktemp(f"seed{seed}")
        out[seed] = (grid.one({"seed": seed, "data_seed": 1234, "threads": 1}, SHORT_STEPS, 0.0, SHORT, root),
                     next(p for p in root.iterdir() if p.is_dir()))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_quickstart_mechanism_reaches_the_copy_floor(short_runs, seed):
    row, run_dir = short_runs[seed]
    check([row])
    # the doctor on the same clean run, the induction head forming in it: healthy, nothing prescribed; whatever
    # moved as the head formed is listed, each judged natural with its reason
    from doctor.cli import doctor
    rep = doctor(run_dir, plots=False)
    assert rep["class"] == "healthy" and rep["earliest"] is None and rep["fix"] is None, rep["summary"]
    assert all(i["judgement"] == "natural" and i["reason"] for i in rep["incidents"]), rep["incidents"]


@pytest.mark.slow
def test_the_readme_follow_ups_run_on_the_default_run(short_runs):
    """What the README shows after `python train.py`, on the default run's own checkpoints (checkpoint.every's
    default): sample it, replay a step, continue it; export says in one line what it cannot carry."""
    row, run_dir = short_runs[0]
    argv = json.loads((run_dir / "environment.json").read_text())["argv"]  # the run's own command line

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=ROOT, env=env(), capture_output=True, text=True,
                              timeout=HANG_S)

    sample = cli("-m", "sample", str(run_dir), "--max-new-tokens", "8", "--seed", "1")
    assert sample.returncode == 0 and sample.stdout.strip(), sample.stderr[-2000:]
    replay = cli("-m", "doctor.replay", str(run_dir), "--step", "101")
    assert replay.returncode == 0 and "replay of step 101 from step_000100" in replay.stdout, replay.stderr[-2000:]
    export = cli("-m", "checkpoint.export_hf", str(run_dir), str(run_dir / "hf"))
    err = export.stderr.strip().splitlines()
    assert export.returncode != 0 and len(err) == 1 and "model.swiglu_clamp" in err[0], export.stderr[-2000:]
    more = cli("train.py", *argv, "resume=latest", "resume.allow_config_change=[train.steps]",
               f"train.steps={SHORT_STEPS + 5}")
    assert more.returncode == 0, more.stderr[-2000:]
    recs = read_records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, SHORT_STEPS + 6))
    # issue 38: the added steps go on at the schedule's final LR (a re-stretched cosine jumped back up), and the
    # doctor reads the extended run as healthy, the change declared
    final = recs[SHORT_STEPS - 1]["lr"]
    assert all(r["lr"] == final for r in recs[SHORT_STEPS:]), [r["lr"] for r in recs[SHORT_STEPS - 2:]]
    from doctor.cli import doctor
    rep = doctor(run_dir, plots=False)
    assert rep["class"] == "healthy" and any("train.steps" in c for c in rep["declared"]), rep["summary"]


@pytest.mark.sweep
def test_quickstart_grid_every_point_at_its_floor(tmp_path):
    points = [{"seed": s, "data_seed": d, "threads": t} for s in range(5) for d in (1234, 99) for t in (1, 2)]
    check(grid.run_grid(points, None, 0.0, [], tmp_path, jobs=2))


@pytest.mark.sweep
def test_quickstart_outcome_survives_a_perturbed_init(tmp_path):
    """1e-6 relative noise on the initial weights: the same outcome (head formed, both gaps at the floor)."""
    points = [{"seed": s, "data_seed": 1234, "threads": 1} for s in (0, 1)]
    check(grid.run_grid(points, None, 1e-6, [], tmp_path, jobs=2))
