"""Guard actions in-process: skip leaves parameters and optimizer untouched (counters as documented);
rollback restores exactly the snapshot's state and data cursor, twice from the same snapshot, and a
batch that triggers again on replay is skipped the next time."""
from __future__ import annotations

import copy

import pytest
import torch

from checkpoint import TrainState
from data import build_data
from data.config import DataConfig
from data.loader import Loader
from model import ModelConfig, Transformer
from optim import build_optimizer, build_scheduler
from optim.accumulate import count_valid_tokens, forward_backward, reduce_step_sums
from optim.config import OptimConfig
from precision import optimizer_step
from helpers import guard_config
from stability.events import EventLog, read_events
from stability.guard import Guard

DATA = {"kind": "synthetic", "seq_len": 16, "min_doc_len": 4, "seed": 3,
        "sources": [{"name": "markov", "kind": "markov", "weight": 0.5, "alphabet": 8, "order": 1},
                    {"name": "copy", "kind": "copy", "weight": 0.5, "alphabet": 8, "segment": 4}]}
OPTIM = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
         "groups": [{"name": "no_decay", "kinds": ["bias", "norm", "embedding"], "weight_decay": 0.0}],
         "schedule": {"name": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1}}


pytestmark = pytest.mark.usefixtures("one_thread")


def guard_cfg(action, **rollback):
    return {"action": action, "replica_tol": 0.0,
            "detector": {"window": 20, "threshold": 6.0, "min_history": 3, "cooldown": 0, "warmup": 0,
                         "metrics": {"loss": {"direction": "up"}}},
            "rollback": {"source": "memory", "snapshot_every": 2, "keep": 3, "margin": 1, "data": "replay",
                         "max_rollbacks": 5, **rollback},
            "anticipatory": {"enabled": False, "delay": 2, "window": 10, "quiet_steps": 5}}


class Rig:
    """train.py's step, reduced to what the guard touches; `spike_at` fakes a loss spike on chosen steps."""

    def __init__(self, tmp_path, action, **rollback):
        torch.manual_seed(0)
        ds = build_data(DataConfig.from_dict(DATA))
        self.model = Transformer(ModelConfig(vocab_size=ds.vocab_size, seq_len=16, d_model=16, n_layers=2,
                                             n_heads=2))
        opt_cfg = OptimConfig.from_dict(OPTIM)
        self.opt, _ = build_optimizer(self.model, opt_cfg)
        self.sched = build_scheduler(self.opt, opt_cfg.schedule, 50)
        self.loader = Loader(ds, 4)
        self.state = TrainState(self.model, self.opt, self.sched, self.loader, {})
        self.events = EventLog(tmp_path)
        self.guard = Guard(guard_config(guard_cfg(action, **rollback)), state=self.state, ckpt=None, events=self.events)
        self.state.guard = self.guard
        self.guard.start(0)
        self.step, self.spike_ids = 0, set()

    def run_step(self, spike=False):
        self.step += 1
        step = self.step
        first_id = self.loader.samples_consumed
        micro = self.loader.next().micro_batches(2)
        n = count_valid_tokens(micro, "cpu")
        sums = forward_backward(self.model, micro, n, 0.0, 1, 2)
        stats = reduce_step_sums(sums, n.item())
        loss = 100.0 if (spike or first_id in self.spike_ids) else stats["loss"]
        res = optimizer_step(self.model.parameters(), self.opt, None, 1.0,
                             veto=lambda norm, overflow: self.guard.before_update(step, loss, norm.item(), {}))
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        verdict = self.guard.after_update(step, first_id, int(n.item()), {}, loss, None)
        self.state.step, self.state.tokens = step, self.state.tokens + int(n.item())
        self.guard.maybe_snapshot(step)
        if verdict.rollback:
            self.step = self.guard.rollback(step)
        return res, verdict


def full_state(rig):
    return {"model": copy.deepcopy(rig.model.state_dict()), "optim": copy.deepcopy(rig.opt.state_dict()),
            "sched": rig.sched.state_dict()["last_epoch"], "cursor": rig.loader.samples_consumed,
            "step": rig.state.step, "tokens": rig.state.tokens, "rng": torch.get_rng_state()}


def assert_same(a, b):
    assert a["step"] == b["step"] and a["tokens"] == b["tokens"] and a["cursor"] == b["cursor"]
    assert a["sched"] == b["sched"] and torch.equal(a["rng"], b["rng"])
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for i, st in a["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["optim"]["state"][i][k]), (i, k)


def test_skip_leaves_parameters_and_optimizer_untouched(tmp_path):
    rig = Rig(tmp_path, "skip")
    for _ in range(5):
        rig.run_step()
    before = full_state(rig)
    res, verdict = rig.run_step(spike=True)
    after = full_state(rig)
    assert res.skipped and res.vetoed and verdict.vetoed and not verdict.rollback
    for k in before["model"]:
        assert torch.equal(before["model"][k], after["model"][k])
    for i, st in before["optim"]["state"].items():  # moments AND Adam's step count unchanged
        for k, v in st.items():
            assert torch.equal(v, after["optim"]["state"][i][k])
    # documented counters: the scheduler and the data cursor advance; tokens consumed; skip counted
    assert after["sched"] == before["sched"] + 1 and after["cursor"] == before["cursor"] + 4
    rec = rig.guard.record()
    assert rec["skipped_steps"] == 1 and rec["skipped_tokens"] == after["tokens"] - before["tokens"] > 0
    kinds = [e["kind"] for e in read_events(tmp_path / "events.jsonl")]
    assert kinds == ["trigger", "skip"]
    res, _ = rig.run_step()  # the next healthy step updates again
    assert not res.skipped


def test_rollback_restores_the_snapshot_exactly_twice(tmp_path):
    rig = Rig(tmp_path, "rollback")
    saved = {}
    for _ in range(7):
        rig.run_step()
        saved[rig.step] = full_state(rig)
    torch.manual_seed(1234)  # RNG drawn since: the rollback must restore the streams too
    _, verdict = rig.run_step(spike=True)  # step 8: target = newest snapshot <= 8 - 1 - margin = 6
    assert verdict.rollback and rig.step == 6
    assert_same(full_state(rig), saved[6])
    rig.run_step()
    rig.run_step()  # steps 7, 8 replayed: the same batches as before
    assert rig.loader.samples_consumed == saved[7]["cursor"] + 4
    _, verdict = rig.run_step(spike=True)  # step 9 -> back to 6 again, from the same (unaliased) snapshot
    assert verdict.rollback and rig.step == 6
    assert_same(full_state(rig), saved[6])
    ev = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "rollback"]
    assert [(e["trigger_step"], e["to_step"], e["data_policy"]) for e in ev] == [(8, 6, "replay"), (9, 6, "replay")]
    assert ev[0]["cursor_restored"] == 24 and ev[0]["replayed_samples"] == [24, 32]
    assert rig.guard.record()["rollbacks"] == 2


def test_skip_window_policy_moves_the_cursor_past_the_trigger(tmp_path):
    rig = Rig(tmp_path, "rollback", data="skip")
    for _ in range(7):
        rig.run_step()
    rig.run_step(spike=True)
    assert rig.step == 6 and rig.loader.samples_consumed == 32  # batches of steps 7, 8 dropped
    ev = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "rollback"][0]
    assert ev["skipped_samples"] == [24, 32]


def test_a_batch_that_triggers_again_on_replay_is_skipped_next_time(tmp_path):
    rig = Rig(tmp_path, "rollback")
    for _ in range(7):
        rig.run_step()
    rig.spike_ids = {28}  # the batch of step 8 is bad data: it spikes whenever it is trained
    rig.run_step()  # step 8 -> rollback to 6, replay
    assert rig.step == 6 and rig.loader.samples_consumed == 24
    rig.run_step()
    rig.run_step()  # step 8 again, same batch, spikes again -> this rollback skips it
    assert rig.step == 6 and rig.loader.samples_consumed == 32
    ev = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "rollback"]
    assert [e["data_policy"] for e in ev] == ["replay", "skip"] and "in the data" in ev[1]["summary"]


def test_rollback_budget_per_incident_then_skips(tmp_path):
    """A spike that comes back after every rollback is in the trajectory: after max_rollbacks the incident's
    further spikes are vetoed (counted skips) and training moves on, instead of looping forever."""
    rig = Rig(tmp_path, "rollback", max_rollbacks=1)
    for _ in range(5):
        rig.run_step()
    rig.run_step(spike=True)  # step 6 -> rollback to 4 (the budget of 1 is spent)
    assert rig.step == 4
    rig.run_step()
    res, verdict = rig.run_step(spike=True)  # step 6 again: vetoed, no second rollback
    assert rig.step == 6 and res.vetoed and not verdict.rollback
    assert rig.guard.record()["skipped_steps"] == 1 and rig.guard.record()["rollbacks"] == 1
    kinds = [e["kind"] for e in read_events(tmp_path / "events.jsonl")]
    assert kinds.count("rollback") == 1 and "rollback_exhausted" in kinds


@pytest.mark.parametrize("path, value, key", [
    (("action",), "panic", "guard.action"), (("rollback", "source"), "cloud", "guard.rollback.source"),
    (("rollback", "data"), "shuffle", "guard.rollback.data"), (("rollback", "keep"), 0, "guard.rollback.keep"),
])
def test_bad_guard_config_names_the_key(tmp_path, path, value, key):
    cfg = guard_cfg("log")
    node = cfg
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        Guard(guard_config(cfg), state=None, ckpt=None, events=EventLog(None))


def test_a_second_trigger_while_replaying_rolls_back_further(tmp_path):
    rig = Rig(tmp_path, "rollback")
    for _ in range(9):
        rig.run_step()
    rig.run_step(spike=True)  # step 10 -> snapshot 8
    assert rig.step == 8
    rig.run_step(spike=True)  # step 9 fires again while replaying: snapshot 8 is suspect -> 6
    assert rig.step == 6
    ev = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "rollback"]
    assert [(e["trigger_step"], e["to_step"]) for e in ev] == [(10, 8), (9, 6)]


def test_rollback_mode_trains_exactly_like_log_mode_until_it_acts(tmp_path):
    """Snapshots must not perturb training (reading a fresh optimizer's state dict would initialise Adam)."""
    a, b = Rig(tmp_path / "a", "log"), Rig(tmp_path / "b", "rollback")
    for _ in range(6):
        a.run_step()
        b.run_step()
    for (k, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(x, y), k
    assert [s for s, _, _ in b.guard.ring] == [2, 4, 6]  # step 1 first, then every 2nd; keep 3
