"""The speedrun recipe (conf/experiment/speedrun.yaml) is reproducible: one seed, one loss curve, bit for bit.

Muon's batched bfloat16 Newton-Schulz, QK-norm and the linear schedule are all in the step; a kernel that
picked its summation order at run time (or state leaking between steps) would show as a last-bit
difference in some step's loss or grad norm. A second seed must differ, or the comparison proves nothing.
Three runs of the recipe: `-m slow` (tests/test_config.py composes it; tests/test_muon.py checks its optimizer).
"""
from __future__ import annotations

import random

import pytest

from stability.record import read_records
from tests.helpers import run_train

WORDS = ("the king shall speak of love and war , my lord ; what news from rome ? "
         "O gentle night , thou art too fair . Enter HAMLET and a servant .").split()


def _text() -> str:
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(400)]
    return "\n".join(lines) + "\n"


def _curve(tmp_path, name: str, seed: int):
    run = tmp_path / name
    r = run_train(run, "+experiment=speedrun", f"data.path={tmp_path / 'text.txt'}", f"seed={seed}",
                  "train.steps=8", "train.eval_every=4", "train.eval_samples=24", "train.eval_batch_size=12",
                  "optim.schedule.warmup_steps=2", "logging.wandb=disabled", "logging.progress=false",
                  "logging.plot=false", "threads=1")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = read_records(run / "metrics.jsonl")
    assert len(recs) == 8
    return [(rec["loss"], rec["grad_norm"], rec["eval"]["loss"] if rec.get("eval") else None) for rec in recs]


@pytest.mark.slow
def test_speedrun_loss_curve_is_bit_identical_for_a_seed(tmp_path):
    (tmp_path / "text.txt").write_text(_text())
    a, b = _curve(tmp_path, "a", 0), _curve(tmp_path, "b", 0)
    assert a == b  # exact: floats read back from JSON are the bits written
    other = _curve(tmp_path, "c", 1)
    assert all(x[0] != y[0] for x, y in zip(a, other))
