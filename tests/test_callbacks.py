"""The step's callback seam (stability/callbacks.py): points called in each callback's declared
order; the fault drill acting through it restores the scheduled LRs exactly and logs its events; train.py names no component that attaches there."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from data import build_data
from data.config import DataConfig
from data.loader import Loader
from helpers import model_config
from model import Transformer
from optim import build_optimizer
from optim.config import OptimConfig
from optim.levers import Levers
from stability.anticipatory import AnticipatoryRouting
from stability.callbacks import Callback, Callbacks, StepState
from stability.events import EventLog
from stability.config import FaultConfig
from stability.faults import FaultDrill, FaultInjector
from stability.telemetry import StepTelemetry

ROOT = Path(__file__).resolve().parents[1]
DATA = {"kind": "synthetic", "seq_len": 16, "min_doc_len": 4, "seed": 5,
        "sources": [{"name": "markov", "kind": "markov", "weight": 1.0, "alphabet": 8, "order": 1, "support": 2}]}


def recorder(name, points, log):
    class Recorder(Callback):
        order = points

        def before_batch(self, s):
            log.append(("before_batch", name))

        def after_update(self, s):
            log.append(("after_update", name))

    return Recorder()


def test_points_run_in_declared_order_whatever_the_attachment_order():
    log = []
    late_out = recorder("drill", {"before_batch": 0, "after_update": 30}, log)
    early_out = recorder("levers", {"before_batch": 10, "after_update": 10}, log)
    cb = Callbacks([early_out, None, late_out])  # None: not attached
    s = StepState(1)
    cb.before_batch(s), cb.before_update(s), cb.after_update(s)
    assert log == [("before_batch", "drill"), ("before_batch", "levers"),
                   ("after_update", "levers"), ("after_update", "drill")]


def test_the_run_callbacks_keep_the_step_order():
    """Drill first in, last out; QK-clip, then telemetry, then the drill after the update."""
    kinds = (FaultDrill, AnticipatoryRouting, StepTelemetry, Levers)
    at = {p: [k.__name__ for k in sorted((k for k in kinds if p in k.order), key=lambda k: k.order[p])]
          for p in ("on_batch", "before_forward", "before_update", "after_update")}
    assert at == {"on_batch": ["FaultDrill", "AnticipatoryRouting"],
                  "before_forward": ["FaultDrill", "StepTelemetry"], "before_update": ["FaultDrill", "StepTelemetry"],
                  "after_update": ["Levers", "StepTelemetry", "FaultDrill"]}


def test_an_unstated_order_is_refused():
    with pytest.raises(ValueError, match="both declare order 5 at after_update"):
        Callbacks([recorder("a", {"before_batch": 0, "after_update": 5}, []),
                   recorder("b", {"before_batch": 1, "after_update": 5}, [])])
    with pytest.raises(TypeError, match="acts at after_update without an order"):
        class Unordered(Callback):
            def after_update(self, s): ...


def test_lr_drill_scales_only_its_window_and_restores_the_schedule_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    ds = build_data(DataConfig.from_dict(DATA))
    model = Transformer(model_config({"d_model": 16, "n_layers": 1, "n_heads": 2,
                                               "vocab_size": ds.vocab_size, "seq_len": ds.seq_len}))
    opt, _ = build_optimizer(model, OptimConfig(lr=3e-3))
    inj = FaultInjector(FaultConfig(kind="lr_spike", step=2, lr_spike={"factor": 7.0, "steps": 1}), model=model,
                        optimizer=opt, loader=Loader(ds, 4))
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
