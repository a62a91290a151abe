"""A rounding or another function? A layer's small miss, rerun at perturbed points (on a failure only).

The forward check (spec/checks/forward.py) calls a layer's miss below 2^-3 relative a rounding. So small a miss can
also be another function close to the layer's own: a softmax temperature a few percent off, an attention window
that drops a few far positions, a norm that ignores a gain near 1. No magnitude separates them (a 16-bit rounding's
bound through a softmax is larger than these). How the error depends on the point does:

    e(x, W) = layer(x, W) − reference(x, W)     the training path's layer and the FP64 reference, fed the same

- A rounding to a grid of spacing h is a sawtooth of the value rounded. Moved by a random perturbation of standard
  deviation σ ≥ h/2, its error is a fresh draw: the sawtooth's k-th Fourier term keeps exp(−2π²k²σ²/h²) ≤ e^−4.9 of
  its correlation. A format of unit roundoff u has spacing h ≤ 2u·|v| at a value v, so a relative perturbation of
  standard deviation u redraws its every rounding.
- Another function's error is smooth in x and W: the same perturbation moves it by a fraction of itself.

With e = s + r (smooth, rounding) at the probe's point and e' = s' + r' at the perturbed one, s' ≈ s and r' an
independent draw of r: ⟨e, e'⟩ ≈ ‖s‖² and ‖e − e'‖²/2 ≈ ‖r‖². The layer computes another function when its miss
is mostly smooth: ⟨e, e'⟩ > ‖e − e'‖²/2, each side averaged over K = DRAWS perturbed points.

Why several: for a rounding, ⟨r, r'⟩ is 0 only on average. Its spread is ‖r‖·‖r'‖/√n, n the number of comparable
draws the miss is made of — few where a few elements dominate it (a loss row's positions with the largest lse²), and
one draw passes the test when the correlation of r and r' exceeds about ½: about 1 in 17 at n = 10. Over K draws,
independent given e, the mean correlation has spread 1/√(K·n); K = 8 puts ½ three spreads away from 0 from n = 5 on
(about 1 in 1000), and a smooth miss, the same in every draw, is unchanged.

The perturbation: the layer's input by 2^-3 relative, the unit roundoff of FP8 E5M2, the coarsest format (every
rounding of an activation redrawn); the matrices its matmuls read by 2^-8, bfloat16's (a weight cast to a 16-bit
format in the forward, as autocast does, redrawn), not more: a weight used otherwise than the math says differs
from the right use by its own distance from what replaces it. Its gains and other vectors not at all: the recipes
apply them in FP32 (autocast runs norms in FP32), and a gain ignored (replaced by 1) is then told at any distance
from 1, as it could not be once moved by 2^-8. The draw is seeded: the same miss is judged alike on every run.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import Tensor

from spec.reference import F64

ETA_INPUT = 2.0 ** -3   # FP8 E5M2's unit roundoff: the coarsest format's rounding redrawn
ETA_WEIGHT = 2.0 ** -8  # bfloat16's: a 16-bit rounding of a matmul's weight redrawn
SEED = 20250417
DRAWS = 8  # perturbed points a miss is judged on: 3 spreads of a rounding's correlation from n = 5 draws (above)


def perturbed(t: Tensor, eta: float, gen: torch.Generator) -> Tensor:
    """t · (1 + η·ξ), ξ ~ N(0, 1) elementwise, in t's dtype (drawn on the host: the run's own generators untouched)."""
    xi = torch.randn(t.shape, generator=gen, dtype=F64)
    return (t.detach().to(F64) * (1 + eta * xi.to(t.device))).to(t.dtype)


def smooth(e0: Tensor, draws: list[Tensor]) -> bool:
    """Whether the miss e0 is mostly smooth: the mean of ⟨e0, e_k⟩ > the mean of ‖e0 − e_k‖²/2 (e_k the misses at
    the perturbed points)."""
    e0, ek = e0.reshape(-1).to(F64), torch.stack([e.reshape(-1).to(F64) for e in draws])
    return bool((ek @ e0).mean() > (ek - e0).square().sum(-1).mean() / 2)


class Rerun:
    """One layer of the training path, to rerun as the probe ran it (its module, hooks and kernels, under the
    recipe's autocast, grad enabled) against `reference(x, weights)`, the FP64 reference's same layer fed the same
    (weights by their names in the model: prefix + the module's own)."""

    def __init__(self, module: torch.nn.Module, prefix: str, args: tuple, kwargs: dict,
                 reference: Callable[[Tensor, dict[str, Tensor]], Tensor], autocast=None, fp64: bool = False):
        self.module, self.prefix, self.args, self.kwargs = module, prefix, args, kwargs
        self.reference, self.autocast, self.fp64 = reference, autocast, fp64

    def error(self, gen: torch.Generator) -> Tensor:
        """The layer's miss at a perturbed point: its input by ETA_INPUT, its matrices by ETA_WEIGHT."""
        w = {n: perturbed(p, ETA_WEIGHT, gen) if p.dim() >= 2 else p.detach()
             for n, p in self.module.named_parameters()}
        return self.miss(perturbed(self.args[0], ETA_INPUT, gen), w)

    def miss(self, x: Tensor | None = None, w: dict[str, Tensor] | None = None) -> Tensor:
        """The layer's output against the reference's, both on input x with weights w (default: the probe's own)."""
        x = self.args[0] if x is None else x
        w = w if w is not None else {n: p.detach() for n, p in self.module.named_parameters()}
        return self.output(x, w) - self.reference(x.to(F64), {self.prefix + n: t.to(F64) for n, t in w.items()})

    def output(self, x: Tensor, w: dict[str, Tensor] | None = None) -> Tensor:
        """The layer's output (FP64) on input x, with its own weights or w, as the probe ran it; with fp64, in FP64
        throughout (the weights, x and the other tensors it is given; no autocast)."""
        w = w if w is not None else {n: p.detach() for n, p in self.module.named_parameters()}
        args, autocast = self.args[1:], self.autocast
        if self.fp64:
            w, x, autocast = {n: t.to(F64) for n, t in w.items()}, x.to(F64), None
            args = tuple(a.to(F64) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
        # NOTE: the attention's logit telemetry would count this forward: off for it
        probe = getattr(self.module, "probe_logits", None)
        if probe is not None:
            self.module.probe_logits = False
        try:
            with torch.enable_grad(), (autocast() if autocast is not None else contextlib.nullcontext()):
                y = torch.func.functional_call(self.module, w, (x, *args), self.kwargs)
        finally:
            if probe is not None:
                self.module.probe_logits = probe
        y = y[0] if isinstance(y, tuple) else y  # an MoE layer's MoEOutput: its y
        return y.detach().to(F64)

    def sees_ahead(self, rel_tol: Tensor) -> bool:
        """Whether a position's output moves when only the positions after it change: causality says it must not.
        The inputs after the middle position are replaced (reversed in order), and the outputs before it compared
        with the layer's own on the probe's input, within the layer's relative tolerance (they are the same
        arithmetic on the same numbers: no more than the recipe's rounding). A mask off by one (each position
        seeing the next) moves the output just before the middle; no mask at all, every one."""
        x = self.args[0]
        half = x.shape[-2] // 2
        other = torch.cat([x[..., :half, :], x[..., half:, :].flip(-2)], dim=-2)
        try:
            y, y2 = self.output(x)[..., :half, :], self.output(other)[..., :half, :]
        except (RuntimeError, TypeError, ValueError):  # a layer that runs only inside its model's forward
            return False
        return bool((y - y2).norm() > rel_tol.to(y.device) * y.norm() + 1e-300)

    def kind(self, e0: Tensor) -> str:
        """"mismatch" when the miss e0 (at the probe's point) is mostly smooth, "precision" when mostly a rounding;
        "precision" still (kind_of's reading) when the layer cannot be rerun."""
        try:
            draws = [self.error(torch.Generator().manual_seed(SEED + k)) for k in range(DRAWS)]
        except (RuntimeError, TypeError, ValueError):  # a layer that runs only inside its model's forward
            return "precision"
        return "mismatch" if smooth(e0, draws) else "precision"
