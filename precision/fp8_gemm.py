"""One FP8 GEMM, C = A · B^T with FP32 accumulation, for every product of an FP8 Linear.

    fprop  y  = x  · W^T   A = x   (M×K, 1×128 tiles)      B = W   (N×K, 128×128 blocks)
    dgrad  dx = dy · W     A = dy  (M×N, 1×128 tiles)      B = W^T (K×N, the same blocks transposed)
    wgrad  dW = dy^T · x   A = dy^T (N×M, 1×128 = dy's 128×1)  B = x^T (K×M, 1×128 = x's 128×1)

Two paths, same numbers up to the order of the FP32 sums:
  - emulation (CPU, and any GPU case below): dequantise both operands to FP32, then an FP32 matmul;
  - CUDA: torch.nn.functional.scaled_mm with the scales as cuBLASLt wants them laid out (block-wise
    scaling needs sm90 and CUDA >= 12.9; tensor-wise needs sm89+).
WARN: the CUDA path could not be run where it was written (no GPU). So each (A kind, B kind) pair
checks its first CUDA result against the emulation and, on an error or a mismatch, falls back to the
emulation for the rest of the process, with one warning. `fast_path_status()` says which happened.

Limited accumulation (`limited_accumulation_gemm_nt`): the emulation above sums in exact FP32, so the
problem DeepSeek-V3 §3.3.2 fixes cannot appear in it. H800 FP8 tensor cores keep only ~14 mantissa bits
in their accumulator; summing a long K there loses the low bits of every addend (~2 % relative error at
K = 4096 in V3's measurement). V3's fix: every N_C = 128 elements along K, copy the partial sum to an FP32
register on the CUDA cores and add it there. This models both: a running accumulator truncated to
`acc_bits` mantissa bits after every addition, promoted to an exact FP32 sum every `promote_every`
elements (None: never promoted, the whole K in the narrow accumulator).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from precision.quant import QTensor

# (a.kind, b.kind) -> True (checked, in use) | False (failed, emulating) ; absent = not tried yet
_FAST: dict[tuple[str, str], bool] = {}
_FAST_NOTES: dict[tuple[str, str], str] = {}
# NOTE: cuBLASLt accumulates in FP32 but in another order (and Hopper's FP8 tensor cores keep ~14
# bits between promotions, DeepSeek-V3 §3.3.2); 1 % of the output RMS separates that from a wrong layout.
_CHECK_RTOL = 1e-2


def gemm_nt(a: QTensor, b: QTensor) -> torch.Tensor:
    """FP32 (M, N) = dequant(a) · dequant(b)^T for a (M, K) and b (N, K)."""
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"gemm_nt: contraction dims differ, {tuple(a.data.shape)} vs {tuple(b.data.shape)}")
    key = (a.kind, b.kind)
    if _fast_eligible(a, b) and _FAST.get(key, True):
        try:
            out = _scaled_mm(a, b)
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
            _disable(key, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        else:
            if key in _FAST:
                return out
            ref = emulated_gemm_nt(a, b)
            err = ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()
            if err <= _CHECK_RTOL:
                _FAST[key], _FAST_NOTES[key] = True, f"scaled_mm checked against emulation (rel err {err:.1e})"
                return out
            _disable(key, f"scaled_mm differs from the emulation by {err:.1e} relative")
            return ref
    return emulated_gemm_nt(a, b)


def emulated_gemm_nt(a: QTensor, b: QTensor) -> torch.Tensor:
    # NOTE: not bit-exact to an FP8 GEMM. There the E4M3 products are exact in FP32 (4-bit significands)
    # and the scales are applied after the sum; here the dequantised values q·s are multiplied, and the
    # scales (amax/448) are not powers of two, so q·s, the products and the sums all round in FP32.
    return a.dequantize() @ b.dequantize().t()


# NOTE: V3 §3.3.2 puts the H800 accumulator at "around 14 bits"; 13 stored bits + the implicit one.
ACC_BITS = 13


def truncate_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x with its mantissa cut to `bits` fractional bits, towards zero.
    NOTE: truncation, not round-to-nearest: a tensor core aligns addends to the larger exponent and
    drops the bits shifted out, so the error is a bias that grows with K rather than averaging out."""
    m, e = torch.frexp(x)  # x = m · 2^e, 0.5 <= |m| < 1
    return torch.ldexp(torch.trunc(m * 2.0 ** (bits + 1)) / 2.0 ** (bits + 1), e)


def limited_accumulation_gemm_nt(a: QTensor, b: QTensor, promote_every: int | None = 128,
                                 acc_bits: int = ACC_BITS) -> torch.Tensor:
    """dequant(a) · dequant(b)^T with a modelled tensor-core accumulator (see the module docstring).

    Products are exact (E4M3 × E4M3 fits any accumulator); each addition into the narrow accumulator
    is truncated to `acc_bits`; every `promote_every` elements the partial sum is added to an FP32
    total and the narrow accumulator restarts at zero. Loops over K: meant for labs and tests."""
    x_MK, w_NK = a.dequantize(), b.dequantize()
    K = x_MK.shape[1]
    chunk = K if promote_every is None else promote_every
    if chunk < 1:
        raise ValueError(f"promote_every={promote_every}: expected a positive number of elements or None")
    total_MN = torch.zeros(x_MK.shape[0], w_NK.shape[0], dtype=torch.float32)
    for k0 in range(0, K, chunk):
        acc_MN = torch.zeros_like(total_MN)
        for k in range(k0, min(K, k0 + chunk)):
            acc_MN = truncate_mantissa(acc_MN + torch.outer(x_MK[:, k], w_NK[:, k]), acc_bits)
        total_MN += acc_MN  # promotion: an exact FP32 add on the CUDA cores
    return total_MN


def fast_path_status() -> dict[str, str]:
    """For the precision table: what each GEMM kind pair actually ran on this process."""
    return {f"{ka}×{kb}": _FAST_NOTES[(ka, kb)] for ka, kb in _FAST_NOTES}


def _disable(key: tuple[str, str], why: str) -> None:
    _FAST[key], _FAST_NOTES[key] = False, f"emulated: {why}"
    warnings.warn(f"FP8 {key[0]}×{key[1]} GEMM: torch scaled_mm path disabled ({why}); using emulation",
                  RuntimeWarning, stacklevel=3)


def _fast_eligible(a: QTensor, b: QTensor) -> bool:
    if a.data.device.type != "cuda" or not hasattr(F, "scaled_mm"):
        return False
    (M, K), N = a.data.shape, b.data.shape[0]
    major, minor = torch.cuda.get_device_capability(a.data.device)
    if a.kind == "tensor" and b.kind == "tensor":
        return (major, minor) >= (8, 9) and M % 16 == 0 and N % 16 == 0 and K % 16 == 0
    blockwise_ok = (major, minor) == (9, 0) and _cuda_version() >= (12, 9)
    pair_ok = a.kind == "tile" and b.kind in ("tile", "block") and a.tile == b.tile == 128
    # NOTE: whole tiles only: cuBLASLt's block-scaled kernels want every dim a multiple of 128.
    return blockwise_ok and pair_ok and M % 128 == 0 and N % 128 == 0 and K % 128 == 0


def _cuda_version() -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in (torch.version.cuda or "0").split(".")[:2])
    except ValueError:
        return (0,)


def _scaled_mm(a: QTensor, b: QTensor) -> torch.Tensor:
    """cuBLASLt FP8 GEMM. Layouts follow torch's test_scaled_mm_block_wise_numerics:
    mat_b is B^T viewed column-major; a 1×128 scale is (rows, K/128) outer-dim-major (stride (1, rows));
    a 128×128 scale is (N/128, K/128) padded to a multiple of 4 along K/128, then transposed."""
    ST = F.ScalingType
    if a.kind == "tensor":
        return F.scaled_mm(a.data.contiguous(), b.data.contiguous().t(), a.scale.reshape(()), ST.TensorWise,
                           b.scale.reshape(()), ST.TensorWise, output_dtype=torch.float32)
    scale_a = a.scale.t().contiguous().t()
    if b.kind == "tile":
        scale_b, recipe_b = b.scale.t().contiguous().t(), ST.BlockWise1x128
    else:
        s = b.scale.contiguous()
        scale_b, recipe_b = F.pad(s, (0, -s.shape[1] % 4)).t(), ST.BlockWise128x128
    return F.scaled_mm(a.data.contiguous(), b.data.contiguous().t(), scale_a, ST.BlockWise1x128,
                       scale_b, recipe_b, output_dtype=torch.float32)
