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
import threading
from pathlib import Path

import pytest

from checkpoint import publish, read_tensors

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# Saves forever: step s holds a 1 MiB tensor of value s. Alternates sync and async mode per process.
# NOTE: the kill moments are handshakes, never sleeps, so a slow or loaded machine changes nothing: the
# child prints "saved S" after each save call returns, and on its `target`-th save it can stop inside
# the write ("before": the temp dir made, nothing written; "after": payload written, no marker yet),
# print "paused" and wait there to be killed.
CHILD = """
import sys, threading
from pathlib import Path
sys.path.insert(0, {root!r})
import torch
from checkpoint import Saver, publish
root, mode, target, pause = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
removed = publish.clean_stale(root)
name = publish.read_latest(root)
step = int(name.split("_")[1]) if name else 0
saver = Saver(root, mode, keep_last=2)
real_write, writes, out = saver._write, [0], threading.Lock()

def say(*words):  # one whole line per write: async writes report from their own thread
    with out:
        sys.stdout.write(" ".join(map(str, words)) + "\\n")
        sys.stdout.flush()

def write(tmp, sd):
    writes[0] += 1
    if writes[0] == target and pause == "after":
        real_write(tmp, sd)
    if writes[0] == target and pause != "none":
        say("paused", tmp.name)
        threading.Event().wait()  # until SIGKILL
    real_write(tmp, sd)

saver._write = write
say("ready", len(removed))
while True:
    step += 1
    saver.save(publish.step_name(step), {{"w": torch.full((1 << 18,), float(step)), "step": step}}, {{"step": step}})
    say("saved", step)
"""
HANG_S = 600


def drill(tmp_path: Path, kills: int, seed: int) -> None:
    script = tmp_path / "saver_child.py"
    script.write_text(CHILD.format(root=str(ROOT)))
    ckpts = tmp_path / "ckpts"
    rng = random.Random(seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    interrupted, paused, last_step = 0, 0, 0
    for i in range(kills):
        mode = ("sync", "async")[i % 2]
        # every third kill stops the child inside a write, so kills mid-save happen on any machine; the
        # others land wherever the child is when the parent has read its `target`-th "saved"
        pause = rng.choice(["before", "after"]) if i % 3 == 1 else "none"
        target = rng.randint(2, 5)  # >= 2 saves: the one before the kill is published even in async mode
        child = subprocess.Popen([sys.executable, str(script), str(ckpts), mode, str(target), pause],
                                 stdout=subprocess.PIPE, text=True, env=env)
        ready = child.stdout.readline().split()
        assert ready and ready[0] == "ready", f"child did not start (exit {child.poll()})"
        interrupted += int(ready[1])  # leftovers of the previous kill: it died mid-save
        start = last_step
        want = "paused" if pause != "none" else f"saved {start + target}"
        hang_guard = threading.Timer(HANG_S, child.kill)  # only a hung child: a slow one answers in seconds
        hang_guard.start()
        while not (line := child.stdout.readline()).startswith(want):
            assert line, f"kill {i}: child exited ({child.wait()}) before {want!r}"
        hang_guard.cancel()
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        paused += pause != "none"

        name = publish.read_latest(ckpts)
        assert name is not None, f"kill {i}: no latest"
        latest = ckpts / name
        assert publish.check(latest) is None, f"kill {i}: latest {name} is incomplete: {publish.check(latest)}"
        step = publish.read_marker(latest)["step"]
        w = read_tensors(latest)["w"]
        assert w.numel() == 1 << 18 and bool((w == step).all()), f"kill {i}: {name} holds other data"
        # the (target-1)-th save of this child was published before the kill, whatever the mode
        assert step >= start + target - 1, f"kill {i}: latest {name} lost a published save"
        last_step = step
    interrupted += len(publish.clean_stale(ckpts))  # what the last kill left behind
    assert last_step >= kills  # the children did make progress between kills
    assert interrupted >= paused >= 1  # every kill inside a write left a temp dir for the next start


def test_sigkill_during_saves_always_leaves_a_complete_latest(tmp_path):
    drill(tmp_path, kills=3, seed=0)


@pytest.mark.sweep
def test_sigkill_during_saves_many_times(tmp_path):
    drill(tmp_path, kills=24, seed=1)
