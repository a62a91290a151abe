"""Crash drill: SIGKILL a process that saves checkpoints back to back, at random moments, many times.

After every kill `latest` must name a complete checkpoint (marker present, every hash matching) that
loads and holds exactly the step its marker claims; the next process cleans up and carries on.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoint import publish, read_tensors

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# Saves forever: step s holds a 1 MiB tensor of value s. Alternates sync and async mode per process.
CHILD = """
import sys
from pathlib import Path
sys.path.insert(0, {root!r})
import torch
from checkpoint import Saver, publish
root, mode = Path(sys.argv[1]), sys.argv[2]
removed = publish.clean_stale(root)
name = publish.read_latest(root)
step = int(name.split("_")[1]) if name else 0
saver = Saver(root, mode, keep_last=2)
print("ready", len(removed), flush=True)
while True:
    step += 1
    saver.save(publish.step_name(step), {{"w": torch.full((1 << 18,), float(step)), "step": step}}, {{"step": step}})
"""


def drill(tmp_path: Path, kills: int, seed: int) -> None:
    script = tmp_path / "saver_child.py"
    script.write_text(CHILD.format(root=str(ROOT)))
    ckpts = tmp_path / "ckpts"
    rng = random.Random(seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    interrupted, last_step = 0, 0
    for i in range(kills):
        mode = ("sync", "async")[i % 2]
        child = subprocess.Popen([sys.executable, str(script), str(ckpts), mode], stdout=subprocess.PIPE, text=True,
                                 env=env)
        ready = child.stdout.readline().split()
        assert ready and ready[0] == "ready", f"child did not start (exit {child.poll()})"
        interrupted += int(ready[1])  # leftovers of the previous kill: it died mid-save
        time.sleep(rng.uniform(0.05, 0.8))
        child.send_signal(signal.SIGKILL)
        child.wait()

        name = publish.read_latest(ckpts)
        assert name is not None, f"kill {i}: no latest"
        latest = ckpts / name
        assert publish.check(latest) is None, f"kill {i}: latest {name} is incomplete: {publish.check(latest)}"
        step = publish.read_marker(latest)["step"]
        w = read_tensors(latest)["w"]
        assert w.numel() == 1 << 18 and bool((w == step).all()), f"kill {i}: {name} holds other data"
        assert step >= last_step  # never goes back to an older checkpoint
        last_step = step
    interrupted += len(publish.clean_stale(ckpts))  # what the last kill left behind
    assert last_step >= kills  # the children did make progress between kills
    assert interrupted >= 1  # and at least one kill landed in the middle of a save


def test_sigkill_during_saves_always_leaves_a_complete_latest(tmp_path):
    drill(tmp_path, kills=3, seed=0)


@pytest.mark.slow
def test_sigkill_during_saves_many_times(tmp_path):
    drill(tmp_path, kills=24, seed=1)
