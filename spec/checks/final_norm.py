"""loss_grad: the gradient the step's backward leaves on the final norm's gain is the gradient of the step's own
loss on the step's own batch — every step, the whole batch, in closed form; and every layer's output is finite
(its norm, over the whole batch: recorded as the layer's output RMS, StepRecord.spec.out_rms, the per-step series
that dates a forward fault the reference checks find only at their next step).

The final RMSNorm's gain γ meets the loss only through the logits, so from the last block's outputs h (kept
from the step's forward by a hook on the final norm) its gradient is exact arithmetic, with no model to rerun:

    x̂ = h / √(mean(h²) + ε)    logits = (γ ⊙ x̂)·Wᵀ    p = softmax(logits)    lse = log Σ exp(logits)
    ∂obj/∂logits = (world / N)·((1 + 2z·lse)·p − onehot(label))   on valid labels (N: the global count of them)
    ∂obj/∂γ = Σ_tokens (∂obj/∂logits · W) ⊙ x̂,   summed over micro-batches, averaged over ranks

This is the course's token normalisation (Σ loss, Σ count, one division), the z-loss and the labels the step
used, checked against what the optimizer receives — a hook that scales gradients, a wrong N, a micro-batch
dropped or counted twice. N is the check's own count of the step's valid labels (the data check holds them to the
specification's), summed over the ranks: never the count the step divided by. The tolerance bounds the rounding of
the sum by its terms' magnitudes: λ·(the stages' unit roundoffs) × Σ_tokens |∂obj/∂logits|₁·max|W|·‖x̂‖ (≥ ‖Σ_tokens
|∂obj/∂logits|·|W| ⊙ |x̂|‖, the same sum with every term's magnitude), so cancellation between tokens cannot make it
tight. The closed form is computed in FP32, the path's own precision, so the tolerance counts the roundings of both
sides. Under FP16 loss scaling the gain's gradient holds S·g until the unscale: S times both.
"""
from __future__ import annotations

import math
import time

import torch
from torch import Tensor

from spec.check import BACKWARD, BEFORE, FORWARD, STEP, Check, Kind, on_device
from spec.checks.forward import kind_of
from spec.reference import F64, IGNORE
from spec.tolerance import LAMBDA, U32, matmul_dtype, stage, u


class LossGradCheck(Check):
    name, layer, cadence, phase = "loss_grad", BACKWARD, STEP, BEFORE
    rank = 30
    doc = "the final norm gain's gradient against its closed form on the whole batch"
    kinds = {
        "mismatch": Kind("optim.gradient_mismatch", "the gradient is not the gradient of the step's loss: its "
                                                    "normalisation, the z-loss, the labels, a backward hook"),
        "scaled": Kind("optim.gradient_spike", "every gradient is scaled: a hook or a loss multiplier, the token "
                                               "count N, or the micro-batch / rank averaging"),
        "nonfinite": Kind("numerics.nonfinite", "a non-finite value from finite weights and inputs: the named "
                                                "layer's output (the first non-finite one) or the gradient",
                          layer=FORWARD),
        "rank": Kind("system.rank_divergence", "the ranks hold different gradients after the reduction"),
        "bypassed": Kind("numerics.mismatch", "the final norm did not run as its module on every micro-batch: the "
                                              "forward computes it otherwise (inline, a fused kernel), where no check "
                                              "of the module reads it", layer=FORWARD),
    }
    rank_kind = "rank"

    @classmethod
    def applies(cls, ctx) -> bool:
        # NOTE: a hook inside a compiled graph breaks it (and recompiles on every change of hooks)
        return not ctx.compiled

    def __init__(self, ctx):
        super().__init__(ctx)
        self.h: list[Tensor] = []
        self._hook = None

    def before_forward(self, s) -> None:
        model = self.ctx.model
        self.bypassed = False
        self.h, self.norms = [], {name: [] for name, _ in self.layers()}
        self.sizes = dict.fromkeys(self.norms, 0)
        self._hooks = [model.norm.register_forward_hook(lambda m, args, out: self.h.append(args[0].detach()))]
        for name, module in self.layers():
            self._hooks.append(module.register_forward_hook(self._norm(name)))

    def _norm(self, name: str):
        def keep(module, args, out):
            t0 = time.perf_counter()
            y = _tensor(out).detach()
            self.norms[name].append(torch.linalg.vector_norm(y, dtype=torch.float32))
            self.sizes[name] += y.numel()
            self.seconds += time.perf_counter() - t0  # the step's time_s.spec counts it (spec/monitor.py took)
        return keep

    def layers(self) -> list[tuple[str, torch.nn.Module]]:
        return output_layers(self.ctx.model)

    def before_update(self, s) -> None:
        for h in self._hooks:
            h.remove()
        if len(self.h) != len(s.micro):
            # NOTE: the model's math runs the final norm's module once a micro-batch (its hook keeps h); a forward that
            # computes it otherwise (inline, a fused kernel) runs what no check of the module reads, and this check
            # cannot rebuild the gain's gradient from it: a failure at this step, not a check skipped
            self.bypassed, self.h = True, []
            self.measure(torch.full((1,), math.inf, dtype=F64, device=self.ctx.model.norm.weight.device), 1.0,
                         "bypassed", where=["norm"])
            return
        # NOTE: every layer's output finite: the weights and the batch are (the continuity and data checks), so a
        # non-finite activation is the layer's fault. Not under FP16, whose range (6.5e4) a healthy forward can
        # exceed: its loss scaler skips that step.
        fp16 = getattr(self.ctx.recipe, "name", "") == "fp16"
        # NOTE: a norm is finite iff every element is (one reduction a layer, no mask): no healthy output comes near
        # where its squares leave FP32's range (an RMS of 3.4e38 over the element count, ≥ 1e16 here)
        model, c = self.ctx.model, self.ctx.model_cfg
        counts = [len(f) for f in self.norms.values()]  # a layer may run twice (recomputed)
        dev = model.norm.weight.device
        bad, rms = torch.zeros(len(counts), device=dev), torch.zeros(len(counts), dtype=F64, device=dev)
        if sum(counts):
            norms = torch.stack([x for f in self.norms.values() for x in f])
            owner = self._owner(tuple(counts), norms.device)
            if not fp16:
                bad = bad.to(norms.device).index_add_(0, owner, (~torch.isfinite(norms)).float())
            size = on_device([max(n, 1) for n in self.sizes.values()], norms.device, F64)
            rms = (torch.zeros_like(size).index_add_(0, owner, norms.double().square()) / size).sqrt()
        # every layer's output RMS over the whole batch, every step: the per-step series that dates a forward fault
        # the reference checks find only at their next step (doctor/conformance.py)
        self.extra["out_rms"] = (list(self.norms), rms)
        gamma, W = _full(model.norm.weight).detach().float(), _full(model.head.weight).detach().float()
        z, world = float(self.ctx.cfg.train.z_loss), self.ctx.dist.world
        # NOTE: per rank, unnormalised; the sums over the ranks are divided by N below (world/N per rank, then the
        # ranks' mean, as the step does)
        scale = float(self.ctx.scaler.scale) if self.ctx.scaler is not None else 1.0
        h = torch.cat([x.reshape(-1, x.shape[-1]) for x in self.h]).float()  # every micro-batch's tokens, (N, D)
        labels = torch.cat([mb.labels.reshape(-1) for mb in s.micro])
        valid = labels != IGNORE
        ms = torch.linalg.vector_norm(h, dim=-1, keepdim=True).square() / h.shape[-1]  # mean(h²), per token
        r = torch.rsqrt(ms + c.norm_eps)  # x̂ = r·h: r scales the (N, V) and (V, N) sides, x̂ is never formed
        logits = (h @ (W * gamma).T) * r  # (x̂ ⊙ γ)·Wᵀ, the gain folded into W: one (V, D) product, not an (N, D) one
        logp = torch.log_softmax(logits, -1)
        lse = logits[:, :1] - logp[:, :1]  # log Σ exp(logits) = logit − log p, at any one vocabulary entry
        # c = 1 + 2z·lse on a valid label, 0 on an ignored one (its row of ∂/∂logits is 0: the mask in the coefficient)
        coef = torch.where(valid[:, None], 1 + 2 * z * lse, 0.0)
        p = logp.exp()
        at = labels.clamp(min=0)[:, None]
        dl = (coef * p).scatter_add_(-1, at, -valid[:, None].to(p.dtype))  # c·p − onehot(label)
        # Σ_t (dl_t·W) ⊙ x̂_t = Σ_v W_v ⊙ ((r ⊙ dl)ᵀ·h)_v: the sum over tokens inside one (V, N)·(N, D) product
        want = (W * ((dl * r).T @ h)).sum(0, dtype=F64) * scale
        # the same sum with every term's magnitude, bounded per token by |∂/∂logits|₁·max|W|·‖x̂_t‖ (the triangle
        # inequality over tokens): |c·p − onehot|₁ = c·(1 − p_y) + |c·p_y − 1| (c·p ≥ 0 off the label), and
        # ‖x̂_t‖ = r_t·‖h_t‖ — N numbers, no (N, V) or (N, D) magnitude formed
        p_y = p.gather(-1, at)
        l1 = coef * (1 - p_y) + torch.where(valid[:, None], (coef * p_y - 1).abs(), 0.0)
        mag = (l1 * r * ms.sqrt()).sum().double() * math.sqrt(h.shape[-1]) * scale * W.abs().max().double()
        lo, hi = torch.aminmax(logits)
        lmax = torch.maximum(hi, -lo)
        n = valid.sum().to(F64).reshape(1)  # this rank's valid labels
        if world > 1:
            import torch.distributed as tdist
            sums = torch.cat([want, mag.reshape(1), n])
            tdist.all_reduce(sums)  # the ranks' sums, and N, in one collective
            want, mag, n = sums[:-2], sums[-2], sums[-1:]
        n = n.clamp(min=1).reshape(())
        want, mag = want / n, mag / n
        got = _full(model.norm.weight.grad).to(F64) if model.norm.weight.grad is not None else torch.zeros_like(want)
        u_in = u(matmul_dtype(self.ctx.recipe, self.ctx.cfg.parallel.param_dtype))
        n_tok = labels.numel()
        # NOTE: this closed form runs in FP32 too, the same stages as the training path: twice their rounding
        stages = (stage(c.d_model, U32) + stage(c.d_model, max(u_in, U32)) + stage(W.shape[0], U32) * (1 + lmax.double())
                  + stage(W.shape[0], max(u_in, U32)) + stage(n_tok, U32) + 4 * U32)
        rel = 2 * LAMBDA * stages
        zero = torch.zeros((), dtype=F64, device=want.device)
        # a non-finite input is upstream's miss, not this one's; a non-finite gradient from a finite one is FP16's
        # routine overflow under a loss scaler (the step skips), a miss without one
        nonfinite = on_device(0.0 if self.ctx.scaler is not None else torch.inf, want.device, F64)
        err = torch.where(~torch.isfinite(want).all(), zero,
                          torch.where(~torch.isfinite(got).all(), nonfinite, (got - want).norm()))
        tol = rel * mag + 1e-300
        self.place = (got, want, tol)
        layers = torch.where(bad.to(err.device) > 0, torch.inf, 0.0).double()
        names = list(self.kinds)
        kinds = on_device([float(names.index("nonfinite"))] * len(layers) + [0.0], err.device, F64)
        self.measure(torch.cat([layers, err.reshape(1)]), torch.cat([torch.full_like(layers, 0.5), tol.reshape(1)]),
                     kinds, where=[*self.norms, "norm.weight"])
        self.n_layers = len(layers)
        self.h = []

    def _owner(self, counts: tuple[int, ...], device) -> Tensor:
        """The layer of each kept sum (cached: the same every step but for a recomputed layer)."""
        if getattr(self, "_owners", (None,))[0] != (counts, str(device)):
            owner = on_device(torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)), device)
            self._owners = ((counts, str(device)), owner)
        return self._owners[1]

    def classify(self, i: int) -> str:
        if self.bypassed:
            return "bypassed"
        if i < self.n_layers:
            return "nonfinite"
        kind = kind_of(*self.place)
        return kind if kind in self.kinds else "mismatch"


def output_layers(model) -> list[tuple[str, torch.nn.Module]]:
    """The layers whose outputs the every-step checks read (finite here, full precision in spec/checks/precision.py),
    in forward order, by telemetry's names."""
    out = [("emb", model.tok_emb)]
    for i, b in enumerate(model.blocks):
        out += [(f"block{i}.attn", b.attn), (f"block{i}.mlp", b.mlp), (f"block{i}", b)]
    return out


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _tensor(out) -> Tensor:
    """A layer's output tensor: a block returns (x, moe), an MoE layer its MoEOutput (y first)."""
    return out[0] if isinstance(out, tuple) else out
