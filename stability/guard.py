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
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from stability.detector import SpikeDetector, Trigger

ACTIONS = ("log", "skip", "rollback")
KEYS = {"action", "detector", "replica_tol", "rollback", "anticipatory"}
ROLLBACK_KEYS = {"source", "snapshot_every", "keep", "margin", "data", "max_rollbacks"}
ANTICIPATORY_KEYS = {"enabled", "delay", "window", "quiet_steps"}


class GuardAbort(RuntimeError):
    """The guard cannot act as configured (nothing to roll back to)."""


def _check(cfg: dict) -> dict:
    for node, keys, where in ((cfg, KEYS, "guard"), (cfg["rollback"], ROLLBACK_KEYS, "guard.rollback"),
                              (cfg["anticipatory"], ANTICIPATORY_KEYS, "guard.anticipatory")):
        extra = set(node) - keys
        if extra:
            raise ValueError(f"{where}.{sorted(extra)[0]}: unknown key, expected one of {sorted(keys)}")
    if cfg["action"] not in ACTIONS:
        raise ValueError(f"guard.action={cfg['action']}: expected one of {', '.join(ACTIONS)}")
    rb = cfg["rollback"]
    if rb["source"] not in ("memory", "disk"):
        raise ValueError(f"guard.rollback.source={rb['source']}: expected memory or disk")
    if rb["data"] not in ("replay", "skip"):
        raise ValueError(f"guard.rollback.data={rb['data']}: expected replay or skip")
    for key in ("snapshot_every", "keep", "max_rollbacks"):
        if int(rb[key]) < 1:
            raise ValueError(f"guard.rollback.{key}={rb[key]}: must be >= 1")
    if int(rb["margin"]) < 0:
        raise ValueError(f"guard.rollback.margin={rb['margin']}: must be >= 0")
    an = cfg["anticipatory"]
    for key in ("window", "quiet_steps"):
        if int(an[key]) < 1:
            raise ValueError(f"guard.anticipatory.{key}={an[key]}: must be >= 1")
    if float(cfg["replica_tol"]) < 0:
        raise ValueError(f"guard.replica_tol={cfg['replica_tol']}: must be >= 0")
    return cfg


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
    def __init__(self, cfg: dict, *, state, ckpt, events, routing=None, is_moe: bool = False):
        cfg = _check(cfg)
        d = cfg["detector"]
        extra = set(d) - {"metrics", "window", "threshold", "min_history", "cooldown", "warmup"}
        if extra:
            raise ValueError(f"guard.detector.{sorted(extra)[0]}: unknown key")
        self.detector = SpikeDetector(d["metrics"], int(d["window"]), float(d["threshold"]),
                                      int(d["min_history"]), int(d["cooldown"]), int(d.get("warmup", 0)))
        self.action, self.replica_tol = cfg["action"], float(cfg["replica_tol"])
        self.rb, self.an = dict(cfg["rollback"]), dict(cfg["anticipatory"])
        self.state, self.ckpt, self.events = state, ckpt, events
        # NOTE: anticipatory routing exists only on MoE models; on a dense model a rollback is a rollback.
        self.routing = routing if (is_moe and self.an["enabled"]) else None
        self.ring: deque = deque(maxlen=int(self.rb["keep"]))  # (step, TrainState snapshot, detector state)
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
        self.verdict = Verdict()

    # --- the two checkpoints of a step ---------------------------------------------------------

    def before_update(self, step: int, loss: float, grad_norm: float, nonfinite: dict[str, bool],
                      scaled: bool = False, fingerprint: str | None = None,
                      loss_by_source: dict[str, float] | None = None) -> bool:
        """Score the pre-update metrics; return True to veto the update.

        `scaled`: an FP16 loss scaler is on — a non-finite gradient with a finite loss is then its
        routine overflow (the scaler skips and backs off), not a spike.
        `fingerprint`: the data manifest the batch came from. A change is an input switch (docs/course.md
        §5: check LR / batch / data switches at the step): logged as a trigger at once, but never
        vetoed or rolled back — the objective changed, and no earlier state can undo that.
        """
        self.verdict = Verdict()
        if fingerprint is not None:
            if self.fingerprint is not None and fingerprint != self.fingerprint:
                self.verdict.switches.append(Trigger("input.data_fingerprint", 1.0, 0.0, None, None, 0,
                                                     note=f"data manifest {self.fingerprint[:12]} -> {fingerprint[:12]}"))
            self.fingerprint = fingerprint
        values = {"loss": loss, "grad_norm": grad_norm,
                  **{f"loss_by_source/{k}": v for k, v in (loss_by_source or {}).items()}}
        if scaled and math.isfinite(loss):
            values["grad_norm"] = grad_norm if math.isfinite(grad_norm) else None
        triggers = self.detector.observe(step, values)
        seen = {t.metric for t in triggers if t.nonfinite}
        # NOTE: a flag the detector already reported as a non-finite value is not reported twice
        covered = {"loss": "loss", "grads": "grad_norm"}
        triggers += [Trigger(f"nonfinite.{k}", math.nan, math.inf, None, None, 0)
                     for k, bad in nonfinite.items() if bad and covered.get(k) not in seen
                     and not (k == "grads" and scaled and math.isfinite(loss))]
        self.verdict.triggers += triggers
        act = any(not t.suppressed for t in triggers)
        self.verdict.vetoed = act and self.action in ("skip", "rollback")
        return self.verdict.vetoed

    def after_update(self, step: int, first_id: int, valid_tokens: int, post: dict, loss: float,
                     expert_violation: float | None) -> Verdict:
        """Score the post-update metrics; log every trigger; decide on a rollback."""
        v = self.verdict
        values = {k: post.get(k) for k in ("update_ratio_max",)}
        new = self.detector.observe(step, values) if any(x is not None for x in values.values()) else []
        if post.get("nonfinite", {}).get("optim_state"):
            new.append(Trigger("nonfinite.optim_state", math.nan, math.inf, None, None, 0))
        for name, spread in post.get("replica", {}).items():
            if not spread <= self.replica_tol:  # NaN spreads count as divergence
                new.append(Trigger(f"replica.{name}", spread, self.replica_tol, 0.0, None, 0,
                                   note=f"ranks disagree by {spread:.3g} > guard.replica_tol={self.replica_tol:g}"))
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
        spent = self.incident is not None and self.incident.get("rollbacks", 0) >= int(self.rb["max_rollbacks"])
        if acted and self.action == "rollback" and spent:
            # NOTE: restoring the same good state keeps leading back into the spike: it is in the
            # trajectory, not in one batch or one corrupted state. Looping would never end; from here the
            # incident is handled as skips (the update is vetoed, counted, logged) until it closes.
            if v.vetoed:
                self.skipped_steps += 1
                self.skipped_tokens += valid_tokens
            self.events.emit(step, "rollback_exhausted", f"{self.incident['rollbacks']} rollback(s) in this incident "
                             f"did not clear it (guard.rollback.max_rollbacks={self.rb['max_rollbacks']}): "
                             + ("update vetoed instead" if v.vetoed else "the update was already applied"),
                             rollbacks=self.incident["rollbacks"], vetoed=v.vetoed, skipped_steps=self.skipped_steps,
                             batch_first=first_id)
        elif acted and self.action == "rollback":
            v.rollback = True
            if first_id in self.bad_batches and self.rb["data"] == "replay":
                self.skip_next_window = True  # same batch, same failure: the data, not the state
            self.bad_batches.add(first_id)
            if self.incident is None:
                hist = self.detector.history.get("loss")
                med = statistics.median(hist) if hist else None
                self.incident = {"trigger_step": step, "metric": acted[0].metric, "loss_median": med,
                                 "before": list(self.recent), "after": [], "recovered_step": None}
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
        """
        if self.action == "rollback" and self.rb["source"] == "memory" and step > 0:
            self.ring.append((step, self.state.snapshot(skip_extras=("faults",)), self.detector.state_dict()))

    def healthy(self) -> bool:
        """May this step's state be checkpointed? Not when the guard acted on it (rollback / skip)."""
        return not (self.verdict.acted_on and self.action != "log") and not any(
            t.metric == "nonfinite.optim_state" for t in self.verdict.triggers)

    def maybe_snapshot(self, step: int) -> None:
        """After a healthy step (nothing acted on): keep an in-memory snapshot every snapshot_every steps."""
        if self.action != "rollback" or self.rb["source"] != "memory" or self.verdict.acted_on:
            return
        if step % int(self.rb["snapshot_every"]) == 0 or not self.ring:
            self.ring.append((step, self.state.snapshot(skip_extras=("faults",)), self.detector.state_dict()))

    def rollback(self, step: int) -> int:
        """Restore the newest good state at least `margin` steps before `step`; return its step."""
        limit = step - 1 - int(self.rb["margin"])
        if self.replay_until is not None and step <= self.replay_until and not self.skip_next_window:
            # fired again while replaying the last rollback, on other data: that target may already
            # hold the damage (a lagging detector), so go further back. (The same batch again is the
            # data's fault, not the state's: that target is fine and the window gets skipped.)
            limit = min(limit, self.last_target - 1)
        cursor_after = self.state.loader.samples_consumed  # just past the batch that triggered
        kept = self._persistent()
        if self.rb["source"] == "memory":
            found = next(((s, snap, det) for s, snap, det in reversed(self.ring) if s <= limit), None)
            if found is None:
                raise GuardAbort(f"guard: no snapshot at step <= {limit} to roll back to (ring holds "
                                 f"{[s for s, _, _ in self.ring]}); raise guard.rollback.keep or lower margin")
            to_step, snap, det = found
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
        skip = self.rb["data"] == "skip" or self.skip_next_window
        if skip:
            self.state.loader.samples_consumed = cursor_after
            self.skip_next_window = False
        policy = "skip" if skip else "replay"
        why = " (the same batch triggered again on replay: the fault is in the data)" if (
            skip and self.rb["data"] == "replay") else ""
        self.events.emit(step, "rollback", f"step {step} -> {to_step} from {source}; data {policy}{why}",
                         trigger_step=step, to_step=to_step, source=source, data_policy=policy,
                         cursor_restored=cursor_restored, cursor_now=self.state.loader.samples_consumed,
                         skipped_samples=[cursor_restored, cursor_after] if skip else None,
                         replayed_samples=None if skip else [cursor_restored, cursor_after],
                         rollbacks=self.rollbacks)
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
                                 window=int(self.an["window"]), quiet_steps=int(self.an["quiet_steps"]))
        return to_step

    def end_step(self, step: int) -> None:
        """Anticipatory routing off after its window or once quiet; the incident closes once quiet.

        Quiet = no trigger acted on for `quiet_steps` steps (and at least that long since the last
        rollback). While an incident is open its rollbacks are counted against max_rollbacks.
        """
        inc, quiet_n = self.incident, int(self.an["quiet_steps"])
        last = self.detector.last_trigger_step
        quiet = last is None or step - last >= quiet_n
        r = self.routing
        if r is not None and r.active:
            on = self.incident_on
            ran = step - on + 1
            if ran >= int(self.an["window"]) or (ran >= quiet_n and quiet):
                r.deactivate(step)
                reason = "window reached" if ran >= int(self.an["window"]) else f"quiet for {quiet_n} steps"
                trail = inc or {}
                self.events.emit(step, "anticipatory_off", f"anticipatory routing off after {ran} steps ({reason})",
                                 duration=ran, on_step=on, reason=reason, recovered_step=trail.get("recovered_step"),
                                 loss_before=[x[1] for x in trail.get("before", [])],
                                 loss_after=[x[1] for x in trail.get("after", [])],
                                 expert_violation_before=[x[2] for x in trail.get("before", [])],
                                 expert_violation_after=[x[2] for x in trail.get("after", [])])
        if inc is not None and quiet and step - inc.get("rollback_to", step) >= quiet_n and not (r is not None and r.active):
            self.events.emit(step, "incident_closed", f"quiet for {quiet_n} steps: the incident that started at step "
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
        return {"skipped_steps": self.skipped_steps, "skipped_tokens": self.skipped_tokens,
                "rollbacks": self.rollbacks, "bad_batches": sorted(self.bad_batches), "fingerprint": self.fingerprint}

    def _restore_persistent(self, kept: dict) -> None:
        self.skipped_steps, self.skipped_tokens = kept["skipped_steps"], kept["skipped_tokens"]
        self.rollbacks, self.bad_batches = kept["rollbacks"], set(kept["bad_batches"])
        self.fingerprint = kept.get("fingerprint")

    def state_dict(self) -> dict:
        return {"detector": self.detector.state_dict(), **self._persistent(),
                "routing": self.routing.state_dict() if self.routing is not None else None,
                "incident_on": self.incident_on}

    def load_state_dict(self, sd: dict) -> None:
        self.detector.load_state_dict(sd["detector"])
        self._restore_persistent(sd)
        if self.routing is not None and sd.get("routing"):
            self.routing.load_state_dict(sd["routing"])
        self.incident_on = sd.get("incident_on")
