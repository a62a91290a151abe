"""gradient: the training path's backward is the derivative of its forward, tensor by tensor, on the probe.

On a reference step the probe's objective, (Σ CE + z·Σ lse²)/n + aux on one sequence, is differentiated twice:
by the training path's autograd (its modules, kernels and backward hooks: spec/probe.py) and by autograd
through the FP64 reference (spec/reference.py), with the same weights and expert ids. Every parameter tensor's
two gradients agree within the model's chained rounding, twice over (the forward's stages, then the backward's
two matmuls for each forward one): tol = 2·Σ_layers tol_layer + the head's (spec/checks/forward.py), normwise
per tensor. A gradient that is the reference's times a factor is a scaled gradient (a hook that multiplies
it); otherwise the backward computes something else.
"""
from __future__ import annotations

import torch

from spec.check import AFTER, BACKWARD, REFERENCE, Check, Kind
from spec.checks.forward import ForwardCheck
from spec.probe import reference_grads
from spec.reference import Reference


class GradientCheck(Check):
    name, layer, cadence, phase = "gradient", BACKWARD, REFERENCE, AFTER
    doc = "each parameter's gradient of the probe objective against the FP64 reference's autograd"
    kinds = {
        "mismatch": Kind("optim.gradient_mismatch", "the backward of the named parameter computes another "
                                                    "gradient than its forward's: a backward hook, an autograd "
                                                    "function, a kernel"),
        "scaled": Kind("optim.gradient_spike", "the named parameter's gradient is scaled in the backward (a hook "
                                               "or a loss term that multiplies it)"),
        "nonfinite": Kind("numerics.nonfinite", "a non-finite gradient on the probe"),
    }

    @classmethod
    def applies(cls, ctx) -> bool:
        # NOTE: under FSDP2 a second backward of the sharded module would run its reduce-scatter hooks into .grad
        return not ctx.sharded

    def after_update(self, s) -> None:
        run = self.ctx.probe(s)
        if run is None or run.grads is None:
            return
        ref = Reference(self.ctx.model.cfg, run.ref_w, run.bias)
        want = reference_grads(ref, run, self.ctx.cfg.train.z_loss)
        fwd = ForwardCheck(self.ctx)
        rel = self.tolerance(fwd, ref, run)
        names = list(want)
        rows = [fwd.compare(run.grads[n], want[n], rel) for n in names]
        err, tol, kind = (torch.stack([r[i] for r in rows]) for i in range(3))
        # ForwardCheck's kinds, read as this check's: scaled and nonfinite keep their meaning, the rest is a mismatch
        names_f = list(fwd.kinds)
        own = {names_f.index(k): list(self.kinds).index(k) for k in ("scaled", "nonfinite")}
        kind = sum((torch.where(kind == i, float(j), 0.0) for i, j in own.items()), torch.zeros_like(kind))
        self.measure(err, tol, kind, where=names)

    def tolerance(self, fwd: ForwardCheck, ref: Reference, run) -> torch.Tensor:
        """2·(every layer's forward tolerance + the head's): the forward's rounding, then the backward's."""
        total = sum(sum(fwd.layer_tolerances(ref, run, i).values()) for i in range(self.ctx.model.cfg.n_layers))
        return 2 * (total + fwd.head_tolerance(self.ctx.model.cfg.vocab_size))
