"""The levers through train.py, as a user runs them: bad input stops before anything is written, and a
run with Muon + QK-clip + z-score clipping resumes bit-identically in a fresh process (slow)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from helpers import ROOT, TINY, env, run_train
from stability.record import read_records

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
LEVERS = ["optim=muon", "train.clip=zscore", "train.zscore.warmup=2", "optim.qk_clip.tau=0.045"]


@pytest.mark.slow  # a process start each; the messages themselves are unit-tested
@pytest.mark.parametrize("override, key", [
    ("optim.qk_clip.tau=0", "optim.qk_clip.tau=0"),
    ("optim.qk_clip.tau=-3", "optim.qk_clip.tau=-3"),
    ("train.zscore.z_thresh=-1", "train.zscore.z_thresh=-1"),
    ("+optim.muon.adamw=[nothing]", "optim.muon.adamw[0]"),
])
def test_bad_lever_config_is_one_line_naming_the_key(tmp_path, override, key):
    extra = ["train.clip=zscore"] if "zscore" in override else ["optim=muon"] if "muon" in override else []
    r = run_train(tmp_path / "run", *TINY, *extra, override)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ballast: config error: ") and key in last
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.sweep
def test_levers_resume_bit_identical(tmp_path):
    cmd = [sys.executable, "-m", "checkpoint.verify", "--out", str(tmp_path / "v"), "--steps", "3", "3", *TINY, *LEVERS]
    r = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    m = re.search(r"final state: (\d+) tensors .*?, (\d+) bit-identical; max rel diff (\S+)", r.stdout)
    assert r.returncode == 0 and m and m.group(1) == m.group(2) and float(m.group(3)) == 0.0, r.stdout[-3000:]
    straight = read_records(tmp_path / "v" / "straight" / "metrics.jsonl")
    resumed = read_records(tmp_path / "v" / "resumed" / "metrics.jsonl")
    assert any(x["qk_clip"]["heads_clipped"] for x in straight)  # the clip acted
    assert any(x["clip"].get("z") is not None for x in straight[3:])  # z-scores past the warm-up
    for x, y in zip(straight, resumed):
        assert (x["loss"], x["grad_norm"], x["clip"], x["qk_clip"]) == (y["loss"], y["grad_norm"], y["clip"], y["qk_clip"])
