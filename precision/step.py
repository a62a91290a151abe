"""The update half of a step, in the only safe order under loss scaling (UPDATE_ORDER, stated the same
in the README and the precision table):

    unscale → global norm → finite check agreed by all ranks → clip → step or a counted skip
    (g ← g/S first), then the scaler update (back off on overflow, grow after a clean interval)

Why this order (docs/course.md §3): the clip threshold c is meant for the true gradient. Clipping the
scaled gradient S·g compares S·‖g‖ with c, i.e. clips at c/S: the coefficient comes out S times too
small whenever S·‖g‖ > c. And the finite check must be one decision for all ranks: under FSDP each rank
sees only its shard, so an inf on one rank must stop the step on every rank, or the replicas diverge.

Nothing here needs the host on the way (train.py reads the step's numbers once, after the update:
parallel/host_scalars.py): the finite check is a flag of the FP64 norm the clip computes anyway, agreed on
the device, and where the optimizer takes it (torch's fused AdamW, as GradScaler uses it) the skip is that
flag too. A loss scaler, an optimizer without the flag, the adaptive clip and the guard's veto decide on
the host: optimizer_step does so (one read), train.py's guard reads the step before its update.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from optim.clip import clip_global_norm
from optim.scaler import DynamicLossScaler
from parallel.dist import all_reduce_max


UPDATE_ORDER = "unscale → global norm → finite check agreed by all ranks → clip → step or a counted skip"


class StepResult(NamedTuple):
    norm: torch.Tensor       # global grad norm before clipping (of the unscaled gradient); inf/NaN on overflow
    coef: torch.Tensor       # clip coefficient applied (1 when skipped)
    # True: optimizer.step() was not called, or (a 0-d device flag) found_inf made it a no-op (apply_update)
    skipped: bool | torch.Tensor
    loss_scale: float | None  # the S this step's backward used (None without a scaler)
    skipped_total: int | None  # the scaler's count of overflow skips so far (None without a scaler)
    vetoed: bool = False      # the guard vetoed a finite update (a spike): skipped for that reason


class Update(NamedTuple):
    """An update measured and clipped, not yet applied: every number still on the device."""
    norm: torch.Tensor        # as StepResult.norm
    coef: torch.Tensor        # as StepResult.coef
    overflow: torch.Tensor    # 0-d FP32 1/0: an inf/NaN gradient element on some rank (all ranks agree)
    loss_scale: float | None


@torch.no_grad()
def prepare_update(params: list[torch.Tensor], scaler: DynamicLossScaler | None, max_grad_norm: float | None,
                   clip=None) -> Update:
    """Unscale → global norm → agreed finite check → clip, with nothing read to the host (unless `clip`, the
    adaptive policy, reads the norm to pick its threshold).

    `clip`: the clip policy. None: the fixed global-norm clip at max_grad_norm. A ZScoreClip
    (optim/zclip.py, train.clip=zscore): the norm is measured first, then the policy picks the threshold
    from its EMA statistics (max_grad_norm during its warm-up) and scales the gradients.
    """
    scale = scaler.scale if scaler is not None else None
    if scaler is not None:
        scaler.unscale_(params)
    # NOTE: clip runs on every rank either way: with sharded gradients it is a collective. On a non-finite
    # norm it returns that norm with coef = 1 and leaves the gradients alone, so the step can be skipped.
    if clip is None:
        norm, coef, nonfinite = clip_global_norm(params, max_grad_norm)
    else:
        norm, _, nonfinite = clip_global_norm(params, None)  # measure only: the policy needs the norm to decide
        coef = clip.apply(params, norm, max_grad_norm)
    # NOTE: agreed by a MAX all-reduce because replicas can disagree (a broken gradient all-reduce): every
    # rank must skip or step alike, or the replicas diverge
    return Update(norm, coef, all_reduce_max(nonfinite.float()), scale)


def skips_on_device(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> bool:
    """Can `optimizer` skip its own step from a device flag, its state left bit for bit as no step leaves it?

    torch's fused Adam / AdamW can: with `found_inf` = 1 the kernel leaves parameters and moments alone and
    the step counts are put back (the contract GradScaler relies on). NOTE: only once every parameter has
    its state (a first step creates the moments even when found_inf skips it, which no skip did before),
    and only with no hook on optimizer.step(): it would see a step that a skip never makes (e.g. a hook
    that keeps the moments "the update wrote").
    """
    from torch.optim import optimizer as torch_optimizer

    hooked = (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
              or torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks)
    return (isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and not hooked
            and all(g.get("fused") for g in optimizer.param_groups)
            and all(p in optimizer.state for p in params if p.grad is not None))


def apply_update(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, scaler: DynamicLossScaler | None,
                 upd: Update, overflow: bool | None = None, vetoed: bool = False) -> StepResult:
    """Step, or a counted skip on overflow or a veto; then the scaler update (back off on overflow, grow
    after a clean interval).

    `overflow`: upd.overflow as read on the host, or None: not read, and then, where the optimizer can
    (skips_on_device) and no scaler needs the answer, the skip is decided on the device and
    StepResult.skipped is that 0-d flag; otherwise it is read here. A veto is the host's (the guard).
    """
    if overflow is None and scaler is None and not vetoed and skips_on_device(optimizer, params):
        optimizer.found_inf = upd.overflow
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
        return StepResult(upd.norm, upd.coef, upd.overflow, None, None, False)
    if overflow is None:
        overflow = bool(upd.overflow.item())
    vetoed = vetoed and not overflow
    if not (overflow or vetoed):
        optimizer.step()
    if scaler is not None:
        scaler.update(overflow)  # NOTE: a vetoed finite step is no overflow: the scale is not backed off
    return StepResult(upd.norm, upd.coef, overflow or vetoed, upd.loss_scale,
                      scaler.skipped_steps if scaler is not None else None, vetoed)


def optimizer_step(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer,
                   scaler: DynamicLossScaler | None, max_grad_norm: float | None,
                   veto: Callable[[torch.Tensor, bool], bool] | None = None, clip=None) -> StepResult:
    """Unscale → global norm → agreed finite check → clip → [veto] → step or skip → scaler update, the
    overflow read to the host (train.py reads it with the step's other numbers: prepare_update and
    apply_update are the two halves).

    Without a scaler a non-finite gradient is skipped the same way (train.py's StepRecord marks it).
    `veto(norm, overflow)`, when given, sees the pre-clip norm before the update and may refuse it
    (the stability guard's skip); it must decide the same on every rank (it gets all-reduced numbers).
    """
    params = list(params)
    upd = prepare_update(params, scaler, max_grad_norm, clip)
    overflow = bool(upd.overflow.item())
    vetoed = veto is not None and veto(upd.norm, overflow) and not overflow
    return apply_update(params, optimizer, scaler, upd, overflow, vetoed)
