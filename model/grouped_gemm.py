"""One GEMM over every expert's rows at once: y[rows of e] = x[rows of e] @ w[e], groups given by a device
tensor of cumulative row counts (no host sync, static shapes).

Wrapped as custom ops (torch.library) so torch.compile treats them as opaque kernels with a known output
shape. NOTE: torch._grouped_mm runs on CPU in fp32, but its fake-tensor rule asks for the CUDA kernel's
bf16, so tracing it directly fails under compile; behind a custom op the trace sees only this file's
shape rules. The backward is written out (dx is a grouped GEMM with wᵀ; dw[e] = x_eᵀ dy_e is a grouped
GEMM along the row dimension), so a compiled backward stays opaque too.
"""
from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("ballast::grouped_mm", mutates_args=())
def grouped_mm(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor) -> Tensor:
    """(M, K) rows sorted by group, (E, K, N) weights, int32 end row of each group -> (M, N)."""
    return torch._grouped_mm(x_MK, w_EKN, offs=offs_E)


@grouped_mm.register_fake
def _(x_MK, w_EKN, offs_E):
    return x_MK.new_empty(x_MK.shape[0], w_EKN.shape[-1])


@torch.library.custom_op("ballast::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(x_MK: Tensor, dy_MN: Tensor, offs_E: Tensor) -> Tensor:
    """dw[e] = x_eᵀ dy_e for every group e -> (E, K, N); an empty group gets zeros."""
    return torch._grouped_mm(x_MK.t(), dy_MN, offs=offs_E)


@grouped_mm_wgrad.register_fake
def _(x_MK, dy_MN, offs_E):
    return x_MK.new_empty(offs_E.shape[0], x_MK.shape[1], dy_MN.shape[1])


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy_MN: Tensor):
    x_MK, w_EKN, offs_E = ctx.saved_tensors
    dy_MN = dy_MN.contiguous()  # WARN: the kernel rejects the zero-stride gradient of a plain .sum()
    dx = grouped_mm(dy_MN, w_EKN.transpose(1, 2), offs_E) if ctx.needs_input_grad[0] else None
    dw = grouped_mm_wgrad(x_MK, dy_MN, offs_E) if ctx.needs_input_grad[1] else None
    return dx, dw, None


grouped_mm.register_autograd(_backward, setup_context=_setup)
