"""The one-step changes the doctor's counterfactuals and fixes are made of (stability/intervene.py), and the
quarantine of a batch (train.skip_batches): each changes exactly the one thing it names."""
from __future__ import annotations

import json

import pytest
import torch

from data import Loader, build_data
from data.config import DataConfig
from run.config_errors import ConfigError
from stability.callbacks import StepState
from stability.drills import Context, registry
from stability.events import EventLog
from stability.intervene import Intervene, InterveneConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ds():
    return build_data(DataConfig(seq_len=32, min_doc_len=4))


def test_a_quarantined_batch_is_never_served(ds):
    B = 4
    plain, skip = Loader(ds, B), Loader(ds, B, skip=(0, 8))
    assert skip.samples_consumed == 4  # a cursor never rests on a quarantined window
    served = []
    for k in range(3):
        assert torch.equal(skip.peek(k).sample_ids, plain.peek([1, 3, 4][k]).sample_ids)
    for _ in range(3):
        served.append(skip.next().sample_ids[0].item())
    assert served == [4, 12, 16]
    assert torch.equal(skip.peek(-1).sample_ids, plain.peek(4).sample_ids)
    resumed = Loader(ds, B, skip=(8,))
    resumed.load_state_dict({"samples_consumed": 8, "fingerprint": ds.fingerprint})
    assert resumed.samples_consumed == 12


def test_a_batch_drill_does_not_fire_on_quarantined_data(ds):
    cfg = registry()["labels_shuffle"].Config()
    B, s = 4, 3
    for skip, fires in (((), True), (((s - 1) * B,), False)):
        loader = Loader(ds, B, skip=skip)
        drill = registry()["labels_shuffle"](cfg, s, Context(loader=loader))
        for step in range(1, s + 1):
            st = StepState(step, first_id=loader.samples_consumed, batch=loader.next())
            clean = st.batch
            drill.on_batch(st)
        assert (st.batch is not clean) == fires and drill.fired == fires


@pytest.mark.parametrize("keys, line", [
    ({"kind": "moved"}, "intervene.kind"),
    ({"kind": "batch", "step": 3}, "intervene.first_id"),
    ({"kind": "lr"}, "intervene.step"),
    ({"kind": "lr", "step": 3, "first_id": 0}, "intervene.first_id"),
    ({"kind": "moments", "step": 0}, "intervene.step"),
])
def test_a_bad_intervention_is_one_line_naming_the_key(keys, line):
    with pytest.raises(ConfigError, match=line) as e:
        InterveneConfig(**keys)
    assert "\n" not in str(e.value)


def _adam(lr=0.1):
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    return w, opt, sched


def _step(w, opt, sched, g):
    w.grad = torch.full_like(w, g)
    opt.step()
    sched.step()


def test_lr_is_put_back_on_its_schedule_from_its_step_on(tmp_path):
    w, opt, sched = _adam()
    iv = Intervene(InterveneConfig(kind="lr", step=2), opt, sched, None, EventLog(tmp_path))
    for step in (1, 2, 3):
        planned = sched.get_last_lr()[0]
        opt.param_groups[0]["lr"] = planned * 50  # what a wrong LR writer does before the update
        iv.before_update(StepState(step))
        assert opt.param_groups[0]["lr"] == (planned * 50 if step < 2 else planned)
        _step(w, opt, sched, 1.0)
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events] == [2, 3] and {e["kind"] for e in events} == {"intervene"}


def test_moments_as_the_update_wrote_them_undo_a_later_writer(tmp_path):
    w, opt, sched = _adam()
    iv = Intervene(InterveneConfig(kind="moments", step=2), opt, sched, None, EventLog(tmp_path))
    _step(w, opt, sched, 1.0)
    iv.before_update(StepState(2))
    _step(w, opt, sched, 3.0)
    written = {k: opt.state[w][k].clone() for k in ("exp_avg", "exp_avg_sq")}
    count = opt.state[w]["step"].clone()
    opt.state[w]["exp_avg_sq"].zero_()  # what an optimizer-state fault does after the update
    iv.after_update(StepState(2))
    for k, v in written.items():
        assert torch.equal(opt.state[w][k], v)
    assert torch.equal(opt.state[w]["step"], count)
    [ev] = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert ev["elements"] == 3
    _step(w, opt, sched, 1.0)  # the hook is gone: a later step is not snapshotted again
    assert iv._moments is None


def test_moments_of_a_vetoed_update_are_left_alone():
    w, opt, sched = _adam()
    _step(w, opt, sched, 1.0)
    iv = Intervene(InterveneConfig(kind="moments", step=2), opt, sched, None, EventLog(None))
    iv.before_update(StepState(2))
    before = opt.state[w]["exp_avg"].clone()
    iv.after_update(StepState(2))  # no optimizer.step() between: the guard skipped it
    assert torch.equal(opt.state[w]["exp_avg"], before) and not opt._optimizer_step_post_hooks


def test_the_batch_of_another_step_is_trained_in_its_place(ds, tmp_path):
    loader = Loader(ds, 4)
    iv = Intervene(InterveneConfig(kind="batch", step=2, first_id=40), None, None, loader, EventLog(tmp_path))
    firsts = []
    for step in (1, 2, 3):
        iv.before_batch(StepState(step))
        firsts.append(loader.samples_consumed)
        loader.next()
    assert firsts == [0, 40, 44]
