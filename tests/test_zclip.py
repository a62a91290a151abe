"""Adaptive z-score clipping (optim/zclip.py) through precision.optimizer_step: a planted series of
grad norms against a hand computation, the state round trip, and bad config."""
from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from optim.config import ZScoreConfig
from optim.zclip import ZScoreClip, build_clip_policy
from precision import optimizer_step

EPS = 1e-6


def _step(policy, g: float, fixed=None):
    """One optimizer_step on a 1-element parameter whose gradient (hence global norm) is g."""
    p = nn.Parameter(torch.zeros(1))
    p.grad = torch.tensor([g])
    opt = torch.optim.SGD([p], lr=0.0)
    res = optimizer_step([p], opt, None, fixed, clip=policy)
    return res, p.grad.item()


def test_planted_series_against_hand_computation():
    z = ZScoreClip(ZScoreConfig(alpha=0.5, z_thresh=1.0, warmup=3))
    # warm-up: 1, 2, 3 pass untouched (fixed = None); then μ = 2, σ² = (1 + 4 + 9)/3 − 2² = 2/3
    for g in (1.0, 2.0, 3.0):
        res, got = _step(z, g)
        assert res.coef.item() == 1.0 and got == g
    assert (z.mean, z.var) == (pytest.approx(2.0), pytest.approx(2 / 3))
    # 2.5: z = 0.5/√(2/3) = 0.61 ≤ 1 → untouched; μ = (2 + 2.5)/2 = 2.25, σ² = (2/3)/2 + (2.5 − 2.25)²/2
    res, got = _step(z, 2.5)
    assert res.coef.item() == 1.0 and got == 2.5
    mu, var = 2.25, (2 / 3) / 2 + 0.25 ** 2 / 2
    assert (z.mean, z.var) == (pytest.approx(mu), pytest.approx(var))
    # 10: z = (10 − 2.25)/σ ≫ 1 → clipped to μ + σ; the EMA takes the clipped value
    res, got = _step(z, 10.0)
    target = mu + math.sqrt(var)
    assert z.last["z"] == pytest.approx((10 - mu) / (math.sqrt(var) + EPS))
    assert res.norm.item() == 10.0 and res.coef.item() == pytest.approx(target / (10 + EPS), rel=1e-6)
    assert got == pytest.approx(target, rel=1e-6)
    mu2 = (mu + target) / 2
    var2 = var / 2 + (target - mu2) ** 2 / 2
    assert (z.mean, z.var) == (pytest.approx(mu2), pytest.approx(var2))
    # a non-finite norm: untouched grads, no statistics update, a skipped step
    before = z.state_dict()
    res, _ = _step(z, math.inf)
    assert res.skipped and z.state_dict() == before


def test_warmup_uses_the_fixed_threshold_and_logs_the_fixed_coefficient():
    z = ZScoreClip(ZScoreConfig(alpha=0.9, z_thresh=2.0, warmup=2))
    res, got = _step(z, 4.0, fixed=1.0)  # warm-up: the fixed clip at 1.0 applies
    assert got == pytest.approx(1.0, rel=1e-5) and z.last["warmup"]
    # the EMA starts from the clipped warm-up norms: 1.0 and 1.0 → μ = 1, σ = 0
    _step(z, 4.0, fixed=1.0)
    res, got = _step(z, 1.5, fixed=1.0)  # z = 0.5/(0 + ε) ≫ 2 → clipped to μ + 2σ = 1
    assert got == pytest.approx(1.0, rel=1e-5)
    assert z.last["fixed_coef"] == pytest.approx(1.0 / 1.5, rel=1e-5)


def _series(z, norms):
    return [_step(z, g, fixed=5.0)[0].coef.item() for g in norms]


def test_state_round_trip_continues_exactly():
    norms = [1.0, 1.3, 0.9, 1.1, 1.2, 6.0, 1.0, 0.8, 9.0, 1.1, 1.4, 7.5]
    straight = _series(ZScoreClip(ZScoreConfig(alpha=0.8, z_thresh=2.0, warmup=4)), norms)
    a = ZScoreClip(ZScoreConfig(alpha=0.8, z_thresh=2.0, warmup=4))
    first = _series(a, norms[:6])
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = ZScoreClip(ZScoreConfig(alpha=0.8, z_thresh=2.0, warmup=4))
    b.load_state_dict(torch.load(buf))
    assert first + _series(b, norms[6:]) == straight
    assert sum(c < 1 for c in straight) >= 2  # the planted spikes were clipped


@pytest.mark.parametrize("zscore, key", [
    ({"z_thresh": 0}, "train.zscore.z_thresh"), ({"z_thresh": -1.0}, "train.zscore.z_thresh"),
    ({"alpha": 1.0}, "train.zscore.alpha"), ({"warmup": 1}, "train.zscore.warmup"),
])
def test_bad_config_names_the_key(zscore, key):
    with pytest.raises(ValueError, match=rf"^{key}"):
        ZScoreConfig(**zscore)


def test_fixed_builds_no_policy():
    assert build_clip_policy("fixed", ZScoreConfig()) is None
    assert isinstance(build_clip_policy("zscore", ZScoreConfig(alpha=0.9, z_thresh=2.5, warmup=5)), ZScoreClip)
