"""The patches of bench/doctor_eval/drills.py that change the step's arithmetic rather than its data or modules: the
attention kernel's call, the token count the loss is divided by, the optimizer state's precision, a group's setting
and one rank's LR. drills.patch calls patch() after its own; each fault's entry is in bench/doctor_eval/key.py.
"""
from __future__ import annotations

# the faults this module plants (drills.patch hands every name over; the others are not this module's)
NAMES = ("attn_scale_d", "attn_bf16_kernel_sustained", "loss_all_positions", "exp_avg_sq_bf16_sustained",
         "wd_on_no_decay", "rank1_lr_x2")


def patch(name: str, clock, S: int) -> None:
    """Plant `name` in this process: `clock.step` is the optimizer step the run is at (the train batches served)."""
    if name not in NAMES:
        return
    import torch
    if name in ("attn_scale_d", "attn_bf16_kernel_sustained"):
        _attention_kernel(name, clock, S)
    if name == "loss_all_positions":  # NOTE: train.py imports the function by name: patched before it runs
        import optim.accumulate as acc
        orig_count = acc.count_valid_tokens

        def count(micro, device):
            if clock.step < S:
                return orig_count(micro, device)
            n = torch.tensor([float(sum(mb.labels.numel() for mb in micro))], dtype=torch.float64)
            return acc.all_reduce_sum(n.to(device))
        acc.count_valid_tokens = count
    if name == "exp_avg_sq_bf16_sustained":
        import precision.step as pstep
        orig_apply = pstep.apply_update

        def apply_update(params, optimizer, *a, **k):
            out = orig_apply(params, optimizer, *a, **k)
            if clock.step >= S:
                for st in optimizer.state.values():
                    if "exp_avg_sq" in st:
                        st["exp_avg_sq"].copy_(st["exp_avg_sq"].bfloat16())
            return out
        pstep.apply_update = apply_update
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
    if name == "rank1_lr_x2":  # NOTE: on the class, as drills' lr_x3: the scheduler sets each step's LR
        import torch.distributed as tdist
        from torch.optim.lr_scheduler import LambdaLR
        orig_sstep = LambdaLR.step

        def sstep(self, *aa, **kk):
            orig_sstep(self, *aa, **kk)
            if clock.step >= S - 1 and tdist.is_initialized() and tdist.get_rank() == 1:
                for g in self.optimizer.param_groups:
                    g["lr"] *= 2.0
        LambdaLR.step = sstep


def _attention_kernel(name: str, clock, S: int) -> None:
    """One block's call of scaled_dot_product_attention computes something else from S on: block1's with the
    scores scaled by 1/d_head, or block2's on q, k, v rounded to bf16 (its output back in theirs)."""
    import torch.nn.functional as F

    import model.attention as att
    from model import transformer as tr
    inside = {"on": False}

    class Functional:
        """torch.nn.functional as model/attention.py sees it, but for the planted block's kernel call."""
        def __getattr__(self, key):
            return getattr(F, key)

        @staticmethod
        def scaled_dot_product_attention(q, k, v, *a, **kw):
            if not inside["on"]:
                return F.scaled_dot_product_attention(q, k, v, *a, **kw)
            if name == "attn_scale_d":
                return F.scaled_dot_product_attention(q, k, v, *a, scale=1.0 / q.shape[-1], **kw)
            return F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), *a, **kw).to(q.dtype)
    att.F = Functional()
    orig_init = tr.Transformer.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        attn = self.blocks[1 if name == "attn_scale_d" else 2].attn

        def enter(mod, args):
            inside["on"] = clock.step >= S

        def leave(mod, args, out):
            inside["on"] = False
        attn.register_forward_pre_hook(enter)
        attn.register_forward_hook(leave)
    tr.Transformer.__init__ = init
