"""The precision check's statistic (spec/checks/precision.py): a value rounded to a coarser format and stored back
has the low bits of its own significand zero; a value of the dtype's own arithmetic has them zero by chance
(2^−b; more where its terms cancel). Zeros, subnormals and non-finite values are not counted."""
from __future__ import annotations

import pytest
import torch

from spec.checks.precision import MIN_COUNT, coarse_counts, sample_stride

N = 4096


def share(y: torch.Tensor) -> float:
    k, n = coarse_counts(y[None])
    return float(k[0] / n[0])


def values(dtype: torch.dtype) -> torch.Tensor:
    # products and sums, as a layer's arithmetic makes them: every bit of the significand in use
    g = torch.Generator().manual_seed(0)
    return (torch.randn(N, 8, generator=g) @ torch.randn(8, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype, coarser", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                            (torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.bfloat16)])
def test_a_value_rounded_coarser_and_back_is_named_and_its_own_arithmetic_is_not(dtype, coarser):
    y = values(dtype)
    # by chance only: expected 2^−b (at most 1/8), far under the check's half (P(≥ 1/4 of 4096) < e^−100)
    assert share(y) < 0.25
    assert share(y.to(coarser).to(dtype)) > 0.99


def test_zeros_subnormals_and_nonfinite_values_are_not_counted():
    y = torch.tensor([0.0, -0.0, 1e-40, float("inf"), float("nan"), 1.5, 1.0000001])  # 1e-40: an FP32 subnormal
    k, n = coarse_counts(y[None])
    assert (float(k[0]), float(n[0])) == (1.0, 2.0)  # 1.5 is coarse (exact in bf16), 1.0000001 is not


def test_a_layer_is_judged_from_a_sample_the_chernoff_bound_allows():
    """n·KL(½‖¼) ≥ λ²/2 = 50 from 348 sampled numbers; the stride (an odd prime, so every column of a power-of-two
    width is met) leaves twice that where the output has it, and takes every element of a small one."""
    assert MIN_COUNT == 348 and 348 * 0.1438 > 50 > 347 * 0.1439
    assert sample_stride(8 * 128 * 128) == 61 and sample_stride(4 * 32 * 32) == 5 and sample_stride(500) == 1


def test_two_sums_off_by_a_rounding_are_a_precision_never_a_scaled_copy():
    """The forward check's loss row compares two sums (the CE and the z): one factor fitted to two numbers explains
    almost any miss, so there a rounding is a precision; a layer's whole output off by a factor is still scaled."""
    from spec.checks.forward import kind_of
    want = torch.tensor([812.3, 4.1], dtype=torch.float64)
    got = want * torch.tensor([1 + 3e-3, 1 - 2e-3], dtype=torch.float64)  # each sum off by its own rounding
    tol = torch.tensor(1.0, dtype=torch.float64)                           # below the miss, ≈ 2.4
    assert kind_of(got, want, tol) == "scaled"  # what a fitted factor says of any two numbers
    assert kind_of(got, want, tol, scalable=False) == "precision"
    y = torch.randn(4096, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    noisy = y + 1e-3 * torch.randn(4096, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert kind_of(2 * y, y, torch.tensor(1e-6, dtype=torch.float64)) == "scaled"
    assert kind_of(noisy, y, torch.tensor(1e-3, dtype=torch.float64)) == "precision"  # ‖noise‖ ≈ 0.064, no factor
    assert kind_of(torch.zeros(4096, dtype=torch.float64), y, torch.tensor(1e-3, dtype=torch.float64)) == "mismatch"
