"""The gradients lab: every component passes the float64 finite-difference check, the label-mask bug
passes it too while changing the loss, and a deliberately wrong backward is caught where it lives."""
from __future__ import annotations

import json

import pytest
import torch

import model.attention
import model.rope
import model.swiglu
from labs import gradients as G
from labs import run as labs_run
from labs.breaks import _ScaledGrad, _StraightThroughClamp  # the same wrong backwards `--set break=` plants
from labs.gradcheck import fd_check

REAL_ROPE, REAL_SWIGLU = model.rope.apply_rope, model.swiglu.swiglu


def _straight_through_swiglu(gate, up, limit):
    if limit is None:
        return REAL_SWIGLU(gate, up, limit)
    return torch.nn.functional.silu(_StraightThroughClamp.apply(gate, None, limit)) * \
        _StraightThroughClamp.apply(up, -limit, limit)


def _lab(tmp_path) -> tuple[int, dict]:
    code = labs_run.main(["--experiment", "gradients", "--seed", "7", "--quick", "--out", str(tmp_path)])
    return code, json.loads((tmp_path / "result.json").read_text())


def test_quick_lab_passes_every_component_and_shows_the_mask_bug(tmp_path, capsys):
    code, res = _lab(tmp_path)
    out = capsys.readouterr().out
    assert code == 0 and res["ok"] and all(res["checks"].values()), out[-3000:]
    assert "whole model (dense + MoE)" in out and "lesson" in out and "expected effect present" in out
    for name, c in res["components"].items():
        assert c["coords"] == 20 and c["rel_err"] <= 1e-6, name
        assert c["grad_norm"] > 0, name  # a check on an all-zero gradient would prove nothing
    assert res["clamp"]["clamped"] > 0 and res["clamp"]["exact_zero"] == res["clamp"]["clamped"]
    s = res["lesson"]
    # the buggy objective counts the PAD positions as labels, and its gradient is exact...
    assert s["labels_bug"] > s["labels_correct"] and s["bug_rel_err"] <= 1e-6
    # ...yet it is another objective: another loss, another gradient
    assert abs(s["loss_bug"] - s["loss_correct"]) > 0.05 * s["loss_correct"]
    assert s["grad_difference"] > 0.1
    assert (tmp_path / "gradients.png").stat().st_size > 5000


def test_a_wrong_rope_backward_fails_exactly_the_components_that_use_rope(tmp_path, monkeypatch, capsys):
    wrong = lambda x, cos, sin: REAL_ROPE(_ScaledGrad.apply(x), cos, sin)  # noqa: E731
    for holder in (model.rope, model.attention):  # the definition and the attention that imports it
        monkeypatch.setattr(holder, "apply_rope", wrong)
    code, res = _lab(tmp_path)
    assert code == 1 and not res["ok"]
    assert "EXPECTED EFFECT ABSENT" in capsys.readouterr().out
    failed = {n for n, c in res["components"].items() if c["rel_err"] > 1e-6}
    assert failed == {"attention (GQA + RoPE)", "attention + QK-norm", "RoPE", "whole model (dense + MoE)"}
    # 1 % of the RoPE path's gradient: the error shows at the percent level, far above 1e-6
    assert 1e-3 < res["components"]["RoPE"]["rel_err"] < 0.02


def test_a_straight_through_clamp_fails_outside_the_bound_only(monkeypatch):
    monkeypatch.setattr(model.swiglu, "swiglu", _straight_through_swiglu)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    inside = fd_check(*G.swiglu_inside(16), 40, gen)
    outside = fd_check(*G.swiglu_outside(16), 40, gen)
    assert inside["rel_err"] <= 1e-6  # inside the bound the clamp is the identity either way
    assert outside["rel_err"] > 0.1    # outside, autograd claims a slope the function does not have


def test_fd_check_redraws_coordinates_that_straddle_a_kink():
    # |x| has a kink at 0: x = ±h/2 straddles it (f_fd there is ~0, autograd says ±1); such points
    # must be re-drawn, not reported as errors
    x = torch.tensor([0.5e-5, -0.5e-5, 0.3, -0.7, 1.2, -2.0], dtype=torch.float64, requires_grad=True)
    res = fd_check(lambda: (x.abs().sum(), x > 0), {"x": x}, 4, torch.Generator().manual_seed(0))
    assert sorted(res["where"]) == ["x[2]", "x[3]", "x[4]", "x[5]"] and res["rel_err"] < 1e-9
    # without the region the same points are checked, and fail
    res = fd_check(lambda: (x.abs().sum(), None), {"x": x}, 6, torch.Generator().manual_seed(0))
    assert res["skipped"] == 0 and res["rel_err"] > 0.1
    # a point that only ever sits on the kink cannot be checked: say so
    y = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="kink or tie"):
        fd_check(lambda: (y.abs().sum(), y > 0), {"y": y}, 2, torch.Generator(), max_skips=2)


def test_fd_check_refuses_a_tensor_it_cannot_check():
    x = torch.ones(3, requires_grad=True)  # float32: FD error ~1e-3, the check would mean nothing
    with pytest.raises(ValueError, match="float64 leaf"):
        fd_check(lambda: (x.sum(), None), {"x": x}, 2, torch.Generator())
