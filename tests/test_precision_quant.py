"""FP8 quantisers and the FP8 Linear against naive references, E4M3's resolution and FP32 numbers."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

from model.moe import GroupedExperts
from precision.fp8_gemm import emulated_gemm_nt, fast_path_status, gemm_nt
from precision.fp8_linear import Fp8GroupedExperts, fp8_linear
from precision.quant import E4M3_MAX, cast_e4m3, dequantize, fake_quantize, quantize

U = 2.0 ** -4      # E4M3: 3 mantissa bits → max relative rounding error of a normal value
SUB = 2.0 ** -10   # half the subnormal spacing 2^-9, in units of the group's scale


def naive_quantize(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Reference: loop over rows×cols groups, s = amax/448, round-trip each group on its own."""
    out = torch.empty_like(x)
    for r in range(0, x.shape[0], rows):
        for c in range(0, x.shape[1], cols):
            g = x[r:r + rows, c:c + cols]
            s = g.abs().max().clamp(min=1e-30) / 448.0
            out[r:r + rows, c:c + cols] = (g / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    return out


def wide_range(R: int, C: int, seed: int = 0) -> torch.Tensor:
    """Every 1×128 tile at its own magnitude, 10^-6 … 10^6 (partial last tile included)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, C, generator=g)
    mags = 10.0 ** (torch.rand(R, math.ceil(C / 128), generator=g) * 12 - 6)
    return x * mags.repeat_interleave(128, dim=1)[:, :C]


@pytest.mark.parametrize("kind, rows, cols", [("tile", 1, 128), ("block", 128, 128), ("tensor", 10**9, 10**9)])
def test_quantize_matches_naive_group_loop(kind, rows, cols):
    x = wide_range(200, 300)  # 300 = 2 full tiles + a partial one; 200 rows = 1 full block + a partial
    assert torch.equal(dequantize(quantize(x, kind)), naive_quantize(x, rows, cols))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["tile", "block", "tensor"])
def test_the_scale_is_the_quotient_amax_over_448_correctly_rounded(kind, device):
    """s = amax / 448 rounded once (IEEE division), on every device: CUDA divides by a number as a product with its
    reciprocal, one ulp off for some amax (on an H200, and then x/s rounded to the next E4M3 code), and the fused
    quantiser divides exactly: the two must agree bit for bit."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = wide_range(256, 384, seed=3).to(device)
    q = quantize(x, kind)
    groups = {"tile": "r (g t) -> r g t", "block": "(a i) (b j) -> a b (i j)", "tensor": "r c -> (r c)"}[kind]
    amax = rearrange(x, groups, **({"t": 128} if kind == "tile" else {"i": 128, "j": 128} if kind == "block" else {}))
    amax = amax.abs().amax(-1)
    assert torch.equal(q.scale, (amax.double() / 448.0).float()), kind



@pytest.mark.parametrize("kind", ["tile", "block"])
def test_round_trip_error_bounded_by_e4m3_resolution_per_group(kind):
    x = wide_range(256, 384, seed=1)
    q = quantize(x, kind)
    s = q.scale.repeat_interleave(128, 1) if kind == "tile" else \
        q.scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    err = (dequantize(q) - x).abs()
    bound = torch.maximum(x.abs() * U, s * SUB)
    assert (err <= bound * (1 + 1e-5)).all()
    # the bound is E4M3's, not something looser: normal values do reach ~2^-4 relative error
    normal = x.abs() > 2.0 ** -6 * s
    assert (err[normal] / x.abs()[normal]).max() > U / 2
    # online amax: the largest element of every group lands exactly on ±448
    mx = q.data.float().abs()
    amax = mx.amax(-1) if kind == "tile" else mx.reshape(2, 128, 3, 128).amax(dim=(1, 3))
    assert torch.all(amax == E4M3_MAX)


@pytest.mark.parametrize("kind", ["tile", "block", "tensor"])
def test_saturation_and_extreme_groups_stay_finite(kind):
    x = torch.randn(128, 512)
    x[:, :128] = 0.0                        # all-zero group: 0/0 must not appear
    x[:, 128:256] *= 1e-42                  # FP32 denormals: the scale must not underflow to 0
    x[:, 256:384] = 3.0e38 * torch.sign(x[:, 256:384])  # near FP32 max: x·448 would overflow
    deq = dequantize(quantize(x, kind))
    assert torch.isfinite(deq).all()
    assert torch.equal(deq[:, :128], x[:, :128])
    big = x[:, 256:384]
    assert ((deq[:, 256:384] - big).abs() <= big.abs() * U).all()
    # values past E4M3's range saturate to ±448 instead of becoming NaN
    over = torch.tensor([449.0, 1e4, -1e30, 464.0])
    assert cast_e4m3(over).float().tolist() == [448.0, 448.0, -448.0, 448.0]


def test_nonfinite_input_is_not_silently_hidden():
    x = torch.randn(4, 256)
    x[1, 5] = float("nan")
    deq = dequantize(quantize(x, "tile"))
    assert deq[1, :128].isnan().any() and torch.isfinite(deq[0]).all()  # only the poisoned tile


def test_block_scaling_beats_per_tensor_on_non_outlier_elements():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1024, generator=g)
    outlier = torch.zeros(1024, dtype=torch.bool)
    outlier[[17, 600]] = True
    x[:, outlier] *= 1e5  # "massive activation" channels
    err = {k: ((fake_quantize(x, k) - x)[:, ~outlier].norm() / x[:, ~outlier].norm()).item()
           for k in ("tile", "tensor")}
    assert err["tile"] < err["tensor"]
    # per-tensor: amax 10^5·4 pushes ordinary values into E4M3 subnormals; tiles without an outlier
    # (6 of 8) keep E4M3's ~2.6 % RMS error
    assert err["tensor"] > 0.2 and err["tile"] < 0.15


def test_block_quantisation_commutes_with_transpose():
    w = wide_range(300, 200, seed=2)
    assert torch.equal(quantize(w, "block").t().dequantize(), quantize(w.t(), "block").dequantize())


@pytest.mark.parametrize("scaling", ["block", "tensor"])
def test_fp8_linear_matches_fake_quant_reference_and_fp32(scaling):
    """Each GEMM against an independent composition of the (tested) quantiser: this pins the tiling
    of every operand, forward and backward (a wgrad that forgot to re-tile fails by ~1e-2)."""
    torch.manual_seed(3)
    x = torch.randn(3, 100, 192, dtype=torch.float64).float().requires_grad_()  # M=300, K=192: partial tiles
    w = (torch.randn(320, 192) * 0.05).requires_grad_()
    dy = torch.randn(3, 100, 320)
    y = fp8_linear(x, w, None, scaling)
    y.backward(dy)
    act, wk = ("tile", "block") if scaling == "block" else ("tensor", "tensor")
    x2, dy2 = x.detach().reshape(300, 192), dy.reshape(300, 320)
    y_ref = fake_quantize(x2, act) @ fake_quantize(w.detach(), wk).t()
    dx_ref = fake_quantize(dy2, act) @ fake_quantize(w.detach(), wk)
    dw_ref = fake_quantize(dy2.t(), act) @ fake_quantize(x2.t(), act).t()
    for got, ref in ((y.detach().reshape(300, 320), y_ref), (x.grad.reshape(300, 192), dx_ref), (w.grad, dw_ref)):
        assert ((got - ref).norm() / ref.norm()).item() < 1e-6
    # and against FP32: E4M3 operands (≤ 2^-4 relative each) give a few % relative error per GEMM
    x32, w32 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.linear(x32, w32).backward(dy)
    for got, ref in ((y.detach(), F.linear(x32, w32).detach()), (x.grad, x32.grad), (w.grad, w32.grad)):
        rel = ((got - ref).norm() / ref.norm()).item()
        assert 1e-3 < rel < 0.08


def test_fp8_linear_output_dtype_follows_autocast_and_empty_input_keeps_graph():
    w = torch.randn(32, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fp8_linear(torch.randn(4, 16), w).dtype == torch.bfloat16
    y = fp8_linear(torch.randn(0, 16), w)  # an expert with no tokens
    y.sum().backward()
    assert y.shape == (0, 32) and torch.equal(w.grad, torch.zeros_like(w))


def test_fp8_grouped_experts_mirror_the_high_precision_loop():
    torch.manual_seed(4)
    ex = GroupedExperts(3, 32, 48, limit=2.0)
    ex.init_weights(0.3, 0.3)
    ex.record_stats, ex.grouped = True, False  # the per-expert loop: the path FP8 experts run
    x = torch.randn(20, 32)
    counts = [7, 0, 13]  # an empty expert included
    ref = ex(x, counts)
    fp8 = Fp8GroupedExperts.from_experts(ex, "block")
    assert fp8.w_gate_up is ex.w_gate_up and fp8.w_down is ex.w_down
    fp8.linear = lambda a, w: F.linear(a, w)  # the drift guard: same loop, high-precision matmuls
    assert torch.equal(fp8(x, counts), ref) and fp8.clamp_hits == ex.clamp_hits
    del fp8.linear
    out = fp8(x, counts)
    assert 1e-3 < ((out - ref).norm() / ref.norm()).item() < 0.1
    assert fp8.clamp_total == ex.clamp_total


@pytest.mark.gpu
@pytest.mark.parametrize("a_kind, b_kind", [("tile", "block"), ("tile", "tile"), ("tensor", "tensor")])
def test_cuda_scaled_mm_agrees_with_emulation(a_kind, b_kind):
    torch.manual_seed(5)
    a = quantize(torch.randn(256, 512, device="cuda"), a_kind)
    b = quantize(torch.randn(384, 512, device="cuda") * 0.02, b_kind)
    out, ref = gemm_nt(a, b), emulated_gemm_nt(a, b)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2
    print(fast_path_status())  # which path ran is part of the GPU report


@pytest.mark.gpu
def test_fp8_linear_on_cuda_matches_the_fake_quant_reference():
    """All three GEMMs (fprop, dgrad, wgrad) on whole 128-tiles: the shapes the scaled_mm path takes."""
    torch.manual_seed(6)
    x = torch.randn(256, 384, device="cuda", requires_grad=True)
    w = (torch.randn(512, 384, device="cuda") * 0.05).requires_grad_()
    dy = torch.randn(256, 512, device="cuda")
    y = fp8_linear(x, w)
    y.backward(dy)
    y_ref = fake_quantize(x.detach(), "tile") @ fake_quantize(w.detach(), "block").t()
    dx_ref = fake_quantize(dy, "tile") @ fake_quantize(w.detach(), "block")
    dw_ref = fake_quantize(dy.t(), "tile") @ fake_quantize(x.detach().t(), "tile").t()
    for got, ref in ((y.detach(), y_ref), (x.grad, dx_ref), (w.grad, dw_ref)):
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2
