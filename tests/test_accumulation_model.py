"""The modelled tensor-core accumulator (precision/fp8_gemm.limited_accumulation_gemm_nt): exact when
the accumulator is wide, lossy over a long K when narrow, and V3's promotion every 128 elements fixes it."""
from __future__ import annotations

import pytest
import torch

from precision.fp8_gemm import emulated_gemm_nt, limited_accumulation_gemm_nt, truncate_mantissa
from precision.quant import quantize


def operands(K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(16, K, generator=g), "tile"), quantize(torch.randn(8, K, generator=g), "block")


def test_truncate_mantissa_drops_low_bits_towards_zero():
    x = torch.tensor([1.0 + 2 ** -5 + 2 ** -9, -(1.0 + 2 ** -5 + 2 ** -9), 3.0, 0.0])
    assert truncate_mantissa(x, 6).tolist() == [1.0 + 2 ** -5, -(1.0 + 2 ** -5), 3.0, 0.0]


def test_a_wide_accumulator_reproduces_the_fp32_emulation():
    a, b = operands(512)
    # 23 bits is FP32's own mantissa: the model degenerates to an FP32 running sum
    assert torch.allclose(limited_accumulation_gemm_nt(a, b, None, acc_bits=23), emulated_gemm_nt(a, b),
                          rtol=1e-5, atol=1e-4)


def test_promotion_bounds_the_error_a_narrow_accumulator_makes_over_a_long_k():
    a, b = operands(2048)
    ref = a.dequantize().double() @ b.dequantize().double().t()
    rel = {e: ((limited_accumulation_gemm_nt(a, b, e).double() - ref).norm() / ref.norm()).item()
           for e in (None, 2048, 128)}
    assert rel[None] == rel[2048]  # promoting once at the end is no promotion
    assert rel[None] > 1e-2 and rel[128] * 5 < rel[None]


def test_bad_promote_every_is_refused():
    a, b = operands(8)
    with pytest.raises(ValueError, match="promote_every=0"):
        limited_accumulation_gemm_nt(a, b, 0)
