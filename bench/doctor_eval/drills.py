"""Faults the doctor has never seen, planted from outside the project (issue 14).

    python -m bench.doctor_eval.drills launch FAULT RUN_DIR [hydra overrides...]   # one run, fault planted
    torchrun --nproc_per_node=2 -m bench.doctor_eval.drills launch FAULT RUN_DIR ...

The launcher monkeypatches functions of this checkout (the loader, the optimizer step, a module's
forward, the checkpoint load, the scheduler) in its own process and then runs train.py through runpy
with fault=none: nothing in the run directory names the fault (no injector, no events, no config node).
The answer key, and the jobs, are bench/doctor_eval/key.py; each patch here makes its fault's entry true.
bench/doctor_eval/score.py draws S per run (inside the default job's natural transition, or late) and sets it for
the launcher's process through BALLAST_DRILL_STEP.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from bench import ROOT
from bench.doctor_eval import step_patches
from bench.doctor_eval.key import BY_NAME

S = int(os.environ.get("BALLAST_DRILL_STEP", "60"))  # the fault step (this process's job)


# ---- the patches (run in the launcher's process only) --------------------------------------------------
class Clock:
    """The optimizer step the run is at: the number of train batches served so far."""
    step = 0


def _noise(batch, frac: float, seed: int):
    import torch
    from data.batch import IGNORE_INDEX
    g = torch.Generator().manual_seed(seed)
    tok, lab = batch.tokens.clone(), batch.labels.clone()
    valid = lab != IGNORE_INDEX
    hit = valid & (torch.rand(tok.shape, generator=g) < frac)
    v = int(tok.max()) + 1
    tok[hit] = torch.randint(1, max(v, 2), (int(hit.sum()),), generator=g)
    lab[:, :-1] = torch.where(valid[:, 1:] & valid[:, :-1], tok[:, 1:], lab[:, :-1])
    return type(batch)(tokens=tok, labels=lab, sources=batch.sources, sample_ids=batch.sample_ids, floor=batch.floor)


def _other_chain(ds, batch, t: int):
    """The markov rows of `batch` regenerated from a chain of another seed (same lengths, same BOS)."""
    import numpy as np
    import torch
    from data.batch import IGNORE_INDEX
    from data.sources import MarkovSource
    k = ds.source_names.index("markov")
    src = ds.sources[k]
    alt = MarkovSource(src.name, src.alphabet, src.order, src.support, src.concentration, ds.seed + 1)
    rows = (batch.sources == k).nonzero().flatten()
    if not len(rows):
        return batch
    tok, lab = batch.tokens.clone(), batch.labels.clone()
    x, _ = alt.generate(np.random.default_rng(t).random((len(rows), tok.shape[1])))
    doc = torch.from_numpy(ds.bos_ids[k] + 1 + x)
    valid = lab[rows] != IGNORE_INDEX
    tok[rows, 1:] = torch.where(valid[:, 1:], doc[:, :-1], tok[rows, 1:])
    lab[rows] = torch.where(valid, doc, lab[rows])
    return type(batch)(tokens=tok, labels=lab, sources=batch.sources, sample_ids=batch.sample_ids, floor=batch.floor)


def patch(name: str) -> None:
    import torch
    from data import loader as loader_mod
    from data.batch import IGNORE_INDEX
    f = BY_NAME[name]
    orig_next = loader_mod.Loader.next

    def next_(self):
        if self.split == "train":
            Clock.step += 1
            t = Clock.step
            if name == "cursor_repeat" and t == S:
                self.samples_consumed -= self.batch_size
            if name == "cursor_skip" and t == S:
                self.samples_consumed += 40 * self.batch_size
            if name == "rank1_other_data" and t >= S and self.rank == 1:
                b = self.local_batch_size
                start = self.samples_consumed + self.rank * b + 5000
                self.samples_consumed += self.batch_size
                return self.dataset.samples(range(start, start + b), self.split)
            if name == "slow_loader" and t >= S:
                import time
                time.sleep(0.06)
        batch = orig_next(self)
        if self.split != "train":
            return batch
        t = Clock.step
        if name == "weights_halved_between" and t == S:
            with torch.no_grad():
                _MODEL[0].blocks[1].attn.proj_out.weight.mul_(0.5)
        if name == "emb_row_x50" and t == S:  # before the forward of step S
            with torch.no_grad():
                bos = 34  # the copy source's BOS id: every copy document starts with it
                _MODEL[0].tok_emb.weight[bos] *= 50.0
        if name in ("swiglu_clamp_tight", "norm_eps_big") and t == S:
            if name == "swiglu_clamp_tight":
                _MODEL[0].blocks[0].mlp.limit = 0.3
            else:
                _MODEL[0].blocks[2].attn_norm.eps = 1e-1
        if name == "moe_bias_ignored" and t == S:
            last = _MODEL[0].moe_layers()[-1][1]
            last.top_ids = lambda scores: torch.topk(scores.detach(), last.top_k, dim=-1).indices
        if name == "moe_router_jitter" and t == S:
            last = _MODEL[0].moe_layers()[-1][1]
            orig_logits = last.router_logits
            last.router_logits = lambda x: (orig_logits(x) + 0.5 * torch.randn_like(orig_logits(x))
                                            if torch.is_grad_enabled() else orig_logits(x))
        if name == "rope_theta_x10_sustained" and t == S:
            from model.rope import rope_tables
            m = _MODEL[0]
            cos, sin = rope_tables(m.rope_cos.shape[0], 2 * m.rope_cos.shape[1], 10 * m.cfg.rope_theta)
            m.rope_cos.copy_(cos)
            m.rope_sin.copy_(sin)
        if name in ("moe_gates_unnormalised", "moe_top1_sustained", "moe_expert_dead", "moe_bias_speed_x10",
                    "moe_balance_coef_x100", "moe_score_sigmoid", "attn_causal_leak") and t == S:  # a module's own setting changed, the run's config unchanged
            import dataclasses
            blk = _MODEL[0].blocks
            last_moe = _MODEL[0].moe_layers()[-1][1]  # block3's in the default job
            if name == "moe_gates_unnormalised":
                blk[1].mlp.cfg = dataclasses.replace(blk[1].mlp.cfg, norm_topk=False)
            if name == "moe_top1_sustained":
                last_moe.top_k = 1
            if name == "moe_balance_coef_x100":
                blk[1].mlp.cfg = dataclasses.replace(blk[1].mlp.cfg, balance_coef=100 * blk[1].mlp.cfg.balance_coef)
            if name == "moe_score_sigmoid":
                last_moe.cfg = dataclasses.replace(last_moe.cfg, score="sigmoid")
            if name == "moe_bias_speed_x10":
                blk[1].mlp.cfg = dataclasses.replace(blk[1].mlp.cfg, bias_update_speed=10 * blk[1].mlp.cfg.bias_update_speed)
            if name == "attn_causal_leak":
                blk[-2].attn.causal = False  # block2 in the default job
            if name == "moe_expert_dead":
                def kill(m, args, out):
                    counts = torch.as_tensor(args[1]).tolist()
                    keep = torch.ones(out.shape[0], 1, dtype=out.dtype, device=out.device)
                    lo = sum(counts[:2])
                    keep[lo:lo + counts[2]] = 0.0  # rows sorted by expert: expert 2's after 0's and 1's
                    return out * keep
                last_moe.experts.register_forward_hook(kill)
        if name == "val_leak_sustained" and t >= S:
            val = self.dataset.samples(range(4), "val")
            tok, lab = batch.tokens.clone(), batch.labels.clone()
            tok[:4], lab[:4] = val.tokens, val.labels
            batch = type(batch)(tokens=tok, labels=lab, sources=batch.sources, sample_ids=batch.sample_ids,
                                floor=batch.floor)
        if name == "labels_ignore_half" and t == S:
            lab = batch.labels.clone()
            hit = (lab != IGNORE_INDEX) & (torch.rand(lab.shape, generator=torch.Generator().manual_seed(t)) < 0.5)
            lab[hit] = IGNORE_INDEX
            batch = type(batch)(tokens=batch.tokens, labels=lab, sources=batch.sources, sample_ids=batch.sample_ids,
                                floor=batch.floor)
        if name == "rows_permuted" and t == S:
            batch = type(batch)(tokens=batch.tokens.roll(1, 0), labels=batch.labels.roll(1, 0), sources=batch.sources,
                                sample_ids=batch.sample_ids, floor=batch.floor)
        if name == "row_duplicated" and t == S:
            tok, lab = batch.tokens.clone(), batch.labels.clone()
            tok[1], lab[1] = tok[0], lab[0]
            batch = type(batch)(tokens=tok, labels=lab, sources=batch.sources, sample_ids=batch.sample_ids,
                                floor=batch.floor)
        if name == "markov_chain_swap" and t >= S:
            batch = _other_chain(self.dataset, batch, t)
        if name == "noise_half" and t == S:
            batch = _noise(batch, 0.5, t)
        if name == "noise_slow" and t >= S:
            batch = _noise(batch, 0.04 * (t - S + 1), t)
        if name == "repeat_quarter" and t == S:
            tok, lab = batch.tokens.clone(), batch.labels.clone()
            valid = lab != IGNORE_INDEX
            hit = valid & (torch.rand(tok.shape, generator=torch.Generator().manual_seed(t)) < 0.25)
            tok[hit] = 5
            lab[:, :-1] = torch.where(valid[:, 1:] & valid[:, :-1], tok[:, 1:], lab[:, :-1])
            batch = type(batch)(tokens=tok, labels=lab, sources=batch.sources, sample_ids=batch.sample_ids,
                                floor=batch.floor)
        if name == "label_shift" and t == S:
            lab = batch.labels.clone()
            lab[:, :-1] = torch.where(lab[:, 1:] != IGNORE_INDEX, lab[:, 1:], lab[:, :-1])
            batch = type(batch)(tokens=batch.tokens, labels=lab, sources=batch.sources,
                                sample_ids=batch.sample_ids, floor=batch.floor)
        if name == "rare_tokens" and t == S:
            tok = batch.tokens.clone()
            valid = batch.labels != IGNORE_INDEX
            hit = valid & (torch.rand(tok.shape, generator=torch.Generator().manual_seed(t)) < 0.1)
            hit[:, 0] = False
            tok[hit] = 0
            batch = type(batch)(tokens=tok, labels=batch.labels, sources=batch.sources,
                                sample_ids=batch.sample_ids, floor=batch.floor)
        return batch
    loader_mod.Loader.next = next_

    from model import transformer as tr
    orig_init = tr.Transformer.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **k)

        def scale(k_, when):
            def hook(mod, args, out):
                if torch.is_grad_enabled() and when(Clock.step):
                    return out * k_ if not isinstance(out, tuple) else out
                return None
            return hook
        if name == "act_x4_attn":
            self.blocks[0].attn.register_forward_hook(scale(4.0, lambda t: t == S))
        if name == "act_x2_mlp_sustained":
            mlp = self.blocks[0].mlp

            def h(mod, args, out):
                if torch.is_grad_enabled() and Clock.step >= S:
                    return out * 2.0 if torch.is_tensor(out) else out._replace(y=out.y * 2.0)
                return None
            mlp.register_forward_hook(h)
        if name == "grad_noise_after_backward":  # each time a micro-batch accumulated into .grad
            def noise(p):
                if Clock.step == S:
                    g = torch.Generator().manual_seed(S)
                    p.grad.add_(torch.randn(p.grad.shape, generator=g) * p.grad.std())
            self.blocks[2].attn.qkv.weight.register_post_accumulate_grad_hook(noise)
        if name == "emb_output_scaled":
            self.tok_emb.register_forward_hook(scale(self.cfg.d_model ** 0.5, lambda t: t >= S))
        if name == "mlp_x2_rows_sustained":
            def rows(mod, args, out):
                if torch.is_grad_enabled() and Clock.step >= S:
                    y = out if torch.is_tensor(out) else out.y  # (B, T, D): a dense MLP's, or an MoE layer's y
                    f = torch.full((y.shape[0], 1, 1), 2.0, dtype=y.dtype, device=y.device)
                    f[0] = 1.0
                    return y * f if torch.is_tensor(out) else out._replace(y=y * f)
                return None
            self.blocks[0].mlp.register_forward_hook(rows)
        if name == "act_x2_attn1_sustained":
            self.blocks[1].attn.register_forward_hook(scale(2.0, lambda t: t >= S))
        if name == "attn1_bf16_sustained":
            def hb(mod, args, out):
                if torch.is_grad_enabled() and Clock.step >= S:
                    return out.bfloat16().to(out.dtype)
                return None
            self.blocks[1].attn.register_forward_hook(hb)
        if name == "nan_attn":
            def hn(mod, args, out):
                if torch.is_grad_enabled() and Clock.step == S:
                    out = out.clone()
                    out[0, :2] = float("nan")
                    return out
                return None
            self.blocks[1].attn.register_forward_hook(hn)
        if name == "logits_bf16_sustained":
            self.head.register_forward_hook(lambda m, a_, out: out.bfloat16().to(out.dtype)
                                            if torch.is_grad_enabled() and Clock.step >= S else None)
        if name == "emb_grad_zero_sustained":
            self.tok_emb.weight.register_hook(lambda g: torch.zeros_like(g) if Clock.step >= S else None)
        if name == "grad_bf16_sustained":
            def round_grad(p):
                if Clock.step >= S:
                    p.grad.copy_(p.grad.bfloat16())
            for p in self.parameters():
                p.register_post_accumulate_grad_hook(round_grad)
        if name == "grad_nan_one_element":
            def nan_one(g):
                if Clock.step == S:
                    g = g.clone()
                    g.view(-1)[7] = float("nan")
                    return g
                return None
            self.blocks[2].mlp.w_down.weight.register_hook(nan_one)
        if name == "moe_bias_frozen":
            moe = self.blocks[1].mlp
            orig_ub = moe.update_bias
            moe.update_bias = lambda load, skipped=False: None if Clock.step >= S else orig_ub(load, skipped)
    tr.Transformer.__init__ = init

    # NOTE: train.py's step is precision.step's prepare_update (unscale, norm, clip) then apply_update (the
    # optimizer step): gradients are scaled before the norm, Adam's v before the update, as a bug would
    import precision.step as pstep
    orig_prepare, orig_apply = pstep.prepare_update, pstep.apply_update

    def prepare_update(params, *a, **k):
        t = Clock.step
        model = _MODEL[0]
        if name == "clip_threshold_div10" and t >= S and len(a) >= 2 and a[1]:
            a = (a[0], a[1] / 10, *a[2:])
        if name in ("grad_x50_layer", "grad_x3_sustained") and (t == S or (name == "grad_x3_sustained" and t > S)):
            blk = model.blocks[1].attn if name == "grad_x50_layer" else model.blocks[0].attn
            for p in blk.parameters():
                if p.grad is not None:
                    p.grad.mul_(50.0 if name == "grad_x50_layer" else 3.0)
        return orig_prepare(params, *a, **k)

    def apply_update(params, optimizer, *a, **k):
        if name == "adam_v_div16" and Clock.step == S:
            for st in optimizer.state.values():
                if "exp_avg_sq" in st:
                    st["exp_avg_sq"].div_(16.0)
        if name == "exp_avg_swapped" and Clock.step == S:
            m0, m2 = (optimizer.state[_MODEL[0].blocks[i].attn.qkv.weight]["exp_avg"] for i in (0, 2))
            kept = m0.clone()
            m0.copy_(m2)
            m2.copy_(kept)
        if name == "adam_step_reset" and Clock.step == S:
            for st in optimizer.state.values():
                if "step" in st:
                    st["step"].zero_()
        out = orig_apply(params, optimizer, *a, **k)
        if name == "rank0_param_drift" and Clock.step == S:
            import torch.distributed as tdist
            if tdist.is_initialized() and tdist.get_rank() == 0:
                with torch.no_grad():
                    w = _MODEL[0].blocks[0].mlp.w_down.weight
                    w.add_(1e-3 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(S)))
        return out
    pstep.prepare_update, pstep.apply_update = prepare_update, apply_update

    _MODEL: list = []
    orig_init2 = tr.Transformer.__init__

    def init2(self, *a, **k):
        orig_init2(self, *a, **k)
        _MODEL[:] = [self]
    tr.Transformer.__init__ = init2

    if name == "no_decay_lr_zero":  # NOTE: on the class, as lr_x3
        from torch.optim.lr_scheduler import LambdaLR
        orig_zstep = LambdaLR.step

        def zstep(self, *aa, **kk):
            orig_zstep(self, *aa, **kk)
            if Clock.step >= S - 1:
                for g in self.optimizer.param_groups:
                    if g.get("name", "").startswith("no_decay"):
                        g["lr"] = 0.0
        LambdaLR.step = zstep

    if name == "lr_schedule_restart":  # NOTE: on the class, as lr_x3
        from torch.optim.lr_scheduler import LambdaLR
        orig_rstep = LambdaLR.step

        def rstep(self, *aa, **kk):
            orig_rstep(self, *aa, **kk)
            if Clock.step == S - 1:  # the step that sets step S's LR
                self.last_epoch = 0
                for g, lam, base in zip(self.optimizer.param_groups, self.lr_lambdas, self.base_lrs):
                    g["lr"] = base * lam(0)
        LambdaLR.step = rstep

    if name == "lr_x3":  # NOTE: on the class, not the instance: the scheduler's state_dict is pickled
        from torch.optim.lr_scheduler import LambdaLR
        orig_sstep = LambdaLR.step

        def sstep(self, *aa, **kk):
            orig_sstep(self, *aa, **kk)
            if Clock.step >= S - 1:
                for g in self.optimizer.param_groups:
                    g["lr"] *= 3.0
        LambdaLR.step = sstep

    if name in ("micro_batch_dropped", "micro_batch_twice"):  # step S's second backward skipped, or its first twice
        orig_backward, calls = torch.Tensor.backward, {}

        def backward(self, *aa, **kk):
            calls[Clock.step] = calls.get(Clock.step, 0) + 1
            if Clock.step == S and calls[S] == 2 and name == "micro_batch_dropped":
                return None
            if Clock.step == S and calls[S] == 1 and name == "micro_batch_twice":
                orig_backward(self, retain_graph=True)
            return orig_backward(self, *aa, **kk)
        torch.Tensor.backward = backward

    if name in ("wd_x10", "beta2_999", "adam_eps_big", "beta1_zero"):  # NOTE: on the class: the optimizer is built after this patch
        orig_ostep = torch.optim.AdamW.step

        def ostep(self, *aa, **kk):
            if Clock.step == S:
                for g in self.param_groups:
                    if name == "wd_x10":
                        g["weight_decay"] *= 10.0
                    elif name == "adam_eps_big":
                        g["eps"] = 1e-3
                    elif name == "beta1_zero":
                        g["betas"] = (0.0, g["betas"][1])
                    else:
                        g["betas"] = (g["betas"][0], 0.999)
            return orig_ostep(self, *aa, **kk)
        torch.optim.AdamW.step = ostep

    if name == "rank1_grad_x3":  # rank 1's buckets scaled inside DDP's reduction, before the all-reduce
        scale_rank_bucket(1, 3.0, lambda: Clock.step == S)

    step_patches.patch(name, Clock, S)  # the step's arithmetic (bench/doctor_eval/step_patches.py)

    if name == "resume_config_change":  # the check that would refuse the resume says nothing
        from checkpoint import checkpointer
        checkpointer.check_config = lambda *a, **k: []
    if f.resume:
        from checkpoint import state as state_mod
        orig_load = state_mod.TrainState.load

        def load(self, *a, **k):
            orig_load(self, *a, **k)
            Clock.step = self.step
            if name == "resume_lost_moments":
                self.optimizer.state.clear()
            if name == "resume_cursor_zero":
                self.loader.samples_consumed = 0
            if name == "resume_schedule_reset":
                self.scheduler.last_epoch = 0
                for g, lam, base in zip(self.scheduler.optimizer.param_groups, self.scheduler.lr_lambdas,
                                        self.scheduler.base_lrs):
                    g["lr"] = base * lam(0)
            if name == "resume_moe_bias_zero":
                for _, moe in self.model.moe_layers():
                    moe.bias_E.zero_()
        state_mod.TrainState.load = load


def scale_rank_bucket(rank: int, factor: float, when) -> None:
    """Every DDP model this process wraps gets a communication hook that multiplies `rank`'s gradient buckets by
    `factor` on their way into the all-reduce while when() holds (one rank's gradient changed before the
    reduction; tests/plant.py's reduce_rank1 too)."""
    import torch
    import torch.distributed as tdist

    import parallel.wrap as wrap
    import run.build
    orig_wrap = wrap.wrap_model

    def wrap_model(model, cfg, dist):
        w = orig_wrap(model, cfg, dist)

        def hook(state, bucket):
            buf = bucket.buffer()
            if dist.rank == rank and when():
                buf.mul_(factor)
            tdist.all_reduce(buf.div_(dist.world))
            fut = torch.futures.Future()
            fut.set_result(buf)
            return fut
        if hasattr(w, "register_comm_hook"):  # DDP (FSDP2 has no bucket to hook)
            w.register_comm_hook(None, hook)
        return w
    wrap.wrap_model = run.build.wrap_model = wrap_model


def launch(name: str | None, run_dir: str, overrides: list[str]) -> None:
    """Plant `name` (None: a clean run) in this process, then run train.py as a user would."""
    import model  # NOTE: the checkout this process imports must be the one whose train.py runs (and is patched)
    where = Path(model.__file__).resolve().parents[1]
    if where != ROOT:
        sys.exit(f"bench.doctor_eval.drills: the project is imported from {where}, not {ROOT}: "
                 f"run `python -m bench.doctor_eval.drills` from {ROOT}")
    if name:
        patch(name)
    sys.argv = [str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *overrides]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] != "launch":
        sys.exit("usage: python -m bench.doctor_eval.drills launch FAULT|none RUN_DIR [overrides...]")
    launch(None if sys.argv[2] == "none" else sys.argv[2], sys.argv[3], sys.argv[4:])
