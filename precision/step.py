"""The update half of a step, in the only safe order under loss scaling (UPDATE_ORDER, stated the same
in the README and the precision table):

    unscale → global norm → finite check agreed by all ranks → clip → step or a counted skip
    (g ← g/S first), then the scaler update (back off on overflow, grow after a clean interval)

Why this order (docs/course.md §3): the clip threshold c is meant for the true gradient. Clipping the
scaled gradient S·g compares S·‖g‖ with c, i.e. clips at c/S: the coefficient comes out S times too
small whenever S·‖g‖ > c. And the finite check must be one decision for all ranks: under FSDP each rank
sees only its shard, so an inf on one rank must stop the step on every rank, or the replicas diverge.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from optim.clip import clip_grad_norm
from optim.scaler import DynamicLossScaler
from parallel.dist import all_reduce_max


UPDATE_ORDER = "unscale → global norm → finite check agreed by all ranks → clip → step or a counted skip"


class StepResult(NamedTuple):
    norm: torch.Tensor       # global grad norm before clipping (of the unscaled gradient); inf/NaN on overflow
    coef: torch.Tensor       # clip coefficient applied (1 when skipped)
    skipped: bool            # True: optimizer.step() was not called
    loss_scale: float | None  # the S this step's backward used (None without a scaler)
    skipped_total: int | None  # the scaler's count of overflow skips so far (None without a scaler)
    vetoed: bool = False      # the guard vetoed a finite update (a spike): skipped for that reason


@torch.no_grad()
def found_nonfinite(params: list[torch.Tensor]) -> bool:
    """Any inf/NaN in any local gradient on any rank: one MAX all-reduce of a flag, then one host sync.

    NOTE: max |g| via the inf-norm, not ‖g‖²: a sum of squares overflows to inf for large *finite*
    gradients, which would turn a clip into a skip.
    """
    grads = [p.grad for p in params if p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    device = grads[0].device if grads else torch.device("cpu")
    grads = [g for g in grads if g.numel()]  # an FSDP shard can be empty; its inf-norm is undefined
    flag = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        amax = torch.stack([n.to(device) for n in torch._foreach_norm(grads, float("inf"))]).max()
        flag = (~torch.isfinite(amax)).float()
    return bool(all_reduce_max(flag).item())


def norm_is_nonfinite(norm: torch.Tensor) -> bool:
    """The cheap half of the finite check, agreed by all ranks (one MAX all-reduce of a flag).

    A finite global ‖g‖ means every gradient element is finite (an inf or NaN anywhere makes Σg²
    non-finite), so the exact element check (found_nonfinite: an inf-norm pass over every element,
    dearer than the 2-norm's fused reduction) runs only after a non-finite norm, where it tells an
    overflow from large finite gradients. The flag is all-reduced because replicas can disagree (a
    broken gradient all-reduce): every rank must take the same branch, as found_nonfinite is a collective.
    """
    return bool(all_reduce_max((~torch.isfinite(norm)).float()).item())


def optimizer_step(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer,
                   scaler: DynamicLossScaler | None, max_grad_norm: float | None,
                   veto: Callable[[torch.Tensor, bool], bool] | None = None, clip=None) -> StepResult:
    """Unscale → global norm → agreed finite check → clip → [veto] → step or skip → scaler update.

    `clip`: the clip policy. None: the fixed global-norm clip at max_grad_norm. A ZScoreClip
    (optim/zclip.py, train.clip=zscore): the norm is measured first, then the policy picks the threshold
    from its EMA statistics (max_grad_norm during its warm-up) and scales the gradients.

    Without a scaler a non-finite gradient is skipped the same way (train.py's StepRecord marks it).
    `veto(norm, overflow)`, when given, sees the pre-clip norm before the update and may refuse it
    (the stability guard's skip); it must decide the same on every rank (it gets all-reduced numbers).
    """
    params = list(params)
    scale = scaler.scale if scaler is not None else None
    if scaler is not None:
        scaler.unscale_(params)
    # NOTE: clip runs on every rank either way: with sharded gradients it is a collective. On a non-finite
    # norm it returns that norm with coef = 1 and leaves the gradients alone, so the finite check may follow.
    if clip is None:
        norm, coef = clip_grad_norm(params, max_grad_norm)
    else:
        norm, _ = clip_grad_norm(params, None)  # measure only: the policy needs the norm to decide
        coef = clip.apply(params, norm, max_grad_norm)
    overflow = norm_is_nonfinite(norm) and found_nonfinite(params)
    vetoed = veto is not None and veto(norm, overflow) and not overflow
    if not (overflow or vetoed):
        optimizer.step()
    if scaler is not None:
        scaler.update(overflow)  # NOTE: a vetoed finite step is no overflow: the scale is not backed off
    return StepResult(norm, coef, overflow or vetoed, scale, scaler.skipped_steps if scaler is not None else None,
                      vetoed)
