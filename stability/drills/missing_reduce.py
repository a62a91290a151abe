"""missing_reduce: at step s, DDP rank `rank` keeps its local gradient instead of the all-reduced
average (a DDP comm hook); the replicas then diverge. 2+ DDP processes only."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel as DDP

from run.config_errors import check
from stability.drills.base import ONE_SHOT, Drill


@dataclass
class Config:
    rank: int = 1  # the rank that keeps its local gradient

    def __post_init__(self) -> None:
        check(self.rank >= 0, "rank", self.rank, "must be >= 0")


class MissingReduce(Drill):
    kind = "missing_reduce"
    expects = "system.rank_divergence"
    lifetime = ONE_SHOT
    points = ("before_forward", "after_update", "wrap")
    Config = Config
    min_world = 2

    def __init__(self, cfg, step, ctx):
        super().__init__(cfg, step, ctx)
        self.step = 0  # the step last given to before_forward: the comm hook's step
        self._armed = self._logged = False

    def check(self) -> None:
        world = self.ctx.world
        if world < 2 or self.cfg.rank >= world:
            rank = self.key("rank")
            self.fail(f"needs 2+ DDP processes and {rank} < world; got world={world}, {rank}={self.cfg.rank}")

    def before_forward(self, s) -> None:
        self.step = s.step
        if self.fired or s.step != self.s:
            self._armed = False
        else:
            self.fired = self._armed = True

    def after_update(self, s) -> None:
        self._armed = False

    def wrap(self, wrapped) -> None:
        if not isinstance(wrapped, DDP):
            self.fail(f"needs a DistributedDataParallel model (parallel.mode=auto or ddp, 2 processes, no compile); "
                      f"got {type(wrapped).__name__}")
        wrapped.register_comm_hook(None, self._comm_hook)

    def _comm_hook(self, state, bucket):
        """DDP's default (all_reduce of buffer/world), except that the faulty rank keeps its own buffer.

        NOTE: no return annotation: DDP rejects any but Future[Tensor], and under postponed
        annotations that one is a string."""
        buf = bucket.buffer()
        local = None
        if self._armed:
            if not self._logged:
                self._logged = True
                self.emit(self.step, rank=self.cfg.rank)
            if self.ctx.rank == self.cfg.rank:
                local = buf.clone()  # the gradient of world·L_rank: this rank's estimate, unaveraged
        # WARN: the faulty rank still joins the all_reduce, or every other rank waits for it forever.
        # NOTE: synchronous, and a future completed here: a Python callback chained with fut.then() is
        # released on gloo's worker thread, which then needs the GIL — one more way into the exit deadlock
        # that parallel.release prevents at its root (the reducer must never own the group last).
        tdist.all_reduce(buf.div_(self.ctx.world))
        fut = torch.futures.Future()
        fut.set_result(buf if local is None else local)
        return fut
