"""FP8 (E4M3) quantisers with online amax: per 1×128 tile, per 128×128 block, or per tensor.

A quantised tensor is q · s: q in float8_e4m3fn, s an FP32 dequantisation scale shared by a group,

    s = amax(group) / 448          q = cast_e4m3(clamp(x / s, -448, 448))

so the largest element of every group lands on E4M3's largest finite value (448). E4M3 keeps 3
mantissa bits: a normal value rounds with relative error <= 2^-4; below 2^-6 (in units of s) it is
subnormal, with absolute error <= 2^-10 · s. One outlier inflates s for its whole group, pushing the
group's ordinary elements down into that subnormal range — hence small groups (DeepSeek-V3 §3.3.1).

Groups (kinds):
    "tile"   1×T along the last dim of a 2-D tensor: activations, output gradients. scale (R, ⌈C/T⌉)
    "block"  T×T: weights. scale (⌈R/T⌉, ⌈C/T⌉); the blocks of W^T are the transposed blocks of W
    "tensor" one scale for the whole tensor: the per-tensor baseline. scale ()
Partial groups at the edges are zero-padded before the amax: zeros change neither amax nor product.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
TILE = 128
# NOTE: a group whose amax is below this is scaled as if its amax were this: s stays a normal FP32
# number, so an all-zero or denormal group never divides 0/0 (NaN) or x/0 (inf).
AMAX_FLOOR = 1e-30


class QTensor(NamedTuple):
    data: torch.Tensor   # float8_e4m3fn, the shape of the original 2-D tensor
    scale: torch.Tensor  # float32 dequantisation scales (see the module docstring for the shape)
    kind: str            # "tile" | "block" | "tensor"
    tile: int = TILE

    def dequantize(self) -> torch.Tensor:
        return dequantize(self)

    def t(self) -> "QTensor":
        """The transpose, exact without requantising: only a block's (or the tensor's) group is
        symmetric. A tile is not: 1×T tiles of x are T×1 tiles of x^T, which is why the backward
        pass quantises the transposed operands afresh ("re-tiling")."""
        if self.kind == "tile":
            raise ValueError("a 1×T tiled tensor has no exact transpose; quantise the transpose instead")
        scale = self.scale.t() if self.kind == "block" else self.scale
        return QTensor(self.data.t(), scale, self.kind, self.tile)


# NOTE: the sign of a NaN is not fixed by IEEE 754, and E4M3 keeps it (0x7F or 0xFF). Inductor's CPU max and
# min (at::vec::maximum/minimum: amax, clamp) return any NaN as the all-ones pattern, sign bit set, where
# eager's return a NaN they were given. So under torch.compile (precision/quant_fused.py) cast_e4m3 and
# _scale put eager's NaN back, and a poisoned group gets the same E4M3 code compiled as eager.
def cast_e4m3(x_scaled: torch.Tensor) -> torch.Tensor:
    """Clamp, then cast. WARN: without the clamp a value past 448 becomes NaN on CUDA (E4M3fn has
    no inf); rounding x/s can overshoot 448 by half an ulp even when s comes from the amax."""
    clamped = x_scaled.clamp(-E4M3_MAX, E4M3_MAX)
    if torch.compiler.is_compiling():  # the NaN the division made, as eager's clamp keeps it
        clamped = torch.where(x_scaled.isnan(), x_scaled, clamped)
    return clamped.to(E4M3)


_QMAX: dict[torch.device, torch.Tensor] = {}


def qmax_on(device: torch.device) -> torch.Tensor:
    """E4M3_MAX as a 0-d FP32 tensor on `device` (cached), the scale's divisor. NOTE: CUDA divides by a number
    as a product with its reciprocal, and 1/448 is inexact, so amax/448 can come out one ulp off the quotient
    (and x/s then round to the next E4M3 code); by a tensor on the device it is IEEE division on every device,
    as the fused quantiser's (precision/quant_fused.py)."""
    device = torch.device(device)
    if device not in _QMAX:
        _QMAX[device] = torch.full((), E4M3_MAX, dtype=torch.float32, device=device)
    return _QMAX[device]


def _scale(amax: torch.Tensor, qmax: torch.Tensor | None) -> torch.Tensor:
    # NOTE: NaN/inf amax passes through (clamp keeps NaN, inf/448 = inf): a non-finite input must
    # reach the output as non-finite, where the step's finite check sees it, not be quietly zeroed.
    if qmax is None:  # inside a compiled model (its graph holds these ops): the number, as before
        qmax = E4M3_MAX if torch.compiler.is_compiling() else qmax_on(amax.device)
    scale = amax.float().clamp(min=AMAX_FLOOR) / qmax
    if torch.compiler.is_compiling():  # a positive NaN, as eager's amax of |x| gives
        scale = torch.where(scale.isnan(), torch.nan, scale)
    return scale


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    R, C = x.shape
    return F.pad(x, (0, -C % cols, 0, -R % rows)) if (R % rows or C % cols) else x


# The three groupings, x (R, C) -> (q, scale). qmax: E4M3_MAX on x's device (None); the fused quantiser
# (precision/quant_fused.py) compiles these same functions and passes it as a tensor.
def quantize_tiles(x: torch.Tensor, tile: int, qmax: torch.Tensor | None = None):
    x = x.float()
    R, C = x.shape
    x_RGt = rearrange(_pad_to(x, 1, tile), "r (g t) -> r g t", t=tile)
    scale_RG = _scale(x_RGt.abs().amax(-1) if R else x_RGt.new_zeros(0, x_RGt.shape[1]), qmax)
    q_RGt = cast_e4m3(x_RGt / scale_RG[..., None])
    return rearrange(q_RGt, "r g t -> r (g t)")[:, :C], scale_RG


def quantize_blocks(x: torch.Tensor, tile: int, qmax: torch.Tensor | None = None):
    x = x.float()
    R, C = x.shape
    x_pad = _pad_to(x, tile, tile)
    # NOTE: the blocks are split in place, not permuted, so every step is a view and q comes out in x's
    # layout; and every axis length is given: under symbolic shapes (the fused quantiser) einops would
    # infer tk as C / bk, which Inductor cannot prove is the tile, and would copy q out instead of viewing it.
    x_blk = rearrange(x_pad, "(bn tn) (bk tk) -> bn tn bk tk", bn=x_pad.shape[0] // tile,
                      bk=x_pad.shape[1] // tile, tn=tile, tk=tile)
    scale_NK = _scale(x_blk.abs().amax(dim=(1, 3)), qmax)
    q_blk = cast_e4m3(x_blk / scale_NK[:, None, :, None])
    return rearrange(q_blk, "bn tn bk tk -> (bn tn) (bk tk)")[:R, :C], scale_NK


def quantize_whole(x: torch.Tensor, tile: int, qmax: torch.Tensor | None = None):
    """tile: unused (one signature for the three groupings)."""
    x = x.float()
    scale = _scale(x.abs().amax() if x.numel() else x.new_zeros(()), qmax)
    return cast_e4m3(x / scale), scale


GROUPINGS = {"tile": quantize_tiles, "block": quantize_blocks, "tensor": quantize_whole}
KINDS = tuple(GROUPINGS)


def check_input(x: torch.Tensor, kind: str, where: str = "quantize") -> None:
    if kind not in KINDS:
        raise ValueError(f"{where}: kind={kind!r}, expected one of {', '.join(KINDS)}")
    if x.dim() != 2:
        raise ValueError(f"{where}: expected a 2-D tensor, got shape {tuple(x.shape)}")


def quantize(x: torch.Tensor, kind: str, tile: int = TILE) -> QTensor:
    """Quantise a 2-D tensor with one online amax per group of the given kind."""
    check_input(x, kind)
    return QTensor(*GROUPINGS[kind](x, tile), kind, tile)


def expand_scale(q: QTensor) -> torch.Tensor:
    """The per-element scale, shape of q.data (the inverse of the grouping above)."""
    R, C = q.data.shape
    if q.kind == "tensor":
        return q.scale.expand(R, C)
    if q.kind == "tile":
        return q.scale.repeat_interleave(q.tile, dim=1)[:, :C]
    return q.scale.repeat_interleave(q.tile, dim=0).repeat_interleave(q.tile, dim=1)[:R, :C]


def dequantize(q: QTensor) -> torch.Tensor:
    return q.data.float() * expand_scale(q)


def fake_quantize(x: torch.Tensor, kind: str, tile: int = TILE) -> torch.Tensor:
    """x → FP8 → x's dtype: what the FP8 GEMM actually multiplies."""
    return dequantize(quantize(x, kind, tile)).to(x.dtype)
