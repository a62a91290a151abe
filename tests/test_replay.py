"""Single-batch replay (doctor/replay.py): a logged step rebuilt from its batch ID and the checkpoint
before it reproduces the logged loss; a NaN drill's replay is finite (the fault is not in the state or
the batch) and the run's telemetry names the first non-finite layer.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from helpers import HANG_S, ROOT, TINY, env, run_train
from doctor.replay import replay
from test_drills import SMALL

# NOTE: DCP warns on every single-process load; here one process is the point.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
STEPS = 10  # checkpoints at 4, 8 and 10: step 9 replays exactly from 8; step 7 re-runs 5..6 from 4
NAN_AT = 12
SHORT_DRILL = [f"checkpoint.every={NAN_AT - 1}", f"checkpoint.stop_after={NAN_AT + 2}", "checkpoint.mode=sync", *SMALL]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay") / "healthy"
    r = run_train(d, *TINY, f"train.steps={STEPS}", "checkpoint.every=4", "checkpoint.mode=sync",
                  "telemetry.every=1", "logging.plot=false")
    assert r.returncode == 0, r.stderr[-3000:]
    return d


@pytest.fixture(scope="module")
def nan_drill(tmp_path_factory):
    """The NaN drill, shrunk: NaN into block 1's MLP output at step 12, a checkpoint at step 11."""
    d = tmp_path_factory.mktemp("replay") / "nan"
    r = run_train(d, "+experiment=drill_nan_activation", f"fault.step={NAN_AT}", "train.steps=400",
                  *SHORT_DRILL)
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def test_replay_reproduces_the_logged_loss(healthy):
    r = replay(healthy, 9)
    assert r.checkpoint.endswith("step_000008") and r.retrained == []
    assert math.isfinite(r.logged_loss) and r.delta < 1e-6, (r.loss, r.logged_loss)
    for s, v in r.logged_loss_by_source.items():
        assert abs(r.loss_by_source[s] - v) < 1e-5
    assert r.first_nonfinite is None and r.notes == []


def test_replay_reruns_the_steps_after_an_older_checkpoint(healthy):
    r = replay(healthy, 7)  # newest checkpoint before 7 is step 4: steps 5 and 6 re-run with the optimizer
    assert r.checkpoint.endswith("step_000004") and r.retrained == [5, 6]
    assert r.delta < 1e-6, (r.loss, r.logged_loss, r.notes)
    stale = replay(healthy, 7, train_to=False)  # the parameters of step 4 instead of 6: not the logged loss
    assert stale.delta > 1e-4 and any("approximate" in n for n in stale.notes)


def test_float64_replay_is_close(healthy):
    r = replay(healthy, 9, dtype="float64")
    assert r.delta < 1e-4, (r.loss, r.logged_loss)


def test_nan_drill_replay_is_finite_and_telemetry_names_the_layer(nan_drill):
    r = replay(nan_drill, NAN_AT)
    assert not math.isfinite(r.logged_loss)
    assert math.isfinite(r.loss) and r.first_nonfinite is None  # (a) not reproducible from state + batch
    assert r.logged_first_nonfinite == "block1.mlp"             # (b) the drill's layer 1, sublayer mlp
    assert any("did not reproduce" in n for n in r.notes)
    # every layer upstream of the NaN replays the activation RMS the run logged
    rec = [json.loads(x) for x in (nan_drill / "metrics.jsonl").read_text().splitlines()][NAN_AT - 1]
    for name in ("emb", "block0.attn", "block0.mlp", "block0", "block1.attn"):
        assert abs(r.act_rms[name] - rec["layers"][name]["act_rms"]) < 1e-5 * rec["layers"][name]["act_rms"]


@pytest.mark.slow  # three launches of the CLI; the replays themselves run in process above
def test_cli_prints_the_comparison_and_errors_in_one_line(healthy):
    ok = subprocess.run([sys.executable, "-m", "doctor.replay", str(healthy), "--step", "9"], cwd=ROOT, env=env(),
                        capture_output=True, text=True, timeout=HANG_S)
    assert ok.returncode == 0, ok.stderr
    assert "vs logged" in ok.stdout and "|Δ| = " in ok.stdout
    out = json.loads((healthy / "replay_step_9.json").read_text())
    assert out["delta"] < 1e-6
    # issue 38: minutes of silence before the answer; a line per phase now (no bar: not a terminal)
    longer = subprocess.run([sys.executable, "-m", "doctor.replay", str(healthy), "--step", "7"], cwd=ROOT,
                            env=env(), capture_output=True, text=True, timeout=HANG_S)
    assert longer.returncode == 0 and "\r" not in longer.stdout + longer.stderr, longer.stderr
    phases = [ln for ln in longer.stdout.splitlines() if ln.startswith("replay: ")]
    assert [p.split(" ", 2)[1] for p in phases] == ["checking", "re-running", "step"], longer.stdout
    assert "re-running steps 5..6 from step_000004" in phases[1]
    bad = subprocess.run([sys.executable, "-m", "doctor.replay", str(healthy), "--step", "3"], cwd=ROOT, env=env(),
                         capture_output=True, text=True, timeout=HANG_S)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "no complete checkpoint" in bad.stderr


@pytest.mark.sweep
def test_corrupted_batch_replays_clean_and_says_so(tmp_path):
    """labels_shuffle corrupts the batch in flight: its ids rebuild the clean batch, whose label alignment
    and loss differ from the logged ones."""
    d = tmp_path / "shuffle"
    r = run_train(d, "+experiment=drill_labels_shuffle", f"fault.step={NAN_AT}", "train.steps=400",
                  *SHORT_DRILL)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = replay(d, NAN_AT)
    assert rep.logged_inputs["label_alignment"] < 0.5 and rep.inputs["label_alignment"] == 1.0
    assert rep.delta > 1e-2 and any("corrupted in flight" in n for n in rep.notes)
