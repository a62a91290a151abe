"""aux: the MoE auxiliary loss the step optimises is the config's, on the probe.

The training path's auxiliary loss on the probe (its MoE layers' balancing and router z-loss, as the modules computed
them: spec/probe.py) against the FP64 reference's with the config's coefficients (spec/reference.py, computed by the
forward check: run.cache["aux"]). A coefficient changed in a module, a term added or dropped, changes the objective
itself; its gradient can stay within the gradient check's tolerance (a router z-loss of 1e-3 moves the router's
gradient by little), its value cannot. The terms are non-negative (a balance E·Σ f·P, a mean squared log-sum-exp), so
the aux is its own magnitude, and the MoE layers' relative tolerance (their router stage) bounds its rounding.
"""
from __future__ import annotations

import torch

from spec.check import AFTER, BACKWARD, REFERENCE, Check, Kind
from spec.checks.forward import ForwardCheck
from spec.reference import Reference


def aux_terms(fwd: ForwardCheck, ref: Reference, run) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(|aux − aux_ref|, its tolerance) on the probe; None without an MoE layer or the forward check's reference."""
    layers = [i for i in range(fwd.ctx.model_cfg.n_layers) if ref.is_moe(i)]
    if not layers or "aux" not in run.cache:
        return None
    rel = torch.stack([torch.as_tensor(fwd.layer_tolerances(ref, run, i)["mlp"]) for i in layers]).max()
    want = run.cache["aux"]
    return (run.loss["aux"] - want).abs(), rel * want.abs() + 1e-300


class AuxCheck(Check):
    name, layer, cadence, phase = "aux", BACKWARD, REFERENCE, AFTER
    rank = 22  # after the forward check, whose reference computed the aux with the config's coefficients
    onset_series = "aux_loss"  # the step's own auxiliary loss, every step (its record's aux_loss)
    doc = "the MoE auxiliary loss on the probe against the reference's with the config's coefficients"
    kinds = {"balancing": Kind("moe.balancing", "the MoE layers' auxiliary loss is not the configured one: a "
                                                "coefficient set in a module (balancing, router z-loss), a term "
                                                "added or dropped")}

    @classmethod
    def applies(cls, ctx) -> bool:
        return bool(ctx.model.moe_layers())

    def after_update(self, s) -> None:
        run = self.ctx.probe(s)
        if run is None:
            return
        terms = aux_terms(ForwardCheck(self.ctx), Reference(self.ctx.model_cfg, run.ref_w, run.bias), run)
        if terms is not None:
            self.measure(*terms, where=["aux_loss"])
