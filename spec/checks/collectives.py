"""The reductions of the gradient: what the optimizer receives is the sum of what the backward produced, over the
micro-batches and, under DDP, averaged over the ranks (reduce); and every replica ends the step alike (replicas).

reduce     each rank's local gradient on probe elements of every parameter is kept as its backward produces it
           (a tensor hook sees each micro-batch's contribution before it is accumulated into .grad, and before DDP's
           reducer adds the ranks up), gathered from every rank after the backward, and their mean compared with
           the gradient .grad holds before the update: the micro-batches are summed in FP32, DDP divides by the
           world size and sums in FP32, 3·u32 of the terms' magnitudes per element (λ of it). In one process the
           same comparison holds .grad to its backward: a gradient written after the backward produced it (a
           post-accumulate hook, a helper that scales or perturbs .grad before the clip) is caught at its step,
           which the probe's autograd (spec/checks/backward.py) never runs through. And every parameter the config
           trains got a gradient: one frozen or cut off the graph (a detach) is named every step, not only at the
           probe's. Known before the update: the guard can refuse the step.
replicas   the parameters' end-of-step fingerprint (each one's FP32 norm and the exact sum of a strided sample of
           its bits, as spec/checks/state.py takes a checkpoint's) is the same bits on every rank.

Under FSDP2 a parameter is a shard and its gradient a reduce-scatter of unsharded gradients no hook holds: the
gradient checks there are loss_grad's (the gain's gradient against its closed form over every rank) and the
probe's; replicas do not exist.
"""
from __future__ import annotations

import time
import zlib

import torch
import torch.distributed as tdist

from spec.check import AFTER, BACKWARD, BEFORE, STEP, SYSTEM, Check, Kind, on_device
from spec.checks.forward import kind_of
from spec.checks.precision import on_coarser_grid
from spec.checks.state import STRIDE, _bits
from spec.tolerance import LAMBDA, U32

K = 4


def _replicated(ctx) -> bool:
    return ctx.dist.world > 1 and not ctx.sharded


class ReduceCheck(Check):
    name, layer, cadence, phase = "reduce", SYSTEM, STEP, BEFORE
    rank = 28  # after the data and the forward's inputs, before the gradient's own checks: it explains them
    doc = "the gradient before the update against the sum of the backward's micro-batches (DDP: the ranks' mean), on probe elements"
    kinds = {"reduce": Kind("system.rank_divergence", "the gradient all-reduce did not return the ranks' mean (a "
                                                      "communication hook, a bucket, one rank's copy)"),
             "written": Kind("optim.gradient_mismatch", "the named parameter's gradient was changed after the backward "
                                                        "produced it: a post-accumulate hook, a helper that writes .grad "
                                                        "before the clip", layer=BACKWARD),
             "scaled": Kind("optim.gradient_spike", "the named parameter's gradient was scaled after the backward "
                                                    "produced it (a hook or a helper that multiplies .grad)",
                            layer=BACKWARD),
             "precision": Kind("numerics.precision", "the named parameter's gradient was rounded to a coarser format "
                                                     "after the backward produced it: a cast in a hook, a reduction in a "
                                                     "lower precision", layer=BACKWARD),
             "missing": Kind("optim.gradient_mismatch", "the named parameter, trained by the config, received no "
                                                        "gradient: frozen (requires_grad off) or cut off the graph "
                                                        "(a detach)", layer=BACKWARD)}

    @classmethod
    def applies(cls, ctx) -> bool:
        return not ctx.sharded

    def __init__(self, ctx):
        super().__init__(ctx)
        self.params = [(n, p) for n, p in ctx.model.named_parameters() if p.requires_grad]
        self.idx = {}
        for n, p in self.params:
            gen = torch.Generator().manual_seed(zlib.crc32(n.encode()) + 1)
            self.idx[n] = torch.randint(0, p.numel(), (min(K, p.numel()),), generator=gen).to(p.device)
        self.where = [n for n, _ in self.params]
        self.offset, at = {}, 0  # each parameter's first probe element in the check's flat vector
        for n, _ in self.params:
            self.offset[n], at = at, at + len(self.idx[n])
        self.n = at
        sizes = torch.tensor([len(self.idx[n]) for n, _ in self.params])  # the parameter of each probe element
        self.owner = torch.repeat_interleave(torch.arange(len(self.params)), sizes).to(self.idx[self.params[0][0]].device)
        self.kept: list[tuple[str, torch.Tensor]] = []
        self.armed = False  # between the step's first forward and its update: the step's own backward
        self.hooks = None   # registered once, at the first step (the model built and wrapped by then)

    def before_forward(self, s) -> None:
        if self.hooks is None:
            self.hooks = [p.register_hook(self.keep(n)) for n, p in self.params]
        self.kept, self.armed = [], True

    def keep(self, name):
        idx = self.idx[name]

        def hook(grad):
            # NOTE: kept here, never read from .grad: under gradient_as_bucket_view an earlier bucket's all-reduce
            # may be writing the .grad of this step while the backward goes on. One gather a micro-batch (take, not a
            # flat view: a transposed gradient's would copy it all); summed after the backward (spec/monitor.py
            # counts this time). Disarmed outside the step's backward (the probe's autograd after the update), it passes
            if self.armed:
                t0 = time.perf_counter()
                self.kept.append((name, grad.detach().take(idx)))
                self.seconds += time.perf_counter() - t0
        return hook

    def before_update(self, s) -> None:
        self.armed = False
        world = self.ctx.dist.world
        dev = self.idx[self.params[0][0]].device
        # every micro-batch's probe elements, summed into each parameter's places in FP64, with their magnitudes
        local = torch.zeros(2, self.n, dtype=torch.float64, device=dev)
        if self.kept:
            terms = torch.cat([t for _, t in self.kept]).double()
            at = self._places(tuple(n for n, _ in self.kept), dev)
            local[0].index_add_(0, at, terms)
            local[1].index_add_(0, at, terms.abs())
        got = torch.cat([p.grad.take(self.idx[n]).double() if p.grad is not None
                         else torch.zeros_like(self.idx[n], dtype=torch.float64) for n, p in self.params])
        if world > 1:
            every = [torch.empty_like(local) for _ in range(world)]
            tdist.all_gather(every, local)
            stacked = torch.stack(every)  # (world, 2, n): each rank's local sum and its terms' magnitude
        else:
            stacked = local[None]
        mean, mag = stacked[:, 0].mean(0), stacked[:, 1].sum(0) / world
        err = (got - mean).abs()
        tol = LAMBDA * 3 * U32 * mag + 1e-300  # the micro-batch sum, the division by the world, the reduction
        # NOTE: a non-finite gradient from the backward (its magnitude, the tolerance, non-finite) judges nothing
        # here: it is the forward's or the backward's own (loss_grad names the layer; FP16's scaler skips the step)
        ratio = torch.where(torch.isfinite(tol), err / tol, 0.0)
        owner = self.owner
        worst = torch.zeros(len(self.params), dtype=torch.float64, device=err.device).scatter_reduce(
            0, owner, ratio, "amax")
        # every parameter the config trains gets a gradient each step: no hook ran and no .grad, it got none
        fired = {n for n, _ in self.kept}
        none = [float(not (p.requires_grad and (n in fired or p.grad is not None))) for n, p in self.params]
        missing = on_device(none, err.device, torch.float64)
        worst = torch.maximum(worst, missing * 2)  # a miss of 2: one gradient absent, where there must be one
        names = list(self.kinds)
        kinds = torch.where(missing > 0, float(names.index("missing")),
                            float(names.index("reduce" if world > 1 else "written")))
        self.measure(worst, 1.0, kinds)
        self.places = (got, mean, tol, owner, none)
        self.kept = []

    def _places(self, order: tuple[str, ...], device) -> torch.Tensor:
        """Where each kept element goes in the flat vector, for the order the hooks ran in (cached: the same each
        step of a run)."""
        if getattr(self, "_order", (None,))[0] != order:
            at = torch.cat([torch.arange(self.offset[n], self.offset[n] + len(self.idx[n])) for n in order])
            self._order = (order, on_device(at, device))
        return self._order[1]

    def classify(self, i: int) -> str:
        """A parameter's .grad within a rounding of what its backward produced (kind_of: relative error below 2^-3)
        with every probe element on a coarser format's grid (its low bits zero: spec/checks/precision.py) was rounded
        after it; one process: a multiple of it was scaled after it."""
        got, want, tol, owner, none = self.places
        if none[i]:
            return "missing"
        mine = owner == i
        kind = kind_of(got[mine], want[mine], tol[mine].norm())
        if kind == "precision" and on_coarser_grid(got[mine], self.params[i][1].dtype):
            return "precision"
        if self.ctx.dist.world > 1:
            return "reduce"
        return "scaled" if kind == "scaled" else "written"


class ReplicasCheck(Check):
    name, layer, cadence, phase = "replicas", SYSTEM, STEP, AFTER
    rank = 60
    doc = "every replica's parameters the same bits after the step"
    kinds = {"replicas": Kind("system.rank_divergence", "the replicas stopped holding the same parameters")}

    @classmethod
    def applies(cls, ctx) -> bool:
        return _replicated(ctx)

    def end_step(self, s) -> None:
        ps = [p.detach().reshape(-1) for p in self.ctx.model.parameters()]
        fp = torch.cat([torch.stack(torch._foreach_norm(ps, 2)).double(),
                        torch.stack([_bits(p[::STRIDE]).to(torch.int64).sum() for p in ps]).double()])
        hi, lo = fp.clone(), fp.clone()
        tdist.all_reduce(hi, op=tdist.ReduceOp.MAX)
        tdist.all_reduce(lo, op=tdist.ReduceOp.MIN)
        off = (hi != lo).any().double()  # the same computation on the same numbers gives the same bits
        self.measure(off, 0.5, "replicas", where=["parameters"])
