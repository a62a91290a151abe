"""The step checks itself against its specification: the registered checks (spec/checks/), attached to the step.

    spec = Conformance(ctx, cfg)     # run/build.py; one Callback, acting at every point of the step
    ...                              # the checks measure at the step's points, into the step's HostScalars
    spec.read(s, host, phase)        # train.py, after each read: s.spec filled, the new failures returned

Cheap checks run every step; the reference checks (the probe through the FP64 reference) on step 1 and every
`spec.every` steps (telemetry's cadence by default), and on a step the guard flagged (on_demand). A check whose
verdict is known before the update (phase "before": the data, the state the step started from, the routes, the
gradient of the loss, the clip, the LR) is read with the step's first read when the guard can veto, so a step
that broke them never reaches the weights; the rest (the optimizer's algebra, the balancing bias, the replicas,
the probe) are read after the update, where guard=rollback undoes the step. Every rank runs every check on its own
share; the worst rank's result is kept, and a failure on some ranks only takes the check's rank class (rank.data;
the ranks disagreeing after a reduction: system.rank_divergence).

A check that cannot run on what the step gave it (a weight its specification names is missing, a shape or an index
the config does not give: the error raised) fails at that step, its first kind, named by the error: a model or an
optimizer built otherwise than the config is a finding, not a crash of the run.

The monitor's state (each check's: the data cursor of the plan, the fingerprint the state ended with, the
update count) rides in the checkpoint as a TrainState extra, so a resume and a rollback are checked against
what was saved.
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as tdist

from spec.check import AFTER, BEFORE, REFERENCE, SpecContext, on_device, pack
from spec.checks import registry
from spec.probe import row, run_probe
from stability.callbacks import Callback, StepState

DEMAND = "demand"  # the reference checks run on a step the guard flagged that was not a reference step
LATE = ("after_update", "end_step")  # the points after the read of the checks known before the update

TIMELINE = {"input": "input", "forward": "forward", "backward": "backward/update", "update": "backward/update",
            "system": "system"}  # a check's layer -> the doctor's timeline layer


class Conformance(Callback):
    # after a drill and an intervention at every point (they are what is checked), before telemetry's forward
    # hooks (so the data and the state are checked before anything reads them), and after every writer of the
    # update (levers, telemetry, drills, interventions) for what the step left
    order = {"before_batch": 50, "before_forward": 15, "before_update": 95, "after_clip": 50, "after_update": 90,
             "end_step": 50}
    optional = True  # a checkpoint saved without it (an older run) resumes, and the checks take their baseline

    def __init__(self, ctx: SpecContext, every: int):
        self.ctx, self.every = ctx, every
        self.checks = [cls(ctx) for cls in registry().values() if cls.applies(ctx)]
        self.rank = {c.name: c.rank for c in self.checks}
        self.phase = {BEFORE: [c for c in self.checks if c.phase == BEFORE],
                      AFTER: [c for c in self.checks if c.phase == AFTER],
                      DEMAND: [c for c in self.checks if c.cadence == REFERENCE]}
        self._probe: tuple[int, object] | None = None
        self._demand: int | None = None  # the step whose reference checks run on demand (on_demand)
        self._failing: int | None = None  # the last step a check failed on (on_demand probes a failure's first)
        self.seconds = 0.0  # the monitor's own host time since took() (the put, the read); each check keeps its own
        ctx.probe = self.probe
        ctx.reference_step, ctx.reference_every = self.reference_step, every

    def reference_step(self, step: int) -> bool:
        return step == 1 or step % self.every == 0

    def probe(self, s: StepState):
        """The probe run of this step (spec/probe.py), once, on a reference step; None otherwise."""
        if not (self.reference_step(s.step) or self._demand == s.step):
            return None
        if self._probe is None or self._probe[0] != s.step:
            c, scaler = self.ctx, self.ctx.scaler
            # NOTE: its row: on demand, the prefix check's of the step (the row a failure was found on); on the
            # reference steps, in turn by their own count, every row of the batch within micro·rows of them (by the
            # step itself, multiples of `every` would keep to one micro-batch wherever micro divides it)
            turn = s.step if self._demand == s.step else s.step // self.every
            at = row(turn, len(s.micro), s.micro[0].tokens.shape[0])
            self._probe = (s.step, run_probe(c.model, s.micro, s.routes, float(c.cfg.train.z_loss), c.recipe.autocast,
                                             float(scaler.scale) if scaler is not None else None,
                                             want_grads=not c.sharded, at=at))
        return self._probe[1]

    def _at(self, point: str, s: StepState, checks=None) -> None:
        ref = self.reference_step(s.step)
        for c in self.checks if checks is None else checks:
            if c.cadence == REFERENCE and not ref and checks is None:
                continue
            t0 = time.perf_counter()
            try:
                if not c.raised:
                    getattr(c, point)(s)
            except torch.OutOfMemoryError:
                raise
            except (RuntimeError, KeyError, IndexError, ValueError, TypeError) as e:
                # NOTE: a check that cannot run on what the step gave it (a weight its specification names is not
                # there, a shape the config does not give) has found the step built otherwise than its specification:
                # a failure of that check at this step, its first kind, named by the error, not a crash of the run.
                # Its other points this step are skipped (their state would be this one's half-made). A check read
                # before the update that raises after it (its result already read) has no read left to fail in: raised
                if c.phase == BEFORE and point in LATE:
                    raise
                c.raised = True
                c.where = [f"{point}: {type(e).__name__}: {e}"[:300]]
                c.measured = (math.inf, 1.0, None)
            c.seconds += time.perf_counter() - t0

    def took(self) -> tuple[float, dict[str, float]]:
        """The host seconds the checks took since the last call: in all (the step's time_s["spec"]) and by check (its
        points and its forward hooks; time_s["spec.<check>"]), the monitor's own (the put, the read) under
        "monitor". NOTE: on a GPU, the time to launch their kernels; what the kernels take shows in the step's own
        times."""
        by = {"monitor": self.seconds}
        self.seconds = 0.0
        for c in self.checks:
            by[c.name], c.seconds = c.seconds, 0.0
        return sum(by.values()), by

    def before_batch(self, s: StepState) -> None:
        for c in self.checks:
            c.measured, c.extra, c.raised = None, {}, False
        self._at("before_batch", s)

    def before_forward(self, s: StepState) -> None:
        self._at("before_forward", s)

    def before_update(self, s: StepState) -> None:
        self._at("before_update", s)

    def after_clip(self, s: StepState) -> None:
        self._at("after_clip", s)
        self._put(s, BEFORE)

    def after_update(self, s: StepState) -> None:
        self._at("after_update", s)

    def end_step(self, s: StepState) -> None:
        self._at("end_step", s)
        self._put(s, AFTER)
        self._probe = None

    def on_demand(self, s: StepState, host) -> list[dict]:
        """A step that was not a reference step, which the guard flagged (a statistic left its band) or on which a
        check failed where the step before failed none: its reference checks run now, after its read — the probe
        re-executes the training path on the row the prefix check read at the step, with the weights the update left,
        as on any reference step — and their results join the step's record through a host read of their own (such a
        step's only). So an incident the doctor judges natural is one whose step computed what its specification says,
        not one no reference check looked at (a rerun of the suspect step, as Megatron-core's rerun state machine does,
        here by the checks); and a fault an every-step check sees by its consequence (a norm's gain ignored: the gain
        gets no gradient) is named by the layer that computed otherwise, at its first step. Returns the failures.
        NOTE: a failure's first step only: a fault that fails every step is probed once, not every step."""
        # NOTE: every rank decides alike (the guard judges the reduced numbers, the failures are every rank's), as the
        # probe's and the pack's collectives need
        failed, failing = bool(s.spec.get("fail")), self._failing == s.step - 1
        if failed:
            self._failing = s.step
        if self.reference_step(s.step) or not self.phase[DEMAND] or (failed and failing):
            return []
        self._demand = s.step
        try:
            for c in self.phase[DEMAND]:
                c.measured, c.extra, c.raised = None, {}, False
            self._at("after_update", s, self.phase[DEMAND])
            t1 = time.perf_counter()
            self._pack(s, DEMAND)
        finally:
            self._demand, self._probe = None, None
        host.read()
        self.seconds += time.perf_counter() - t1
        return self.read(s, host, DEMAND)

    # --- the read ----------------------------------------------------------------------------------------
    def _put(self, s: StepState, phase: str) -> None:
        t0 = time.perf_counter()
        self._pack(s, phase)
        self.seconds += time.perf_counter() - t0

    def _pack(self, s: StepState, phase: str) -> None:
        checks = self.phase[phase]
        if not checks:
            return
        dev = s.n_valid_t.device
        table = pack(checks, dev)
        world = self.ctx.dist.world
        if world > 1:
            every = [torch.empty_like(table) for _ in range(world)]
            tdist.all_gather(every, table)
            table = torch.stack(every)
        else:
            table = table[None]
        s.host.put(**{f"spec/{phase}": table})
        extra = {f"spec/{k}": on_device(v, dev) for c in checks for k, (_, v) in c.extra.items()}
        for k, v in extra.items():
            if world > 1:
                tdist.all_reduce(v, op=tdist.ReduceOp.MAX)
            s.host.put(**{k: v})

    def read(self, s: StepState, host, phase: str) -> list[dict]:
        """After the step's read of `phase`'s checks: fill s.spec, return the failures (dicts) found."""
        t0 = time.perf_counter()
        try:
            return self._read(s, host, phase)
        finally:
            self.seconds += time.perf_counter() - t0

    def _read(self, s: StepState, host, phase: str) -> list[dict]:
        key = f"spec/{phase}"
        if key not in host:
            return []
        checks, table = self.phase[phase], host[key]  # table: [rank][check][miss, where, kind, err, tol]
        spec = s.spec.setdefault("miss", {})
        fails = []
        for j, c in enumerate(checks):
            per_rank = [table[r][j] for r in range(len(table))]
            ran = [row for row in per_rank if row[0] >= 0]
            if not ran:
                continue
            rank = max(range(len(per_rank)), key=lambda r: per_rank[r][0])
            miss, where, kind, err, tol = per_rank[rank]
            spec[c.name] = miss
            if not miss > 1:
                continue
            classify = getattr(c, "classify", None) if not c.raised else None
            # NOTE: how it missed, when the check decides that only for a failure (rank 0's own measurement)
            kname = classify(int(where)) if classify is not None and rank == self.ctx.dist.rank else c.kind_name(kind)
            failing = sum(row[0] > 1 for row in ran)
            if 1 < len(per_rank) and failing < len(per_rank) and getattr(c, "rank_kind", None):
                kname = c.rank_kind  # one rank (not all of them) broke it: that rank's inputs or gradient
            k = c.kinds[kname]
            fails.append({"check": c.name, "kind": kname, "class": k.cls, "layer": TIMELINE[k.layer or c.layer],
                          "where": c.where[int(where)] if int(where) < len(c.where) else None, "rank": rank,
                          "err": err, "tol": tol, "miss": miss, "fix": k.fix, "series": c.onset_series,
                          **self._family(c)})
        # in the registry's order across both reads: the first failure listed is the one that broke first
        s.spec["fail"] = sorted(s.spec.get("fail", []) + fails, key=lambda f: self.rank[f["check"]])
        if phase == AFTER:  # the step's outcome is on the host now: the checks that count updates go on from it
            for c in checks:
                if c.measured is not None and hasattr(c, "after_read"):
                    c.after_read(s)
        for c in checks:
            for k, (names, _) in c.extra.items():
                if f"spec/{k}" in host:
                    s.spec[k] = dict(zip(names, host[f"spec/{k}"]))
        return fails

    def _family(self, c) -> dict:
        """A failure's family fields: `family`, the check whose places it checks on other steps; `between`, the checks
        that check its places on the steps it does not run (doctor/conformance.py reads both)."""
        between = [d.name for d in self.checks if d.family == c.name]
        return {**({"family": c.family} if c.family else {}), **({"between": between} if between else {})}

    def rolled_back(self, cursor: int) -> None:
        """The guard restored an earlier state (its snapshot brought the checks' state back with it) and put the
        data cursor at `cursor` by its declared data policy."""
        for c in self.checks:
            hook = getattr(c, "rolled_back", None)
            if hook is not None:
                hook(cursor)

    # --- checkpoint ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {c.name: c.state_dict() for c in self.checks}

    def load_state_dict(self, sd: dict) -> None:
        for c in self.checks:
            if c.name in sd:
                c.load_state_dict(sd[c.name])


def build_spec(cfg, *, model, wrapped, optimizer, scheduler, loader, dataset, dist, recipe, scaler, evals,
               clip_policy, sharded: bool) -> Conformance | None:
    """The run's Conformance, or None when spec.enabled is false."""
    sc = cfg.spec
    if not sc.enabled:
        return None
    ctx = SpecContext(cfg=cfg, model=model, model_cfg=cfg.model.for_data(dataset), wrapped=wrapped, optimizer=optimizer,
                      loader=loader, dataset=dataset, dist=dist, recipe=recipe, scaler=scaler, evals=evals,
                      scheduler=scheduler, clip_policy=clip_policy, sharded=sharded, compiled=bool(cfg.train.compile),
                      max_grad_norm=cfg.train.max_grad_norm, names={id(p): n for n, p in model.named_parameters()})
    every = sc.every or cfg.telemetry.every or 10
    return Conformance(ctx, every)

