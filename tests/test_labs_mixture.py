"""The mixture lab: three runs from one seed, classified from per-source telemetry alone; the classifier
as a plain function on synthetic telemetry whose truth is known."""
from __future__ import annotations

import json
import math
import random

import pytest

from labs import mixture as M
from labs import run as labs_run

FLOORS = {"easy": 0.4, "hard": 1.7}


def _records(steps: int, share_hard, loss, sigma=0.7, seed=0) -> list[dict]:
    """StepRecord-shaped telemetry: per-source loss = loss(s, t) + noise of σ per √token, documents
    drawn from the mixture share_hard(t) (16 documents of 48 labels per step)."""
    rng = random.Random(seed)
    out = []
    for t in range(steps):
        n_hard = sum(rng.random() < share_hard(t) for _ in range(16))
        toks = {"easy": 48 * (16 - n_hard), "hard": 48 * n_hard}
        by = {s: loss(s, t) + rng.gauss(0, sigma / math.sqrt(n)) for s, n in toks.items() if n}
        out.append({"step": t + 1, "tokens_by_source": toks, "loss_by_source": by})
    return out


def _verdict(records, S=100, W=40, noise=None):
    noise = noise or M.spread(_records(200, lambda t: 0.5, lambda s, t: FLOORS[s] + 0.1, seed=99), FLOORS)
    return M.classify(M.window(records, S - W, S), M.window(records, S, S + W), FLOORS, noise)


def test_spread_recovers_the_noise_per_token_despite_a_trend():
    # a steep linear descent must not inflate the estimate: consecutive differences cancel it
    recs = _records(400, lambda t: 0.5, lambda s, t: FLOORS[s] + 1.0 - 0.002 * t, sigma=0.7)
    noise = M.spread(recs, FLOORS)
    for s in FLOORS:
        assert noise["by_source"][s] == pytest.approx(0.7, rel=0.15)


def test_classifier_on_telemetry_with_a_known_truth():
    steady = lambda s, t: FLOORS[s] + 0.2 - 0.0005 * t  # noqa: E731  still descending slowly
    assert _verdict(_records(200, lambda t: 0.5, steady)) == M.HEALTHY
    # mixture moves to the hard source at step 100, per-source losses unchanged: total loss jumps up
    moved = _records(200, lambda t: 0.5 if t < 100 else 0.9, steady)
    assert _verdict(moved) == M.OBJECTIVE
    # the easy source alone rises 0.2 nats above its trajectory at step 100: a fault, whatever the mix
    hurt = lambda s, t: steady(s, t) + (0.2 if s == "easy" and t >= 100 else 0.0)  # noqa: E731
    assert _verdict(_records(200, lambda t: 0.5, hurt)) == M.BROKE
    assert _verdict(_records(200, lambda t: 0.5 if t < 100 else 0.9, hurt)) == M.BROKE
    nan = lambda s, t: math.nan if t >= 100 else steady(s, t)  # noqa: E731
    assert _verdict(_records(200, lambda t: 0.5, nan)) == M.BROKE


def test_classifier_scales_its_tolerance_with_the_tokens_a_source_had():
    # a 0.06-nat rise of the easy source: many standard errors while it has half the documents, but
    # within the noise once it keeps only ~5 % of them (~1 document a step)
    noise = {"by_source": {"easy": 0.7, "hard": 0.7}, "mix_floor": 0.15}
    rise = lambda s, t: FLOORS[s] + 0.2 + (0.06 if s == "easy" and t >= 100 else 0.0)  # noqa: E731
    assert _verdict(_records(200, lambda t: 0.5, rise), noise=noise) == M.BROKE
    few = _records(200, lambda t: 0.5 if t < 100 else 0.95, rise)
    ev = M.evidence(M.window(few, 60, 100), M.window(few, 100, 140), FLOORS, noise)
    assert ev["rise_se"]["easy"] < M.K < ev["mix_shift_se"]
    assert _verdict(few, noise=noise) == M.OBJECTIVE


def test_quick_lab_classifies_the_three_runs(tmp_path, capsys):
    code = labs_run.main(["--experiment", "mixture", "--seed", "7", "--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "result.json").read_text())
    assert code == 0 and res["ok"], out[-3000:]
    assert list(res["verdicts"].values()) == [M.HEALTHY, M.OBJECTIVE, M.BROKE]
    for verdict in ("healthy", "objective changed", "optimisation broke"):
        assert verdict in out
    t = res["telemetry"]
    ref, mix, fault = (t[n] for n in res["verdicts"])
    # b and c both raise the total train loss; only c lifts the per-source losses off their floors
    assert mix["loss_after"] > ref["loss_after"] + 0.2 and fault["loss_after"] > ref["loss_after"] + 0.2
    assert mix["mix_after"] > mix["mix_before"] + 0.3  # the floor of the new mixture is higher
    assert all(abs(mix["excess_after"][s] - ref["excess_after"][s]) < 0.05 for s in res["floors"])
    assert all(fault["excess_after"][s] > ref["excess_after"][s] + 0.1 for s in res["floors"])
    assert (tmp_path / "mixture.png").stat().st_size > 5000


def test_with_the_fault_switched_off_the_lab_reports_no_fault():
    res = M.run(7, quick=True, fault=None)
    assert not res["ok"]
    assert list(res["verdicts"].values()) == [M.HEALTHY, M.OBJECTIVE, M.HEALTHY]


def test_an_unknown_fault_is_refused():
    with pytest.raises(ValueError, match="fault='nope'"):
        M.run(7, quick=True, fault="nope")
