"""The `optim` group's schema: AdamW settings, parameter-group rules, the lr schedule.

Rules that need the model (a rule that matches no parameter) stay with what knows it; a schedule
longer than train.steps is clamped to the run (ScheduleConfig.fit), not refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from omegaconf import DictConfig, OmegaConf

from run.config_errors import ConfigError, check, choice, fail, from_mapping

KINDS = ("bias", "norm", "embedding", "router", "expert_bias")  # parameter kinds a rule can name
DEFAULT_GROUP = "default"
SCHEDULES = ("cosine", "linear", "wsd", "constant")


def _nonneg(key: str, value: float) -> None:
    check(value >= 0, key, value, "must be >= 0")  # NOTE: also rejects NaN


@dataclass
class GroupRule:
    """One parameter-group rule: the first matching rule wins (optim/groups.py)."""
    name: str | None = None            # null: group<i>
    kinds: list[str] = field(default_factory=list)   # parameter kinds: bias | norm | embedding | router | expert_bias
    names: list[str] = field(default_factory=list)   # fnmatch patterns on parameter names
    weight_decay: float | None = None  # null: optim.weight_decay
    lr_scale: float = 1.0              # this group's lr = optim.lr × lr_scale

    def check(self, i: int) -> None:
        key = f"optim.groups[{i}]"
        bad = [k for k in self.kinds if k not in KINDS]
        if bad:
            fail(f"{key}.kinds", list(self.kinds), f"unknown kind {bad[0]!r}, expected one of {', '.join(KINDS)}")
        if not self.kinds and not self.names:
            raise ConfigError(f"{key} ({self.name}) gives neither kinds nor names: it could match nothing")
        check(self.name != DEFAULT_GROUP, f"{key}.name", self.name, "reserved for parameters that no rule matches")
        if self.weight_decay is not None:
            _nonneg(f"{key}.weight_decay", self.weight_decay)
        _nonneg(f"{key}.lr_scale", self.lr_scale)


@dataclass
class ScheduleConfig:
    name: str = "cosine"              # cosine | linear | wsd | constant
    warmup_steps: int = 50            # linear warmup from lr/W to lr
    min_lr_ratio: float = 0.1         # the decay ends at min_lr_ratio × lr
    decay_steps: int | None = None    # null: the rest of the run (wsd: decay_fraction of it)
    decay_fraction: float = 0.2       # wsd only: the last 20 % of steps decay

    def __post_init__(self) -> None:
        choice("optim.schedule.name", self.name, SCHEDULES)
        check(self.warmup_steps >= 0, "optim.schedule.warmup_steps", self.warmup_steps, "must be >= 0")
        check(0.0 <= self.min_lr_ratio <= 1.0, "optim.schedule.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        check(self.decay_steps is None or self.decay_steps > 0, "optim.schedule.decay_steps", self.decay_steps,
              "must be a positive integer or null")
        check(0.0 < self.decay_fraction <= 1.0, "optim.schedule.decay_fraction", self.decay_fraction,
              "must be in (0, 1]")

    def fit(self, total_steps: int) -> tuple[int, int]:
        """(W, D): the warmup and decay steps of a `total_steps` run, the schedule clamped to the run.

        NOTE: clamped, not refused, so a smoke run (`train.steps=20` under a 50-step warmup) runs as
        written. Non-wsd: W = min(warmup_steps, T), i.e. the W = T schedule that always fit — the lr
        reaches its peak at the last step, the shape the config asked for cut to the run — and no new
        shape. wsd keeps its decay, D = min(D, T) (the cooldown is the part of wsd that lands the loss),
        and the warmup takes what is left, W = min(warmup_steps, T − D). A schedule that fits is
        unchanged, step for step."""
        check(isinstance(total_steps, int) and total_steps > 0, "train.steps", total_steps,
              "must be a positive integer")
        if self.name != "wsd":
            warmup = min(self.warmup_steps, total_steps)
            return warmup, self.decay_steps or max(total_steps - warmup, 1)
        decay = min(self._wsd_decay(total_steps), total_steps)
        return min(self.warmup_steps, total_steps - decay), decay

    def clamp_note(self, total_steps: int) -> str | None:
        """One line saying how `fit` clamped the schedule to the run, or None when it fits as configured."""
        warmup, decay = self.fit(total_steps)
        wanted = self._wsd_decay(total_steps) if self.name == "wsd" else decay
        if (warmup, decay) == (self.warmup_steps, wanted):
            return None
        changes = [f"warmup_steps {self.warmup_steps} → {warmup}"] * (warmup != self.warmup_steps)
        changes += [f"decay steps {wanted} → {decay}"] * (decay != wanted)
        return f"optim.schedule clamped to train.steps={total_steps}: {', '.join(changes)}"

    def _wsd_decay(self, total_steps: int) -> int:
        return self.decay_steps if self.decay_steps is not None else max(round(self.decay_fraction * total_steps), 1)

    @classmethod
    def from_dict(cls, d: Mapping) -> "ScheduleConfig":
        return from_mapping(cls, d, "optim.schedule")


@dataclass
class MuonConfig:
    """optim.name=muon (optim/muon.py): Muon on hidden matrices, AdamW on the rest."""
    momentum: float = 0.95     # mu of M <- mu*M + G
    nesterov: bool = True      # U = G + mu*M (false: U = M)
    ns_steps: int = 5          # Newton-Schulz quintic iterations
    rms_scale: float = 0.2     # update = rms_scale * sqrt(max(m, n)) * NS5(U): RMS ~ rms_scale, like AdamW's
    # NS5's matmuls in float32, or bfloat16 as Jordan's reference runs them (the orthogonal factor only needs its
    # singular values near 1, not float32 digits); auto: bfloat16 where the device multiplies it natively, float32
    # where it would be emulated, slower than float32 (optim/muon.py ns_dtype_for)
    ns_dtype: str = "float32"   # float32 | bfloat16 | auto
    adamw: list[str] = field(default_factory=list)  # fnmatch patterns of extra parameters left to AdamW

    def __post_init__(self) -> None:
        check(0 <= self.momentum < 1, "optim.muon.momentum", self.momentum, "must be in [0, 1)")
        check(self.ns_steps >= 1, "optim.muon.ns_steps", self.ns_steps, "must be an integer >= 1")
        check(self.rms_scale > 0, "optim.muon.rms_scale", self.rms_scale, "must be > 0")
        choice("optim.muon.ns_dtype", self.ns_dtype, ("float32", "bfloat16", "auto"))


@dataclass
class QKClipConfig:
    """Kimi K2's QK-clip, any optimizer (optim/qk_clip.py): after each step, a head whose largest attention
    logit on the step's batch exceeds tau gets W_q (and W_k) scaled back to tau."""
    tau: float | None = None   # null = off

    def __post_init__(self) -> None:
        check(self.tau is None or (math.isfinite(self.tau) and self.tau > 0), "optim.qk_clip.tau", self.tau,
              "must be a positive number or null (off)")


@dataclass
class ZScoreConfig:
    """train.clip=zscore (optim/zclip.py): clip g to mu + z_thresh*sigma when its norm's z-score against an
    EMA mean and variance exceeds z_thresh (ZClip)."""
    alpha: float = 0.97        # EMA factor of the grad-norm mean and variance
    z_thresh: float = 2.5
    warmup: int = 25           # steps of plain statistics (max_grad_norm applies) before z-scores

    def __post_init__(self) -> None:
        check(0 < self.alpha < 1, "train.zscore.alpha", self.alpha, "must be in (0, 1)")
        check(self.z_thresh > 0, "train.zscore.z_thresh", self.z_thresh, "must be > 0")
        check(self.warmup >= 2, "train.zscore.warmup", self.warmup, "must be an integer >= 2 (a variance needs two norms)")


OPTIMIZERS = ("adamw", "muon")
CLIP_MODES = ("fixed", "zscore")  # train.clip


def _default_groups() -> list[GroupRule]:
    """No decay on biases, norms, embeddings and routers: decay pulls a gain or a lookup row towards 0,
    which is not a regulariser for them."""
    return [GroupRule(name="no_decay", kinds=["bias", "norm", "embedding", "router"], weight_decay=0.0)]


@dataclass
class OptimConfig:
    """AdamW (optim/adamw.py) over parameter groups (optim/groups.py), with an lr schedule; or Muon on the
    hidden matrices (optim.name=muon); QK-clip with either."""
    name: str = "adamw"        # adamw | muon
    # NOTE: 2e-3, not 3e-3: on the quickstart's seed grid (README) 3e-3 knocked one point off the path to
    # the copy source's induction head (grad-norm spikes at peak lr); 2e-3 formed it on every point
    lr: float = 2e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    groups: list[GroupRule] = field(default_factory=_default_groups)  # first matching rule wins; one matching nothing is an error
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    muon: MuonConfig = field(default_factory=MuonConfig)
    qk_clip: QKClipConfig = field(default_factory=QKClipConfig)

    def __post_init__(self) -> None:
        choice("optim.name", self.name, OPTIMIZERS)
        check(math.isfinite(self.lr) and self.lr > 0, "optim.lr", self.lr, "must be > 0")
        check(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), "optim.betas", list(self.betas),
              "expected two values in [0, 1)")
        check(self.eps > 0, "optim.eps", self.eps, "must be > 0")
        _nonneg("optim.weight_decay", self.weight_decay)
        seen = set()
        for i, rule in enumerate(self.groups):
            rule.check(i)
            name = rule.name or f"group{i}"
            check(name not in seen, f"optim.groups[{i}].name", name, "duplicate group name")
            seen.add(name)

    @classmethod
    def from_dict(cls, d: Mapping) -> "OptimConfig":
        if isinstance(d, cls):
            return d
        d = dict(OmegaConf.to_container(d, resolve=True) if isinstance(d, DictConfig) else d)
        if isinstance(d.get("groups"), (list, tuple)):  # one by one, so an error names its index
            d["groups"] = [from_mapping(GroupRule, r, f"optim.groups[{i}]") for i, r in enumerate(d["groups"])]
        return from_mapping(cls, d, "optim")


@dataclass
class LossScaleConfig:
    """Dynamic loss scaling (optim/scaler.py; precision=fp16). Keep init, growth and backoff powers of
    two: unscaling by S is then exact."""
    init: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000  # finite steps in a row before the scale grows
    min_scale: float = 1.0

    def __post_init__(self) -> None:
        p = "precision.loss_scale"
        check(self.init > 0, f"{p}.init", self.init, "must be > 0")
        check(self.growth_factor > 1, f"{p}.growth_factor", self.growth_factor, "must be > 1")
        check(0 < self.backoff_factor < 1, f"{p}.backoff_factor", self.backoff_factor, "must be in (0, 1)")
        check(self.growth_interval >= 1, f"{p}.growth_interval", self.growth_interval, "must be an integer >= 1")
        check(0 < self.min_scale <= self.init, f"{p}.min_scale", self.min_scale, f"must be in (0, init={self.init}]")
