"""The patches of bench/doctor_eval/drills.py on the optimizer's and the LR scheduler's classes (torch.optim.AdamW,
LambdaLR, Optimizer.zero_grad): a group's setting or LR, one rank's LR, update or moments, the decay's form, the
gradients' zeroing, a slow step. Patched on the class: the optimizer and the scheduler are built after the patch.
bench/doctor_eval/step_patches.py calls patch(); each fault's entry is in bench/doctor_eval/key.py.
"""
from __future__ import annotations

# the faults this module plants (every name is handed over; the others are not this module's)
NAMES = ("wd_on_no_decay", "rank1_lr_x2", "zero_grad_skipped", "rank1_step_skipped", "slow_optimizer",
         "adam_l2_not_decoupled", "rank1_exp_avg_zeroed", "default_group_lr_x15")


def patch(name: str, clock, S: int) -> None:
    """Plant `name` in this process: `clock.step` is the optimizer step the run is at (the train batches served)."""
    if name not in NAMES:
        return
    import torch
    import torch.distributed as tdist
    if name == "wd_on_no_decay":  # NOTE: on the class: the optimizer is built after this patch
        orig_ostep = torch.optim.AdamW.step

        def ostep(self, *aa, **kk):
            if clock.step >= S:
                decay = max(g["weight_decay"] for g in self.param_groups)
                for g in self.param_groups:
                    if g.get("name", "").startswith("no_decay"):
                        g["weight_decay"] = decay
            return orig_ostep(self, *aa, **kk)
        torch.optim.AdamW.step = ostep
    if name == "adam_l2_not_decoupled":
        l2_in_gradient(lambda: clock.step >= S)
    if name == "rank1_exp_avg_zeroed":  # NOTE: on the class: the optimizer is built after this patch
        orig_zstep = torch.optim.AdamW.step

        def zstep(self, *aa, **kk):
            if clock.step == S and tdist.is_initialized() and tdist.get_rank() == 1:
                for st in self.state.values():
                    if "exp_avg" in st:
                        st["exp_avg"].zero_()
            return orig_zstep(self, *aa, **kk)
        torch.optim.AdamW.step = zstep
    if name == "default_group_lr_x15":  # NOTE: on the class, as the drills' lr_x3: the scheduler sets each step's LR
        from torch.optim.lr_scheduler import LambdaLR
        orig_gstep = LambdaLR.step

        def gstep(self, *aa, **kk):
            orig_gstep(self, *aa, **kk)
            if clock.step >= S - 1:
                for g in self.optimizer.param_groups:
                    if g.get("name", "") == "default":
                        g["lr"] *= 1.5
        LambdaLR.step = gstep
    if name == "slow_optimizer":  # NOTE: on the class: the optimizer is built after this patch
        import time
        orig_sstep2 = torch.optim.AdamW.step

        def slow_step(self, *aa, **kk):
            if clock.step >= S:
                time.sleep(0.06)
            return orig_sstep2(self, *aa, **kk)
        torch.optim.AdamW.step = slow_step
    if name == "zero_grad_skipped":  # NOTE: on the class: train.py zeroes at the end of each step
        orig_zero = torch.optim.Optimizer.zero_grad

        def zero_grad(self, *aa, **kk):
            if clock.step == S - 1:
                return None
            return orig_zero(self, *aa, **kk)
        torch.optim.Optimizer.zero_grad = zero_grad
    if name == "rank1_step_skipped":  # NOTE: on the class: the optimizer is built after this patch
        orig_astep = torch.optim.AdamW.step

        def astep(self, *aa, **kk):
            if clock.step == S and tdist.is_initialized() and tdist.get_rank() == 1:
                return None
            return orig_astep(self, *aa, **kk)
        torch.optim.AdamW.step = astep
    if name == "rank1_lr_x2":  # NOTE: on the class, as drills' lr_x3: the scheduler sets each step's LR
        from torch.optim.lr_scheduler import LambdaLR
        orig_sstep = LambdaLR.step

        def sstep(self, *aa, **kk):
            orig_sstep(self, *aa, **kk)
            if clock.step >= S - 1 and tdist.is_initialized() and tdist.get_rank() == 1:
                for g in self.optimizer.param_groups:
                    g["lr"] *= 2.0
        LambdaLR.step = sstep


def l2_in_gradient(when) -> None:
    """While when() holds, AdamW's decay is added to the gradient (Adam with an L2 term) and its decoupled decay is off
    (tests/plant.py's adam_l2 too). NOTE: on the class: the optimizer is built after this patch."""
    import torch
    orig_l2 = torch.optim.AdamW.step

    def l2_step(self, *aa, **kk):
        if not when():
            return orig_l2(self, *aa, **kk)
        decay = [g["weight_decay"] for g in self.param_groups]
        with torch.no_grad():
            for g, wd in zip(self.param_groups, decay):
                for p in g["params"]:
                    if wd and p.grad is not None:
                        p.grad.add_(p, alpha=wd)
                g["weight_decay"] = 0.0
        try:
            return orig_l2(self, *aa, **kk)
        finally:
            for g, wd in zip(self.param_groups, decay):
                g["weight_decay"] = wd
    torch.optim.AdamW.step = l2_step
