"""The guard's incident logic on its hard paths, driven directly with a fake TrainState (no training):
a spike that returns on every replay must not loop; the rollback budget holds per incident; the ring
never holds a step twice; counters agree with what happened. Property-based over random per-step
trigger sequences (hypothesis), plus the two reproductions of issue 13 #1."""
from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import guard_config
from stability.events import EventLog, read_events
from stability.guard import Guard, GuardAbort

TOKENS = 10  # valid tokens per step


class FakeState:
    """What the guard touches of a TrainState: step, tokens, loader cursor, snapshot / restore.
    `param` counts the updates applied (the stand-in for parameters and moments)."""

    def __init__(self):
        self.step = self.tokens = self.param = 0
        self.loader = SimpleNamespace(samples_consumed=0, batch_size=1)
        self.guard = None

    def snapshot(self, skip_extras=()):
        return {"step": self.step, "tokens": self.tokens, "param": self.param,
                "cursor": self.loader.samples_consumed}

    def restore(self, snap):
        self.step, self.tokens, self.param = snap["step"], snap["tokens"], snap["param"]
        self.loader.samples_consumed = snap["cursor"]


class FakeCkpt:
    """checkpoint.every-style saves of healthy steps; load_before restores state AND the guard's saved
    state, as Checkpointer.load_before does through TrainState.load."""

    root = "fake"

    def __init__(self, state, every):
        self.state, self.every, self.saved = state, every, {}

    def maybe_save(self, step, healthy):
        if step % self.every == 0 and healthy:
            self.saved[step] = (self.state.snapshot(), copy.deepcopy(self.state.guard.state_dict()))

    def has_before(self, max_step):
        return any(s <= max_step for s in self.saved)

    def load_before(self, max_step, skip_extras=()):
        best = max((s for s in self.saved if s <= max_step), default=None)
        if best is None:
            return None
        snap, gsd = self.saved[best]
        self.state.restore(snap)
        self.state.guard.load_state_dict(copy.deepcopy(gsd))
        return f"step_{best}"


def cfg(source="memory", max_rollbacks=1, margin=1, snapshot_every=5, keep=4, data="replay", quiet_steps=5):
    return {"action": "rollback", "replica_tol": 0.0,
            "detector": {"window": 20, "threshold": 6.0, "min_history": 3, "cooldown": 0, "warmup": 0,
                         "metrics": {"loss": {"direction": "up"}}},
            "rollback": {"source": source, "snapshot_every": snapshot_every, "keep": keep, "margin": margin,
                         "data": data, "max_rollbacks": max_rollbacks},
            "anticipatory": {"enabled": False, "delay": 2, "window": 10, "quiet_steps": quiet_steps}}


def drive(tmp_path, c, steps, fires, every=10, cap=None):
    """train.py's loop around the guard. fires(step, n) -> a spike at the n-th execution of `step`?
    Returns a summary; asserts the per-step invariants on the way."""
    state = FakeState()
    events = EventLog(tmp_path)
    ckpt = FakeCkpt(state, every) if c["rollback"]["source"] == "disk" else None
    guard = Guard(guard_config(c), state=state, ckpt=ckpt, events=events)
    state.guard = guard
    guard.start(0)
    budget, step, execs, seen, applied = c["rollback"]["max_rollbacks"], 0, 0, {}, {}
    abort = None
    cap = cap or 10 * steps
    while step < steps and execs < cap:
        step += 1
        execs += 1
        seen[step] = seen.get(step, 0) + 1
        first_id = state.loader.samples_consumed
        state.loader.samples_consumed += 1
        loss = math.nan if fires(step, seen[step]) else 1.0
        vetoed = guard.before_update(step, loss, 1.0, {})
        if not vetoed:
            state.param += 1
        applied[step] = not vetoed
        verdict = guard.after_update(step, first_id, TOKENS, {}, loss, None)
        state.step, state.tokens = step, state.tokens + TOKENS
        if ckpt is not None:
            ckpt.maybe_save(step, guard.healthy())
        guard.maybe_snapshot(step)
        ring = [s for s, _, _ in guard.ring]
        assert ring == sorted(set(ring)), f"ring holds a step twice or out of order: {ring}"
        if verdict.rollback:
            try:
                step = guard.rollback(step)
            except GuardAbort as e:
                abort = str(e)
                break
            if c["rollback"]["source"] == "memory":  # the abandoned trajectory's snapshots are gone
                assert [s for s, _, _ in guard.ring][-1] == step
        assert guard.incident is None or guard.incident.get("rollbacks", 0) <= budget
        guard.end_step(step)
    events.close()
    ev = read_events(tmp_path / "events.jsonl")
    return SimpleNamespace(guard=guard, state=state, execs=execs, step=step, abort=abort, events=ev,
                           applied=applied, seen=seen)


def check_counters(r, steps, c):
    kinds = [e["kind"] for e in r.events]
    assert kinds.count("rollback") == r.guard.rollbacks
    # every veto is either undone by a rollback or counted as a skip (with its tokens)
    vetoes = sum(1 for e in r.events if e["kind"] == "trigger" and e["action"] == "rollback")
    assert vetoes == r.guard.rollbacks + r.guard.skipped_steps + (r.abort is not None)  # the abort's own veto
    assert r.guard.skipped_tokens == TOKENS * r.guard.skipped_steps
    if r.abort is None:
        assert r.step == steps
        # the surviving trajectory: one update per step that applied it on its last execution
        assert r.state.param == sum(r.applied[s] for s in range(1, steps + 1))
        assert r.state.tokens == TOKENS * steps
    # per incident: its rollbacks within the budget (incident_closed carries the count)
    for e in r.events:
        if e["kind"] == "incident_closed":
            assert e["rollbacks"] <= c["rollback"]["max_rollbacks"]


@pytest.mark.parametrize("source", ["memory", "disk"])
def test_a_spike_that_returns_on_every_replay_ends_in_skips(tmp_path, source):
    """Issue 13 #1: step 48 spikes on every execution. The old guard closed the incident while replaying
    (the restored detector looked quiet), restarting the budget: 58 rollbacks in 600 executions."""
    c = cfg(source, max_rollbacks=1, quiet_steps=5, snapshot_every=10)
    r = drive(tmp_path, c, 80, lambda s, n: s == 48, cap=600)
    assert r.abort is None and r.step == 80, r.abort
    assert r.guard.rollbacks == 1 and r.guard.skipped_steps == 1
    assert r.execs == 80 + (48 - [e for e in r.events if e["kind"] == "rollback"][0]["to_step"])
    kinds = [e["kind"] for e in r.events]
    assert "rollback_exhausted" in kinds and kinds.count("incident_closed") == 1
    closed = next(e for e in r.events if e["kind"] == "incident_closed")
    assert closed["step"] > 48
    check_counters(r, 80, c)


spikes = st.dictionaries(st.integers(1, 40), st.one_of(st.integers(1, 4), st.just(10 ** 6)), max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spikes=spikes, source=st.sampled_from(["memory", "disk"]), max_rollbacks=st.integers(1, 3),
       margin=st.integers(0, 2), snapshot_every=st.integers(1, 4), keep=st.integers(1, 4),
       data=st.sampled_from(["replay", "skip"]), quiet_steps=st.integers(1, 6), every=st.integers(1, 6))
def test_random_trigger_sequences_terminate_within_budget(tmp_path_factory, spikes, source, max_rollbacks, margin,
                                                          snapshot_every, keep, data, quiet_steps, every):
    """spikes: step -> on how many of its executions it fires (10**6: every replay). Whatever the sequence:
    the run ends (or aborts only at an incident's first rollback, for want of any target), within
    steps · (1 + #spike steps · max_rollbacks) executions, each incident within its budget, and the
    counters add up."""
    steps = 45
    c = cfg(source, max_rollbacks, margin, snapshot_every, keep, data, quiet_steps)
    bound = steps * (1 + len(spikes) * max_rollbacks)
    r = drive(tmp_path_factory.mktemp("g"), c, steps, lambda s, n: n <= spikes.get(s, 0), every=every,
              cap=bound + 1)
    assert r.execs <= bound, f"{r.execs} executions > {bound}"
    if r.abort is not None:
        assert r.guard.incident is not None and r.guard.incident.get("rollbacks", 0) == 0, r.abort
    check_counters(r, steps, c)
    # incidents move forward: each one opens past the furthest step the previous one triggered at
    opened = [e["trigger_step"] for e in r.events if e["kind"] == "incident_closed"]
    assert opened == sorted(opened) and len(set(opened)) == len(opened)
