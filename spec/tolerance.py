"""Tolerances from the precision recipe: unit roundoff and accumulation length, never a calibration run.

A floating-point operation rounds its exact result to the nearest representable value: relative error at most
the unit roundoff u = 2^−p (p: the significand's bits, the implicit one included):

    fp64 2^−53   fp32 2^−24   bf16 2^−8   fp16 2^−11   fp8 E4M3 2^−4   fp8 E5M2 2^−3

A product-sum of K terms (a matmul's inner dimension) whose inputs are rounded to the recipe's matmul dtype and
accumulated in FP32 has, in the probabilistic model of rounding (Higham & Mary 2019, "A new approach to
probabilistic rounding error analysis": independent zero-mean errors), a relative error below

    λ·(2·u_in + √K·u_acc + u_out)       with probability ≥ 1 − 2·exp(−λ²/2)

(u_in for each of the two rounded inputs, √K·u_acc for the K accumulations, u_out for the stored result).
λ = 10 makes that failure probability 4e-22 per reduction, so over every reduction of every check of a
1e6-step run the chance of a false alarm stays below 1e-9. A chain of n such stages adds their errors
(first order), and a stage whose output is more sensitive than its input (softmax over logits as large as s:
relative sensitivity ≤ 1 + s; Newton–Schulz's a = 3.4445 per step) multiplies them by that condition number.
The forward and backward checks compare normwise (‖Δ‖/‖y‖ over a whole tensor), where these bounds hold
as written; elementwise checks (the optimizer's algebra) use the deterministic bound n·u of n roundings.
"""
from __future__ import annotations

import math

import torch

LAMBDA = 10.0  # Higham–Mary's λ: failure probability 2·exp(−λ²/2) = 4e-22 per reduction
# the deterministic bounds (n roundings, n·u) count every rounding ×4: room for the roundings an implementation adds
# (a fused kernel's order)
SAFETY = 4

UNIT_ROUNDOFF = {
    torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11,
    torch.float8_e4m3fn: 2.0 ** -4, torch.float8_e5m2: 2.0 ** -3,
}
U32 = UNIT_ROUNDOFF[torch.float32]


def u(dtype: torch.dtype) -> float:
    return UNIT_ROUNDOFF[dtype]


def stage(K: int, u_in: float, u_acc: float = U32, u_out: float | None = None) -> float:
    """Normwise relative error bound (without λ) of one rounded product-sum stage of length K."""
    return 2 * u_in + math.sqrt(max(K, 1)) * u_acc + (u_in if u_out is None else u_out)


def chain(*stages: float, condition: float = 1.0) -> float:
    """λ·Σ stages · condition: the relative tolerance of a chain of stages."""
    return LAMBDA * sum(stages) * condition


def matmul_dtype(recipe, param_dtype: str = "float32") -> torch.dtype:
    """The dtype a run rounds matmul inputs to: FP8 for the FP8 recipes, the autocast dtype of bf16 / fp16, the
    FSDP2 param_dtype when it is lower, else FP32."""
    name = getattr(recipe, "name", "fp32")
    if name.startswith(("fp8", "te")):
        return torch.float8_e4m3fn
    dtype = getattr(recipe, "dtype", None) if name in ("bf16", "fp16") else torch.float32
    low = getattr(torch, param_dtype, torch.float32)
    return dtype if u(dtype) >= u(low) else low
