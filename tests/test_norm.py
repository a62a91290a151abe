"""model/norm.py: RMSNorm with its backward written out computes torch's forward bit for bit and autograd's
gradient to rounding (float64: to finite differences)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.norm import RMSNorm, rms_norm


def _norm(d: int, dtype=torch.float32) -> RMSNorm:
    norm = RMSNorm(d, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(d, dtype=dtype))  # a gain other than 1, so dw is not Σ g·x̂ alone
    return norm


def test_forward_is_torchs_bit_for_bit_and_the_module_is_an_nn_rmsnorm():
    torch.manual_seed(0)
    norm = _norm(128)
    ref = nn.RMSNorm(128, eps=1e-5)
    ref.load_state_dict(norm.state_dict())  # the same parameter under the same name
    x = 3 * torch.randn(12, 64, 128)
    assert isinstance(norm, nn.RMSNorm)
    assert torch.equal(norm(x), ref(x)) and torch.equal(norm(x), F.rms_norm(x, [128], norm.weight, 1e-5))


def test_gradient_matches_autograd_of_the_composite_in_float32():
    torch.manual_seed(0)
    norm = _norm(128)
    x = (3 * torch.randn(12, 64, 128)).requires_grad_()
    g = torch.randn(12, 64, 128)
    dx, dw = torch.autograd.grad(norm(x), (x, norm.weight), g)
    rx, rw = torch.autograd.grad(F.rms_norm(x, [128], norm.weight, 1e-5), (x, norm.weight), g)
    torch.testing.assert_close(dx, rx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, rw, rtol=1e-5, atol=1e-4)


def test_gradient_against_finite_differences_in_float64():
    torch.manual_seed(0)
    w = (1 + 0.3 * torch.randn(16, dtype=torch.float64)).requires_grad_()
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-5), (x, w))
    strided = torch.randn(3, 5, 24, dtype=torch.float64)[..., 4:20].requires_grad_()  # a view, as a q/k head is
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-5), (strided, w))


def test_a_bf16_stream_is_normalised_in_fp32_and_keeps_its_dtype():
    torch.manual_seed(0)
    norm = _norm(32)
    x = torch.randn(4, 8, 32, dtype=torch.bfloat16, requires_grad=True)
    y = norm(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, F.rms_norm(x.float(), [32], norm.weight, 1e-5).bfloat16())
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and norm.weight.grad.dtype == torch.float32


def test_one_call_with_a_gain_per_head_is_two_norms():
    """QK-norm's single call: q's gain on q's heads and k's on k's, each head normalised on its own."""
    torch.manual_seed(0)
    H, K, d = 4, 2, 16
    qn, kn = _norm(d), _norm(d)
    qk = torch.randn(3, 8, H + K, d, requires_grad=True)
    gain = torch.cat([qn.weight.expand(H, -1), kn.weight.expand(K, -1)])
    one = rms_norm(qk, gain, 1e-5)
    two = torch.cat([F.rms_norm(qk[:, :, :H], [d], qn.weight, 1e-5), F.rms_norm(qk[:, :, H:], [d], kn.weight, 1e-5)], 2)
    assert torch.equal(one, two)
    g = torch.randn_like(one)
    got = torch.autograd.grad(one, (qk, qn.weight, kn.weight), g)
    want = torch.autograd.grad(two, (qk, qn.weight, kn.weight), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    w64 = (1 + 0.3 * torch.randn(H + K, d, dtype=torch.float64)).requires_grad_()
    x64 = torch.randn(2, 3, H + K, d, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-5), (x64, w64))
