"""The collectives (DDP): the reduced gradient is the mean of the ranks' own (reduce), and every replica ends the
step alike (replicas).

reduce     each rank's local gradient on probe elements of every parameter is kept as its backward produces it
           (a tensor hook sees each micro-batch's contribution before DDP's reducer adds it up), gathered from every
           rank after the backward, and their mean compared with the gradient the reduction left: the micro-batches
           are summed in FP32, DDP divides by the world size and sums in FP32, 3·u32 of the terms' magnitudes per
           element (λ of it). Known before the update: the guard can refuse a step whose reduction was wrong.
replicas   the parameters' end-of-step fingerprint (each one's FP32 norm and the exact sum of a strided sample of
           its bits, as spec/checks/state.py takes a checkpoint's) is the same bits on every rank.

Under FSDP2 a parameter is a shard and its gradient a reduce-scatter of unsharded gradients no hook holds: the
gradient checks there are loss_grad's (the gain's gradient against its closed form over every rank) and the
probe's; replicas do not exist.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as tdist

from spec.check import AFTER, BEFORE, STEP, SYSTEM, Check, Kind
from spec.checks.state import STRIDE, _bits
from spec.tolerance import LAMBDA, U32

K = 4


def _replicated(ctx) -> bool:
    return ctx.dist.world > 1 and not ctx.sharded


class ReduceCheck(Check):
    name, layer, cadence, phase = "reduce", SYSTEM, STEP, BEFORE
    rank = 28  # after the data and the forward's inputs, before the gradient's own checks: it explains them
    doc = "DDP's reduced gradient against the mean of the ranks' local gradients, on probe elements"
    kinds = {"reduce": Kind("system.rank_divergence", "the gradient all-reduce did not return the ranks' mean (a "
                                                      "communication hook, a bucket, one rank's copy)")}

    @classmethod
    def applies(cls, ctx) -> bool:
        return _replicated(ctx)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.params = [(n, p) for n, p in ctx.model.named_parameters() if p.requires_grad]
        self.idx = {}
        for n, p in self.params:
            gen = torch.Generator().manual_seed(zlib.crc32(n.encode()) + 1)
            self.idx[n] = torch.randint(0, p.numel(), (min(K, p.numel()),), generator=gen).to(p.device)
        self.where = [n for n, _ in self.params]
        self.local: dict[str, torch.Tensor] = {}
        self.hooks = []

    def before_forward(self, s) -> None:
        self.local = {}
        self.hooks = [p.register_hook(self.keep(n)) for n, p in self.params]

    def keep(self, name):
        idx = self.idx[name]

        def hook(grad):
            # NOTE: summed here, never read from .grad: under gradient_as_bucket_view an earlier bucket's
            # all-reduce may be writing the .grad of this step while the backward goes on. The FP32 accumulation
            # of the micro-batches rounds relative to their magnitudes, not their sum's: both are kept.
            incoming = grad.detach().reshape(-1)[idx].double()
            prior = self.local.get(name, torch.zeros(2, len(idx), dtype=torch.float64, device=incoming.device))
            self.local[name] = prior + torch.stack([incoming, incoming.abs()])
        return hook

    def before_update(self, s) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        world = self.ctx.dist.world
        local = torch.cat([self.local.get(n, torch.zeros(2, len(self.idx[n]), dtype=torch.float64))
                           for n, _ in self.params], dim=1)
        got = torch.cat([p.grad.reshape(-1)[self.idx[n]].double() if p.grad is not None
                         else torch.zeros_like(self.idx[n], dtype=torch.float64) for n, p in self.params])
        every = [torch.empty_like(local) for _ in range(world)]
        tdist.all_gather(every, local)
        stacked = torch.stack(every)  # (world, 2, n): each rank's local sum and its terms' magnitude
        mean, mag = stacked[:, 0].mean(0), stacked[:, 1].sum(0) / world
        err = (got - mean).abs()
        tol = LAMBDA * 3 * U32 * mag + 1e-300  # the micro-batch sum, the division by the world, the reduction
        owner = torch.repeat_interleave(torch.arange(len(self.params)), torch.tensor([len(self.idx[n]) for n, _ in
                                                                                     self.params])).to(err.device)
        worst = torch.zeros(len(self.params), dtype=torch.float64, device=err.device).scatter_reduce(
            0, owner, err / tol, "amax")
        self.measure(worst, torch.ones_like(worst), "reduce")


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
        self.measure(off, torch.tensor(0.5, dtype=torch.float64), "replicas", where=["parameters"])
