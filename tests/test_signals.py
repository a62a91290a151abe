"""The signal registry (stability/signals.py) is the one declaration every consumer reads: the record's fields
are declared there, the guard takes any of them by name, and every class a signal names exists."""
from __future__ import annotations

import math

import pytest

from doctor.classes import CLASSES
from stability.config import ConfigError, DetectorConfig
from helpers import guard_config
from stability.events import EventLog
from stability.guard import Guard
from stability.signals import SIGNALS, LAYERS, ReadContext, family, guard_values


def test_every_signal_is_complete():
    from doctor.levers import LEVERS
    from stability.signals import ROLES
    for name, sig in SIGNALS.items():
        assert sig.layer in LAYERS, name
        assert sig.cls is None or sig.cls in CLASSES, (name, sig.cls)
        assert sig.direction in ("up", "down", "both"), name
        assert sig.phase in ("before", "after"), name
        assert sig.fix, f"{name}: a signal says what to look at when it moves first"
        assert sig.role in ROLES, f"{name}: the doctor's rules read its role, never its name"
        assert sig.lever is None or sig.lever in LEVERS, (name, sig.lever)
        assert sig.flags is None or sig.flags in SIGNALS, (name, sig.flags)


def test_every_field_a_real_record_holds_is_declared(quickstart_records):
    """Each numeric field of a real run's records that the doctor can score is read by a declared signal:
    a layer quantity, a state norm, an MoE layer's health, a top-level scalar."""
    read = set()
    for prev, r in zip([None, *quickstart_records], quickstart_records):
        for sig in SIGNALS.values():
            read |= {s for s, *_ in sig.read(r, ReadContext(prev=prev))}
    layer_keys = {k for r in quickstart_records for q in (r.get("layers") or {}).values() for k in q}
    for key in layer_keys:
        assert any(s.startswith(f"{key}/") for s in read), f"layers[*][{key!r}] is written but no signal reads it"
    for r in quickstart_records:
        for k in r.get("state") or {}:
            name = f"state.d{k}" if k.startswith("w/") else f"state.{k}"  # ‖θ‖ is read as its step-to-step change
            assert name in read, f"state[{k!r}] is written but no signal reads it"
    for k in ("loss", "grad_norm", "logit_max", "z_loss", "clip_coef", "update_ratio_max"):
        assert k in read, k
    assert any(s.startswith("moe.experts_used/") for s in read) and any(s.startswith("moe.out_rms_min/") for s in read)
    assert any(s.startswith("below_floor/") for s in read) and "eval_below_floor" in read
    assert all(family(s) is not None for s in read)


@pytest.fixture(scope="module")
def quickstart_records(tmp_path_factory):
    """A short default run with telemetry every step (records of every kind)."""
    import json
    import subprocess
    import sys

    from helpers import HANG_S, ROOT, env
    d = tmp_path_factory.mktemp("sig") / "run"
    r = subprocess.run([sys.executable, "train.py", f"hydra.run.dir={d}", "train.steps=6", "telemetry.every=1",
                        "optim.schedule.warmup_steps=2", "train.eval_every=3", "train.eval_samples=16",
                        "train.eval_batch_size=16", "model.d_model=32", "model.n_heads=2", "data.seq_len=32",
                        "train.batch_size=8", "logging.wandb=disabled", "logging.progress=false", "logging.plot=false",
                        "threads=1"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]


def test_every_drill_expects_a_declared_class():
    from stability.drills import registry
    for kind, drill in registry().items():
        assert drill.expects is None or drill.expects in CLASSES, (kind, drill.expects)


def test_every_fault_class_declares_its_fix():
    """Each class's fix, where the class is declared, answers a diagnosis of that class with the four keys."""
    from pathlib import Path

    from doctor.classes import fix_for
    from doctor.diagnosis import Diagnosis, Judgement
    from doctor.timeline import Deviation, Run
    run = Run(Path("run"), [], [], [], [], {"train": {"max_grad_norm": 1.0}, "model": {}}, [])
    for name in CLASSES:
        d = Diagnosis(name, f"{name} at step 70. what broke", Deviation("loss", "forward", 0, 70, 3.0, 2.0, 9.0),
                      70, "0", {"step": 70, "first": 560, "size": 8}, None, model_layer="block0.attn")
        d.judgement, d.lever = Judgement("fault", "", {"check": "forward"}), {"override": "optim.lr=0.001"}
        fix = fix_for(d, run, None)
        assert set(fix) == {"variable", "change", "override", "expect"}, (name, fix)


def test_the_guard_accepts_any_registered_signal_and_refuses_others():
    for name in SIGNALS:
        assert name in DetectorConfig(metrics={name: {}}).metrics
    with pytest.raises(ConfigError, match=r"guard.detector.metrics.act_rmss: not a registered signal"):
        DetectorConfig(metrics={"act_rmss": {}})


def test_the_guard_fires_on_a_signal_chosen_by_config(tmp_path):
    """guard.detector.metrics.attn_logit_max: the guard reads it from the step's telemetry after the update and
    fires on one block's logit max ×20, naming that block; the default set never sees it."""
    def run(metrics):
        cfg = {"action": "log", "detector": {"window": 20, "min_history": 5, "cooldown": 0, "warmup": 0,
                                             "metrics": metrics}}
        g = Guard(guard_config(cfg), state=None, ckpt=None, events=EventLog(tmp_path))
        fired = []
        for t in range(1, 31):
            v = 4.0 * (1 + 0.02 * math.sin(t)) * (20 if t == 25 else 1)
            g.before_update(t, 2.0, 1.0, {})
            post = {"layers": {"block0.attn": {"attn_logit_max": v}}, "update_ratio_max": 0.01}
            verdict = g.after_update(t, 8 * t, 100, post, 2.0, None, extra={})
            fired += [(t, x.metric) for x in verdict.acted_on]
            g.end_step(t)
        return fired
    assert run({"attn_logit_max": {"log": True}}) == [(25, "attn_logit_max/block0.attn")]
    assert run({"loss": {}}) == []


def test_guard_values_reads_only_its_phase():
    rec = {"loss": 2.0, "clip_coef": 0.5, "layers": {"b": {"act_rms": 0.3}}}
    assert guard_values(rec, ["loss", "clip_coef", "act_rms"], "before")[0] == {"loss": 2.0}
    assert guard_values(rec, ["loss", "clip_coef", "act_rms"], "after")[0] == {"clip_coef": 0.5, "act_rms/b": 0.3}
