"""docs/hacking.md's recipes, each performed on a temporary module or copy: a model option, a specification check,
a fault drill, a lab, a config option and a per-layer telemetry quantity, each found (or refused) by the code and the
test that guards it. (The signal recipe's doctor half is tests/test_doctor_judge.py::test_a_new_signal_is_one_declaration.)"""
from __future__ import annotations

import dataclasses
import importlib
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_a_new_model_option_fails_the_export_test_until_options_declares_it(monkeypatch):
    """Recipe 1: a ModelConfig field without an export decision fails the exporter's enumeration test."""
    import test_export_hf as t
    from checkpoint.export_hf import OPTIONS, TRAINING, Option
    from model.config import ModelConfig

    Student = dataclasses.make_dataclass("ModelConfig", [("student_gate", bool, dataclasses.field(default=False))],
                                         bases=(ModelConfig,))
    monkeypatch.setattr(t, "ModelConfig", Student)
    with pytest.raises(AssertionError):
        t.test_every_model_option_has_an_export_decision()
    monkeypatch.setitem(OPTIONS, "student_gate", Option(TRAINING, probe=True))
    t.test_every_model_option_has_an_export_decision()


DRILL = '''
from dataclasses import dataclass

from run.config_errors import choice
from stability.drills.base import TRANSIENT, Drill


@dataclass
class Config:
    scale: str = "log"  # a str, where optim_state's `scale` is a float: each drill's keys are its own

    def __post_init__(self) -> None:
        choice("scale", self.scale, ("log", "linear"))


class StudentNoop(Drill):
    kind = "student_noop"
    expects = "optim.lr_switch"
    lifetime = TRANSIENT
    points = ("before_update",)
    Config = Config

    def before_update(self, s) -> None:
        if s.step == self.s:
            self.fired = True
'''


def test_a_drill_module_dropped_into_the_package_is_in_the_registry(tmp_path, monkeypatch):
    """Recipe 3: one module in stability/drills/ (here a temporary folder on the package's path); its keys
    are fault.<kind>.<key> in the schema stability/config.py builds from the registry."""
    import stability.drills as drills
    from run.config_errors import ConfigError
    from stability.config import fault_schema
    from stability.drills.base import REGISTRY

    (tmp_path / "student_noop.py").write_text(DRILL)
    try:
        with monkeypatch.context() as m:
            m.setattr(drills, "__path__", [*drills.__path__, str(tmp_path)])
            reg = drills.registry()
        assert reg["student_noop"].__module__ == "stability.drills.student_noop"
        assert reg["student_noop"].expects == "optim.lr_switch"
        FaultConfig = fault_schema(reg)  # tests/test_drill_registry.py composes it as Hydra does, and trains
        cfg = FaultConfig(kind="student_noop", step=3, student_noop={"scale": "linear"})
        assert cfg.resolved() == {"kind": "student_noop", "step": 3, "student_noop": {"scale": "linear"}}
        with pytest.raises(ConfigError, match=r"^fault.student_noop.scale=cubic: expected one of log, linear$"):
            FaultConfig(kind="student_noop", step=3, student_noop={"scale": "cubic"})
    finally:
        REGISTRY.pop("student_noop", None)
        sys.modules.pop("stability.drills.student_noop", None)
    assert "student_noop" not in drills.registry()


CHECK = '''
import torch

from spec.check import BEFORE, STEP, UPDATE, Check, Kind


class StudentLR(Check):
    name, layer, rank, cadence, phase = "student_lr", UPDATE, 46, STEP, BEFORE
    kinds = {"lr": Kind("optim.lr_switch", "a group's LR is not a finite positive number")}

    def before_update(self, s) -> None:
        lr = torch.tensor([float(g["lr"]) for g in self.ctx.optimizer.param_groups], dtype=torch.float64)
        bad = (~torch.isfinite(lr) | (lr <= 0)).double()  # a miss is one group off: half a group is the tolerance
        self.measure(bad, torch.full_like(bad, 0.5), "lr", where=[g["name"] for g in self.ctx.optimizer.param_groups])
'''


def test_a_check_module_dropped_into_the_package_runs_and_fails_at_its_step(tmp_path, monkeypatch):
    """Recipe: one module in spec/checks/ (here a temporary folder on the package's path) is a registered check, in
    its rank's place, that passes on a clean step and fails where its specification breaks."""
    from types import SimpleNamespace

    import spec.checks as checks
    from spec.check import CHECKS, SpecContext

    (tmp_path / "student_lr.py").write_text(CHECK)
    try:
        with monkeypatch.context() as m:
            m.setattr(checks, "__path__", [*checks.__path__, str(tmp_path)])
            reg = checks.registry()
        names = list(reg)
        assert names.index("lr") < names.index("student_lr") < names.index("optimizer")
        groups = [{"name": "default", "lr": 1e-3}, {"name": "no_decay", "lr": 1e-3}]
        ctx = SpecContext(cfg=None, model=None, model_cfg=None, wrapped=None,
                          optimizer=SimpleNamespace(param_groups=groups),
                          loader=None, dataset=None, dist=None, recipe=None, scaler=None, evals=[])
        check = reg["student_lr"](ctx)
        check.before_update(SimpleNamespace(step=1))
        assert float(check.out[0]) == 0.0  # miss: none
        groups[1]["lr"] = -1e-3
        check.before_update(SimpleNamespace(step=2))
        miss, where, kind = (float(x) for x in check.out[:3])
        assert miss > 1 and check.where[int(where)] == "no_decay" and check.kind_name(kind) == "lr"
    finally:
        CHECKS.pop("student_lr", None)
        sys.modules.pop("spec.checks.student_lr", None)
    assert "student_lr" not in checks.registry()


LAB = '''
TITLE = "student: a claim, its check, and the table that shows it"


def run(seed: int, quick: bool = False, factor: float = 2.0) -> dict:
    ok = factor * 2 == 2 * factor
    return {"ok": ok, "checks": {"multiplication commutes": ok}, "table": f"factor {factor}: ok={ok}"}


def plot(result: dict, path) -> None:
    path.write_bytes(b"")  # a real lab saves a PNG here
'''


def test_a_lab_registered_in_labs_is_listed_and_runs(tmp_path, monkeypatch, capsys):
    """Recipe 4: a module with TITLE, run() and plot(), one line in labs/__init__.py LABS."""
    from labs import LABS
    from labs import run as labs_run

    (tmp_path / "student_lab.py").write_text(LAB)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(LABS, "student", "student_lab")
    try:
        assert labs_run.main(["--list"]) == 0
        out = capsys.readouterr().out
        assert "student         student: a claim" in out and "knobs: factor=2.0" in out
        assert labs_run.main(["--experiment", "student", "--set", "factor=3", "--out", str(tmp_path / "o")]) == 0
        assert "factor 3.0: ok=True" in capsys.readouterr().out
        assert (tmp_path / "o" / "result.json").exists()
    finally:
        sys.modules.pop("student_lab", None)


def test_a_new_config_option_composes_and_sets_only_what_it_changes(tmp_path):
    """Recipe 5: a file conf/<group>/<option>.yaml (here in a copy of conf/) selected by group=option."""
    from hydra import initialize_config_dir

    from run.config import compose_check

    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    (conf / "guard" / "student.yaml").write_text(
        "# guard=student: a rollback guard that waits longer before it scores\n"
        "defaults:\n  - rollback\n  - _self_\ndetector:\n  warmup: 80\n")
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        base, cfg = compose_check(["guard=rollback"]), compose_check(["guard=student"])
    assert cfg.guard.detector.warmup == 80 and cfg.guard.action == base.guard.action
    assert dataclasses.replace(cfg.guard, detector=base.guard.detector) == base.guard


QUANTITY = '''
import math

from stability.signals import BACKWARD, declare, per_layer
from stability.telemetry import quantity

declare("student_weight_rms", BACKWARD, per_layer("student_weight_rms"), log=True, direction="both", per_layer=True,
        fix="the named layer's weights grew or shrank")
quantity("student_weight_rms", ("theta_sq",), lambda x, at: math.sqrt(x["theta_sq"] / at.numel))
'''


def test_a_per_layer_quantity_is_one_declaration_beside_its_signal(tmp_path, monkeypatch):
    """Recipe 2, a per-layer signal: its declare() and its quantity() in a module of the student's own; telemetry
    writes it into StepRecord.layers and the signal reads it there. Its weights' RMS reads each layer's own
    parameters: attention's matrices (≈ init std), the norm gains apart (exactly 1 at init)."""
    import math

    import test_telemetry as tt
    from stability.config import TelemetryConfig
    from stability.signals import SIGNALS, ReadContext
    from stability.telemetry import QUANTITIES, Telemetry, quantity

    (tmp_path / "student_quantity.py").write_text(QUANTITY)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        importlib.import_module("student_quantity")
        ds, model = tt.build()
        from data.loader import Loader
        from optim import build_optimizer
        from optim.config import OptimConfig
        opt, _ = build_optimizer(model, OptimConfig(lr=1e-2))
        attn = [p.detach().double() for n, p in model.blocks[0].attn.named_parameters()]
        want = math.sqrt(sum(p.square().sum().item() for p in attn) / sum(p.numel() for p in attn))
        out, _ = tt.step(model, model, opt, Telemetry(model, TelemetryConfig(every=1)),
                         Loader(ds, tt.BATCH).next().micro_batches(2), 1)
        series = dict((s, v) for s, v, _, _ in SIGNALS["student_weight_rms"].read(out, ReadContext()))
        with pytest.raises(ValueError, match="declare its signal first"):
            quantity("student_unsignalled", ("theta_sq",), lambda x, at: 0.0)
        with pytest.raises(ValueError, match="does not measure"):
            quantity("student_unsignalled", ("theta_cubed",), lambda x, at: 0.0)
    finally:
        SIGNALS.pop("student_weight_rms", None)
        QUANTITIES.pop("student_weight_rms", None)
        sys.modules.pop("student_quantity", None)
    assert series["student_weight_rms/block0.attn"] == pytest.approx(want, rel=1e-6)  # an FP32 norm (telemetry_layers)
    assert series["student_weight_rms/block0.attn"] < 0.5  # the matrices', not the gain's
    assert series["student_weight_rms/block0.attn_norm"] == series["student_weight_rms/norm"] == 1.0
    assert "student_weight_rms/block0" not in series  # the residual stream owns no parameters


def test_the_recipes_are_in_hacking_md():
    text = (ROOT / "docs" / "hacking.md").read_text(encoding="utf-8")
    for name in ("a model option", "a signal", "a specification check", "a fault drill", "a lab", "a config option"):
        assert f"## Add {name}" in text, name
    assert "docs/hacking.md" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert importlib.util.find_spec("test_doctor_judge") is not None  # the signal recipe's test
