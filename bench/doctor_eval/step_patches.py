"""The patches of bench/doctor_eval/drills.py that change what the step computes: the attention kernel's call, the
token count and the z-loss coefficient the loss is given, the optimizer state's precision, the modules' own forwards
(norms, MLPs, the MoE layers' shared expert, balancing and expert weights), the batch and a resume; the optimizer's and
the scheduler's own (bench/doctor_eval/optim_patches.py) through it. drills.patch calls patch() after its own; each
fault's entry is in bench/doctor_eval/key.py.
"""
from __future__ import annotations

from bench.doctor_eval import optim_patches

# the faults this module plants (drills.patch hands every name over; the others are not this module's)
NAMES = ("attn_scale_d", "attn_bf16_kernel_sustained", "loss_all_positions", "exp_avg_sq_bf16_sustained",
         "z_loss_x10_sustained", "moe_shared_expert_off",
         "moe_bias_stale_loads", "moe_experts_swapped_between", "attn_window_16",
         "norm_gain_ignored", "weights_bf16_sustained", "moe_aux_dropped", "columns_truncated", "resume_step_count_off",
         "moe_gates_biased", "router_bf16_sustained", "attn_proj_out_transposed", "head_weight_detached",
         "swiglu_gelu_sustained", "attn_sees_next", "mlp_hidden_bf16_sustained",
         "moe_gates_unnormalised", "emb_dropout_sustained", "attn_heads_rolled",
         "attn_qk_fp16_sustained", "moe_expert_out_bf16_sustained", "first_tokens_swapped", "resume_cursor_ahead",
         "grad_accum_last_only", "attn_out_fp16_sustained", "norm_eps_1e4_sustained", "rope_theta_1pct_sustained",
         "moe_router_z_x10", "labels_last_ignored",
         "attn_v_bf16_sustained", "swiglu_halves_swapped", "attn_out_x098_sustained",
         "two_rows_swapped", "moe_shared_expert_x2")


def patch(name: str, clock, S: int) -> None:
    """Plant `name` in this process: `clock.step` is the optimizer step the run is at (the train batches served)."""
    optim_patches.patch(name, clock, S)
    if name not in NAMES:
        return
    if name in ("attn_scale_d", "attn_bf16_kernel_sustained", "attn_window_16", "attn_sees_next",
                "attn_qk_fp16_sustained", "attn_v_bf16_sustained"):
        _attention_kernel(name, clock, S)
    if name == "loss_all_positions":
        count_every_position(lambda: clock.step >= S)
    if name == "exp_avg_sq_bf16_sustained":
        _rounded_after_update(clock, S, lambda opt: [st["exp_avg_sq"] for st in opt.state.values()
                                                     if "exp_avg_sq" in st])
    if name in ("moe_shared_expert_off", "moe_bias_stale_loads", "moe_experts_swapped_between", "moe_aux_dropped",
                "norm_gain_ignored", "columns_truncated", "moe_gates_biased", "router_bf16_sustained",
                "attn_proj_out_transposed", "head_weight_detached", "weights_bf16_sustained", "swiglu_gelu_sustained",
                "mlp_hidden_bf16_sustained", "moe_gates_unnormalised", "emb_dropout_sustained", "attn_heads_rolled",
                "moe_expert_out_bf16_sustained", "first_tokens_swapped", "grad_accum_last_only", "attn_out_fp16_sustained",
                "norm_eps_1e4_sustained", "rope_theta_1pct_sustained", "moe_router_z_x10", "labels_last_ignored",
                "swiglu_halves_swapped", "attn_out_x098_sustained", "two_rows_swapped", "moe_shared_expert_x2"):
        _modules(name, clock, S)
    if name in ("resume_step_count_off", "resume_cursor_ahead"):
        from checkpoint import state as state_mod
        orig_load = state_mod.TrainState.load

        def load(self, *a, **k):
            orig_load(self, *a, **k)
            if name == "resume_cursor_ahead":  # the data cursor one batch further than saved
                self.loader.samples_consumed = self.loader._served(self.loader.samples_consumed + self.loader.batch_size)
                return
            for st in self.optimizer.state.values():
                if "step" in st:
                    st["step"] += 1
        state_mod.TrainState.load = load
    if name == "z_loss_x10_sustained":  # NOTE: train.py imports forward_backward by name: patched before it runs
        import optim.accumulate as acc
        orig_fb = acc.forward_backward

        def forward_backward(wrapped, micro, n_valid, z_coef, *aa, **kk):
            return orig_fb(wrapped, micro, n_valid, z_coef * 10.0 if clock.step >= S else z_coef, *aa, **kk)
        acc.forward_backward = forward_backward


def _rounded_after_update(clock, S: int, tensors) -> None:
    """After every update from S on, each tensor tensors(optimizer) gives rounded to bf16 in place (kept coarser than
    its FP32)."""
    import torch

    import precision.step as pstep
    orig_apply = pstep.apply_update

    def apply_update(params, optimizer, *a, **k):
        out = orig_apply(params, optimizer, *a, **k)
        if clock.step >= S:
            with torch.no_grad():
                for t in tensors(optimizer):
                    t.copy_(t.bfloat16())
        return out
    pstep.apply_update = apply_update


def count_every_position(when) -> None:
    """The step's token count (optim.accumulate.count_valid_tokens) counts every position, the ignored labels too,
    while when() holds (tests/plant.py's n_all_positions too). NOTE: train.py imports the function by name: this
    runs before it does."""
    import torch

    import optim.accumulate as acc
    orig_count = acc.count_valid_tokens

    def count(micro, device):
        if not when():
            return orig_count(micro, device)
        n = torch.tensor([float(sum(mb.labels.numel() for mb in micro))], dtype=torch.float64)
        return acc.all_reduce_sum(n.to(device))
    acc.count_valid_tokens = count


def _attention_kernel(name: str, clock, S: int) -> None:
    """One block's call of scaled_dot_product_attention computes something else from S on: block1's with the
    scores scaled by 1/d_head, block2's on q, k, v rounded to bf16 (its output back in theirs) or with a mask that
    lets each position see the next one, or block0's within a window of 16 positions or on q and k rounded to fp16."""
    import torch
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
            if name in ("attn_window_16", "attn_sees_next"):  # causal and 16 back at most | one position ahead
                T, S_ = q.shape[-2], k.shape[-2]
                t, j = torch.arange(T, device=q.device)[:, None], torch.arange(S_, device=q.device)[None, :]
                mask = (j <= t) & (t - j < 16) if name == "attn_window_16" else j <= t + 1
                kw = {**kw, "is_causal": False, "attn_mask": mask}
                return F.scaled_dot_product_attention(q, k, v, *a, **kw)
            if name == "attn_v_bf16_sustained":
                return F.scaled_dot_product_attention(q, k, v.bfloat16().to(v.dtype), *a, **kw)
            if name == "attn_qk_fp16_sustained":
                return F.scaled_dot_product_attention(q.half().to(q.dtype), k.half().to(k.dtype), v, *a, **kw)
            return F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), *a, **kw).to(q.dtype)
    att.F = Functional()
    orig_init = tr.Transformer.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        attn = self.blocks[{"attn_scale_d": 1, "attn_bf16_kernel_sustained": 2, "attn_window_16": 0, "attn_sees_next": 2,
                            "attn_qk_fp16_sustained": 0,
                            "attn_v_bf16_sustained": 0}[name]].attn

        def enter(mod, args):
            inside["on"] = clock.step >= S

        def leave(mod, args, out):
            inside["on"] = False
        attn.register_forward_pre_hook(enter)
        attn.register_forward_hook(leave)
    tr.Transformer.__init__ = init


def _modules(name: str, clock, S: int) -> None:
    """block3's shared expert zeroed, its auxiliary loss dropped or its router logits in bf16, block2's MLP norm
    without its gain or its attention projection transposed, block1's scores biased or its bias moved by the last
    step's loads, block1's experts 0 and 1 swapped in place before step S's forward (outside any update), the head's
    tied weight detached, block2's MLP weights kept in bf16, or step S's batch one position shorter; block0's SwiGLU
    gated by GELU, block2's MLP hidden activation rounded to bf16, block1's top-k gates left unnormalised, or
    dropout on the embedding's output; block1's attention heads rolled by one before its output projection, block1's
    expert outputs rounded to bf16, step S's rows with their first two tokens swapped, or step S's gradient cleared
    between its micro-batches (the last one's alone); block2's attention output rounded to fp16 before its projection,
    block1's attention norm at ε 1e-4, the RoPE tables at θ ×1.01, block1's router z-loss ×10, or step S's last target
    of every row ignored."""
    import torch

    from model import transformer as tr
    built: list = []
    orig_init = tr.Transformer.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        built[:] = [self]
        if name == "moe_shared_expert_off":
            self.blocks[3].mlp.shared.register_forward_hook(
                lambda m, args, out: torch.zeros_like(out) if clock.step >= S else None)
        if name == "moe_aux_dropped":
            self.blocks[3].mlp.register_forward_hook(
                lambda m, args, out: out._replace(aux_loss=out.aux_loss * 0.0) if clock.step >= S else None)
        if name == "norm_gain_ignored":
            norm = self.blocks[2].mlp_norm
            norm.register_forward_hook(lambda m, args, out: torch.nn.functional.rms_norm(
                args[0], m.normalized_shape, None, m.eps) if clock.step >= S else None)
        if name == "moe_gates_biased":
            moe = self.blocks[1].mlp
            orig_scores = moe.scores
            moe.scores = lambda logits: orig_scores(logits) + moe.bias_E if clock.step >= S else orig_scores(logits)
        if name == "router_bf16_sustained":
            moe = self.blocks[3].mlp
            orig_logits = moe.router_logits
            moe.router_logits = lambda x: (orig_logits(x).bfloat16().float() if clock.step >= S
                                           else orig_logits(x))
        if name in ("attn_proj_out_transposed", "head_weight_detached"):
            lin = self.blocks[2].attn.proj_out if name == "attn_proj_out_transposed" else self.head
            orig_fwd = lin.forward

            def forward(x, lin=lin, orig_fwd=orig_fwd):
                if clock.step < S:
                    return orig_fwd(x)
                w = lin.weight.T if name == "attn_proj_out_transposed" else lin.weight.detach()
                return torch.nn.functional.linear(x, w)
            lin.forward = forward
        if name in ("swiglu_gelu_sustained", "mlp_hidden_bf16_sustained", "swiglu_halves_swapped"):
            mlp = self.blocks[0 if name == "swiglu_gelu_sustained" else 2].mlp
            orig_mlp = mlp.forward

            def mlp_forward(x, mlp=mlp, orig_mlp=orig_mlp):
                if clock.step < S:
                    return orig_mlp(x)
                gate, up = mlp.w_gate_up(x).chunk(2, dim=-1)
                if name == "swiglu_halves_swapped":  # the fused projection read as (up, gate), not (gate, up)
                    gate, up = up, gate
                if mlp.limit is not None:
                    gate, up = gate.clamp(max=mlp.limit), up.clamp(-mlp.limit, mlp.limit)
                if name == "swiglu_gelu_sustained":
                    return mlp.w_down(torch.nn.functional.gelu(gate) * up)
                h = torch.nn.functional.silu(gate) * up
                return mlp.w_down(h.bfloat16().to(up.dtype) if name == "mlp_hidden_bf16_sustained" else h)
            mlp.forward = mlp_forward
        if name == "moe_gates_unnormalised":  # the module's own config swapped: the run's config unchanged
            from dataclasses import replace
            moe = self.blocks[1].mlp
            own, off = moe.cfg, replace(moe.cfg, norm_topk=False)
            moe.register_forward_pre_hook(lambda m, args: setattr(m, "cfg", off if clock.step >= S else own))
        if name == "emb_dropout_sustained":
            self.tok_emb.register_forward_hook(lambda m, args, out: torch.nn.functional.dropout(out, 0.1, training=True)
                                               if clock.step >= S and torch.is_grad_enabled() else None)
        if name == "attn_heads_rolled":  # a layout bug: head h's output where head h + 1's belongs
            H = self.blocks[1].attn.n_heads
            self.blocks[1].attn.proj_out.register_forward_pre_hook(
                lambda m, args: (args[0].unflatten(-1, (H, -1)).roll(1, dims=-2).flatten(-2),) if clock.step >= S
                else None)
        if name == "moe_expert_out_bf16_sustained":
            self.blocks[1].mlp.experts.register_forward_hook(
                lambda m, args, out: out.bfloat16().to(out.dtype) if clock.step >= S else None)
        if name == "grad_accum_last_only":  # .grad cleared before step S's second micro-batch's forward
            seen = {"n": 0}

            def cleared(m, args):
                if clock.step == S and torch.is_grad_enabled():
                    seen["n"] += 1
                    if seen["n"] == 2:
                        for p in m.parameters():
                            p.grad = None
            self.register_forward_pre_hook(cleared)
        if name == "attn_out_fp16_sustained":
            self.blocks[2].attn.proj_out.register_forward_pre_hook(
                lambda m, args: (args[0].half().to(args[0].dtype),) if clock.step >= S else None)
        if name == "norm_eps_1e4_sustained":
            norm = self.blocks[1].attn_norm
            norm.register_forward_pre_hook(lambda m, args: setattr(m, "eps", 1e-4 if clock.step >= S else 1e-5))
        if name == "rope_theta_1pct_sustained":  # the model's tables recomputed at S (its buffers, not the config)
            from model.rope import rope_tables
            model = self
            c = self.cfg
            cos, sin = rope_tables(c.seq_len, c.head_dim, c.rope_theta * 1.01)

            def swap(m, args):
                if clock.step >= S and not getattr(m, "_swapped", False):
                    m.rope_cos.copy_(cos.to(m.rope_cos.device))
                    m.rope_sin.copy_(sin.to(m.rope_sin.device))
                    m._swapped = True
            model.register_forward_pre_hook(swap)
        if name == "moe_router_z_x10":  # the module's own config: the run's coefficient unchanged
            from dataclasses import replace
            moe = self.blocks[1].mlp
            own, on = moe.cfg, replace(moe.cfg, router_z_coef=10 * moe.cfg.router_z_coef)
            moe.register_forward_pre_hook(lambda m, args: setattr(m, "cfg", on if clock.step >= S else own))
        if name == "attn_out_x098_sustained":
            self.blocks[1].attn.register_forward_hook(lambda m, args, out: out * 0.98 if clock.step >= S else None)
        if name == "moe_shared_expert_x2":
            self.blocks[3].mlp.shared.register_forward_hook(lambda m, args, out: out * 2.0 if clock.step >= S else None)
        if name == "moe_bias_stale_loads":
            moe, last = self.blocks[1].mlp, {}
            orig_ub = moe.update_bias

            def update_bias(load, skipped=False):
                use = last.get("load", load) if clock.step >= S else load
                last["load"] = load.clone()
                return orig_ub(use, skipped)
            moe.update_bias = update_bias
    tr.Transformer.__init__ = init
    if name == "weights_bf16_sustained":
        _rounded_after_update(clock, S, lambda opt: list(built[0].blocks[2].mlp.parameters()))
    if name in BATCH_EDITS:
        _at_batch(clock, S, lambda out: BATCH_EDITS[name](out, built))


def _two_rows_swapped(out, built):  # rows 0 and 1's content swapped, their ids kept
    out.tokens[[0, 1]] = out.tokens[[1, 0]]
    out.labels[[0, 1]] = out.labels[[1, 0]]


def _last_target_ignored(out, built):  # each row's last label that has a target
    valid = out.labels != -100
    last = valid.shape[1] - 1 - valid.flip(1).int().argmax(1)
    rows = valid.any(1).nonzero()[:, 0]
    out.labels[rows, last[rows]] = -100


def _first_tokens_swapped(out, built):
    out.tokens[:, [0, 1]] = out.tokens[:, [1, 0]]


def _columns_truncated(out, built):
    from dataclasses import fields
    return type(out)(**{f.name: (getattr(out, f.name)[:, :-1] if getattr(out, f.name) is not None
                                 and getattr(out, f.name).dim() == 2 else getattr(out, f.name)) for f in fields(out)})


def _experts_swapped(out, built):  # drills' Loader.next counted this batch: step S's, before its forward
    import torch
    with torch.no_grad():
        w = built[0].blocks[1].mlp.experts.w_down
        kept = w[0].clone()
        w[0].copy_(w[1])
        w[1].copy_(kept)


# the faults that edit step S's batch (or act when it is served): name -> edit(batch, [model]) -> a batch or None
BATCH_EDITS = {"two_rows_swapped": _two_rows_swapped, "labels_last_ignored": _last_target_ignored,
               "first_tokens_swapped": _first_tokens_swapped, "columns_truncated": _columns_truncated,
               "moe_experts_swapped_between": _experts_swapped}


def _at_batch(clock, S: int, edit) -> None:
    """Loader.next gives step S's train batch through edit (its result, or the batch it edited in place)."""
    from data import loader as loader_mod
    orig_next = loader_mod.Loader.next

    def next_(self):
        out = orig_next(self)
        if self.split == "train" and clock.step == S:
            out = edit(out) or out
        return out
    loader_mod.Loader.next = next_
