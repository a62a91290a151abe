"""FP8 Linear layers: every GEMM of forward and backward on E4M3 operands, accumulated in FP32.

Block scaling (DeepSeek-V3 §3.3, Fig. 7):
    forward   x: 1×128 tiles along K        W: 128×128 blocks
    dgrad     dy: 1×128 tiles along N       W^T: the same 128×128 blocks, transposed
    wgrad     dy, x: 128×1 tiles (along the tokens, the contraction dim of dW = dy^T · x)
Per-tensor scaling ("tensor") uses one scale per operand everywhere: the baseline block scaling beats.
Master weights stay FP32 and are quantised afresh from them at every use (online amax).
NOTE: x is saved for backward in its own precision and re-tiled from there; DeepSeek-V3 caches it in
FP8 to save memory, which costs a second rounding that this reference leaves out.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.moe import GroupedExperts
from precision.fp8_gemm import gemm_nt
from precision.quant import quantize
from precision.quant_fused import quantize_fused

SCALINGS = ("block", "tensor")


def _kinds(scaling: str) -> tuple[str, str]:
    """(activation/gradient kind, weight kind)."""
    return ("tile", "block") if scaling == "block" else ("tensor", "tensor")


class _Fp8Matmul(torch.autograd.Function):
    """y_MN = x_MK · w_NK^T with FP8 operands; the gradients come from FP8 GEMMs too."""

    @staticmethod
    def forward(ctx, x_MK: Tensor, w_NK: Tensor, scaling: str, fused: bool) -> Tensor:
        act, wk = _kinds(scaling)
        ctx.save_for_backward(x_MK, w_NK)
        ctx.scaling, ctx.fused = scaling, fused
        quant = _quantizer(fused)
        return gemm_nt(quant(x_MK, act), quant(w_NK, wk))

    @staticmethod
    def backward(ctx, dy_MN: Tensor):
        x_MK, w_NK = ctx.saved_tensors
        act, wk = _kinds(ctx.scaling)
        quant = _quantizer(ctx.fused)
        dy_MN = dy_MN.float()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # NOTE: quantise(W)^T == quantise(W^T) exactly for blocks (a symmetric group): no re-tiling.
            dx = gemm_nt(quant(dy_MN, act), quant(w_NK, wk).t()).to(x_MK.dtype)
        if ctx.needs_input_grad[1]:
            # Re-tiled: dW contracts over the tokens, so dy and x are grouped along the tokens.
            dw = gemm_nt(quant(dy_MN.t(), act), quant(x_MK.t(), act)).to(w_NK.dtype)
        return dx, dw, None, None


def _quantizer(fused: bool):
    """The same QTensor either way (precision/quant_fused.py): compiled per kind, or the eager reference."""
    return quantize_fused if fused else quantize


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, scaling: str = "block",
               fused: bool = False) -> Tensor:
    """F.linear with FP8 GEMMs. Output in x's dtype (or autocast's), computed in FP32. fused: quantise with
    the compiled quantiser (precision.fused_quant)."""
    if scaling not in SCALINGS:
        raise ValueError(f"precision.scaling={scaling!r}: expected one of {', '.join(SCALINGS)}")
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    if x.numel() == 0:  # an expert that got no tokens: keep the weight in the graph (DDP), do no work
        return F.linear(x, weight, bias).to(out_dtype)
    # NOTE: autocast off inside: it would recast the FP32 dequantised operands to BF16.
    with torch.autocast(dev, enabled=False):
        x_MK = x.reshape(-1, x.shape[-1])
        y_MN = _Fp8Matmul.apply(x_MK, weight, scaling, fused)
        if bias is not None:
            y_MN = y_MN + bias.float()
    return y_MN.reshape(*x.shape[:-1], weight.shape[0]).to(out_dtype)


class Fp8Linear(nn.Linear):
    """nn.Linear whose matmuls run in FP8. Same parameters, names and state dict as nn.Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, scaling: str = "block",
                 device=None, dtype=None, fused: bool = False):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.scaling, self.fused = scaling, fused

    @classmethod
    def from_linear(cls, lin: nn.Linear, scaling: str, fused: bool = False) -> "Fp8Linear":
        """Wrap the *same* Parameter objects (no copy): ties and optimizer references survive."""
        new = cls(lin.in_features, lin.out_features, lin.bias is not None, scaling, device="meta", fused=fused)
        new.weight = lin.weight
        new.bias = lin.bias
        return new

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.bias, self.scaling, self.fused)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8=e4m3, scaling={self.scaling}, fused_quant={self.fused}"


class Fp8GroupedExperts(GroupedExperts):
    """GroupedExperts with each expert's two matmuls in FP8; its weights quantised per expert.

    Only `linear` is overridden: the dispatch loop and clamp telemetry are GroupedExperts' own.
    """

    def __init__(self, n_experts: int, d_model: int, hidden: int, limit: float | None, scaling: str = "block",
                 fused: bool = False):
        super().__init__(n_experts, d_model, hidden, limit)
        self.scaling, self.fused = scaling, fused

    @classmethod
    def from_experts(cls, ex: GroupedExperts, scaling: str, fused: bool = False) -> "Fp8GroupedExperts":
        E, H2, D = ex.w_gate_up.shape
        with torch.device("meta"):
            new = cls(E, D, H2 // 2, ex.limit, scaling, fused)
        new.w_gate_up, new.w_down = ex.w_gate_up, ex.w_down
        new.record_stats, new.clamp_hits, new.clamp_total = ex.record_stats, ex.clamp_hits, ex.clamp_total
        return new

    def linear(self, x: Tensor, w: Tensor) -> Tensor:
        return fp8_linear(x, w, None, self.scaling, self.fused)

    def extra_repr(self) -> str:
        return f"fp8=e4m3, scaling={self.scaling}, fused_quant={self.fused}"
