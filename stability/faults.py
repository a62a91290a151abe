"""Fault injection for stability drills: one deliberate fault, at a known step, chosen by `fault=<kind>`.

Each kind plants one cause of a loss spike from docs/course.md §1 (data switch, corrupted text, label
misalignment, overlong sequences, activation outliers, a wrong gradient reduction, corrupted optimizer
state), so the detector, guard and doctor can be shown to find it.

    kind            what happens at step s                                          lifetime
    nan_activation  NaN/inf into a few positions of blocks[layer].{attn,mlp} output  one-shot
    labels_shuffle  labels permuted over each sample's valid positions              the batch
    repeat_token    every input and label one token id, every position valid        the batch
    overlong_doc    one random-token document across every row, no BOS / padding    the batch
    lr_spike        every group's lr × factor for `steps` steps                     transient
    optim_state     Adam exp_avg_sq zeroed or scaled after the update               one-shot
    missing_reduce  one DDP rank keeps its local gradient instead of the average    one-shot
    mixture_switch  data.sources weights change; the loader draws the new mixture   persistent

FaultInjector's calls, at step t (first_id = loader.samples_consumed before next()):
    before_batch(t); batch = loader.next(); batch = corrupt(t, first_id, batch); before_forward(t)
    forward/backward; lr × lr_factor(t) around optimizer.step(); after_update(t); pop_events()
and wrap(wrapped) once, after parallel.wrap_model. The DDP comm hook of missing_reduce reads the step
last given to before_forward (also public as `self.step`): call before_forward every step. FaultDrill
makes those calls from the step's callback points (stability/callbacks.py), so train.py names no fault.

Time, the lesson of a rollback drill:
- one-shot and transient faults live in wall-clock time: they fire the first time step s is reached
  and never again, even when a rollback replays step s.
- a data fault lives in the data: it is keyed by the batch ID (first global sample id of the step-s
  batch) recorded when it first fires; a rollback that replays that batch meets the same bad data
  (same corruption: it is seeded by the sample ids), one that skips the window never sees it again.
- mixture_switch is an objective change, not an optimisation fault: from step s on the loader draws
  the new mixture, and it stays switched after a rollback to before s.
WARN: so a guard rollback must not restore this object's state (keep it out of the rollback snapshot).
state_dict / load_state_dict are for resuming a process: a resumed run neither refires a one-shot nor
forgets the bad batch id.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel as DDP

from data import IGNORE_INDEX, DataConfig, build_data
from model.moe import MoEOutput
from stability.callbacks import Callback, StepState
from stability.config import FaultConfig

DATA_KINDS = ("labels_shuffle", "repeat_token", "overlong_doc")
VALUES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def parse_fault(cfg) -> dict:
    """The `fault` node as a plain dict of the keys its kind reads; the schema (stability/config.py,
    FaultConfig) checks keys, types and ranges. kind none: {"kind": "none"}, whatever else is set."""
    return FaultConfig.from_dict(_plain(cfg)).resolved()


class FaultInjector:
    """One run's fault (kind "none": every call returns at once). Built on every rank after the
    optimizer and loader; errors that need the model or the data (layer, param, weights) surface here."""

    def __init__(self, cfg, *, model=None, optimizer=None, loader=None, data_cfg=None, dist=None):
        self.cfg = parse_fault(cfg)
        self.kind, self.s = self.cfg["kind"], self.cfg.get("step")
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.rank, self.world = (dist.rank, dist.world) if dist is not None else (0, 1)
        self.step = 0  # the step last given to a per-step call
        self._events: list[dict] = []
        self._fired = False  # one-shot kinds; data kinds: the bad batch was recorded
        self._bad_id: int | None = None  # data kinds: the batch ID that is bad
        self._token: int | None = self.cfg.get("token")  # repeat_token: the id, fixed at first fire
        self._spike_last: int | None = None  # lr_spike: the last spiked step
        self._spike_over = False
        self._switched = False
        self._handle = None  # nan_activation: the armed forward hook
        self._reduce_armed = self._reduce_logged = False
        c = self.cfg
        if self.kind == "nan_activation" and c["layer"] >= len(model.blocks):
            raise ValueError(f"fault.layer={c['layer']}: the model has {len(model.blocks)} blocks")
        if self.kind == "optim_state" and c["param"] and not any(c["param"] in n for n, _ in model.named_parameters()):
            raise ValueError(f"fault.param={c['param']}: matches no parameter name")
        if self.kind == "repeat_token" and self._token is not None and self._token >= loader.dataset.vocab_size:
            raise ValueError(f"fault.token={self._token}: must be < vocab size {loader.dataset.vocab_size}")
        if self.kind == "missing_reduce" and (self.world < 2 or c["rank"] >= self.world):
            raise ValueError(f"fault.kind=missing_reduce: needs 2+ DDP processes and fault.rank < world; "
                             f"got world={self.world}, fault.rank={c['rank']}")
        if self.kind == "mixture_switch":
            self._new_data = self._build_switched(_plain(data_cfg) or {})

    def describe(self) -> str:
        return "fault: none" if self.kind == "none" else "fault: " + ", ".join(f"{k}={v}" for k, v in self.cfg.items())

    # ---- per-step calls, in loop order ---------------------------------------------------------------
    def before_batch(self, step: int) -> None:
        self.step = step
        if self.kind == "mixture_switch" and not self._switched and step >= self.s:
            old = self.loader.dataset.weights.tolist()
            self._switch()
            self._emit(step, weights_from=old, weights_to=self.loader.dataset.weights.tolist(),
                       fingerprint=self.loader.dataset.fingerprint[:12])

    def corrupt(self, step: int, first_id: int, batch):
        """The batch to train at this step: corrupted when it is the bad batch (this rank's shard)."""
        self.step = step
        if self.kind not in DATA_KINDS:
            return batch
        replay = self._bad_id is not None
        if not (first_id == self._bad_id if replay else step == self.s):
            return batch
        self._bad_id, self._fired = first_id, True
        batch = getattr(self, f"_{self.kind}")(first_id, batch)
        extra = {"token": self._token} if self.kind == "repeat_token" else {}
        self._emit(step, batch_first=first_id, batch_size=self.loader.batch_size, replay=replay, **extra)
        return batch

    def before_forward(self, step: int) -> None:
        self.step = step
        if self._handle is not None:  # armed at an earlier step whose training forward never ran
            self._handle.remove()
            self._handle = None
        if self._fired or step != self.s:
            self._reduce_armed = False
        elif self.kind == "nan_activation":
            self._fired = True  # NOTE: fired in wall-clock time when armed: a rollback never re-arms it
            module = getattr(self.model.blocks[self.cfg["layer"]], self.cfg["sublayer"])
            # prepend: hooks registered earlier (telemetry) already see the bad output
            self._handle = module.register_forward_hook(self._nan_hook, prepend=True)
        elif self.kind == "missing_reduce":
            self._fired = self._reduce_armed = True

    def lr_factor(self, step: int) -> float:
        """Multiply every param group's lr by this for the update of `step` (call once per step)."""
        if self.kind != "lr_spike" or self._spike_over:
            return 1.0
        last = self._spike_last
        in_window = self.s <= step < self.s + self.cfg["steps"]
        if last is not None and (step != last + 1 or not in_window):  # ran out, or the clock went back
            self._spike_over = True
            return 1.0
        if not in_window:
            return 1.0
        self._spike_last, self._fired = step, True
        self._emit(step, factor=self.cfg["factor"], window=[self.s, self.s + self.cfg["steps"] - 1])
        return self.cfg["factor"]

    @torch.no_grad()
    def after_update(self, step: int) -> None:
        """optim_state: corrupt Adam's second moment v right after the optimizer step at s.

        With v := 0 the next update's denominator is √((1−β2)·g²/(1−β2^t)) instead of ≈ rms(g): the
        update grows ~1/√(1−β2) (4.5× at β2=0.95), and to m̂/ε wherever the next gradient is 0.
        """
        self._reduce_armed = False
        if self.kind != "optim_state" or self._fired or step != self.s:
            return
        self._fired = True
        names = {id(p): n for n, p in self.model.named_parameters()}
        mode, scale, sub = self.cfg["mode"], self.cfg["scale"], self.cfg["param"]
        tensors = elements = 0
        for p, st in self.optimizer.state.items():
            v = st.get("exp_avg_sq")
            if v is None or (sub and sub not in names.get(id(p), "")):
                continue
            if mode == "zero":
                v.zero_()
            else:
                v.mul_(scale)
            tensors, elements = tensors + 1, elements + v.numel()
        self._emit(step, mode=mode, scale=scale if mode == "scale" else None, param=sub,
                   tensors=tensors, elements=elements)

    def wrap(self, wrapped) -> None:
        """missing_reduce: install the comm hook on the DDP module (once, after wrap_model)."""
        if self.kind != "missing_reduce":
            return
        if not isinstance(wrapped, DDP):
            raise ValueError(f"fault.kind=missing_reduce: needs a DistributedDataParallel model "
                             f"(parallel.mode=auto or ddp, 2 processes, no compile); got {type(wrapped).__name__}")
        wrapped.register_comm_hook(None, self._comm_hook)

    def pop_events(self) -> list[dict]:
        events, self._events = self._events, []
        return events

    # ---- resume --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"kind": self.kind, "fired": self._fired, "bad_id": self._bad_id, "token": self._token,
                "spike_last": self._spike_last, "spike_over": self._spike_over, "switched": self._switched}

    def load_state_dict(self, sd: dict) -> None:
        # NOTE: state saved under another kind (e.g. a clean run resumed into a drill) starts fresh.
        if sd.get("kind") != self.kind:
            return
        self._fired, self._bad_id, self._token = sd["fired"], sd["bad_id"], sd["token"]
        self._spike_last, self._spike_over = sd["spike_last"], sd["spike_over"]
        if sd["switched"] and not self._switched:
            self._switch()

    # ---- the faults ----------------------------------------------------------------------------------
    def _emit(self, step: int, **info) -> None:
        # NOTE: decided from global quantities only, so every rank emits the same events.
        self._events.append({"step": step, "kind": "fault", "fault": self.kind, **info})

    def _nan_hook(self, module, args, output):
        if not torch.is_grad_enabled():  # a routing-only or eval forward: wait for the training one
            return None
        self._handle.remove()
        self._handle = None
        y_BTD = (output.y if isinstance(output, MoEOutput) else output).clone()
        k = min(self.cfg["positions"], y_BTD.shape[1])
        y_BTD[0, :k] = VALUES[self.cfg["value"]]  # positions 0..k-1 of sample 0 always hold labels
        self._emit(self.step, layer=self.cfg["layer"], sublayer=self.cfg["sublayer"], value=self.cfg["value"],
                   positions=k)
        return output._replace(y=y_BTD) if isinstance(output, MoEOutput) else y_BTD

    def _labels_shuffle(self, first_id: int, batch):
        labels_bT = batch.labels.clone()
        for i, g in enumerate(batch.sample_ids.tolist()):
            pos = torch.nonzero(labels_bT[i] != IGNORE_INDEX).squeeze(1)
            perm = torch.from_numpy(np.random.default_rng([self.cfg["seed"], g]).permutation(len(pos)))
            labels_bT[i, pos] = labels_bT[i, pos[perm]]
        return dataclasses.replace(batch, labels=labels_bT, floor=None)  # the floor no longer applies

    def _repeat_token(self, first_id: int, batch):
        if self._token is None:  # the most frequent label of the GLOBAL batch: the same id on every rank
            ld = self.loader
            full = ld.dataset.samples(range(first_id, first_id + ld.batch_size), ld.split)
            self._token = int(torch.bincount(full.labels[full.labels != IGNORE_INDEX]).argmax())
        fill_bT = torch.full_like(batch.tokens, self._token)
        return dataclasses.replace(batch, tokens=fill_bT, labels=fill_bT.clone(), floor=None)

    def _overlong_doc(self, first_id: int, batch):
        """Row r of the global batch is window [r·T, r·T + T] of one uniform-random document."""
        T, n, ds = batch.tokens.shape[1], self.loader.batch_size, self.loader.dataset
        pool = np.setdiff1d(np.arange(1, ds.vocab_size), getattr(ds, "bos_ids", []))  # no PAD, no BOS
        rng = np.random.default_rng([self.cfg["seed"], first_id])  # the same document on every replay
        doc = torch.from_numpy(pool[rng.integers(0, len(pool), n * T + 1)])
        rows_b = batch.sample_ids - first_id  # this rank's rows of the global batch
        doc_bT1 = doc[rows_b[:, None] * T + torch.arange(T + 1)]
        return dataclasses.replace(batch, tokens=doc_bT1[:, :-1].clone(), labels=doc_bT1[:, 1:].clone(), floor=None)

    def _comm_hook(self, state, bucket):
        """DDP's default (all_reduce of buffer/world), except that the faulty rank keeps its own buffer.

        NOTE: no return annotation: DDP rejects any but Future[Tensor], and under postponed
        annotations that one is a string."""
        buf = bucket.buffer()
        local = None
        if self._reduce_armed:
            if not self._reduce_logged:
                self._reduce_logged = True
                self._emit(self.step, rank=self.cfg["rank"])
            if self.rank == self.cfg["rank"]:
                local = buf.clone()  # the gradient of world·L_rank: this rank's estimate, unaveraged
        # WARN: the faulty rank still joins the all_reduce, or every other rank waits for it forever.
        # NOTE: synchronous, and a future completed here: a Python callback chained with fut.then() is
        # released on gloo's worker thread, which then needs the GIL — one more way into the exit deadlock
        # that parallel.release prevents at its root (the reducer must never own the group last).
        tdist.all_reduce(buf.div_(self.world))
        fut = torch.futures.Future()
        fut.set_result(buf if local is None else local)
        return fut

    def _build_switched(self, data_cfg: dict):
        data, w = DataConfig.from_dict(data_cfg), self.cfg["weights"]  # the run's data, defaults filled in
        if data.kind != "synthetic":
            raise ValueError(f"fault.kind=mixture_switch: needs data.kind=synthetic with data.sources; "
                             f"got data.kind={data.kind}")
        if len(w) != len(data.sources):
            raise ValueError(f"fault.weights={w}: expected {len(data.sources)} weights, one per data.sources entry")
        return build_data(dataclasses.replace(data, sources=[dataclasses.replace(src, weight=x)
                                                             for src, x in zip(data.sources, w)]))

    def _switch(self) -> None:
        # WARN: the loader's fingerprint changes with the weights: restoring a pre-switch loader state
        # (rollback past s, resume) meets a fingerprint mismatch unless data changes are allowed.
        self.loader.dataset = self._new_data
        self._switched = True


class FaultDrill(Callback):
    """The injector attached to the step: one object, and the loop never asks which fault it is.

    Its events go to the run's EventLog as soon as the fault fires, in the same story as the guard's.
    A drill is meant to be quiet before its injection; when the guard already acted (a natural spike on
    this seed or CPU), the fault's event says so (`preceded_by`), and the console line with it, so nobody
    reads the run's incidents as the drill's alone.
    """

    def __init__(self, injector: FaultInjector, optimizer, events, guard=None):
        self.inj, self.optimizer, self.events, self.guard = injector, optimizer, events, guard
        self._planned: list[float] | None = None  # the scheduled LRs an LR drill scaled this step
        self._checked = False  # the quiet-before-injection check is made at the first fault event

    def before_batch(self, s: StepState) -> None:
        self.inj.before_batch(s.step)
        self._emit()

    def on_batch(self, s: StepState) -> None:
        s.batch = self.inj.corrupt(s.step, s.first_id, s.batch)
        self._emit()

    def before_forward(self, s: StepState) -> None:
        self.inj.before_forward(s.step)

    def before_update(self, s: StepState) -> None:
        self._emit()  # a NaN hook fired during the forward
        factor = self.inj.lr_factor(s.step)  # 1.0 unless an LR drill
        self._planned = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] *= factor
        self._emit()

    def after_update(self, s: StepState) -> None:
        # NOTE: the scheduled LRs exactly (not lr / factor, which can round): the schedule continues from them
        for g, lr in zip(self.optimizer.param_groups, self._planned or []):
            g["lr"] = lr
        self.inj.after_update(s.step)
        self._emit()

    def _emit(self) -> None:
        for e in self.inj.pop_events():
            info = {k: v for k, v in e.items() if k not in ("step", "kind")}
            summary = ", ".join(f"{k}={v}" for k, v in info.items())
            det = getattr(self.guard, "detector", None)
            if not self._checked and det is not None:
                self._checked = True
                # NOTE: acted-on triggers before the injection; after a resume into a drill that already
                # fired, the drill's own triggers (at or after its step) are not a warning
                if det.fired and det.last_trigger_step is not None and det.last_trigger_step < e["step"]:
                    info["preceded_by"] = {"guard_triggers": det.fired, "last_trigger_step": det.last_trigger_step}
                    summary += (f"; WARN: the drill was not quiet before its injection: the guard acted on "
                                f"{det.fired} trigger(s) already (last at step {det.last_trigger_step}), so "
                                f"this run's incidents are not the drill's alone")
            self.events.emit(e["step"], "fault", summary, **info)


def _plain(cfg):
    if hasattr(cfg, "_metadata"):  # an OmegaConf node -> plain, resolved python
        from omegaconf import OmegaConf
        cfg = OmegaConf.to_container(cfg, resolve=True)
    return cfg
