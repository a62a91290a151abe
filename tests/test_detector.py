"""Spike detector: fires on a planted spike, not on stationary noise; cooldown; state round-trip."""
from __future__ import annotations

import math
import random

import pytest

from stability.config import DetectorConfig
from stability.detector import SpikeDetector

METRICS = {"loss": {"direction": "up"}, "grad_norm": {"direction": "up", "log": True}}


def noisy_series(n, seed, base=3.0, sigma=0.05, drift=-1e-3):
    rng = random.Random(seed)
    return [base + drift * i + rng.gauss(0, sigma) for i in range(n)]


def feed(det, losses, norms=None, start=1):
    fired = []
    for i, x in enumerate(losses):
        values = {"loss": x, "grad_norm": norms[i] if norms else 1.0 + 0.01 * math.sin(i)}
        trig = det.observe(start + i, values)
        fired += [(start + i, t) for t in trig]
    return fired


@pytest.mark.parametrize("seed", range(5))
def test_quiet_on_noisy_stationary_series(seed):
    det = SpikeDetector(DetectorConfig(metrics=METRICS, window=50, threshold=6.0, min_history=20, cooldown=10, warmup=0))
    rng = random.Random(100 + seed)
    norms = [math.exp(rng.gauss(0, 0.1)) for _ in range(2000)]
    assert feed(det, noisy_series(2000, seed), norms) == []


def test_fires_on_planted_spike_at_its_step():
    det = SpikeDetector(DetectorConfig(metrics=METRICS, window=50, threshold=6.0, min_history=20, cooldown=10, warmup=0))
    losses = noisy_series(200, 0)
    losses[120] += 1.0  # a 20σ one-step spike
    fired = feed(det, losses)
    assert [(s, t.metric) for s, t in fired] == [(121, "loss")]
    t = fired[0][1]
    assert t.z > 6 and not t.suppressed and abs(t.median - 3.0 + 0.12) < 0.1


def test_grad_norm_is_scored_on_log_scale():
    det = SpikeDetector(DetectorConfig(metrics=METRICS, window=50, threshold=6.0, min_history=20, cooldown=10, warmup=0))
    rng = random.Random(3)
    norms = [0.01 * math.exp(rng.gauss(0, 0.1)) for _ in range(100)]
    norms[80] *= 20  # ×20 is a spike at 0.01 just as at 10
    fired = feed(det, noisy_series(100, 1), norms)
    assert [(s, t.metric) for s, t in fired] == [(81, "grad_norm")]


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_a_log_metric_floor_is_in_log_units_whatever_the_unit(scale):
    """On a calm plateau (MAD of log x ≈ 0.02) a ×2.5 blip is jitter and a ×5 jump is a spike, in any unit:
    the floor is 0.2 log units, never rel_floor·|median of log x| (which is 0 for a median near 1)."""
    rng = random.Random(5)
    fired_at = {}
    for blip in (2.5, 5.0):
        det = SpikeDetector(DetectorConfig(metrics=METRICS, window=50, threshold=6.0, min_history=20, cooldown=10, warmup=0))
        norms = [scale * math.exp(rng.gauss(0, 0.03)) for _ in range(100)]
        norms[80] *= blip
        fired_at[blip] = [s for s, t in feed(det, noisy_series(100, 1), norms) if t.metric == "grad_norm"]
    assert fired_at == {2.5: [], 5.0: [81]}


def test_non_finite_fires_at_once_even_without_history():
    det = SpikeDetector(DetectorConfig(metrics=METRICS, window=50, threshold=6.0, min_history=20, cooldown=10, warmup=0))
    fired = feed(det, [3.0, 2.9, math.nan])
    assert [(s, t.metric, t.nonfinite) for s, t in fired] == [(3, "loss", True)]


def test_no_z_score_before_min_history():
    det = SpikeDetector(DetectorConfig(metrics=METRICS, window=50, threshold=6.0, min_history=20, cooldown=10, warmup=0))
    losses = noisy_series(30, 2)
    losses[10] += 5.0  # before min_history: unscored (and accepted, a known blind spot)
    losses[25] += 5.0
    assert [s for s, _ in feed(det, losses)] == [26]


def test_cooldown_suppresses_repeat_triggers_then_rearms():
    det = SpikeDetector(DetectorConfig(metrics=METRICS, window=50, threshold=6.0, min_history=20, cooldown=10, warmup=0))
    losses = noisy_series(120, 4)
    for i in (60, 63, 75):
        losses[i] += 2.0
    fired = feed(det, losses)
    assert [(s, t.suppressed) for s, t in fired] == [(61, False), (64, True), (76, False)]
    assert det.fired == 2 and det.last_trigger_step == 76


def test_spike_never_joins_the_baseline():
    det = SpikeDetector(DetectorConfig(metrics=METRICS, window=50, threshold=6.0, min_history=20, cooldown=0, warmup=0))
    losses = noisy_series(100, 5) + [10.0] * 3  # a plateau of spikes: every one still fires
    fired = feed(det, losses)
    assert [s for s, _ in fired] == [101, 102, 103]
    assert max(det.history["loss"]) < 4


def test_state_round_trips_so_a_resume_is_not_blind():
    a = SpikeDetector(DetectorConfig(metrics=METRICS, window=50, threshold=6.0, min_history=20, cooldown=10, warmup=0))
    losses = noisy_series(150, 6)
    losses[105] += 1.0  # 5 steps after the "resume" at step 100
    feed(a, losses[:100])
    b = SpikeDetector(DetectorConfig(metrics=METRICS, window=50, threshold=6.0, min_history=20, cooldown=10, warmup=0))
    b.load_state_dict(a.state_dict())
    fired_a, fired_b = feed(a, losses[100:], start=101), feed(b, losses[100:], start=101)
    assert [(s, t.metric, t.z) for s, t in fired_a] == [(s, t.metric, t.z) for s, t in fired_b]
    assert [s for s, _ in fired_b] == [106]
    fresh = SpikeDetector(DetectorConfig(metrics=METRICS, window=50, threshold=6.0, min_history=20, cooldown=10, warmup=0))
    assert feed(fresh, losses[100:], start=101) == []  # without the saved state it starts blind


@pytest.mark.parametrize("kwargs, key", [
    ({"window": 2}, "window"), ({"min_history": 60}, "min_history"), ({"threshold": 0}, "threshold"),
    ({"cooldown": -1}, "cooldown"),
])
def test_bad_settings_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=f"guard.detector.{key}"):
        SpikeDetector(DetectorConfig(metrics=METRICS, **{"window": 50, "threshold": 6.0, "min_history": 20, "cooldown": 10, **kwargs}))


def test_bad_metric_spec_names_the_key():
    with pytest.raises(ValueError, match="guard.detector.metrics.loss.direction"):
        SpikeDetector(DetectorConfig(metrics={"loss": {"direction": "down"}}, window=50, warmup=0))


def test_warmup_steps_are_not_scored_but_fill_the_history():
    det = SpikeDetector(DetectorConfig(metrics=METRICS, window=50, threshold=6.0, min_history=20, cooldown=0, warmup=40))
    losses = noisy_series(60, 7)
    losses[30] += 2.0  # step 31: inside warmup, unscored
    losses[50] += 2.0  # step 51: scored
    assert [s for s, _ in feed(det, losses)] == [51]


def test_a_metric_family_keeps_one_history_per_member():
    det = SpikeDetector(DetectorConfig(metrics={"loss_by_source": {"direction": "up"}}, window=50, threshold=6.0, min_history=20,
                        cooldown=0, warmup=0))
    a, b = noisy_series(80, 8, base=1.0), noisy_series(80, 9, base=3.0)
    a[70] += 1.0  # one source's jump, small beside the gap between sources
    fired = []
    for i in range(80):
        fired += [(i + 1, t.metric) for t in det.observe(i + 1, {"loss_by_source/a": a[i], "loss_by_source/b": b[i]})]
    assert fired == [(71, "loss_by_source/a")]
    restored = SpikeDetector(DetectorConfig(metrics={"loss_by_source": {"direction": "up"}}, window=50, min_history=20, warmup=0))
    restored.load_state_dict(det.state_dict())
    assert list(restored.history["loss_by_source/b"]) == list(det.history["loss_by_source/b"])


def test_a_mean_over_few_tokens_is_scored_with_its_own_noise():
    """Per-source losses are means over that source's tokens: noise ∝ 1/√n. On a history of means over
    ~64 tokens (σ 0.1), a batch where the source has 4 tokens and its loss is 0.8 above the median
    (2 σ of a 4-token mean, robust z ~8 unscaled) is noise; the same move over 64 tokens is a spike.
    Without counts the detector cannot tell the two apart and fires on both."""
    def run(n_last, counts):
        rng = random.Random(3)
        det = SpikeDetector(DetectorConfig(metrics={"loss_by_source": {}}, window=30, min_history=20, warmup=0))
        for t in range(60):
            x = 2.0 + 0.1 * rng.gauss(0, 1)
            det.observe(t, {"loss_by_source/a": x}, {"loss_by_source/a": 64} if counts else None)
        return det.observe(60, {"loss_by_source/a": 2.8}, {"loss_by_source/a": n_last} if counts else None)
    assert run(4, counts=True) == []
    (few,), (many,) = run(4, counts=False), run(64, counts=True)
    assert few.z > 6 and many.z > 6
    # the counts ride in the state: a resumed detector scales the same way
    det = SpikeDetector(DetectorConfig(metrics={"loss_by_source": {}}, window=30, min_history=20, warmup=0))
    for t in range(30):
        det.observe(t, {"loss_by_source/a": 2.0 + 0.01 * (t % 5)}, {"loss_by_source/a": 64})
    again = SpikeDetector(DetectorConfig(metrics={"loss_by_source": {}}, window=30, min_history=20, warmup=0))
    again.load_state_dict(det.state_dict())
    assert list(again.counts["loss_by_source/a"]) == [64.0] * 30
