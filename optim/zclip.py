"""Adaptive z-score gradient clipping (ZClip, Kumar et al. 2025, arXiv 2504.02507): clip the global grad
norm g only when it is an outlier against its own recent history.

    warm-up (the first `warmup` finite norms): no z-score; the fixed threshold train.max_grad_norm
        applies (null: none); at its end μ = mean, σ² = population variance of those norms
    then, per step:  z = (g − μ) / (σ + ε)
        z > z_thresh:   clip to  g* = μ + z_thresh · σ        (coef = g*/g)
        else:           g* = g                                (coef = 1)
        μ ← α·μ + (1 − α)·g*            σ² ← α·σ² + (1 − α)·(g* − μ)²    (μ the updated mean)

NOTE: the EMA takes the clipped norm g*, not g: a spike must not inflate the baseline it is judged
against (ZClip does the same). A non-finite norm changes nothing (the step is skipped anyway). A step the
guard vetoes still updates the EMA with its clipped norm: bounded by μ + z·σ, so it cannot run away.
Its state (count, μ, σ², warm-up sums) goes into checkpoints as a TrainState extra, so a resumed run
clips exactly as the uninterrupted one.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from optim.clip import scale_grads_
from optim.config import ZScoreConfig



class ZScoreClip:
    def __init__(self, cfg: ZScoreConfig, eps: float = 1e-6):
        """cfg: train.zscore, checked by the schema (optim/config.py)."""
        self.alpha, self.z_thresh, self.warmup, self.eps = float(cfg.alpha), float(cfg.z_thresh), cfg.warmup, float(eps)
        self.count = 0          # finite norms seen
        self.mean = self.var = 0.0
        self.warm_sum = self.warm_sq = 0.0
        self.last: dict = {}

    def threshold(self, norm: float, fixed: float | None) -> tuple[float | None, float | None]:
        """(threshold to clip to or None, z-score or None) for a finite pre-clip norm."""
        if self.count < self.warmup:
            return (fixed if fixed else None), None
        std = math.sqrt(self.var)
        z = (norm - self.mean) / (std + self.eps)
        return (self.mean + self.z_thresh * std if z > self.z_thresh else None), z

    def update(self, clipped_norm: float) -> None:
        self.count += 1
        if self.count <= self.warmup:
            self.warm_sum += clipped_norm
            self.warm_sq += clipped_norm ** 2
            if self.count == self.warmup:
                self.mean = self.warm_sum / self.warmup
                self.var = max(self.warm_sq / self.warmup - self.mean ** 2, 0.0)
            return
        a = self.alpha
        self.mean = a * self.mean + (1 - a) * clipped_norm
        self.var = a * self.var + (1 - a) * (clipped_norm - self.mean) ** 2

    @torch.no_grad()
    def apply(self, params: Iterable[torch.Tensor], norm: torch.Tensor, fixed: float | None) -> torch.Tensor:
        """Clip the grads of `params` (pre-clip global norm `norm`, all ranks agree on it) in place;
        return the coefficient as a 0-d tensor. `fixed`: train.max_grad_norm, used during warm-up and
        logged as the coefficient a fixed clip would have applied."""
        g = norm.item()
        one = torch.ones((), dtype=torch.float32, device=norm.device)
        if not math.isfinite(g):
            self.last = {"mode": "zscore", "z": None, "threshold": None, "fixed_coef": 1.0}
            return one
        thr, z = self.threshold(g, fixed)
        coef = min(1.0, thr / (g + self.eps)) if thr is not None else 1.0
        if coef < 1.0:
            scale_grads_(params, coef)
        self.last = {"mode": "zscore", "z": z, "threshold": thr, "mean": self.mean, "std": math.sqrt(self.var),
                     "warmup": self.count < self.warmup,
                     "fixed_coef": min(1.0, fixed / (g + self.eps)) if fixed else 1.0}
        self.update(g * coef)
        return one * coef

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "var": self.var, "warm_sum": self.warm_sum,
                "warm_sq": self.warm_sq}

    def load_state_dict(self, sd: Mapping) -> None:
        self.count, self.mean, self.var = int(sd["count"]), float(sd["mean"]), float(sd["var"])
        self.warm_sum, self.warm_sq = float(sd["warm_sum"]), float(sd["warm_sq"])


def build_clip_policy(clip: str, zc: ZScoreConfig) -> ZScoreClip | None:
    """train.clip = fixed → None (optimizer_step's fixed global-norm clip); zscore → a ZScoreClip from
    train.zscore (both checked by the schema)."""
    return None if clip == "fixed" else ZScoreClip(zc)
