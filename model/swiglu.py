"""SwiGLU MLP with the DeepSeek-V4 activation clamp, and its clamp telemetry."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def swiglu(gate: Tensor, up: Tensor, limit: float | None) -> Tensor:
    """silu(gate) * up, or with limit L: silu(min(gate, L)) * clamp(up, -L, L).

    WARN: a hard clamp has zero gradient outside the bound: an element pinned at L stops learning
    through that path until it comes back inside. The clamp bounds the activation, not the weights.
    NOTE: silu is bounded below (min ≈ -0.28), so the gate is only clamped from above.
    """
    if limit is None:
        return F.silu(gate) * up
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


_SWIGLU = swiglu  # the function as defined here (swiglu_counted and swiglu_fused ask whether it was replaced)


class _SwiGLU(torch.autograd.Function):
    """swiglu of the two halves of one fused projection's output, differentiated by hand so that the gradient of
    both halves is written into one buffer: autograd's would be two products, silu's backward and a concatenation
    (the chunk's backward) copying both halves again.

        h = s·uc,  s = silu(gc),  gc = min(g, L),  uc = clamp(u, −L, L)
        ∂h/∂u = s·[|u| ≤ L]      ∂h/∂g = uc·silu′(gc)·[g ≤ L]      (clamp's gradient: 1 inside the bound, ends included)

    With `count`, also the clamp hits (clamp_hits), read from the clamp's outputs (_hits): the same forward and
    backward whether telemetry counts or not, so recording leaves training bit for bit as it was.
    """

    @staticmethod
    def forward(ctx, gate_up: Tensor, limit: float | None, count: bool):
        gate, up = gate_up.chunk(2, dim=-1)
        gate_c, up_c = (gate, up) if limit is None else (gate.clamp(max=limit), up.clamp(-limit, limit))
        s = F.silu(gate_c)
        hits = _hits(gate, up, gate_c, up_c, limit) if count else torch.zeros((), dtype=torch.int64)
        ctx.save_for_backward(gate_up, s)
        ctx.limit = limit
        ctx.mark_non_differentiable(hits)
        return s * up_c, hits

    @staticmethod
    def backward(ctx, dh: Tensor, _):
        gate_up, s = ctx.saved_tensors
        limit = ctx.limit
        gate, up = gate_up.chunk(2, dim=-1)
        d = torch.empty_like(gate_up)
        d_gate, d_up = d.chunk(2, dim=-1)
        gate_c, up_c = (gate, up) if limit is None else (gate.clamp(max=limit), up.clamp(-limit, limit))
        torch.mul(dh, s, out=d_up)
        torch.ops.aten.silu_backward(dh * up_c, gate_c, grad_input=d_gate)
        if limit is not None:
            d_gate.masked_fill_(gate.le(limit).logical_not_(), 0)
            d_up.masked_fill_(up.abs().le(limit).logical_not_(), 0)
        return d, None, None


def swiglu_fused(gate_up: Tensor, limit: float | None) -> Tensor:
    """swiglu(*gate_up.chunk(2, dim=-1), limit): the same values, one backward buffer (_SwiGLU). A replaced
    swiglu (a lab's planted bug, labs/breaks.py) is what runs, and torch.compile sees the plain expression."""
    if swiglu is not _SWIGLU or torch.compiler.is_compiling():
        return swiglu(*gate_up.chunk(2, dim=-1), limit)
    return _SwiGLU.apply(gate_up, limit, False)[0]


def swiglu_fused_counted(gate_up: Tensor, limit: float | None) -> tuple[Tensor, Tensor]:
    """(swiglu_fused(gate_up, limit), clamp_hits of its halves): the same values, bits and gradient as
    swiglu_fused, for a module recording its clamp statistics."""
    if swiglu is not _SWIGLU or torch.compiler.is_compiling():
        return swiglu_counted(*gate_up.chunk(2, dim=-1), limit)
    return _SwiGLU.apply(gate_up, limit, True)


def _within(gate: Tensor, up: Tensor, limit: float) -> bool:
    """A sufficient test that nothing lies beyond the clamp: max(gate) ≤ L and |up| ≤ L. When gate and up
    are the two halves of one contiguous tensor (the fused projection, chunked), one contiguous aminmax of
    it bounds both (a gate below −L then fails the test, and the exact count decides): a reduction over a
    strided half costs ~3× one over the whole here."""
    base = gate._base
    if base is not None and base is up._base and base.is_contiguous() and base.numel() == 2 * gate.numel():
        lo, hi = torch.aminmax(base.detach())
        return max(hi.item(), -lo.item()) <= limit
    gate, up = gate.detach(), up.detach()
    return max(gate.amax().item(), up.amax().item(), -up.amin().item()) <= limit


def swiglu_counted(gate: Tensor, up: Tensor, limit: float | None) -> tuple[Tensor, Tensor]:
    """(swiglu(gate, up, limit), clamp_hits(gate, up, limit)): the same values, bits and graph as the two
    called apart, for a module recording its clamp statistics."""
    # NOTE: a replaced swiglu (a lab's planted bug, labs/breaks.py) is honoured: computed through it
    if swiglu is not _SWIGLU or limit is None or torch.compiler.is_compiling():
        return swiglu(gate, up, limit), clamp_hits(gate, up, limit)
    gate_c, up_c = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate_c) * up_c, _hits(gate, up, gate_c, up_c, limit)  # swiglu's own expression


def _hits(gate: Tensor, up: Tensor, gate_c: Tensor, up_c: Tensor, limit: float | None) -> Tensor:
    """clamp_hits(gate, up, limit), given the clamp's outputs gate_c = min(gate, L), up_c = clamp(up, ±L).

    NOTE: on a CPU the sufficient test reads the clamp's OUTPUTS right after they are written
    (max(min(gate, L)) < L and max|clamp(up)| < L: nothing was clamped), while they are still in
    cache, where clamp_hits reads the projection's output from memory (bench/speed/telemetry_overhead.py
    measures the difference). A max that reaches L (a hit, or an element exactly at L) or a NaN
    leaves the answer to the exact count.
    """
    if limit is None or gate.numel() == 0 or gate.device.type != "cpu" or torch.compiler.is_compiling():
        return clamp_hits(gate, up, limit)
    gate_hi = gate_c.detach().amax()
    up_lo, up_hi = torch.aminmax(up_c.detach())
    # NOTE: a clamped element holds L rounded to the tensor's dtype, which may lie below L (0.7 in float32,
    # 7.32 in bfloat16): the test is against that value, never against L itself.
    bound = torch.tensor(limit, dtype=gate_c.dtype).item()
    if max(gate_hi.item(), up_hi.item(), -up_lo.item()) < bound:
        return torch.zeros((), dtype=torch.int64)
    return _count(gate, up, limit)


def clamp_hits(gate: Tensor, up: Tensor, limit: float | None) -> Tensor:
    """Detached count of elements the clamp changes (gate > L or |up| > L); 0 when off."""
    if limit is None:
        return torch.zeros((), dtype=torch.int64, device=gate.device)
    # NOTE: on a CPU, first the common case of a healthy run: nothing beyond the clamp. Three reductions
    # write no tensor, so answering 0 is cheaper than counting (bench/speed/telemetry_overhead.py). Not on an
    # accelerator (the comparison reads a number back: a device sync per MLP), nor under torch.compile
    # (a graph break).
    if gate.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=gate.device)
    if gate.device.type == "cpu" and not torch.compiler.is_compiling() and _within(gate, up, limit):
        return torch.zeros((), dtype=torch.int64)
    return _count(gate, up, limit)


def _count(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    # NOTE: gate > L or |up| > L  ⟺  max(gate, |up|) > L: three passes over the activations instead of five
    return torch.count_nonzero(torch.maximum(gate.detach(), up.detach().abs()).gt_(limit))


class SwiGLU(nn.Module):
    """down(swiglu(gate, up)) with gate and up from one fused matmul; no biases."""

    def __init__(self, d_model: int, hidden: int, limit: float | None):
        super().__init__()
        self.limit = limit
        self.w_gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)
        self.record_stats = False
        # NOTE: tensors, never Python numbers: reading them must not force a device sync in forward.
        self.clamp_hits = torch.zeros((), dtype=torch.int64)
        self.clamp_total = torch.zeros((), dtype=torch.int64)

    def init_weights(self, std: float, resid_std: float) -> None:
        nn.init.normal_(self.w_gate_up.weight, std=std)
        nn.init.normal_(self.w_down.weight, std=resid_std)  # writes into the residual stream

    def forward(self, x_BTD: Tensor) -> Tensor:
        gate_up_BTX = self.w_gate_up(x_BTD)
        if not self.record_stats:
            return self.w_down(swiglu_fused(gate_up_BTX, self.limit))
        h_BTH, self.clamp_hits = swiglu_fused_counted(gate_up_BTX, self.limit)
        self.clamp_total = torch.tensor(h_BTH.numel(), dtype=torch.int64, device=h_BTH.device)
        return self.w_down(h_BTH)
