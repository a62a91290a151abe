"""The stability guard: what a run does when the spike detector fires.

    guard.action = log       record the trigger (events.jsonl + StepRecord), change nothing
                 = skip      veto this step's update: parameters and optimizer state untouched
                 = rollback  veto, then restore a recent good TrainState and (MoE) turn on
                             anticipatory routing until training is quiet again (DeepSeek-V4)

Two checkpoints of the step feed the detector (docs/design.md §3):
  before the update  loss, grad norm, non-finite loss / logits / grads   → skip or rollback can veto
  after the update   max update ratio ρ, non-finite optimizer state, replica divergence → only a
                     rollback can undo an update that was already applied (skip logs that it can't)

Skip accounting (docs/course.md §5: a skip must be counted, never silent): the optimizer does not
step (its step count does not advance, so Adam's bias correction is unchanged); the scheduler DOES
advance (the LR schedule follows the step clock); the batch is consumed: the data cursor and
`tokens` move on, and the guard counts `skipped_steps` and `skipped_tokens` (in the StepRecord's
`guard` field and in the TrainState).

Rollback: the snapshot source is an in-memory ring of TrainState snapshots (every `snapshot_every`
healthy steps, the last `keep`) or the newest complete checkpoint on disk. The target is the newest
one at least `margin` steps before the trigger (a detector can lag; a snapshot taken just before it
fired may already hold the damage). Data policy `replay` trains the same batches again — if the same
batch triggers again on replay the fault is in the data, and the next rollback skips it; `skip`
moves the cursor past the offending window at once. Both are logged with sample-id ranges. An
incident (first trigger → quiet for `quiet_steps`) gets at most `max_rollbacks` rollbacks: a spike that
returns after each one is in the trajectory itself, and its further spikes are vetoed as skips.

Guaranteed progress: an incident stays open until the run has passed the furthest step it triggered at
(`until`) AND `quiet_steps` executed steps went by without an acted-on trigger. Both are counted by the
guard itself, never restored by a rollback (the detector's own `last_trigger_step` is rolled back with
its snapshot, so a replay of old steps would look quiet and close the incident before the spike
returns, restarting the budget forever). Ring snapshots newer than a rollback target belong to the
abandoned trajectory and are dropped. Hence per incident ≤ max_rollbacks rollbacks of ≤ keep ·
snapshot_every + margin steps each (memory), and the furthest step reached grows from one incident
to the next. A trigger with no older target left, in an incident that already rolled back, is a skip.
"""
from __future__ import annotations

import copy
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from stability.config import GuardConfig
from stability.detector import SpikeDetector, Trigger
from stability.signals import SIGNALS, SWITCH_TRIGGER, ReadContext, guard_values

# NOTE: the step's own numbers, which it hands the guard as arguments (before_update, after_update's post): the
# record fields they are, read like any record through the registry's readers; a watched signal that reads
# nothing from them needs the step's partial record (`extra`)
ARGUMENTS = {"loss": 1.0, "grad_norm": 1.0, "loss_by_source": {"_": 1.0}, "tokens_by_source": {"_": 1},
             "update_ratio_max": 1.0, "nonfinite": {}}


def _needs_more(name: str) -> bool:
    """Does the watched signal read anything beyond the step's arguments (in either phase)?"""
    return not list(SIGNALS[name].read(ARGUMENTS, ReadContext()))


class GuardAbort(RuntimeError):
    """The guard cannot act as configured (nothing to roll back to)."""


@dataclass
class Verdict:
    """What the guard decided this step (→ StepRecord.guard)."""
    triggers: list[Trigger] = field(default_factory=list)
    switches: list[Trigger] = field(default_factory=list)  # input switches: logged, never acted on
    vetoed: bool = False       # the update was not applied
    rollback: bool = False     # the loop must call guard.rollback() after this step's record

    @property
    def acted_on(self) -> list[Trigger]:
        return [t for t in self.triggers if not t.suppressed]


class Guard:
    def __init__(self, cfg: GuardConfig, *, state, ckpt, events, routing=None, is_moe: bool = False):
        d = cfg.detector  # checked by the schema when it was built (stability/config.py)
        self.detector = SpikeDetector(d)
        self.watched = list(d.metrics)
        # the step then hands the guard its partial record (extra): a watched signal beyond its arguments
        self.watches_more = any(_needs_more(n) for n in self.watched)
        self.action, self.replica_tol = cfg.action, float(cfg.replica_tol)
        # its verdict before the update can stop the update: the step must then read its numbers first
        self.vetoes = self.action in ("skip", "rollback")
        self.rb, self.an = cfg.rollback, cfg.anticipatory
        self.state, self.ckpt, self.events = state, ckpt, events
        # NOTE: anticipatory routing exists only on MoE models; on a dense model a rollback is a rollback.
        self.routing = routing if (is_moe and self.an.enabled) else None
        self.ring: deque = deque(maxlen=self.rb.keep)  # (step, TrainState snapshot, detector state)
        self.restored: list = []  # called with the data cursor after every rollback (the specification checks)
        # counters that survive a rollback (they describe the run, not a point of the trajectory)
        self.skipped_steps = self.skipped_tokens = self.rollbacks = 0
        self.bad_batches: set[int] = set()  # first sample ids that triggered (data-borne if seen twice)
        self.skip_next_window = False
        self.incident: dict | None = None   # open incident: trigger step, loss median, trajectories
        self.recent: deque = deque(maxlen=16)  # (step, loss, max expert-load violation)
        self.incident_on: int | None = None  # step anticipatory routing was turned on
        self.fingerprint: str | None = None  # the data manifest of the last step
        self.replay_until: int | None = None  # trigger step of the last rollback: replaying until then
        self.last_target: int | None = None   # step the last rollback restored
        self.quiet_run: int | None = None     # executed steps since the last acted-on trigger (None: never)
        self.verdict = Verdict()

    # --- the two checkpoints of a step ---------------------------------------------------------

    def before_update(self, step: int, loss: float, grad_norm: float, nonfinite: dict[str, bool],
                      scaled: bool = False, fingerprint: str | None = None,
                      loss_by_source: dict[str, float] | None = None,
                      tokens_by_source: dict[str, int] | None = None, extra: dict | None = None,
                      spec: list[dict] | None = None) -> bool:
        """Score the pre-update metrics; return True to veto the update.

        `scaled`: an FP16 loss scaler is on — a non-finite gradient with a finite loss is then its
        routine overflow (the scaler skips and backs off), not a spike.
        `fingerprint`: the data manifest the batch came from. A change is an input switch (docs/course.md
        §5: check LR / batch / data switches at the step): logged as a trigger at once, but never
        vetoed or rolled back — the objective changed, and no earlier state can undo that.
        `tokens_by_source`: the tokens each per-source loss is the mean of (its noise scales with them).
        `extra`: what else the step knows before its update (a partial StepRecord: inputs, logit_max, ...),
        from which any other registered signal the config watches is read (stability/signals.py).
        """
        self.verdict = Verdict()
        if fingerprint is not None:
            if self.fingerprint is not None and fingerprint != self.fingerprint:
                self.verdict.switches.append(Trigger(SWITCH_TRIGGER, 1.0, 0.0, None, None, 0,
                                                     note=f"data manifest {self.fingerprint[:12]} -> {fingerprint[:12]}"))
            self.fingerprint = fingerprint
        rec = {**(extra or {}), "loss": loss, "grad_norm": grad_norm, "nonfinite": nonfinite,
               "loss_by_source": loss_by_source or {}, "tokens_by_source": tokens_by_source or {}}
        # NOTE: under FP16 loss scaling a non-finite gradient with a finite loss is the scaler's routine overflow
        # (it skips and backs off): the gradient's signals read nothing then (ReadContext.overflow)
        ctx = ReadContext(overflow=scaled and math.isfinite(loss) and not math.isfinite(grad_norm))
        values, counts = guard_values(rec, self.watched, "before", ctx)
        triggers = self.detector.observe(step, values, counts)
        triggers += self._flags(rec, "before", ctx, {t.metric for t in triggers if t.nonfinite})
        triggers += spec_triggers(spec)
        self.verdict.triggers += triggers
        act = any(not t.suppressed for t in triggers)
        self.verdict.vetoed = act and self.action in ("skip", "rollback")
        return self.verdict.vetoed

    def _flags(self, rec: dict, phase: str, ctx: ReadContext, seen: set[str]) -> list[Trigger]:
        """A trigger per non-finite flag the step raised at this phase (the registry's flag signals), unless the
        detector already reported the value it flags as non-finite (not reported twice)."""
        return [Trigger(series, math.nan, math.inf, None, None, 0)
                for sig in SIGNALS.values() if sig.role == "nonfinite" and sig.phase == phase
                for series, v, _, _ in sig.read(rec, ctx) if v and sig.flags not in seen]

    def after_update(self, step: int, first_id: int, valid_tokens: int, post: dict, loss: float,
                     expert_violation: float | None, extra: dict | None = None,
                     spec: list[dict] | None = None) -> Verdict:
        """Score the post-update metrics; log every trigger; decide on a rollback. `extra`: the rest of
        the step's partial StepRecord after its update (moe, state, clip_coef, ...), for other registered
        signals the config watches."""
        v = self.verdict
        rec = {**(extra or {}), "update_ratio_max": post.get("update_ratio_max"), "layers": post.get("layers", {}),
               "nonfinite": post.get("nonfinite", {})}
        values, counts = guard_values(rec, self.watched, "after")
        new = self.detector.observe(step, values, counts) if values else []
        new += self._flags(rec, "after", ReadContext(), {t.metric for t in new if t.nonfinite})
        for name, spread in post.get("replica", {}).items():
            if not spread <= self.replica_tol:  # NaN spreads count as divergence
                new.append(Trigger(f"replica.{name}", spread, self.replica_tol, 0.0, None, 0,
                                   note=f"ranks disagree by {spread:.3g} > guard.replica_tol={self.replica_tol:g}"))
        new += spec_triggers(spec)
        v.triggers += new
        acted = v.acted_on
        if v.vetoed and self.action == "skip":  # a rollback undoes the whole step: nothing to count
            self.skipped_steps += 1
            self.skipped_tokens += valid_tokens
        for t in v.switches:
            self.events.emit(step, "trigger", t.describe(), metric=t.metric, value=t.value, threshold=t.threshold,
                             median=None, z=None, cooldown=0, suppressed=False, action="log", batch_first=first_id)
        for t in v.triggers:
            self.events.emit(step, "trigger", t.describe(), metric=t.metric, value=t.value, threshold=t.threshold,
                             median=t.median, z=t.z, cooldown=t.cooldown, suppressed=t.suppressed,
                             action=self.action if not t.suppressed else "none", batch_first=first_id)
        if v.vetoed and self.action == "skip":
            self.events.emit(step, "skip", f"update vetoed ({self.skipped_steps} skipped so far); scheduler "
                             f"advanced, batch consumed", skipped_steps=self.skipped_steps,
                             skipped_tokens=self.skipped_tokens, batch_first=first_id)
        elif acted and self.action == "skip":
            self.events.emit(step, "skip", "post-update trigger: the update is already applied, a skip cannot "
                             "undo it (guard=rollback can)", applied=True)
        spent = self.incident is not None and self.incident.get("rollbacks", 0) >= self.rb.max_rollbacks
        why = (f"{self.incident['rollbacks']} rollback(s) in this incident did not clear it (guard.rollback."
               f"max_rollbacks={self.rb.max_rollbacks})") if spent else ""
        if acted and self.action == "rollback" and not spent and self.incident is not None and \
                self.incident.get("rollbacks", 0) and not self._has_target(self._limit(step)):
            spent, why = True, f"no snapshot older than step {self._limit(step) + 1} is left to roll back to"
        if acted and self.incident is not None:
            self.incident["until"] = max(self.incident["until"], step)
        if acted and self.action == "rollback" and spent:
            # NOTE: restoring the same good state keeps leading back into the spike: it is in the
            # trajectory, not in one batch or one corrupted state. Looping would never end; from here the
            # incident is handled as skips (the update is vetoed, counted, logged) until it closes.
            if v.vetoed:
                self.skipped_steps += 1
                self.skipped_tokens += valid_tokens
            self.events.emit(step, "rollback_exhausted", f"{why}: "
                             + ("update vetoed instead" if v.vetoed else "the update was already applied"),
                             rollbacks=self.incident["rollbacks"], vetoed=v.vetoed, skipped_steps=self.skipped_steps,
                             batch_first=first_id)
        elif acted and self.action == "rollback":
            v.rollback = True
            if first_id in self.bad_batches and self.rb.data == "replay":
                self.skip_next_window = True  # same batch, same failure: the data, not the state
            self.bad_batches.add(first_id)
            if self.incident is None:
                hist = self.detector.history.get("loss")
                med = statistics.median(hist) if hist else None
                self.incident = {"trigger_step": step, "until": step, "metric": acted[0].metric,
                                 "loss_median": med, "before": list(self.recent), "after": [],
                                 "recovered_step": None}
        self.quiet_run = 0 if acted else (None if self.quiet_run is None else self.quiet_run + 1)
        self.recent.append((step, loss, expert_violation))
        self._track_incident(step, loss, expert_violation)
        return v

    def record(self) -> dict:
        """This step's StepRecord.guard field."""
        v = self.verdict
        return {"action": self.action, "triggers": [t.metric for t in v.acted_on + v.switches],
                "suppressed": [t.metric for t in v.triggers if t.suppressed], "vetoed": v.vetoed,
                "rollback": v.rollback, "skipped_steps": self.skipped_steps, "skipped_tokens": self.skipped_tokens,
                "rollbacks": self.rollbacks}

    # --- snapshots and rollback ------------------------------------------------------------------

    def start(self, step: int) -> None:
        """A resumed run's starting state is its first rollback target.

        WARN: not a fresh run's: torch creates Adam's state lazily, and reading the state dict of an
        optimizer that never stepped initialises it (step count 1), which changes every later update.
        A fresh run takes its first snapshot after step 1 instead (maybe_snapshot).
        NOTE: a checkpoint is taken before its step's end_step (the snapshot point precedes it), so a
        resumed run first finishes that step's incident bookkeeping, silently: the run that saved it
        already announced it. Otherwise a window the straight run closed at that step stays open.
        """
        if step > 0:
            self.end_step(step, announce=False)
        if self.action == "rollback" and self.rb.source == "memory" and step > 0:
            self.ring.append((step, self.state.snapshot(skip_extras=("faults",)), self.detector.state_dict()))

    def healthy(self) -> bool:
        """May this step's state be checkpointed? Not when the guard acted on it (rollback / skip)."""
        return not (self.verdict.acted_on and self.action != "log") and not any(
            t.metric == "nonfinite.optim_state" for t in self.verdict.triggers)

    def maybe_snapshot(self, step: int) -> None:
        """After a healthy step (nothing acted on): keep an in-memory snapshot every snapshot_every steps."""
        if self.action != "rollback" or self.rb.source != "memory" or self.verdict.acted_on:
            return
        if step % self.rb.snapshot_every == 0 or not self.ring:
            while self.ring and self.ring[-1][0] >= step:  # a replayed step replaces its old copy
                self.ring.pop()
            self.ring.append((step, self.state.snapshot(skip_extras=("faults",)), self.detector.state_dict()))

    def _limit(self, step: int) -> int:
        """The newest step a rollback triggered at `step` may restore."""
        limit = step - 1 - self.rb.margin
        if self.replay_until is not None and step <= self.replay_until and not self.skip_next_window:
            # fired again while replaying the last rollback, on other data: that target may already
            # hold the damage (a lagging detector), so go further back. (The same batch again is the
            # data's fault, not the state's: that target is fine and the window gets skipped.)
            limit = min(limit, self.last_target - 1)
        return limit

    def _has_target(self, limit: int) -> bool:
        if self.rb.source == "memory":
            return any(s <= limit for s, _, _ in self.ring)
        return self.ckpt is not None and self.ckpt.has_before(limit)

    def rollback(self, step: int) -> int:
        """Restore the newest good state at least `margin` steps before `step`; return its step."""
        limit = self._limit(step)
        cursor_after = self.state.loader.samples_consumed  # just past the batch that triggered
        kept = self._persistent()
        if self.rb.source == "memory":
            found = next(((s, snap, det) for s, snap, det in reversed(self.ring) if s <= limit), None)
            if found is None:
                raise GuardAbort(f"guard: no snapshot at step <= {limit} to roll back to (ring holds "
                                 f"{[s for s, _, _ in self.ring]}); raise guard.rollback.keep or lower margin")
            to_step, snap, det = found
            while self.ring and self.ring[-1][0] > to_step:  # the abandoned trajectory's snapshots
                self.ring.pop()
            self.state.restore(snap)
            self.detector.load_state_dict(det)
            source = f"memory:step {to_step}"
        else:
            name = self.ckpt.load_before(limit, skip_extras=("faults",))
            if name is None:
                raise GuardAbort(f"guard: no complete checkpoint at step <= {limit} in {self.ckpt.root}; set "
                                 f"checkpoint.every or use guard.rollback.source=memory")
            to_step, source = self.state.step, f"disk:{name}"
        self._restore_persistent(kept)
        self.rollbacks += 1
        self.replay_until, self.last_target = step, to_step
        cursor_restored = self.state.loader.samples_consumed
        skip = self.rb.data == "skip" or self.skip_next_window
        if skip:
            self.state.loader.samples_consumed = cursor_after
            self.skip_next_window = False
        policy = "skip" if skip else "replay"
        why = " (the same batch triggered again on replay: the fault is in the data)" if (
            skip and self.rb.data == "replay") else ""
        self.events.emit(step, "rollback", f"step {step} -> {to_step} from {source}; data {policy}{why}",
                         trigger_step=step, to_step=to_step, source=source, data_policy=policy,
                         cursor_restored=cursor_restored, cursor_now=self.state.loader.samples_consumed,
                         skipped_samples=[cursor_restored, cursor_after] if skip else None,
                         replayed_samples=None if skip else [cursor_restored, cursor_after],
                         rollbacks=self.rollbacks)
        for tell in self.restored:
            tell(self.state.loader.samples_consumed)
        if self.incident is not None:
            self.incident["rollback_to"] = to_step
            self.incident["rollbacks"] = self.incident.get("rollbacks", 0) + 1
        if self.routing is not None:
            self.routing.reset()  # routes cached with the parameters we just threw away
            if not self.routing.active:
                self.routing.activate(to_step + 1)
                self.incident_on = to_step + 1
                delay = self.routing.delay
                self.events.emit(to_step + 1, "anticipatory_on", f"anticipatory routing on from step {to_step + 1}, "
                                 f"delay {delay} (ramping 0..{delay} while the route cache fills)",
                                 delay=delay, feature_version=to_step, route_version=to_step,
                                 window=self.an.window, quiet_steps=self.an.quiet_steps)
        return to_step

    def end_step(self, step: int, announce: bool = True) -> None:
        """Anticipatory routing off after its window or once quiet; the incident closes once quiet.

        Quiet = no trigger acted on for `quiet_steps` executed steps; an incident closes only once quiet
        and past the furthest step it triggered at. While an incident is open its rollbacks are counted against max_rollbacks.
        """
        inc, quiet_n = self.incident, self.an.quiet_steps
        emit = self.events.emit if announce else (lambda *a, **k: None)
        # NOTE: counted in executed steps by the guard, not from the detector's last_trigger_step (a
        # rollback restores that, and replayed steps would look quiet)
        quiet = self.quiet_run is None or self.quiet_run >= quiet_n
        r = self.routing
        if r is not None and r.active:
            on = self.incident_on
            ran = step - on + 1
            if ran >= self.an.window or (ran >= quiet_n and quiet):
                r.deactivate(step)
                reason = "window reached" if ran >= self.an.window else f"quiet for {quiet_n} steps"
                trail = inc or {}
                emit(step, "anticipatory_off", f"anticipatory routing off after {ran} steps ({reason})",
                     duration=ran, on_step=on, reason=reason, recovered_step=trail.get("recovered_step"),
                     loss_before=[x[1] for x in trail.get("before", [])],
                     loss_after=[x[1] for x in trail.get("after", [])],
                     expert_violation_before=[x[2] for x in trail.get("before", [])],
                     expert_violation_after=[x[2] for x in trail.get("after", [])])
        if inc is not None and quiet and step > inc["until"] and not (r is not None and r.active):
            emit(step, "incident_closed", f"quiet for {quiet_n} steps: the incident that started at step "
                 f"{inc['trigger_step']} is closed ({inc.get('rollbacks', 0)} rollback(s))",
                 trigger_step=inc["trigger_step"], rollbacks=inc.get("rollbacks", 0),
                 recovered_step=inc.get("recovered_step"))
            self.incident = None

    def _track_incident(self, step: int, loss: float, violation: float | None) -> None:
        inc = self.incident
        if inc is None or "rollback_to" not in inc or step <= inc["rollback_to"]:
            return
        if len(inc["after"]) < 32:
            inc["after"].append((step, loss, violation))
        med = inc["loss_median"]
        if inc["recovered_step"] is None and med and math.isfinite(loss) and loss <= med:
            inc["recovered_step"] = step
            self.events.emit(step, "recovered", f"loss {loss:.4f} back at the pre-incident median {med:.4f}, "
                             f"{step - inc['rollback_to']} steps after the rollback",
                             recovered_steps=step - inc["rollback_to"], trigger_step=inc["trigger_step"])

    # --- state ------------------------------------------------------------------------------------

    def _persistent(self) -> dict:
        """What describes the run, not a point of its trajectory: kept across a rollback, saved in a
        checkpoint. The open incident and the anticipatory window are in it: a run resumed inside an
        incident must close it (and turn routing off) exactly where the uninterrupted run does."""
        return {"skipped_steps": self.skipped_steps, "skipped_tokens": self.skipped_tokens,
                "rollbacks": self.rollbacks, "bad_batches": sorted(self.bad_batches), "fingerprint": self.fingerprint,
                "quiet_run": self.quiet_run, "incident": copy.deepcopy(self.incident),
                "replay_until": self.replay_until, "last_target": self.last_target,
                "skip_next_window": self.skip_next_window, "recent": list(self.recent),
                "incident_on": self.incident_on,
                "routing": self.routing.state_dict() if self.routing is not None else None}

    def _restore_persistent(self, kept: dict) -> None:
        self.skipped_steps, self.skipped_tokens = kept["skipped_steps"], kept["skipped_tokens"]
        self.rollbacks, self.bad_batches = kept["rollbacks"], set(kept["bad_batches"])
        self.fingerprint = kept.get("fingerprint")
        self.quiet_run = kept.get("quiet_run")
        self.incident = copy.deepcopy(kept.get("incident"))
        self.replay_until, self.last_target = kept.get("replay_until"), kept.get("last_target")
        self.skip_next_window = bool(kept.get("skip_next_window", False))
        self.recent = deque(kept.get("recent", []), maxlen=self.recent.maxlen)
        self.incident_on = kept.get("incident_on")
        if self.routing is not None and kept.get("routing"):
            self.routing.load_state_dict(kept["routing"])

    def state_dict(self) -> dict:
        return {"detector": self.detector.state_dict(), **self._persistent()}

    def load_state_dict(self, sd: dict) -> None:
        self.detector.load_state_dict(sd["detector"])
        self._restore_persistent(sd)

    def local_state_dict(self) -> dict:
        """This rank's own part (each rank routes its shard of the batch): the anticipatory route cache."""
        return {"routes": self.routing.cache_state() if self.routing is not None else None}

    def load_local_state_dict(self, sd: dict) -> None:
        if self.routing is not None and sd.get("routes") is not None:
            self.routing.load_cache_state(sd["routes"])


def spec_triggers(failed: list[dict] | None) -> list[Trigger]:
    """A failed specification check (spec/monitor.py) is a trigger, never suppressed: the step did not do what
    its specification says, whatever the detector's cooldown."""
    return [Trigger(f"spec.{f['check']}", f["miss"], 1.0, None, None, 0,
                    note=f"{f['where']} missed its specification by {f['miss']:.3g}× its tolerance ({f['class']})")
            for f in failed or []]
