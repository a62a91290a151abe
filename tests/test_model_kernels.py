"""The model's elementwise kernels: the SwiGLU clamp and its count of clamp hits, and the nodes whose gradients are
written by hand (model/swiglu.py swiglu_fused, model/norm.py rms_norm) against the formulas, torch and autograd."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model import SwiGLU
from model.norm import RMSNorm, rms_norm
from model.swiglu import swiglu, swiglu_fused


# ---------------------------------------------------------------- SwiGLU clamp

def test_swiglu_clamp_forward_matches_formula():
    L = 2.0
    g = torch.tensor([-5.0, -1.0, 0.0, 1.5, 2.0, 3.0, 50.0])
    u = torch.tensor([4.0, -3.0, 1.0, -1.5, 2.5, -0.5, 1.0])
    silu = lambda z: z / (1 + math.exp(-z))
    expected = [silu(min(gi, L)) * max(-L, min(ui, L)) for gi, ui in zip(g.tolist(), u.tolist())]
    torch.testing.assert_close(swiglu(g, u, L), torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_swiglu_clamp_zeroes_gradient_outside_the_bound():
    L = 1.0
    g = torch.tensor([-3.0, 0.5, 1.5, 4.0, 0.2], requires_grad=True)
    u = torch.tensor([2.0, -0.3, 0.7, -5.0, -1.2], requires_grad=True)
    swiglu(g, u, L).sum().backward()
    assert torch.equal(g.grad == 0, torch.tensor([False, False, True, True, False]))
    assert torch.equal(u.grad == 0, torch.tensor([True, False, False, True, True]))


def test_swiglu_unclamped_path_is_exact():
    g, u = torch.randn(100) * 30, torch.randn(100) * 30
    assert torch.equal(swiglu(g, u, None), F.silu(g) * u)
    torch.testing.assert_close(swiglu(g, u, None), g * torch.sigmoid(g) * u)


def test_swiglu_module_counts_clamp_hits():
    torch.manual_seed(4)
    mlp = SwiGLU(8, 16, limit=0.5)
    torch.nn.init.normal_(mlp.w_gate_up.weight, std=0.4)  # large enough that some elements hit L
    x = torch.randn(3, 5, 8)
    mlp(x)
    assert mlp.clamp_total.item() == 0  # record_stats off: nothing recorded
    mlp.record_stats = True
    mlp(x)
    h = x @ mlp.w_gate_up.weight.T
    hits = sum(int(h[b, t, j] > 0.5 or abs(h[b, t, 16 + j]) > 0.5)
               for b in range(3) for t in range(5) for j in range(16))
    assert 0 < hits < 3 * 5 * 16
    assert mlp.clamp_hits.item() == hits and mlp.clamp_total.item() == 3 * 5 * 16


def test_swiglu_fused_is_swiglu_of_the_halves_and_its_hand_written_gradient_is_autograds():
    torch.manual_seed(6)
    for limit in (None, 1.0):
        x = torch.randn(4, 5, 12) * 2
        x[0, 0, :3] = torch.tensor([1.0, -1.0, 7.0])  # at the bound (its gradient passes) and beyond it
        x[0, 0, 6:9] = torch.tensor([1.0, -1.0, -7.0])
        dh = torch.randn(4, 5, 6)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_fused, y_plain = swiglu_fused(a, limit), swiglu(*b.chunk(2, dim=-1), limit)
        assert torch.equal(y_fused, y_plain)
        y_fused.backward(dh)
        y_plain.backward(dh)
        assert torch.equal(a.grad == 0, b.grad == 0)  # the clamp's zeros, ends of the bound included
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-7, atol=0)  # one rounding of silu′ apart at most
        x64 = (torch.randn(3, 4, 10, dtype=torch.float64) * 2).requires_grad_()
        assert torch.autograd.gradcheck(lambda t: swiglu_fused(t, limit), (x64,))


def test_swiglu_fused_runs_a_replaced_swiglu(monkeypatch):
    import model.swiglu as sw
    monkeypatch.setattr(sw, "swiglu", lambda gate, up, limit: gate * up)  # a planted bug, as labs/breaks.py does
    x = torch.randn(3, 8)
    assert torch.equal(sw.swiglu_fused(x, None), x[:, :4] * x[:, 4:])


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_rms_norm_is_torchs_and_its_hand_written_gradient_is_exact():
    torch.manual_seed(7)
    x, g, dy = torch.randn(6, 9, 32) * 3, 1 + 0.2 * torch.randn(32), torch.randn(6, 9, 32)
    a, ga = x.clone().requires_grad_(), g.clone().requires_grad_()
    b, gb = x.clone().requires_grad_(), g.clone().requires_grad_()
    y = rms_norm(a, ga, 1e-5)
    # ‖x‖²/D instead of mean(x²): another order of one sum, a few units of the last place
    torch.testing.assert_close(y, torch.rms_norm(b, (32,), gb, 1e-5), rtol=4e-7, atol=0)
    y.backward(dy)
    torch.rms_norm(b, (32,), gb, 1e-5).backward(dy)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ga.grad, gb.grad, rtol=1e-5, atol=1e-5)
    x64 = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    g64 = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, w: rms_norm(t, w, 1e-5), (x64, g64))
    # a BF16 input (q, k under autocast) is normed in FP32 and cast back, as torch.rms_norm does
    xb = x.bfloat16()
    assert torch.equal(rms_norm(xb, g, 1e-5), torch.rms_norm(xb, (32,), g, 1e-5))
    norm = RMSNorm(32, eps=1e-5)
    assert isinstance(norm, torch.nn.RMSNorm) and list(norm.state_dict()) == ["weight"]


# ---------------------------------------------------------------- clamp hits

@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", ["none", "gate_below", "gate_above", "up_below", "up_above", "empty"])
def test_clamp_hits_equals_the_elementwise_count(case, fused):
    """clamp_hits (with its shortcut when nothing lies beyond the clamp) equals the plain count of
    positions where gate > L or |up| > L; one element beyond the bound on either side is counted. `fused`:
    gate and up are the halves of one projection's output (the shortcut's one-tensor path)."""
    from model.swiglu import clamp_hits
    g = torch.Generator().manual_seed(0)
    n = 0 if case == "empty" else 64
    gate, up = torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)
    if case == "gate_below":
        gate[3, 2] = -20.0  # silu is bounded below: the gate is clamped from above only
    elif case == "gate_above":
        gate[3, 2] = 11.0
    elif case == "up_below":
        up[5, 1] = -11.0
        gate[5, 0] = -20.0  # silu is bounded below: a gate far below -L is not clamped, not counted
    elif case == "up_above":
        up[0, 0] = 10.5
    ref = int(((gate > 10.0) | (up.abs() > 10.0)).sum())
    if fused:
        gate, up = (torch.cat([gate, up], dim=-1) * 1.0).chunk(2, dim=-1)
        assert gate._base is up._base is not None
    assert int(clamp_hits(gate, up, 10.0)) == ref == (0 if case in ("none", "gate_below", "empty") else 1)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", ["none", "gate_at_L", "gate_above", "gate_below", "up_below", "up_at_minus_L", "nan",
                                  "empty", "off"])
@pytest.mark.parametrize("limit, dtype", [(10.0, torch.float32), (0.7, torch.float32), (7.32, torch.bfloat16)])
def test_swiglu_counted_is_swiglu_and_clamp_hits_to_the_bit(case, fused, limit, dtype):
    """The recording path (its cheap test reads the clamp's outputs) gives swiglu's values and gradients
    bit for bit and clamp_hits' count, including an element exactly at the bound (not a hit), a NaN, and
    bounds the dtype rounds down (0.7 in float32, 7.32 in bfloat16: a clamped element then lies below L)."""
    from model.swiglu import clamp_hits, swiglu_counted
    g = torch.Generator().manual_seed(1)
    n = 0 if case == "empty" else 48
    gate, up = torch.randn(n, 8, generator=g) * limit / 4, torch.randn(n, 8, generator=g) * limit / 4
    gate, up = gate.to(dtype), up.to(dtype)
    L = torch.tensor(limit, dtype=dtype).item()  # the bound as the dtype holds it
    edits = {"gate_at_L": ("gate", (2, 3), L), "gate_above": ("gate", (2, 3), limit * 1.05),
             "gate_below": ("gate", (4, 1), -3 * limit), "up_below": ("up", (7, 7), -1.2 * limit),
             "up_at_minus_L": ("up", (7, 7), -L), "nan": ("gate", (1, 1), math.nan)}
    if case in edits:
        which, at, v = edits[case]
        (gate if which == "gate" else up)[at] = v
    limit = None if case == "off" else limit
    ref_hits = int(((gate > limit) | (up.abs() > limit)).sum()) if limit else 0

    def run(counted: bool):
        base = torch.cat([gate, up], dim=-1).requires_grad_()
        if fused:
            ga, u = base.chunk(2, dim=-1)
        else:
            ga, u = (t.clone() for t in base.chunk(2, dim=-1))
        if counted:
            h, hits = swiglu_counted(ga, u, limit)
        else:
            h, hits = swiglu(ga, u, limit), clamp_hits(ga, u, limit)
        (h.float() * torch.linspace(-1, 1, h.numel()).view_as(h)).sum().backward()
        return h.detach(), int(hits), base.grad

    (h0, n0, g0), (h1, n1, g1) = run(False), run(True)
    same = lambda a, b: torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(a.isnan(), b.isnan())
    assert same(h0, h1) and same(g0, g1)
    assert n1 == n0 == ref_hits
    assert ref_hits == (1 if case in ("gate_above", "up_below") else 0)
