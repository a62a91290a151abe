"""Mixture-of-experts MLP: FP32 router, top-k selection with an aux-loss-free bias, dropless
dispatch to SwiGLU experts, Switch balancing loss, router z-loss, and the anticipatory-routing seam.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from model.config import MoEConfig
from model.grouped_gemm import grouped_mm
from model.rope import at_least_fp32
from model.swiglu import SwiGLU, swiglu_fused, swiglu_fused_counted


class MoEOutput(NamedTuple):
    y: Tensor              # same shape as the input
    aux_loss: Tensor       # scalar: balance_coef·L_bal + router_z_coef·z_router, with grad
    balance_loss: Tensor   # scalar L_bal, with grad
    router_z: Tensor       # scalar z_router, with grad
    load_E: Tensor         # (E,) fp32 detached: assignments of valid tokens per expert (sums to k·n_valid)
    route_ids_Nk: Tensor   # (N, k) int64: the experts each token went to
    # (E,) fp32 detached: Σ over the valid assignments of expert e of its output row's mean square, before
    # the gate weight (÷ load_E → the expert's output mean square; 0 where load_E is 0)
    out_sq_E: Tensor | None = None


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights: w_gate_up (E, 2H, D), w_down (E, D, H).

    Two ways to run them, equal in value (tests/test_moe_grouped.py):
      grouped  two `torch._grouped_mm` calls over every expert at once, the group boundaries given as
               a device tensor (cumulative counts): no host sync, static shapes, so torch.compile
               traces one graph whatever the load pattern;
      loop     the readable reference: one matmul pair per expert on its rows, split sizes as Python
               ints (one host sync per MoE layer). Used where _grouped_mm does not run (a device or dtype
               without the kernel), whenever a precision recipe overrides `linear` (FP8), and with
               `grouped = False`.
    """

    def __init__(self, n_experts: int, d_model: int, hidden: int, limit: float | None):
        super().__init__()
        self.limit = limit
        self.w_gate_up = nn.Parameter(torch.empty(n_experts, 2 * hidden, d_model))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.record_stats = False
        # True: the grouped GEMM wherever it runs, eager and compiled; False: the loop (the reference).
        # NOTE: the two differ in the last bit (another summation blocking), so a run must keep one path
        # throughout: _probe's answer must not depend on the grad mode of the first call (see there).
        self.grouped = True
        self.clamp_hits = torch.zeros((), dtype=torch.int64)
        self.clamp_total = torch.zeros((), dtype=torch.int64)

    def init_weights(self, std: float, resid_std: float) -> None:
        nn.init.normal_(self.w_gate_up, std=std)
        nn.init.normal_(self.w_down, std=resid_std)  # writes into the residual stream

    def linear(self, x: Tensor, w: Tensor) -> Tensor:
        """One expert matmul; a precision recipe overrides only this (precision/fp8_linear.py)."""
        return F.linear(x, w)

    def forward(self, x_MD: Tensor, counts_E: Tensor | list[int]) -> Tensor:
        """x_MD holds the tokens sorted by expert, counts_E[e] rows for expert e."""
        # NOTE: `linear` overridden (by a subclass or on the instance): only the loop calls it
        plain = type(self).linear is GroupedExperts.linear and "linear" not in self.__dict__
        dev = x_MD.device.type
        # NOTE: under autocast the GEMMs take the autocast dtype, as F.linear's do in the loop; CUDA's
        # grouped kernel exists for bf16 only, so an fp32 x_MD there would always fall back to the loop.
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x_MD.dtype
        # WARN: the kernel wants every row stride a multiple of 16 bytes (bf16 with D or H not a multiple of 8,
        # fp32 not of 4 raised "strides should be multiple of 16 bytes"): such shapes take the loop
        aligned = all(n * torch.finfo(dtype).bits % 128 == 0 for n in self.w_down.shape[1:])
        if self.grouped and plain and aligned and grouped_mm_runs(x_MD, dtype):
            return self._grouped(x_MD.to(dtype), torch.as_tensor(counts_E, device=x_MD.device))
        return self._loop(x_MD, counts_E if isinstance(counts_E, list) else counts_E.tolist())

    def _grouped(self, x_MD: Tensor, counts_E: Tensor) -> Tensor:
        offs_E = counts_E.cumsum(0).to(torch.int32)  # end row of each expert's group
        w_gate_up = self.w_gate_up.to(x_MD.dtype)  # NOTE: what F.linear does under autocast (x_MD is cast)
        # NOTE: transposed views: grouped_mm computes x_m @ w_e with w_e (D, 2H); F.linear(x, W) = x @ Wᵀ
        gate_up_MX = grouped_mm(x_MD, w_gate_up.transpose(1, 2), offs_E)
        if self.record_stats:
            h_MH, self.clamp_hits = swiglu_fused_counted(gate_up_MX, self.limit)
            self.clamp_total = torch.tensor(h_MH.numel(), dtype=torch.int64, device=x_MD.device)
        else:
            h_MH = swiglu_fused(gate_up_MX, self.limit)
        return grouped_mm(h_MH, self.w_down.to(h_MH.dtype).transpose(1, 2), offs_E)

    def _loop(self, x_MD: Tensor, counts: list[int]) -> Tensor:
        outs, hits, total = [], 0, 0
        # WARN: every expert runs, even on zero rows (an empty matmul): then every parameter is in
        # the autograd graph every step, as DDP / FSDP require without find_unused_parameters.
        for e, x_mD in enumerate(torch.split(x_MD, counts)):
            gate_up_mX = self.linear(x_mD, self.w_gate_up[e])
            if self.record_stats:
                h_mH, hits_e = swiglu_fused_counted(gate_up_mX, self.limit)
                hits, total = hits + hits_e, total + h_mH.numel()
            else:
                h_mH = swiglu_fused(gate_up_mX, self.limit)
            outs.append(self.linear(h_mH, self.w_down[e]))
        if self.record_stats:
            self.clamp_hits = torch.as_tensor(hits, dtype=torch.int64, device=x_MD.device)
            self.clamp_total = torch.tensor(total, dtype=torch.int64, device=x_MD.device)
        return torch.cat(outs)


_GROUPED_OK: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_runs(x: Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether torch._grouped_mm runs forward and backward for x's device type and dtype, or `dtype` (the
    autocast one): probed once on a tiny problem, eagerly even when first asked inside a trace; CUDA's
    kernel wants bf16 on recent GPUs, CPU runs fp32 and bf16."""
    key = (x.device.type, dtype or x.dtype)
    if key not in _GROUPED_OK:
        _probe(key, x.device, key[1])
    return _GROUPED_OK[key]


@torch.compiler.disable  # NOTE: run eagerly even when first reached inside a trace
def _probe(key, device, dtype) -> None:
    ok = hasattr(torch, "_grouped_mm")
    if ok:
        try:
            # WARN: grad on, whatever the caller's mode: first reached under no_grad (an eval, a routing-only
            # forward after a resume), the backward probe failed and the process ran the loop from then on,
            # while the run it resumed had run grouped — a resume that was not bit-identical (1-ulp
            # differences in the expert gradients, then in exp_avg).
            # NOTE: under the probe's own saved-tensor hooks: first reached inside an activation checkpoint, the
            # probe's saved tensors would count as the block's, and the recompute (the probe cached) saves fewer
            with torch.inference_mode(False), torch.enable_grad(), \
                    torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                a = torch.ones(4, 16, device=device, dtype=dtype, requires_grad=True)
                w = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
                y = torch._grouped_mm(a, w, offs=torch.tensor([1, 4], device=device, dtype=torch.int32))
                torch.autograd.grad(y, (a, w), torch.ones_like(y))
        except (RuntimeError, NotImplementedError, TypeError):
            ok = False
    _GROUPED_OK[key] = ok


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig, d_model: int, limit: float | None):
        super().__init__()
        self.cfg = cfg
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(d_model, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, d_model, cfg.expert_hidden, limit)
        self.shared = SwiGLU(d_model, cfg.expert_hidden, limit) if cfg.shared_expert else None
        # DeepSeek-V3 aux-loss-free balancing: a per-expert bias that shifts *selection* only.
        # NOTE: persistent, so it is saved in checkpoints; it is training state, not a constant.
        self.register_buffer("bias_E", torch.zeros(cfg.n_experts, dtype=torch.float32))

    def init_weights(self, std: float, resid_std: float) -> None:
        nn.init.normal_(self.router.weight, std=std)
        self.experts.init_weights(std, resid_std)
        if self.shared is not None:
            self.shared.init_weights(std, resid_std)

    def router_logits(self, x_ND: Tensor) -> Tensor:
        # WARN: FP32 even under autocast: a bf16 softmax over E logits rounds near-ties, and the
        # top-k choice flips between otherwise identical steps (DeepSeek-V3 keeps the gate in FP32).
        dtype = at_least_fp32(x_ND.dtype)
        with torch.autocast(device_type=x_ND.device.type, enabled=False):
            return F.linear(x_ND.to(dtype), self.router.weight.to(dtype))

    def scores(self, logits_NE: Tensor) -> Tensor:
        return logits_NE.softmax(-1) if self.cfg.score == "softmax" else logits_NE.sigmoid()

    def top_ids(self, scores_NE: Tensor) -> Tensor:
        """(N, k) int64 expert ids. The bias moves which experts win, never how much they weigh
        (DeepSeek-V3 §2.1.2)."""
        return torch.topk(scores_NE.detach() + self.bias_E, self.top_k, dim=-1).indices

    def select(self, x: Tensor) -> Tensor:
        """(N, k) the expert ids forward() would choose for x (..., D): the router alone, no expert runs
        (the routing-only forward's last MoE layer)."""
        return self.top_ids(self.scores(self.router_logits(x.reshape(-1, x.shape[-1]))))

    def forward(self, x: Tensor, route_ids_Nk: Tensor | None = None, valid_N: Tensor | None = None) -> MoEOutput:
        """x: (..., D). route_ids_Nk, when given, replaces top-k selection (anticipatory routing).

        valid_N: (N,) bool, the positions whose label counts (labels != IGNORE_INDEX); None = all.
        Every position is routed and dispatched (its output is defined), but only valid ones enter the
        expert loads, the Switch loss and the router z-loss: padding is no traffic to balance
        (in the quickstart data 41 % of positions are padding, and they all pile on the same experts).
        """
        N, E, k = x[..., 0].numel(), self.n_experts, self.top_k
        x_ND = x.reshape(N, x.shape[-1])
        logits_NE = self.router_logits(x_ND)
        scores_NE = self.scores(logits_NE)

        if route_ids_Nk is None:
            route_ids_Nk = self.top_ids(scores_NE)
        elif route_ids_Nk.shape != (N, k):
            raise ValueError(f"route_ids shape {tuple(route_ids_Nk.shape)} != (N, model.moe.top_k) = {(N, k)}")
        else:
            route_ids_Nk = route_ids_Nk.long()
        # Gates come from the *current* scores at the chosen ids, so the router always gets gradient.
        gates_Nk = scores_NE.gather(-1, route_ids_Nk)
        # NOTE: never at k = 1: the renormalised gate would be p/p = 1, a constant, and the router would get
        # no gradient from the LM loss (Switch multiplies the expert output by the raw p instead).
        if k > 1 and (self.cfg.norm_topk or self.cfg.score == "sigmoid"):
            gates_Nk = gates_Nk / gates_Nk.sum(-1, keepdim=True)

        # Dropless dispatch: sort the N·k assignments by expert, run each expert on its rows.
        ids_M = rearrange(route_ids_Nk, "n k -> (n k)")
        order_M = torch.argsort(ids_M, stable=True)
        token_M = order_M // k
        # NOTE: index_add, not bincount: a static output shape, so torch.compile needs no recompile per load
        counts_E = torch.zeros(E, dtype=torch.int64, device=x.device).index_add_(0, ids_M, torch.ones_like(ids_M))
        out_MD = self.experts(x_ND[token_M], counts_E)
        weighted_MD = out_MD.to(gates_Nk.dtype) * rearrange(gates_Nk, "n k -> (n k) 1")[order_M]
        # NOTE: the k contributions of a token are summed in (at least) FP32, like every reduction.
        y_ND = torch.zeros(N, x.shape[-1], dtype=gates_Nk.dtype, device=x.device)
        y_ND = y_ND.index_add(0, token_M, weighted_MD)
        if self.shared is not None:
            y_ND = y_ND + self.shared(x_ND)

        if valid_N is None:
            load_E, n = counts_E.detach().to(torch.float32), N
            valid_N, valid_M = torch.ones(N, dtype=torch.bool, device=x.device), None
        else:
            valid_N = valid_N.reshape(N)
            valid_M = valid_N.repeat_interleave(k)  # (n k) order, like ids_M
            load_E = torch.zeros(E, dtype=torch.float32, device=x.device).index_add_(0, ids_M, valid_M.float())
            n = valid_N.sum()
        out_sq_E = self._out_sq(out_MD, ids_M[order_M], valid_M[order_M] if valid_M is not None else None)
        n_f = torch.as_tensor(n, dtype=logits_NE.dtype, device=x.device).clamp(min=1)  # all-padding: losses 0
        # Switch balance loss: E·Σ_e f_e·P_e is 1 at uniform routing; f carries no gradient, P does.
        probs_NE = scores_NE if self.cfg.score == "softmax" else scores_NE / scores_NE.sum(-1, keepdim=True)
        f_E = load_E.to(probs_NE.dtype) / (n_f * k)
        # NOTE: where, not multiply-by-mask: a non-finite score at a padding position must not become NaN
        P_E = torch.where(valid_N[:, None], probs_NE, 0.0).sum(0) / n_f
        balance = E * (f_E * P_E).sum()
        # Router z-loss (ST-MoE): keeps router logits small so the softmax stays out of saturation.
        router_z = torch.where(valid_N, torch.logsumexp(logits_NE, dim=-1).square(), 0.0).sum() / n_f
        aux = self.cfg.balance_coef * balance + self.cfg.router_z_coef * router_z
        return MoEOutput(y_ND.to(x.dtype).reshape(x.shape), aux, balance, router_z, load_E, route_ids_Nk,
                         out_sq_E)

    @torch.no_grad()
    def _out_sq(self, out_MD: Tensor, ids_M: Tensor, valid_M: Tensor | None) -> Tensor:
        """(E,) Σ over valid rows of each expert of ‖row‖²/D: read from the expert output already computed
        (whichever path produced it, after any forward hook on self.experts), one norm per row."""
        acc = at_least_fp32(out_MD.dtype)
        ms_M = torch.linalg.vector_norm(out_MD.detach(), dim=-1, dtype=acc).square() / out_MD.shape[-1]
        if valid_M is not None:
            # NOTE: where, not multiply-by-mask: a padding row's inf must not reach a valid expert's sum as NaN
            ms_M = torch.where(valid_M, ms_M, 0.0)
        return torch.zeros(self.n_experts, dtype=acc, device=out_MD.device).index_add_(0, ids_M, ms_M)

    @torch.no_grad()
    def update_bias(self, load_E: Tensor, skipped: bool | Tensor = False) -> None:
        """DeepSeek-V3: bias_e += gamma · sign(mean(load) - load_e).

        The caller passes the load summed over micro-batches and all-reduced across ranks, so every
        rank applies the same update and the buffers never diverge. `skipped`: the optimizer step was
        skipped, so the bias stays too; a 0-d device flag is obeyed on the device (nothing read).
        """
        gamma = self.cfg.bias_update_speed
        if gamma == 0 or (isinstance(skipped, bool) and skipped):
            return
        load_E = load_E.to(self.bias_E)
        moved_E = self.bias_E + gamma * torch.sign(load_E.mean() - load_E)
        # NOTE: a select, not a multiply by the flag: a kept bias keeps its bits (-0 + 0·d is +0)
        self.bias_E.copy_(torch.where(skipped.bool(), self.bias_E, moved_E) if torch.is_tensor(skipped) else moved_E)
