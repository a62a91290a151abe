"""Named breakages a student can switch on: `python -m labs.run --experiment NAME --set break=KEY`.

Each one plants, for the duration of one lab run, a bug that the repository's tests also plant — a
wrong gradient no forward test would see, a count that includes padding, a reduction of norms instead
of squares. With the break on, the lab that guards the broken piece reports EXPECTED EFFECT ABSENT and
its table shows which claim failed: the exercise is to predict which, and why (docs/exercises.md).

A break replaces a function (or method) by name: in the module that defines it and in every loaded
module that imported it by name, so it reaches the lab's own `from x import f` too; all are restored
on exit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys

import torch
import torch.nn.functional as F


class _ScaledGrad(torch.autograd.Function):
    """Identity forward, gradient × 1.01 backward: a 1 % error no forward test would ever see."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return 1.01 * g


class _StraightThroughClamp(torch.autograd.Function):
    """Clamped forward, identity backward: the gradient claims a slope the clamped function lacks."""

    @staticmethod
    def forward(ctx, x, lo, hi):
        return x.clamp(lo, hi)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


@contextlib.contextmanager
def _replace(module_name: str, attr: str, make):
    """Replace `module.attr` by make(original) in its module and wherever it was imported by name."""
    __import__(module_name)
    owner = sys.modules[module_name]
    original = getattr(owner, attr)
    new = make(original)
    holders = [m for m in list(sys.modules.values())
               if m is not None and getattr(m, "__dict__", {}).get(attr) is original]
    for m in holders:
        setattr(m, attr, new)
    try:
        yield
    finally:
        for m in holders:
            setattr(m, attr, original)


@contextlib.contextmanager
def _replace_method(module_name: str, cls: str, attr: str, make):
    __import__(module_name)
    klass = getattr(sys.modules[module_name], cls)
    original = getattr(klass, attr)
    setattr(klass, attr, make(original))
    try:
        yield
    finally:
        setattr(klass, attr, original)


def _wrong_rope_backward():
    return _replace("model.rope", "apply_rope", lambda rope: lambda x, cos, sin: rope(_ScaledGrad.apply(x), cos, sin))


def _straight_through_clamp():
    def make(swiglu):
        def st(gate, up, limit):
            if limit is None:
                return swiglu(gate, up, limit)
            return F.silu(_StraightThroughClamp.apply(gate, None, limit)) * _StraightThroughClamp.apply(up, -limit, limit)
        return st
    return _replace("model.swiglu", "swiglu", make)


def _padded_token_count():
    return _replace("optim.accumulate", "count_valid_tokens", lambda f: lambda mbs, device: torch.tensor(
        [float(sum(mb.tokens.numel() for mb in mbs))], dtype=torch.float64))


def _norms_all_reduced():
    return _replace("optim.clip", "_sum_of_squares", lambda f: lambda ts, device: torch.stack(
        [t.float().norm() for t in ts]).sum() if ts else torch.zeros((), device=device))


def _unscale_lost():
    return _replace_method("optim.scaler", "DynamicLossScaler", "unscale_", lambda f: lambda self, params: None)


def _rng_not_restored():
    return _replace("checkpoint.rng", "restore", lambda f: lambda state: None)


def _zloss_no_gradient():
    return _replace("model.transformer", "token_losses", lambda f: lambda logits, labels: dataclasses.replace(
        f(logits, labels), z_sum=f(logits, labels).z_sum.detach()))


# key -> (what it breaks, the lab that shows it, how to plant it)
BREAKS = {
    "wrong_rope_backward": ("RoPE's backward scales its gradient by 1.01 (the forward is exact)", "gradients",
                            _wrong_rope_backward),
    "straight_through_clamp": ("the SwiGLU clamp passes the gradient through where it clamps", "swiglu_clamp",
                               _straight_through_clamp),
    "padded_token_count": ("the token count includes padding positions", "microbatch_mean", _padded_token_count),
    "norms_all_reduced": ("the global norm adds each shard's norm instead of its sum of squares", "shard_norm",
                          _norms_all_reduced),
    "unscale_lost": ("the FP16 loss scaler's unscale does nothing", "clip_unscale", _unscale_lost),
    "rng_not_restored": ("a checkpoint's RNG state is not restored on load", "resume_jump", _rng_not_restored),
    "zloss_no_gradient": ("the z-loss term is computed but carries no gradient", "zloss", _zloss_no_gradient),
}


@contextlib.contextmanager
def planted(keys: list[str]):
    """Every break in `keys` on for the duration (ValueError naming an unknown key)."""
    unknown = [k for k in keys if k not in BREAKS]
    if unknown:
        raise ValueError(f"break={','.join(unknown)}: expected one of {', '.join(BREAKS)}")
    with contextlib.ExitStack() as stack:
        for k in keys:
            stack.enter_context(BREAKS[k][2]())
        yield
