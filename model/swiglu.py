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


_SWIGLU = swiglu  # the function as defined here (swiglu_counted asks whether it was replaced)


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
    called apart, for a module recording its clamp statistics.

    NOTE: on a CPU the sufficient test of clamp_hits reads the clamp's OUTPUTS right after they are written
    (max(min(gate, L)) < L and max|clamp(up)| < L: nothing was clamped), while they are still in
    cache, where it reads the projection's output from memory (bench/speed/telemetry_overhead.py measures
    the difference). A max that reaches L (a hit, or an element exactly at L) or a NaN
    leaves the answer to the exact count.
    """
    # NOTE: a replaced swiglu (a lab's planted bug, labs/breaks.py) is honoured: computed through it
    if swiglu is not _SWIGLU or limit is None or gate.numel() == 0 or gate.device.type != "cpu" \
            or torch.compiler.is_compiling():
        return swiglu(gate, up, limit), clamp_hits(gate, up, limit)
    gate_c = gate.clamp(max=limit)
    gate_hi = gate_c.detach().amax()
    up_c = up.clamp(-limit, limit)
    up_lo, up_hi = torch.aminmax(up_c.detach())
    h = F.silu(gate_c) * up_c  # swiglu's own expression, on the clamped halves
    # NOTE: a clamped element holds L rounded to the tensor's dtype, which may lie below L (0.7 in float32,
    # 7.32 in bfloat16): the test is against that value, never against L itself.
    bound = torch.tensor(limit, dtype=gate_c.dtype).item()
    if max(gate_hi.item(), up_hi.item(), -up_lo.item()) < bound:
        return h, torch.zeros((), dtype=torch.int64)
    return h, _count(gate, up, limit)


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
        gate_BTH, up_BTH = self.w_gate_up(x_BTD).chunk(2, dim=-1)
        if not self.record_stats:
            return self.w_down(swiglu(gate_BTH, up_BTH, self.limit))
        h_BTH, self.clamp_hits = swiglu_counted(gate_BTH, up_BTH, self.limit)
        self.clamp_total = torch.tensor(gate_BTH.numel(), dtype=torch.int64, device=gate_BTH.device)
        return self.w_down(h_BTH)
