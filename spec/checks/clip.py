"""clip: the gradient norm the step measured is the backward's gradient's, and the coefficient it applies is the
configured policy's:

    fixed    coef = min(1, c / (‖g‖ + ε)),  c = train.max_grad_norm (null or 0: 1), ε = 1e-6
    zscore   the z-score policy's threshold from its state before this step (optim/zclip.py documents it)

‖g‖ is measured here again from the gradients as the backward left them (before_update: after every drill and
lever that may act there, before the unscale and the clip), each tensor's norm in FP32 summed in FP64: its
relative error stays below λ·(√n + 2)·u32 for the largest tensor's n (a vectorised sum's error grows as
√n in the probabilistic model), which is the tolerance on the comparison. A norm that differs means the
gradient changed between the backward and the clip; a coefficient that differs, the policy or its threshold.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as tdist

from spec.check import BEFORE, STEP, UPDATE, Check, Kind, _arange, on_device
from spec.checks.state import module_state
from spec.tolerance import LAMBDA, U32

EPS = 1e-6  # the clip's ε in c / (‖g‖ + ε): part of the policy's definition (optim/clip.py)


def _is_shard(g) -> bool:
    return hasattr(g, "placements") and any(type(p).__name__ == "Shard" for p in g.placements)


class ClipCheck(Check):
    name, layer, cadence, phase = "clip", UPDATE, STEP, BEFORE
    rank = 40
    doc = "the measured gradient norm and the applied clip coefficient against the configured policy"
    kinds = {
        "gradient": Kind("optim.gradient_spike", "the gradient changed between the backward and the clip"),
        "coef": Kind("optim.settings", "the clip coefficient is not the configured policy's (its threshold)"),
    }

    def before_update(self, s) -> None:
        params = [p for _, p in module_state(self.ctx.model)[0] if p.grad is not None]
        grads = [p.grad for p in params]
        sharded = [_is_shard(g) for g in grads]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        dev = local[0].device
        norms = torch.stack(torch._foreach_norm(local, 2)).double()
        if any(sharded):  # FSDP2: a shard's square summed over the ranks, a replicated tensor's counted once
            shard = on_device(sharded, dev, torch.bool)
            sq_shard = torch.where(shard, norms.square(), 0.0).sum()
            tdist.all_reduce(sq_shard)
            sq = sq_shard + torch.where(shard, 0.0, norms.square()).sum()
        else:
            sq = norms.square().sum()
        scale = float(self.ctx.scaler.scale) if self.ctx.scaler is not None else 1.0  # FP16: S·g until the unscale
        self.norm = sq.sqrt() / scale
        # each parameter's gradient norm, every step: the series that dates a gradient fault the reference checks find
        # only at their next step (spec/checks/backward.py); a shard's norm is not its tensor's
        if not any(sharded):
            self.extra["param_grad_norm"] = ([self.ctx.names.get(id(p), "?") for p in params], norms / scale)
        self.n_max = max(g.numel() for g in local)
        self.policy = self.policy_threshold()

    def policy_threshold(self):
        """What the policy decides from, before this step: the fixed c, or the z-score policy's state (its running
        count, mean and variance) with its settings from the config (train.zscore), not from the policy built."""
        pol = self.ctx.clip_policy
        if pol is None:
            return None
        zc = self.ctx.cfg.train.zscore
        return {"count": pol.count, "mean": pol.mean, "var": pol.var, "warmup": zc.warmup,
                "z_thresh": float(zc.z_thresh), "eps": pol.eps}

    def coef(self, norm: torch.Tensor) -> torch.Tensor:
        c, one = self.ctx.max_grad_norm, torch.ones((), dtype=torch.float64, device=norm.device)
        st = self.policy
        if st is not None:  # z-score: warm-up on the fixed c, then μ + z_thresh·σ for an outlier only
            if st["count"] >= st["warmup"]:
                g = float(norm)  # NOTE: the policy reads the norm on the host itself (optim/zclip.py)
                std = math.sqrt(st["var"])
                z = (g - st["mean"]) / (std + st["eps"])
                thr = st["mean"] + st["z_thresh"] * std if z > st["z_thresh"] else None
                return one * (min(1.0, thr / (g + st["eps"])) if thr is not None and math.isfinite(g) else 1.0)
            c = c if c else None
            eps = st["eps"]
        else:
            eps = EPS
        if not c or c <= 0:
            return one
        return torch.where(norm.isfinite(), (c / (norm + eps)).clamp(max=1.0), one)

    def after_clip(self, s) -> None:
        upd = s.update
        spec = self.coef(self.norm)
        self.ctx.coef_spec, self.ctx.norm_finite = spec, self.norm.isfinite()
        rel = LAMBDA * (math.sqrt(self.n_max) + 2) * U32
        rel_coef = rel + LAMBDA * 4 * U32  # the norm's error carried into c / (‖g‖ + ε), and that division's own
        finite = self.norm.isfinite()
        zero = torch.zeros((), dtype=torch.float64, device=self.norm.device)
        applied = upd.coef.double().to(spec.device)
        # NOTE: the optimizer check's gradient is coef_spec·g₀: where either coefficient clips, the applied one may be
        # off it by as much as this check allows (the step sums its norm in FP32, this check in FP64), and that
        # difference is in the moments the optimizer wrote
        self.ctx.coef_tol = torch.where((spec < 1) | (applied < 1), rel_coef, 0.0)
        err = torch.stack([torch.where(finite, (upd.norm.double() - self.norm).abs(), zero),
                           torch.where(finite, (applied - spec).abs(), zero)])
        tol = torch.stack([rel * self.norm.abs(), rel_coef * spec]) + 1e-300
        self.measure(err, tol, _arange(2, err.device), where=["norm", "coef"])  # the kinds: gradient, coef
