"""The loss row's rerun (spec/checks/forward.py): the training path from the final norm's input to each position's
CE and z, as one module, for spec/rerun.py to rerun at a perturbed point.

The loss is not a module of the model: Transformer.forward calls its module's `token_losses` on the head's logits.
A miss of the loss below 2^-3 of itself is a rounding (logits or sums kept in a coarser format) or another loss
close to the configured one (label smoothing, a temperature, a reweighted token): as for any layer, only the
rerun tells them apart, and it needs a function to call. HeadLoss is one: the model's final norm and head, then the
loss function looked up by the name Transformer.forward calls it (at each call: what the step ran, patched or
not), on each position alone, so that the miss is a (P, 2) of every position's CE and z: a rounding's is P fresh
draws, another function's a smooth P-vector.
"""
from __future__ import annotations

import sys

import torch
from einops import rearrange
from torch import Tensor, nn

from spec.reference import Reference, token_terms


class HeadLoss(nn.Module):
    """The training path's norm → head → token_losses on labels (1, P): (P, 2), each position's (CE, z)."""

    def __init__(self, model: nn.Module, labels: Tensor):
        super().__init__()
        self.norm, self.head = model.norm, model.head
        self.labels = labels
        # where the model's forward finds token_losses: the module of its class, or of the first base that has one
        self.home = next((sys.modules[c.__module__] for c in type(model).__mro__
                          if hasattr(sys.modules.get(c.__module__), "token_losses")), None)

    def forward(self, x: Tensor) -> Tensor:
        logits = rearrange(self.head(self.norm(x)), "b t v -> (b t) 1 v")
        labels = rearrange(self.labels, "b t -> (b t) 1")
        out = [self.home.token_losses(logits[t:t + 1], labels[t:t + 1]) for t in range(len(labels))]
        return torch.stack([torch.stack([o.loss_sum, o.z_sum]) for o in out])


def per_position(ref: Reference, x: Tensor, labels: Tensor) -> Tensor:
    """The reference's (P, 2): each position's CE and lse² from the final norm's input x (1, P, D), 0 where ignored."""
    return torch.stack(token_terms(ref.head(x)[0], labels[0]), -1)


def loss_miss(d_ce: Tensor, d_z: Tensor, z: Tensor, mag: Tensor) -> Tensor:
    """The loss row's miss from its CE and z errors: the z error in the CE's units (δ(lse²) = 2·lse·δlse, so
    δz·mag/(2z) is a δlse summed as the CE's terms are), whichever is the larger."""
    return torch.maximum(d_ce.abs(), d_z.abs() * mag / (2 * z).clamp(min=1e-300))


def loss_kind(rerun, want: Tensor, tol: Tensor, mag: Tensor) -> str:
    """A loss row's small miss (want: the reference's CE and z sums; tol, mag: the row's): "mismatch" when the rerun
    of norm → head → loss does not miss (the forward around them computed another loss) or misses smoothly,
    "precision" when its miss is a rounding (spec/rerun.py Rerun.kind)."""
    try:
        e0 = rerun.miss()
    except (AttributeError, RuntimeError, TypeError, ValueError):  # no token_losses there, or one that runs only
        # inside the model's forward
        return "precision"
    if not bool(loss_miss(*e0.sum(0), want[1], mag) > tol):
        return "mismatch"
    return rerun.kind(e0)
