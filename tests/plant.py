"""Bugs planted from outside the specification checks, for tests/test_spec.py.

    python tests/plant.py FAULT STEP RUN_DIR [hydra overrides...]

Each fault monkeypatches a component of this checkout the way a bug would (a loader, a hook on a module, a
patched function, a scheduler) in this process, then runs train.py through runpy: nothing in the run's config
names it. It acts at optimizer step STEP (the STEP-th train batch) or from there on. FAULTS maps each to the
check that must fail at STEP and the place it must name.
"""
from __future__ import annotations

import math
import os
import runpy
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # NOTE: before any project import: the patched modules are the ones train.py uses

# fault -> (the check that must fail at its step, the place it names (None: any), its kind)
FAULTS = {
    "label_shift": ("data", "labels", "corrupted"),
    "cursor_skip": ("data", "ids", "cursor"),
    "val_row": ("data", "leak", "leak"),
    "row_dup": ("data", "tokens", "corrupted"),  # one row: a lone row off says nothing of its source
    "chain_swap": ("data", None, "source"),  # every markov row from another chain, the copy rows as they were
    "emb_row": ("continuity", "tok_emb.weight", "state"),
    "attn_x3": ("forward", "block1.attn", "scaled"),
    "nan_mlp": ("loss_grad", "block0.mlp", "nonfinite"),  # its NaN gradient is the layer's, not a write (reduce)
    "mlp_bf16": ("forward", "block0.mlp", "precision"),
    "attn_bf16": ("forward", "block1.attn", "precision"),  # q, k, v rounded to bf16 inside the attention
    "attn_temp": ("forward", "block1.attn", "mismatch"),  # the scores ×1.1: a function near the layer's own
    "norm_gain_off": ("forward", "block0", "mismatch"),  # the MLP's norm without its gain
    "attn_next": ("forward", "block1.attn", "leak"),  # each position sees the next one too: a mask off by one
    "attn_qk_fp16": ("exact", "block1.attn", "precision"),  # q and k rounded to fp16: within the FP32 recipe's bound
    "attn_temp_small": ("exact", "block1.attn", "mismatch"),  # the scores ×1.001: within it too
    "adam_l2": ("optimizer", None, "update"),  # the decay added to the gradient (Adam's L2), not decoupled
    "expert_dead": ("forward", "block1.mlp", "dead_expert"),
    "rope_rebuilt": ("tables", "rope_sin", "mismatch"),  # the RoPE tables rebuilt with θ ×1.01 inside the forward
    "expert_clamp_tight": ("forward", "block1.mlp", "mismatch"),  # the experts' SwiGLU clamp at 0.3, the config's 10
    "expert_out_bf16": ("forward", "block1.mlp", "precision"),  # the experts' outputs rounded to bf16
    "grad_hook": ("gradient", "blocks.0.attn.qkv.weight", "scaled"),
    "all_grads_x2": ("loss_grad", "norm.weight", "scaled"),
    "grad_after_backward": ("reduce", "blocks.0.attn.qkv.weight", "scaled"),
    "grad_noise_after_backward": ("reduce", "blocks.0.mlp.w_down.weight", "written"),
    "detached_block": ("reduce", None, "missing"),
    "clip_input": ("clip", "norm", "gradient"),
    "clip_threshold": ("clip", "coef", "coef"),
    "lr_x3": ("lr", None, "lr"),
    "eps": ("optimizer", None, "update"),
    "betas": ("optimizer", None, "update"),  # the moments off the config's βs, on another's: a setting, not the state
    "adam_v": ("optimizer", None, "state"),
    "route_flip": ("route", "moe1", "topk"),
    "bias_sign": ("balance", "moe1", "rule"),
    "reduce_rank1": ("reduce", None, "reduce"),
    "replica_drift": ("optimizer", "blocks.0.mlp.w_down.weight", "rank"),  # rank 0's weights moved after its update
    "emb_grad_zero": ("gradient", None, "mismatch"),  # a gradient erased (factor 0) is another one, not a scaled copy
    "grad_bf16": ("reduce", "blocks.0.mlp.w_down.weight", "precision"),  # .grad rounded after the backward: a cast
    "aux_coef": ("aux", "aux_loss", "balancing"),  # the MoE balancing coefficient ×100 in the module, not the config
    "router_z_x10": ("aux", "aux_loss", "balancing"),  # the router z-loss coefficient ×10 in the module, not the config
    "n_all_positions": ("loss_grad", "norm.weight", "scaled"),  # the step's token count counts the ignored labels too
    "ce_half": ("forward", "loss", "mismatch"),  # the CE sum halved: off by half of itself, though z (larger) is right
    "label_smooth": ("forward", "loss", "mismatch"),  # CE with label smoothing 0.1: within 2^-3 of itself, smooth
    "loss_bf16": ("forward", "loss", "precision"),  # the CE sum rounded to bf16: within 2^-3, a rounding
    "loss_x105": ("forward", "loss", "mismatch"),  # the CE sum ×1.05 by the model's forward, outside the loss function
    "emb_frozen": ("reduce", "tok_emb.weight", "missing"),  # the embedding frozen (requires_grad off) from step S on
    "v_bf16": ("optimizer", None, "precision"),  # exp_avg_sq rounded to bf16 after the update: kept coarser
    "w_bf16": ("optimizer", "blocks.0.mlp.w_down.weight", "precision"),  # a weight rounded to bf16 after its update
    "router_bf16": ("forward", "block1.mlp", "precision"),  # the MoE router's logits rounded to bf16 from step S on
    "lr_rank1": ("lr", None, "rank"),  # rank 1's LRs ×2, rank 0's on schedule
}
RESUME = {"resume_lost_moments": ("continuity", None, "resume")}  # planted on a resume from step S − 1
# a component built otherwise than its config says, so from step 1 (STEP is not read): tests/test_spec.py
BUILT = {"decay_norms": ("optimizer", None, "update"), "model_eps": ("forward", "block0", "mismatch"),
         "model_top1": ("route", "moe1", "topk"), "model_experts2x": ("forward", None, "mismatch")}
# the model built with another setting than its config's (the config unchanged): BUILT's model_* faults
MODEL_BUILDS = {
    "model_eps": lambda c: replace(c, norm_eps=1e-2),                                   # RMSNorm ε 1e-2, config 1e-5
    "model_top1": lambda c: replace(c, moe=replace(c.moe, top_k=1)),                    # each token to 1 expert
    "model_experts2x": lambda c: replace(c, moe=replace(c.moe, n_experts=2 * c.moe.n_experts)),  # twice the experts
}
# one step between reference steps that the guard's detector flags (a planted trigger): tests/test_spec.py
FLAGGED = {"flagged": None, "attn_x3_flagged": ("forward", "block1.attn", "scaled")}
# at STEP, between reference steps (spec.every=5): a check that runs every step fails there (tests/test_spec.py)
BETWEEN = {"route_flip": FAULTS["route_flip"], "mlp_bf16": ("precision", "block0.mlp", "coarse"),
           "logits_bf16": ("precision", "head", "coarse"),
           # a token mid-row changed inside the forward: past the prefix's first and last positions, seen in its
           # embedding's output, which it holds over the whole row
           "token_mid": ("prefix", "emb", "mismatch")}
# from STEP on, for a check that runs every few steps: tests/test_spec.py dates it
SUSTAINED = {"attn_x3_on": ("forward", "block1.attn", "scaled"),
             "attn_bf16_on": ("forward", "block1.attn", "precision"),  # q, k, v in bf16: the output RMS as it was
             "grad_hook_on": ("gradient", "blocks.0.attn.qkv.weight", "scaled"),
             # q and k in bf16: within the FP32 recipe's bound (only the exact check fails), the output RMS as it was
             "attn_qk_bf16_on": ("exact", "block1.attn", "precision"),
             # block1's attention reads the last 8 positions only: no output among the first 8 changes
             "attn_window_on": ("forward", "block1.attn", "mismatch")}
# block0's MLP on the second micro-batch only, from STEP on: -> (check, place, kind, the steps it fails of 13..16 at
# spec.every=5: the prefix's micro-batch is t mod 2, off the reference steps; the precision check's t mod 2 every step)
ONE_MICRO_BATCH = {"mlp_x2_mb1_on": ("prefix", "block0.mlp", "scaled", [13]),
                   "mlp_bf16_mb1_on": ("precision", "block0.mlp", "coarse", [13, 15])}
# block0's MLP ×2 from STEP on, on every sequence but the one row 0 of micro-batch 0 holds (by its content: a probe of
# that sequence's first positions is spared too, a probe of another row's is not)
SPARES_ROW0 = "mlp_x2_spare_row0_on"


class Clock:
    step = 0  # the train batches served so far: the step being run
    row0 = None  # that batch's first row's tokens


def plant(name: str, S: int) -> None:
    import torch

    from data import loader as loader_mod
    from data.batch import IGNORE_INDEX
    from model import transformer as tr

    models: list = []
    orig_next = loader_mod.Loader.next

    def next_(self):
        if self.split == "train":
            Clock.step += 1
            if name == "cursor_skip" and Clock.step == S:
                self.samples_consumed += 5 * self.batch_size
            if name == "emb_row" and Clock.step == S:  # between the steps: the weights change under the run
                with torch.no_grad():
                    models[0].tok_emb.weight[3] *= 2.0
            if name in ("aux_coef", "router_z_x10") and Clock.step == S:
                moe = models[0].blocks[1].mlp
                moe.cfg = (replace(moe.cfg, balance_coef=100 * moe.cfg.balance_coef) if name == "aux_coef"
                           else replace(moe.cfg, router_z_coef=10 * moe.cfg.router_z_coef))
        batch = orig_next(self)
        if self.split == "train":
            Clock.row0 = batch.tokens[0].clone()
        if self.split != "train" or Clock.step != S:
            return batch
        if name == "label_shift":
            lab = batch.labels.clone()
            lab[:, :-1] = torch.where(lab[:, 1:] != IGNORE_INDEX, lab[:, 1:], lab[:, :-1])
            batch.labels = lab
        if name == "row_dup":  # row 1 holds row 0's content, its id and source kept (a collation bug)
            batch.tokens[1], batch.labels[1] = batch.tokens[0].clone(), batch.labels[0].clone()
        if name == "chain_swap":
            from bench.doctor_eval.drills import _other_chain
            batch = _other_chain(self.dataset, batch, S)
        if name == "val_row":
            val = self.dataset.samples(range(0, 1), "val")
            batch.tokens[0], batch.labels[0] = val.tokens[0], val.labels[0]
            batch.sources[0] = val.sources[0]
        return batch
    loader_mod.Loader.next = next_

    orig_init = tr.Transformer.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        models[:] = [self]
        at = lambda: torch.is_grad_enabled() and Clock.step == S  # noqa: E731

        if name in ("attn_x3", "attn_x3_flagged"):  # the second between reference steps, the guard flagging it
            self.blocks[1].attn.register_forward_hook(lambda m, a_, out: out * 3.0 if at() else None)
        if name == "attn_x3_on":  # from STEP on: a check that runs every few steps finds it late, the doctor dates it
            self.blocks[1].attn.register_forward_hook(
                lambda m, a_, out: out * 3.0 if torch.is_grad_enabled() and Clock.step >= S else None)
        if name == "nan_mlp":  # once: the step's first forward (the probe's, after the update, runs clean)
            spent = []

            def nan(m, a_, out):
                if at() and not spent:
                    spent.append(1)
                    return out * float("nan")
                return None
            self.blocks[0].mlp.register_forward_hook(nan)
        if name in ("attn_bf16", "attn_bf16_on", "attn_temp", "attn_qk_fp16", "attn_qk_bf16_on",
                    "attn_temp_small"):  # block1's q, k, v
            attn, qk = self.blocks[1].attn, self.blocks[1].attn.qk
            on = (lambda: torch.is_grad_enabled() and Clock.step >= S) if name.endswith("_on") else at

            def changed(*a, **k):
                q, k_, v = qk(*a, **k)
                if not on():
                    return q, k_, v
                if name in ("attn_temp", "attn_temp_small"):
                    return q * (1.1 if name == "attn_temp" else 1.001), k_, v
                if name == "attn_qk_fp16":
                    return q.half().to(q.dtype), k_.half().to(k_.dtype), v
                if name == "attn_qk_bf16_on":
                    return q.bfloat16().to(q.dtype), k_.bfloat16().to(k_.dtype), v
                return q.bfloat16().float(), k_.bfloat16().float(), v.bfloat16().float()
            attn.qk = changed
        if name in ("attn_next", "attn_window_on"):
            attn1, forward1 = self.blocks[1].attn, self.blocks[1].attn.forward
            on = (lambda: torch.is_grad_enabled() and Clock.step >= S) if name.endswith("_on") else at

            def ahead(x, cos, sin, kv=None):
                if not on():
                    return forward1(x, cos, sin, kv=kv)
                q, k_, v = attn1.qk(x, cos, sin)
                T = q.shape[-2]
                s_, t_ = torch.arange(T)[None, :], torch.arange(T)[:, None]
                # the next position too (a mask off by one), or the last 8 only (a sliding window in the kernel call)
                mask = s_ <= t_ + 1 if name == "attn_next" else (s_ <= t_) & (s_ > t_ - 8)
                y = torch.nn.functional.scaled_dot_product_attention(q, k_, v, attn_mask=mask,
                                                                     enable_gqa=attn1.n_kv_heads != attn1.n_heads)
                return attn1.proj_out(y.transpose(1, 2).flatten(2))
            attn1.forward = ahead
        if name in ("mlp_x2_mb1_on", "mlp_bf16_mb1_on"):  # the step's second forward: its second micro-batch's
            calls: dict[int, int] = {}

            def second(m, a_, out):
                if not (torch.is_grad_enabled() and Clock.step >= S):
                    return None
                calls[Clock.step] = calls.get(Clock.step, 0) + 1
                if calls[Clock.step] != 2:
                    return None
                return out * 2.0 if name == "mlp_x2_mb1_on" else out.bfloat16().to(out.dtype)
            self.blocks[0].mlp.register_forward_hook(second)
        if name == "token_mid":  # at STEP: every row's middle token, as the embedding reads it, the next id
            def other(m, a_):
                if not at():
                    return None
                tokens, mid = a_[0].clone(), a_[0].shape[1] // 2
                tokens[:, mid] = (tokens[:, mid] + 1) % m.num_embeddings
                return (tokens,)
            self.tok_emb.register_forward_pre_hook(other)
        if name == "norm_inline":  # from STEP on: the final norm computed inline with ε 0.05, never by the module's call
            trunk, norm = self._trunk, self.norm

            def inline(*a_, **k_):
                if not (torch.is_grad_enabled() and Clock.step >= S):
                    return trunk(*a_, **k_)
                self.__dict__["norm"] = lambda x: torch.nn.functional.rms_norm(x, (x.shape[-1],), norm.weight, 0.05)
                try:
                    return trunk(*a_, **k_)
                finally:
                    del self.__dict__["norm"]
            self._trunk = inline
        if name == "mlp_inline_on":  # from STEP on: block0's MLP ×1.5, computed outside its module (no call, no hook)
            block0, mlp0 = self.blocks[0], self.blocks[0].mlp
            forward0 = block0._forward

            def outside(*a_, **k_):
                if not (torch.is_grad_enabled() and Clock.step >= S):
                    return forward0(*a_, **k_)
                block0.__dict__["mlp"] = lambda h: 1.5 * mlp0.forward(h)
                try:
                    return forward0(*a_, **k_)
                finally:
                    del block0.__dict__["mlp"]
            block0._forward = outside
        if name == SPARES_ROW0:
            seen: list = []
            self.register_forward_pre_hook(lambda m, a_: seen.__setitem__(slice(None), [a_[0]]))

            def others(m, a_, out):
                if not (torch.is_grad_enabled() and Clock.step >= S):
                    return None
                tokens = seen[0]
                n = min(tokens.shape[1], 32)  # the probe's positions: the same sequence as far as it reads
                hit = (tokens[:, :n] != Clock.row0[:n]).any(-1).to(out.dtype)
                return out * (1.0 + hit[:, None, None])
            self.blocks[0].mlp.register_forward_hook(others)
        if name == "norm_gain_off":
            self.blocks[0].mlp_norm.register_forward_hook(
                lambda m, a_, out: torch.nn.functional.rms_norm(a_[0], m.normalized_shape, None, m.eps) if at() else None)
        if name == "mlp_bf16":
            self.blocks[0].mlp.register_forward_hook(lambda m, a_, out: out.bfloat16().float() if at() else None)
        if name == "logits_bf16":
            self.head.register_forward_hook(lambda m, a_, out: out.bfloat16().float() if at() else None)
        if name == "rope_rebuilt":
            from model.rope import rope_tables
            cos, sin = rope_tables(self.rope_cos.shape[0], self.cfg.head_dim, self.cfg.rope_theta * 1.01)

            def rebuild(m, a_):
                if at():
                    m.rope_cos.copy_(cos)
                    m.rope_sin.copy_(sin)
            self.register_forward_pre_hook(rebuild)
        if name == "expert_clamp_tight":
            experts, limit = self.blocks[1].mlp.experts, self.blocks[1].mlp.experts.limit
            experts.register_forward_pre_hook(lambda m, a_: setattr(m, "limit", 0.3 if at() else limit))
        if name == "expert_out_bf16":
            self.blocks[1].mlp.experts.register_forward_hook(lambda m, a_, out: out.bfloat16().float() if at() else None)
        if name == "expert_dead":
            def kill(m, args, out):
                if not at():
                    return None
                counts = torch.as_tensor(args[1]).tolist()
                keep = torch.ones(out.shape[0], 1, dtype=out.dtype)
                keep[:counts[0]] = 0.0  # the rows are sorted by expert: expert 0's come first
                return out * keep
            self.blocks[1].mlp.experts.register_forward_hook(kill)
        if name == "emb_grad_zero":
            self.tok_emb.weight.register_hook(lambda g: torch.zeros_like(g) if Clock.step == S else None)
        if name == "grad_hook":
            w = self.blocks[0].attn.qkv.weight
            w.register_hook(lambda g: g * 0.5 if Clock.step == S else None)
        if name == "grad_hook_on":  # a tenth: this tiny job's gradient norms move by a third a step early on
            self.blocks[0].attn.qkv.weight.register_hook(lambda g: g * 0.1 if Clock.step >= S else None)
        if name == "grad_after_backward":  # .grad halved once the backward accumulated it (autograd.grad never runs it)
            w, seen = self.blocks[0].attn.qkv.weight, []

            def halve(p):  # after the step's last micro-batch (the tests' runs have 2)
                seen.append(Clock.step)
                if Clock.step == S and seen.count(S) == 2:
                    p.grad.mul_(0.5)
            w.register_post_accumulate_grad_hook(halve)
        if name == "grad_bf16":  # .grad rounded to bf16 and back after each accumulation (every value finite)
            def round_grad(p):
                if Clock.step == S:
                    p.grad.copy_(p.grad.bfloat16())
            self.blocks[0].mlp.w_down.weight.register_post_accumulate_grad_hook(round_grad)
        if name == "grad_noise_after_backward":  # noise added to .grad after the backward (a helper before the clip)
            w = self.blocks[0].mlp.w_down.weight
            w.register_post_accumulate_grad_hook(lambda p: (p.grad.add_(torch.randn_like(p.grad) * p.grad.std()), None)[1]
                                                 if Clock.step == S else None)
        if name == "emb_frozen":
            def freeze(mod, args):
                if Clock.step == S:
                    self.tok_emb.weight.requires_grad_(False)
            self.register_forward_pre_hook(freeze)
        if name == "detached_block":  # block 1 reads block 0's output cut off the graph: block 0 gets no gradient
            self.blocks[1].register_forward_pre_hook(
                lambda mod, args: (args[0].detach(), *args[1:]) if Clock.step == S and torch.is_grad_enabled() else None)
        if name == "all_grads_x2":
            for p in self.parameters():
                p.register_hook(lambda g: g * 2.0 if Clock.step == S else None)
        if name == "route_flip":
            moe = self.blocks[1].mlp
            orig_top = moe.top_ids
            moe.top_ids = lambda scores: (torch.topk(-scores.detach(), moe.top_k, -1).indices if at()
                                          else orig_top(scores))
        if name == "router_bf16":  # the router's FP32 logits rounded to bf16 (model/moe.py keeps them FP32)
            moe = self.blocks[1].mlp
            orig_logits = moe.router_logits
            moe.router_logits = lambda x: orig_logits(x).bfloat16().float() if at() else orig_logits(x)
        if name == "bias_sign":
            moe = self.blocks[1].mlp
            orig_ub = moe.update_bias
            moe.update_bias = lambda load, skipped=False: (orig_ub(-load, skipped) if Clock.step == S
                                                           else orig_ub(load, skipped))
    tr.Transformer.__init__ = init

    if name in ("flagged", "attn_x3_flagged"):  # the detector flags step STEP, as a spike would make it
        from stability import guard as guard_mod
        from stability.detector import Trigger
        orig_after = guard_mod.Guard.after_update

        def after_update(self, step, *a, **k):
            v = orig_after(self, step, *a, **k)
            if step == S:
                v.triggers.append(Trigger("loss", 9.0, 1.0, 1.0, 8.0, 0))
            return v
        guard_mod.Guard.after_update = after_update

    import precision.step as pstep
    orig_prepare, orig_apply = pstep.prepare_update, pstep.apply_update

    def prepare_update(params, scaler, max_grad_norm, clip=None):
        if name == "clip_input" and Clock.step == S:
            for p in models[0].blocks[1].parameters():
                if p.grad is not None:
                    p.grad.mul_(10.0)
        if name == "clip_threshold" and Clock.step == S and max_grad_norm:
            max_grad_norm = max_grad_norm * 0.01
        if name == "clip_unapplied" and Clock.step == S and max_grad_norm:  # the coefficient reported, not applied
            upd = orig_prepare(params, scaler, None, clip=clip)
            return upd._replace(coef=(max_grad_norm / (upd.norm + 1e-6)).clamp(max=1.0))
        if name == "coef_in_tolerance" and max_grad_norm:  # every step: the applied clip coefficient off the
            # policy's by half what the clip check allows (spec/checks/clip.py), as an FP32 norm's rounding puts it
            from spec.tolerance import LAMBDA, U32
            n = max(p.numel() for p in models[0].parameters())
            max_grad_norm = max_grad_norm * (1 + 0.5 * LAMBDA * (math.sqrt(n) + 6) * U32)
        return orig_prepare(params, scaler, max_grad_norm, clip=clip)

    def apply_update(params, optimizer, *a, **k):
        if name == "adam_v" and Clock.step == S:
            for st in optimizer.state.values():
                if "exp_avg_sq" in st:
                    st["exp_avg_sq"].div_(16.0)
        out = orig_apply(params, optimizer, *a, **k)
        if name == "w_bf16" and Clock.step == S:
            with torch.no_grad():
                w = models[0].blocks[0].mlp.w_down.weight
                w.copy_(w.bfloat16())
        if name == "v_bf16" and Clock.step == S:
            for st in optimizer.state.values():
                if "exp_avg_sq" in st:
                    st["exp_avg_sq"].copy_(st["exp_avg_sq"].bfloat16())
        if name == "replica_drift" and Clock.step == S and int(os.environ.get("RANK", "0")) == 0:
            with torch.no_grad():  # one replica's copy changed after its update (the others keep theirs)
                models[0].blocks[0].mlp.w_down.weight.mul_(1.001)
        return out
    pstep.prepare_update, pstep.apply_update = prepare_update, apply_update

    if name == "adam_l2":  # from step S on, the decay added to the gradient and the decoupled decay off (Adam's L2)
        from bench.doctor_eval.optim_patches import l2_in_gradient
        l2_in_gradient(lambda: Clock.step >= S)

    if name in ("eps", "betas"):  # an optimizer setting changed under the config, from step S on
        orig_step = torch.optim.AdamW.step

        def step(self, *aa, **kk):
            if Clock.step >= S:
                for g in self.param_groups:
                    if name == "eps":
                        g["eps"] = 1e-3
                    else:
                        g["betas"] = (0.8, 0.99)
            return orig_step(self, *aa, **kk)
        torch.optim.AdamW.step = step

    if name == "muon_scale":  # Muon's update multiplier (rms_scale) ×1.1 in its param groups from step S on
        import optim.muon
        orig_mstep = optim.muon.Muon.step

        def mstep(self, *aa, **kk):
            if Clock.step == S:
                for g in self.param_groups:
                    g["rms_scale"] *= 1.1
            return orig_mstep(self, *aa, **kk)
        optim.muon.Muon.step = mstep

    if name == "muon_block0":  # Muon's update of block 0's hidden matrices alone 10 % larger, from step S on
        import optim.muon
        orig_mstep0 = optim.muon.Muon.step

        def mstep0(self, *aa, **kk):
            mine = [p for g in self.param_groups if g.get("optimizer") == "muon" for p in g["params"]
                    if any(p is q for q in models[0].blocks[0].parameters())] if Clock.step >= S else []
            before = [p.detach().clone() for p in mine]
            out = orig_mstep0(self, *aa, **kk)
            with torch.no_grad():
                for p, b in zip(mine, before):
                    p.add_(p - b, alpha=0.1)
            return out
        optim.muon.Muon.step = mstep0

    if name == "decay_norms":  # the groups built against the config's rules: the no_decay group's tensors (norm gains,
        import optim.adamw  # embeddings) held in the default group, decayed from the first step, every group's
        orig_groups = optim.adamw.build_param_groups  # settings as configured

        def build_param_groups(model, cfg):
            groups, table = orig_groups(model, cfg)
            by = {g["name"]: g for g in groups}
            by["default"]["params"] = by["default"]["params"] + by.pop("no_decay")["params"]
            return list(by.values()), table
        optim.adamw.build_param_groups = build_param_groups

    if name in MODEL_BUILDS:
        from model.transformer import Transformer
        as_built = Transformer.__init__

        def built(self, cfg):
            as_built(self, MODEL_BUILDS[name](cfg))
        Transformer.__init__ = built

    if name in ("lr_x3", "lr_rank1"):
        from torch.optim.lr_scheduler import LambdaLR
        orig_step = LambdaLR.step

        def sstep(self, *aa, **kk):
            orig_step(self, *aa, **kk)
            if Clock.step >= S - 1 and (name == "lr_x3" or int(os.environ.get("RANK", "0")) == 1):
                for g in self.optimizer.param_groups:
                    g["lr"] *= 3.0 if name == "lr_x3" else 2.0
        LambdaLR.step = sstep

    if name == "ce_half":  # the CE sum halved from step S on, where a gradient flows (the step's and the probe's)
        orig_losses = tr.token_losses

        def token_losses(logits, labels):
            out = orig_losses(logits, labels)
            if Clock.step >= S and torch.is_grad_enabled():
                out.loss_sum = out.loss_sum * 0.5
            return out
        tr.token_losses = token_losses

    if name in ("label_smooth", "loss_bf16"):  # the loss function itself, from step S on (the step's and the probe's)
        orig_tl = tr.token_losses

        def token_losses(logits, labels):
            out = orig_tl(logits, labels)
            if Clock.step < S:
                return out
            if name == "loss_bf16":
                out.loss_sum = out.loss_sum.bfloat16().float()
                return out
            # (1 − ε)·CE + ε·(the mean over the vocabulary of lse − logit_v)
            valid = labels != -100
            uniform = torch.where(valid, logits.float().logsumexp(-1) - logits.float().mean(-1), 0.0).sum()
            out.loss_sum = 0.9 * out.loss_sum + 0.1 * uniform
            return out
        tr.token_losses = token_losses

    if name == "loss_x105":
        orig_fwd = tr.Transformer.forward

        def forward(self, *a, **k):
            out = orig_fwd(self, *a, **k)
            if Clock.step >= S and hasattr(out, "loss_sum"):
                out.loss_sum = out.loss_sum * 1.05
            return out
        tr.Transformer.forward = forward

    if name == "n_all_positions":  # from step S on, the count the loss is divided by counts every position
        from bench.doctor_eval.step_patches import count_every_position
        count_every_position(lambda: Clock.step >= S)

    if name == "resume_lost_moments":  # a resume that loads the model but drops Adam's moments
        from checkpoint import state as state_mod
        orig_load = state_mod.TrainState.load

        def load(self, *a, **k):
            orig_load(self, *a, **k)
            Clock.step = self.step
            self.optimizer.state.clear()
        state_mod.TrainState.load = load

    if name == "reduce_rank1":  # rank 1's gradient halved before the all-reduce, by a DDP communication hook
        from bench.doctor_eval.drills import scale_rank_bucket
        scale_rank_bucket(1, 0.5, lambda: Clock.step == S)


if __name__ == "__main__":
    fault, step, run_dir, *overrides = sys.argv[1:]
    if fault != "none":
        plant(fault, int(step))
    os.chdir(ROOT)
    sys.argv = [str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *overrides]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
