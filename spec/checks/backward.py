"""gradient: the training path's backward is the derivative of its forward, tensor by tensor, on the probe.

On a reference step the probe's objective, (Σ CE + z·Σ lse²)/n + aux on one sequence, is differentiated twice:
by the training path's autograd (its modules, kernels and backward hooks: spec/probe.py) and by autograd
through the FP64 reference (spec/reference.py), with the same weights and expert ids: the reference the forward
check built, each layer fed the training path's input to it and wired to the next (the reference linearised
at the training path's activations: the chain rule's Jacobians at the points the training path's own backward
used; spec/checks/forward.py `through`). Every parameter tensor's two gradients agree within the model's
chained rounding, twice over (the forward's stages, then the backward's two matmuls for each forward one):
tol = 2·Σ_layers tol_layer + the head's (spec/checks/forward.py), normwise per tensor. A gradient that is the reference's times a factor is a scaled gradient (a hook that multiplies
it); otherwise the backward computes something else.
"""
from __future__ import annotations

import torch

from spec.check import AFTER, BACKWARD, REFERENCE, Check, Kind, on_device
from spec.checks.aux import aux_terms
from spec.checks.forward import ForwardCheck, kind_of
from spec.reference import Reference


class GradientCheck(Check):
    name, layer, cadence, phase = "gradient", BACKWARD, REFERENCE, AFTER
    rank = 35
    onset_series = "param_grad_norm"  # every parameter's gradient norm, every step (spec/checks/clip.py)
    doc = "each parameter's gradient of the probe objective against the FP64 reference's autograd"
    kinds = {
        "mismatch": Kind("optim.gradient_mismatch", "the backward of the named parameter computes another "
                                                    "gradient than its forward's: a backward hook, an autograd "
                                                    "function, a kernel"),
        "scaled": Kind("optim.gradient_spike", "the named parameter's gradient is scaled in the backward (a hook "
                                               "or a loss term that multiplies it)"),
        "nonfinite": Kind("numerics.nonfinite", "a non-finite gradient on the probe"),
        "balancing": Kind("moe.balancing", "the MoE layers' auxiliary loss is not the configured one (its balancing "
                                           "or router-z coefficient, its definition): the gradient of the router "
                                           "and of what feeds it"),
    }

    @classmethod
    def applies(cls, ctx) -> bool:
        # NOTE: under FSDP2 a second backward of the sharded module would run its reduce-scatter hooks into .grad
        return not ctx.sharded

    def after_update(self, s) -> None:
        run = self.ctx.probe(s)
        if run is None or run.grads is None:
            return
        ref = Reference(self.ctx.model_cfg, run.ref_w, run.bias)
        fwd = ForwardCheck(self.ctx)
        if "objective" not in run.cache:  # the forward check did not run on this probe: its graph, built here
            list(fwd.layers(ref, run))
        names = [n for n, w in run.ref_w.items() if w.requires_grad]
        got_ref = torch.autograd.grad(run.cache["objective"], [run.ref_w[n] for n in names], allow_unused=True)
        want = [torch.zeros_like(run.ref_w[n]) if g is None else g for n, g in zip(names, got_ref)]
        rel = self.tolerance(fwd, ref, run)
        got = [run.grads[n] for n in names]
        # ‖got − want‖ per tensor: two multi-tensor ops, not one op a parameter
        err = torch.stack(torch._foreach_norm(torch._foreach_sub(got, want)))
        tol = on_device(rel, err.device, err.dtype) * torch.stack(torch._foreach_norm(want)) + 1e-300
        self.places = (got, want, tol)
        self.aux = self.aux_miss(fwd, ref, run)
        self.measure(err, tol, where=names)

    def aux_miss(self, fwd: ForwardCheck, ref: Reference, run) -> torch.Tensor:
        """|aux − aux_ref| over its tolerance (spec/checks/aux.py), 0 without an MoE layer."""
        terms = aux_terms(fwd, ref, run)
        return torch.zeros((), dtype=torch.float64) if terms is None else terms[0] / terms[1]

    def classify(self, i: int) -> str:
        """A gradient missed while the auxiliary loss differs from the config's: the balancing's fault; otherwise
        kind_of's reading of the gradient itself."""
        got, want, tol = self.places
        if bool(self.aux > 1):
            return "balancing"
        kind = kind_of(got[i], want[i], tol[i])
        return kind if kind in self.kinds else "mismatch"

    def tolerance(self, fwd: ForwardCheck, ref: Reference, run) -> torch.Tensor:
        """2·(every layer's forward tolerance + the head's): the forward's rounding, then the backward's."""
        total = sum(sum(fwd.layer_tolerances(ref, run, i).values()) for i in range(self.ctx.model_cfg.n_layers))
        return 2 * (total + fwd.head_tolerance(self.ctx.model_cfg.vocab_size))
