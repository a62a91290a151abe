"""Global-norm gradient clipping that stays global when gradients are sharded.

    ‖g‖ = sqrt(Σ_ranks Σ_i g_i²)          g ← g · min(1, c / (‖g‖ + ε))

"Global" means the whole model's gradient, not this rank's piece of it. A gradient is either
  - replicated: a plain tensor (DDP: every rank holds the full, already averaged gradient) or a
    DTensor without Shard placements. Its squares are summed locally and NOT all-reduced — doing so
    would count it once per rank (√world too large a norm);
  - sharded: a DTensor with a Shard placement (FSDP2). Each rank sums the squares of its local shard
    and one all_reduce(SUM) over the shard process group adds the pieces.
A mix of both is handled by reducing only the sharded partial sum.
"""

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Shard


def _is_sharded(g: torch.Tensor) -> bool:
    if not isinstance(g, DTensor):
        return False
    if any(isinstance(pl, Partial) for pl in g.placements):
        raise ValueError(f"clip_grad_norm: gradient with placements {g.placements} is an unreduced "
                         "partial sum; reduce it before clipping")
    return any(isinstance(pl, Shard) for pl in g.placements)


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ_i t_i² over all tensors, accumulated in FP64.

    WARN: not FP32: a finite gradient with ‖g‖ > √(FP32 max) ≈ 1.8e19 has Σg² = inf in FP32; the clip
    coefficient then came out 1 and the finite check (on ‖g‖) passed, so the optimizer stepped on the raw
    gradient. In FP64 Σg² overflows only past ‖g‖ ≈ 1.3e154, far beyond any FP32/BF16 element
    (max 3.4e38 each). Per-tensor norms are read from the FP32/BF16 grads and accumulated in FP64.
    Cost on a CPU: a few times an FP32 sum, a small share of a step; an FP32 pass with an FP64 redo of
    the non-finite ones (stability/telemetry_layers.norms) would need a host sync, which this function
    avoids.
    """
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)
    return torch.stack([n.to(device) for n in norms]).square().sum()


class Clipped(NamedTuple):
    norm: torch.Tensor       # 0-d FP32 global norm before the clip (inf past FP32 max, see below)
    coef: torch.Tensor       # 0-d FP32 coefficient applied (1: below the threshold, measure only, non-finite)
    nonfinite: torch.Tensor  # 0-d bool: some gradient element is inf/NaN (on this rank's view of the norm)


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[torch.Tensor], max_norm: float | None, eps: float = 1e-6,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip the gradients of `params` in place to global norm `max_norm`; return (pre-clip norm, coef).
    clip_global_norm's first two results (it says how)."""
    norm, coef, _ = clip_global_norm(params, max_norm, eps, group)
    return norm, coef


@torch.no_grad()
def clip_global_norm(
    params: Iterable[torch.Tensor], max_norm: float | None, eps: float = 1e-6,
    group: dist.ProcessGroup | None = None,
) -> Clipped:
    """Clip the gradients of `params` in place to global norm `max_norm`: (pre-clip norm, coef, nonfinite).

    g ← g · min(1, c / (‖g‖ + ε)), with ‖g‖ over every shard on every rank of `group` (default: the
    1-D device mesh the sharded gradients live on).
    max_norm None or <= 0: only measure (coef = 1). A non-finite norm is returned as is and the grads are
    left untouched (coef = 1): the caller decides to skip the step. All three results are 0-d tensors on
    the grads' device; nothing here syncs with the host.

    `nonfinite` is exact: the FP64 Σg² of FP32 / BF16 / FP16 elements (each < 3.4e38) is finite unless an
    element is inf or NaN, so it tells an overflow from large finite gradients whose norm only the FP32
    report rounds to inf. Under FSDP the sharded squares are summed over ranks first, so every rank agrees;
    DDP replicas each judge their own copy (precision/step.py agrees them).

    WARN: every rank of `group` must call this with the same set of sharded gradients (the all_reduce
    is collective). With a 2-D mesh (HSDP: replicate × shard) pass the shard group, or replicas add up.
    """
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    is_sharded = [_is_sharded(g) for g in grads]
    sharded = [g for g, s in zip(grads, is_sharded) if s]
    replicated = [g for g, s in zip(grads, is_sharded) if not s]

    if sharded and group is None:
        mesh = sharded[0].device_mesh
        if mesh.ndim != 1 or any(g.device_mesh != mesh for g in sharded):
            raise ValueError("clip_grad_norm: sharded gradients on a multi-dim mesh or on several meshes "
                             "need an explicit shard `group`")
        group = mesh.get_group()
    # under no_grad, to_local() is the DTensor's own storage: the in-place scale below reaches it.
    sharded = [g.to_local() for g in sharded]
    replicated = [g.to_local() if isinstance(g, DTensor) else g for g in replicated]

    sq_sharded = _sum_of_squares(sharded, device)
    if sharded:
        dist.all_reduce(sq_sharded, op=dist.ReduceOp.SUM, group=group)
    norm64 = (sq_sharded + _sum_of_squares(replicated, device)).sqrt()
    # NOTE: reported in FP32 (inf past 3.4e38, where only `nonfinite` tells overflow from large)
    norm = norm64.float()
    nonfinite = ~norm64.isfinite()

    one = torch.ones((), dtype=torch.float32, device=device)
    if max_norm is None or max_norm <= 0:
        return Clipped(norm, one, nonfinite)
    # NOTE: torch.where instead of `if norm.isfinite()` keeps the host out of it; × 1.0 is exact,
    # so non-finite and below-threshold norms leave every grad bit-identical.
    coef = torch.where(norm64.isfinite(), (max_norm / (norm64 + eps)).clamp(max=1.0), one.double()).float()
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in sharded + replicated:
        by_device.setdefault(g.device, []).append(g)
    for dev, gs in by_device.items():
        torch._foreach_mul_(gs, coef.to(dev))
    return Clipped(norm, coef, nonfinite)


@torch.no_grad()
def scale_grads_(params: Iterable[torch.Tensor], coef: float | torch.Tensor) -> None:
    """g ← g · coef on every gradient (a DTensor's local shard in place): the scale half of a clip."""
    grads = [p.grad for p in params if p.grad is not None]
    grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for dev, gs in by_device.items():
        torch._foreach_mul_(gs, coef.to(dev) if isinstance(coef, torch.Tensor) else float(coef))
