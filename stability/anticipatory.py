"""Anticipatory routing (DeepSeek-V4; docs/course.md §9): train on expert ids that
were chosen Δt optimizer steps earlier, while hidden states and gate weights come from the current
parameters. The guard turns it on after a rollback and off once training is stable again.

Timing (policy version v = optimizer updates applied; step t's forward runs on version t−1):

    step t, after loader.next(), BEFORE the forward (parameters at version t−1):
        1. routing-only forward (model(tokens, routes_only=True): through the wrapper, no grad; it stops
           at the last MoE layer's router) of the batch that will be trained at step t+Δt  →  cached
           under its batch ID with route version t−1;
        2. step t's own batch is trained with the ids cached for it.
    The batch computed at step t is trained at step t+Δt on feature version t+Δt−1, so
        delay = feature_version − route_version = (t+Δt−1) − (t−1) = Δt.

Δt = 0: step 1 routes the current batch right before its forward, with the same parameters, bias and
autocast → the same ids as normal top-k routing (bit-for-bit; tested).

Activation (or reset, a resume into another world size, or any cursor jump) finds no cache entry for the current batch; the
batches t..t+Δt−1 are then routed at once with version t−1, so their delay ramps 0, 1, .., Δt−1 before
the steady Δt. info(step) reports the delay actually served at each step.

Batch ID: the global first sample id of a step's batch (loader.samples_consumed before next()); the
samples of a batch are pure functions of their ids, so Loader.peek(k) rebuilds any upcoming batch
without moving the cursor. Every rank routes its own local shard.

While OFF nothing runs: no peek, no routing forward, no hook; routes_for returns None at once.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from stability.callbacks import Callback, StepState
from stability.config import AnticipatoryConfig

Routes = list[dict[int, Tensor]]  # one {MoE layer: ids (b, T, k)} per micro-batch


@dataclass
class _Entry:
    route_version: int  # policy version of the parameters that chose these ids
    routes: Routes


class AnticipatoryRouting(Callback):
    order = {"on_batch": 10}  # after a data drill replaced the batch: the routes are the trained batch's
    def __init__(self, model, loader, micro_batches: int, cfg: AnticipatoryConfig, device, autocast=None,
                 forward=None):
        """model: the unwrapped Transformer; forward: the module the step calls (DDP / FSDP2 wrapper,
        default `model`): the routing forward goes through it so FSDP2 gathers the parameters; loader:
        micro_batches: train.micro_batches (routes follow the same split); autocast: the recipe's
        callable returning a context manager, so routing sees the activations training will see; cfg:
        guard.anticipatory, checked by the schema (this object reads its delay Δt)."""
        delay = cfg.delay
        if not model.moe_layers():
            raise ValueError("guard.anticipatory: the model has no MoE layer to route (model.moe=null)")
        self.model, self.loader, self.micro_batches = model, loader, micro_batches
        self.forward = forward if forward is not None else model
        self._has_dtensor: bool | None = None  # asked at the first routing forward (parameters sharded by then)
        self.delay, self.device = delay, torch.device(device)
        self.autocast = autocast if autocast is not None else contextlib.nullcontext
        self.active = False
        self.on_since: int | None = None  # first step trained with anticipatory routes
        self._cache: dict[int, _Entry] = {}  # batch first id -> entry; Δt+1 entries at most
        self._served: tuple[int, int] | None = None  # (step, route version) of the last routes_for

    def activate(self, step: int) -> None:
        """Train with anticipatory routes from `step` on (already on: nothing changes)."""
        if self.active:
            return
        self.active, self.on_since = True, step
        self._cache.clear()

    def deactivate(self, step: int) -> None:
        """Back to normal routing from step+1 on; drops the cache. Duration: step − on_since + 1."""
        self.active, self.on_since = False, None
        self._cache.clear()

    def reset(self) -> None:
        """After a rollback: the parameters and the cursor changed, so every cached id is stale."""
        self._cache.clear()

    def routes_for(self, step: int, first_id: int) -> Routes | None:
        """Call right after step `step`'s loader.next() (first_id = loader.samples_consumed before it).

        Routes the batch Δt steps ahead with the current parameters, then returns this batch's cached
        routes (one dict per micro-batch, on the device), or None while off.
        """
        if not self.active:
            return None
        bs = self.loader.batch_size
        if first_id != self.loader.samples_consumed - bs:
            raise RuntimeError(f"routes_for(step={step}, first_id={first_id}): the loader has moved on to "
                               f"{self.loader.samples_consumed}; call it right after that step's next()")
        if first_id not in self._cache:  # activation, resume, reset or a cursor jump: route t..t+Δt−1 now
            self._cache.clear()
            for j in range(self.delay):
                self._cache[first_id + j * bs] = self._route(j, step)
        # NOTE: with Δt = 0 this is the current batch, routed just before its own forward.
        self._cache[first_id + self.delay * bs] = self._route(self.delay, step)
        entry = self._cache.pop(first_id)  # trained now: its ids are never needed again
        self._served = (step, entry.route_version)
        return entry.routes

    def on_batch(self, s: StepState) -> None:
        """The step's callback point: this batch's routes (None while off), its StepRecord.routing, and
        the time the routing-only forward took (time_s.route, not the data's)."""
        t0 = time.perf_counter()
        s.routes = self.routes_for(s.step, s.first_id)
        s.routing = self.info(s.step)
        s.time_s["route"] = time.perf_counter() - t0

    def _sharded(self) -> bool:
        if self._has_dtensor is None:
            self._has_dtensor = any(isinstance(p, DTensor) for p in self.model.parameters())
        return self._has_dtensor

    def _route(self, j: int, step: int) -> _Entry:
        """Routes of the batch trained at step+j (peek(j−1): next() of step `step` already ran)."""
        batch = self.loader.peek(j - 1)
        # NOTE: inference_mode (no version counters, no autograd metadata: a cheaper routing forward) on
        # the bare model only: a DDP / FSDP2 wrapper keeps state across forwards (FSDP2's
        # all-gather buffers) that a later grad-mode forward updates in place, so no_grad there.
        # WARN: fully_shard wraps the model in place (forward is model), so sharded parameters say it: a
        # resumed FSDP2 run whose first all-gather came under inference_mode failed its next training step.
        grad_off = torch.inference_mode if self.forward is self.model and not self._sharded() else torch.no_grad
        routes = []
        with grad_off():
            for mb in batch.micro_batches(self.micro_batches):  # the split train.py uses
                with self.autocast():
                    routes.append(self.forward(mb.tokens.to(self.device, non_blocking=True), routes_only=True))
        if grad_off is torch.inference_mode:  # the training forward saves the ids for backward (gather)
            routes = [{layer: ids.clone() for layer, ids in r.items()} for r in routes]
        # NOTE: version step−1 assumes every earlier step applied its update; a skipped (non-finite)
        # step leaves the parameters unchanged, so the true delay can then be smaller than reported.
        return _Entry(route_version=step - 1, routes=routes)

    def info(self, step: int) -> dict:
        """The StepRecord `routing` field of a step: {on, delay, feature_version, route_version}.

        A step that got no routes from routes_for ran normal top-k routing: route version = feature
        version, delay 0, even when the guard turned routing on later in that step.
        """
        if self._served is not None and self._served[0] == step:
            rv = self._served[1]
            return {"on": True, "delay": step - 1 - rv, "feature_version": step - 1, "route_version": rv}
        return {"on": False, "delay": 0, "feature_version": step - 1, "route_version": step - 1}

    def state_dict(self) -> dict:
        """Rank-independent state; the cache (each rank's own shard) is cache_state()."""
        return {"active": self.active, "on_since": self.on_since, "delay": self.delay}

    def cache_state(self) -> dict:
        """The cached ids (chosen by parameters a checkpoint no longer holds): saved per rank, so a run
        resumed inside the window trains on the same routes, with the same delays, as the straight one."""
        return {fid: (e.route_version, [{l: ids.cpu() for l, ids in r.items()} for r in e.routes])
                for fid, e in self._cache.items()}

    def load_cache_state(self, sd: dict) -> None:
        self._cache = {fid: _Entry(v, [{l: ids.to(self.device) for l, ids in r.items()} for r in routes])
                       for fid, (v, routes) in sd.items()}

    def load_state_dict(self, sd: dict) -> None:
        self.active, self.on_since = bool(sd["active"]), sd["on_since"]
        self._cache.clear()
        self._served = None
