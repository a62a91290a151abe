"""The step's callback seam (stability/callbacks.py): points called in attachment order, after_update in
reverse; the fault drill acting through it restores the scheduled LRs exactly and logs its events;
train.py names no component that attaches there."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from data import build_data
from data.loader import Loader
from model import ModelConfig, Transformer
from optim import build_optimizer
from stability.callbacks import Callback, Callbacks, StepState
from stability.events import EventLog
from stability.faults import FaultDrill, FaultInjector

ROOT = Path(__file__).resolve().parents[1]
DATA = {"kind": "synthetic", "seq_len": 16, "min_doc_len": 4, "seed": 5,
        "sources": [{"name": "markov", "kind": "markov", "weight": 1.0, "alphabet": 8, "order": 1, "support": 2}]}


class Recorder(Callback):
    def __init__(self, name, log):
        self.name, self.log = name, log

    def before_batch(self, s):
        self.log.append(("before_batch", self.name))

    def before_update(self, s):
        self.log.append(("before_update", self.name))

    def after_update(self, s):
        self.log.append(("after_update", self.name))


def test_points_run_in_order_and_after_update_in_reverse():
    log = []
    cb = Callbacks([Recorder("drill", log), None, Recorder("telemetry", log)])  # None: not attached
    s = StepState(1)
    cb.before_batch(s), cb.before_update(s), cb.after_update(s)
    assert log == [("before_batch", "drill"), ("before_batch", "telemetry"), ("before_update", "drill"),
                   ("before_update", "telemetry"), ("after_update", "telemetry"), ("after_update", "drill")]


def test_lr_drill_scales_only_its_window_and_restores_the_schedule_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    ds = build_data(DATA)
    model = Transformer(ModelConfig.from_dict({"d_model": 16, "n_layers": 1, "n_heads": 2,
                                               "vocab_size": ds.vocab_size, "seq_len": ds.seq_len}))
    opt, _ = build_optimizer(model, {"lr": 3e-3})
    inj = FaultInjector({"kind": "lr_spike", "step": 2, "factor": 7.0, "steps": 1}, model=model, optimizer=opt,
                        loader=Loader(ds, 4))
    events = EventLog(tmp_path)
    drill = FaultDrill(inj, opt, events)
    planned = [g["lr"] for g in opt.param_groups]
    seen = []
    for step in (1, 2, 3):
        s = StepState(step)
        drill.before_update(s)
        seen.append([g["lr"] for g in opt.param_groups])
        drill.after_update(s)
        assert [g["lr"] for g in opt.param_groups] == planned  # exactly the scheduled values again
    assert seen == [planned, [lr * 7.0 for lr in planned], planned]
    events.close()
    assert [ln.split(":")[0] for ln in events.pop()] == ["fault"]
    assert '"kind": "fault"' in (tmp_path / "events.jsonl").read_text()


def test_train_py_names_no_drill_telemetry_or_routing():
    src = (ROOT / "train.py").read_text()
    for name in ("FaultInjector", "FaultDrill", "faults", "Telemetry", "AnticipatoryRouting", "lr_factor"):
        assert not re.search(rf"\b{name}\b", src), f"train.py names {name}: attach it at a callback point instead"
    assert len(src.splitlines()) <= 250
