"""Hydra multirun: each run of a sweep in its own directory under one sweep directory; bench.tools.sweep compares
them."""
from __future__ import annotations

import subprocess
import sys

from bench.tools import sweep
from tests.helpers import ROOT, TINY, env


def test_multirun_of_two_tiny_runs_gives_two_run_dirs_and_a_table(tmp_path, capsys):
    d = tmp_path / "sweep"
    r = subprocess.run([sys.executable, "train.py", "-m", "optim.lr=1e-3,3e-2", "+experiment=dense_tiny",
                        f"hydra.sweep.dir={d}", *TINY, "train.steps=4", "train.eval_every=4", "logging.plot=false"],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted(p.name for p in d.iterdir() if (p / "metrics.jsonl").is_file())
    assert runs == ["0", "1"]
    assert sweep.main([str(d)]) == 0
    out = capsys.readouterr().out.splitlines()
    head = [c.strip() for c in out[0].strip("|").split("|")]
    assert head == ["run", "optim.lr", "steps", "final loss", "gap to floor", "spikes", "skipped", "time s"]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out[2:4]]
    assert [row[:3] for row in rows] == [["0", "0.001", "4"], ["1", "0.03", "4"]]
    for row in rows:  # the gap is the final loss minus the synthetic data's exact floor
        assert float(row[3]) > float(row[4]) > 0
    assert float(rows[0][3]) != float(rows[1][3])  # the learning rate changed the run
    assert (d / "sweep.png").stat().st_size > 1000
