"""prefix: every layer of the step's own forward computes its math — on the steps between the reference steps, on
the first PREFIX_TOKENS positions of row 0 of micro-batch 0 (the first of the probe's, spec/probe.py).

The forward check (spec/checks/forward.py) holds every layer to the FP64 reference on reference steps only, every
spec.every steps: a fault that begins between two of them shows at the next one, up to spec.every − 1 steps late,
and a fault that leaves the layers' output RMS where it was (a rounding inside an attention, another ε in a norm,
another activation) cannot be dated back from any per-step series. Yet the step's forward has already run the very
positions the probe runs: causal attention makes a prefix of a sequence a sequence of its own, so what each layer
took and gave on them is a probe run — without the probe's second forward. Forward hooks keep those rows (a copy of
PREFIX_TOKENS rows a layer, the first call: not the recompute of activation checkpointing) and, before the update,
the forward check's own layers — the same reference, tolerances and wiring — compare them: every layer is checked
every step, the first failing step is the fault's, and the guard can refuse it.

What the probe adds and this leaves to the reference steps: the loss (the step's loss sums the whole batch), the
gradient, the layer reruns that tell a rounding from another function, the exact FP64 reruns. A failure here is
one the monitor follows with the reference checks at the same step (spec/monitor.py on_demand), which class it; the
doctor reads this check as the forward check's `family`: a failure here and the forward check's at the same layer
are one incident. Not under FSDP2 (the weights are shards: gathering them every step is the step's collectives
again), nor under train.compile (a hook breaks the graph).
"""
from __future__ import annotations

import itertools
import time

import torch

from spec.check import BEFORE, STEP
from spec.checks.forward import ForwardCheck
from spec.probe import ProbeRun, Taken, kept_layers, routing
from spec.reference import F64, Reference


# the first positions of row 0: every layer, head and expert's math on 8 tokens, RoPE's rotations by 0..7 positions
# and the causal mask among them. NOTE: fewer than the probe's 32: every step, the FP64 matmuls (an MoE layer's every
# expert on every row, spec/reference.py) cost as many times less; which positions a fault at a layer shows at is the
# reference steps' to see, with the probe's
PREFIX_TOKENS = 8


class PrefixCheck(ForwardCheck):
    name, cadence, phase = "prefix", STEP, BEFORE
    rank = 23  # after the forward check's own (20, on demand at the same step), which classes the layer's miss
    family = "forward"
    onset_series = None
    doc = "each layer's output on the step's own first positions against the FP64 reference, between reference steps"

    @classmethod
    def applies(cls, ctx) -> bool:
        return not ctx.sharded and not ctx.compiled

    def before_forward(self, s) -> None:
        for h in getattr(self, "_hooks", []):  # a step that ended before its update (it raised) left them
            h.remove()
        self._hooks = []
        if self.ctx.reference_step(s.step):  # the forward check's step: its probe checks the same positions
            return
        self.taken, self._unread = Taken(), None
        self._hooks = [m.register_forward_hook(self._keep(key)) for key, m in kept_layers(self.ctx.model).items()
                       if key != "norm"]

    def _keep(self, key: str):
        def keep(module, args, out):
            if key in self.taken.io or not args or not torch.is_grad_enabled():  # the first training call only
                return
            t0 = time.perf_counter()
            try:
                self.taken.io[key] = (_rows(args[0]), _rows(out))
            except (IndexError, TypeError, AttributeError) as e:  # the step's forward goes on: the check fails
                self._unread = f"{key}: {type(e).__name__}: {e}"
            self.seconds += time.perf_counter() - t0  # the step's time_s.spec counts it (spec/monitor.py took)
        return keep

    def before_update(self, s) -> None:
        for h in self._hooks:
            h.remove()
        if not self._hooks:
            return
        self._hooks, taken, self.taken = [], self.taken, None
        if self._unread:  # a layer gave what no layer of the model's gives: a failure of this check (spec/monitor.py)
            raise ValueError(f"a layer's input or output is not the model's: {self._unread}")
        model, c = self.ctx.model, self.ctx.model_cfg
        if len(taken.io) != 1 + 3 * c.n_layers:  # a forward these hooks did not see (a wrapper bypassing a module)
            return
        mb = s.micro[0]
        ids, bias = routing(model, taken)
        w = self._weights()
        run = ProbeRun(mb.tokens[:1, :PREFIX_TOKENS], mb.labels[:1, :PREFIX_TOKENS], taken, {}, None, ids, w, bias)
        # every layer's row; the loss's (the generator's last) is the probe's alone
        rows = list(itertools.islice(self.layers(Reference(c, w, bias), run), 1 + 3 * c.n_layers))
        err, tol = (torch.stack([r[i] for r in rows]) for i in (1, 2))
        self.places = [r[4] for r in rows]
        self.measure(err, tol, where=[r[0] for r in rows])

    def after_update(self, s) -> None: ...

    def _weights(self) -> dict[str, torch.Tensor]:
        """Every parameter by name in FP64, copied into buffers kept from step to step (one foreach copy, nothing
        allocated: the step's weights are a few MB of FP64 each step)."""
        params = dict(self.ctx.model.named_parameters())
        if getattr(self, "_w", None) is None or any(self._w[n].shape != p.shape for n, p in params.items()):
            self._w = {n: torch.empty_like(p, dtype=F64) for n, p in params.items()}
        torch._foreach_copy_(list(self._w.values()), [p.detach() for p in params.values()])
        return self._w


def _rows(x):
    """The probe's rows of a layer's input or output (a block's (x, MoEOutput), an MoE layer's MoEOutput: its output
    and its tokens' experts), copied: the step may write over its activations, and keeps no view of them alive."""
    if torch.is_tensor(x):
        return x.detach()[:1, :PREFIX_TOKENS].clone()
    if isinstance(x, tuple) and hasattr(x, "route_ids_Nk"):
        y = _rows(x.y)
        return x._replace(y=y, route_ids_Nk=x.route_ids_Nk[:y.shape[1]].clone())  # (B·T, k): row 0's tokens first
    if isinstance(x, tuple):
        return tuple(_rows(v) for v in x)
    return x
