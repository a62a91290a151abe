"""The probe: one sequence of the step's batch run through the training path and through the FP64 reference.

On a reference step, after the update (spec/checks/forward.py reads it from after_update): the first positions of one
row of the step's batch (`row`: the rows of every micro-batch in turn) go through the bare model — the training
path's own modules, hooks and kernels, under the recipe's autocast, the way the step ran them — with forward hooks
that keep what each layer took and gave, and its objective is differentiated by autograd (torch.autograd.grad:
nothing reaches .grad). The same positions then go through spec/reference.py in float64, from the same weights and
with the same expert ids.

NOTE: after the update, not before: the probe is a forward of its own, and telemetry counts every forward of
the step while its hooks are on (until after_update); a one-shot drill hook is also spent by the step's own
forward by then. The weights are the updated ones, on both sides alike: the check is of the model's math,
for whatever weights.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import Tensor

from spec.reference import F64, weights_f64


@dataclass
class Taken:
    """What the training path's modules took (input) and gave (output) on the probe, first call each; and the whole
    call (its arguments), for a layer's rerun (spec/rerun.py)."""
    io: dict[str, tuple[Tensor, object]] = field(default_factory=dict)
    calls: dict[str, tuple[tuple, dict]] = field(default_factory=dict)

    def hook(self, key: str):
        def keep(module, args, kwargs, out):
            if key not in self.io:
                self.io[key] = (args[0].detach() if args else None, _detach(out))
                self.calls[key] = (_detach(tuple(args)), kwargs)
        return keep


def _detach(out):
    if torch.is_tensor(out):
        return out.detach()
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # a NamedTuple (MoEOutput)
        return type(out)(*[_detach(x) for x in out])
    if isinstance(out, tuple):
        return tuple(_detach(x) for x in out)
    return out


@dataclass
class ProbeRun:
    tokens: Tensor          # (1, P)
    labels: Tensor          # (1, P)
    taken: Taken
    loss: dict[str, Tensor]        # the training path's ce, z, aux sums on the probe (float64)
    grads: dict[str, Tensor] | None  # name -> the training path's gradient of the probe objective (float64)
    ids: dict[int, Tensor]         # MoE layer -> (P, k) the experts the training path used
    ref_w: dict[str, Tensor]       # the reference's float64 weights (leaves with grad when grads is not None)
    bias: dict[int, Tensor]        # MoE layer -> the selection bias
    cache: dict = field(default_factory=dict)  # what one check computed that another reads (tolerances)
    autocast: object = None  # the recipe's autocast the probe ran under (a layer's rerun runs under it too)


# the first positions of one sequence: every layer and head, the position rules (RoPE, the causal mask) on 32 of them,
# some 2·32 expert assignments. NOTE: the probe's cost is more its ops' than its FLOPs: halving it from 64 saves a
# quarter of a reference step, which the overhead goal needs (bench/speed/spec_overhead.py)
PROBE_TOKENS = 32


def kept_layers(model) -> dict[str, torch.nn.Module]:
    """The modules whose input and output a probe run keeps, by the forward check's names."""
    kept = {"emb": model.tok_emb, "norm": model.norm}
    for i, block in enumerate(model.blocks):
        kept.update({f"block{i}": block, f"block{i}.attn": block.attn, f"block{i}.mlp": block.mlp})
    return kept


def routing(model, taken: Taken) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
    """Each MoE layer's expert ids on the kept rows (what its call gave) and its selection bias in float64."""
    ids = {i: taken.io[f"block{i}.mlp"][1].route_ids_Nk for i, _ in model.moe_layers()}
    return ids, {i: m.bias_E.detach().to(F64) for i, m in model.moe_layers()}


def row(turn: int, micro: int, rows: int) -> tuple[int, int]:
    """(micro-batch, row) of the `turn`-th check of a row: the micro-batches in turn, and within them the rows in turn,
    so every row of every micro-batch comes round once in micro·rows turns (16 in the default job). The prefix check's
    turn is its step; the probe's, its reference step's count (spec/monitor.py)."""
    return turn % micro, (turn // micro) % rows


class Calls:
    """The step's training forwards of `model` so far, counted by a pre-hook (`hook`, for the caller to remove): the
    micro-batch a layer's call belongs to, `n` (−1 before the first). Activation checkpointing's recompute calls the
    layers again, not the model: it counts nothing."""

    def __init__(self, model: torch.nn.Module):
        self.n = -1
        self.hook = model.register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        if torch.is_grad_enabled():
            self.n += 1


def run_probe(model, micro, routes, z_coef: float, autocast, loss_scale: float | None, want_grads: bool,
              at: tuple[int, int] = (0, 0)) -> ProbeRun:
    """The training path on the first PROBE_TOKENS positions of row at[1] of micro-batch at[0] (causal: a prefix is a
    sequence of its own), with its layers' inputs and outputs kept."""
    j, r = at
    tokens, labels = micro[j].tokens[r:r + 1, :PROBE_TOKENS], micro[j].labels[r:r + 1, :PROBE_TOKENS]
    taken = Taken()
    hooks = [m.register_forward_hook(taken.hook(key), with_kwargs=True) for key, m in kept_layers(model).items()]
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    probe_routes = None if routes is None else {l: x[r:r + 1, :PROBE_TOKENS] for l, x in routes[j].items()}
    try:
        with torch.enable_grad(), (autocast() if autocast is not None else contextlib.nullcontext()):
            out = model(tokens, labels, routes=probe_routes)
        objective = (out.loss_sum + z_coef * out.z_sum) / out.n_valid.clamp(min=1) + out.aux_loss
        grads = None
        if want_grads:
            scale = float(loss_scale) if loss_scale else 1.0  # FP16: scaled like the step, so nothing underflows
            got = torch.autograd.grad(objective * scale, list(params.values()), allow_unused=True)
            grads = {n: (torch.zeros_like(p, dtype=F64) if g is None else g.detach().to(F64))
                     for (n, p), g in zip(params.items(), got)}
            if scale != 1.0:
                torch._foreach_div_(list(grads.values()), scale)
            # a parameter the config trains that the step froze gets none: 0, which the gradient check compares
            grads.update({n: torch.zeros_like(p, dtype=F64) for n, p in model.named_parameters() if n not in grads})
    finally:
        for h in hooks:
            h.remove()
    ids, bias = routing(model, taken)
    loss = {"ce": out.loss_sum.detach().to(F64), "z": out.z_sum.detach().to(F64), "aux": out.aux_loss.detach().to(F64)}
    return ProbeRun(tokens, labels, taken, loss, grads, ids, weights_f64(model, requires_grad=want_grads), bias,
                    autocast=autocast)
