"""The fault-drill registry (stability/drills/): every drill is one module, and what it declares is what
the config, the Hydra options and the injector see. Milliseconds, except the composes (~1 s)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from hydra import initialize_config_dir

from run.config import compose_check
from run.config_errors import ConfigError
from stability.config import FaultConfig
from stability.drills import LIFETIMES, NONE, POINTS, registry
from stability.drills.base import Drill

ROOT = Path(__file__).resolve().parents[1]
DRILLS = registry()


def test_every_drill_has_its_hydra_option_and_every_option_a_drill():
    options = {p.stem for p in (ROOT / "conf/fault").glob("*.yaml")}
    assert options - {NONE} == set(DRILLS), "conf/fault/<kind>.yaml and stability/drills/<kind>.py drifted apart"
    for kind in DRILLS:
        head = (ROOT / f"conf/fault/{kind}.yaml").read_text()
        assert re.search(rf"^kind: {kind}$", head, re.M), f"conf/fault/{kind}.yaml does not set kind: {kind}"
        assert (ROOT / f"stability/drills/{kind}.py").is_file(), f"{kind}: one module per drill, named by its kind"


@pytest.mark.parametrize("kind", sorted(DRILLS))
def test_each_drill_declares_what_it_is(kind):
    d = DRILLS[kind]
    assert d.lifetime in LIFETIMES and set(d.points) <= set(POINTS) and d.points
    assert re.fullmatch(r"[a-z]+\.[a-z_]+", d.expects), d.expects  # a doctor class: layer.name
    assert sys.modules[d.__module__].__doc__.startswith(f"{kind}: "), "the module's docstring says what it does"


def test_a_drill_must_define_exactly_the_points_it_declares():
    with pytest.raises(TypeError, match="declares points"):
        class Sloppy(Drill):  # noqa: F841
            kind, expects, lifetime, points = "sloppy", "x.y", LIFETIMES[0], ("on_batch",)

            def before_update(self, s): ...
    assert "sloppy" not in registry()


def test_the_fault_schema_is_the_union_of_the_drills_keys():
    from dataclasses import fields

    schema = {f.name for f in fields(FaultConfig)} - {"kind", "step"}
    assert schema == {f.name for d in DRILLS.values() for f in fields(d.Config)}
    for kind, d in DRILLS.items():  # kind + step alone: the drill's own defaults fill in the rest
        r = FaultConfig(kind=kind, step=3).resolved() if kind != "mixture_switch" else \
            FaultConfig(kind=kind, step=3, weights=[1, 0]).resolved()
        assert set(r) == {"kind", "step"} | {f.name for f in fields(d.Config)}


@pytest.fixture(scope="module")
def hydra_conf():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        yield


@pytest.mark.parametrize("fault, line", [
    ({"kind": "dead_expert", "step": 2, "factor": 3.0}, "fault.factor=3.0: not used by fault.kind=dead_expert"),
    ({"kind": "clip_threshold", "step": 2, "factor": 0.0}, "fault.factor=0.0: must be > 0"),
    ({"kind": "dead_expert", "step": 2, "expert": -1}, "fault.expert=-1: must be >= 0"),
    ({"kind": "causal_lek", "step": 2}, "fault.kind=causal_lek: expected one of"),
])
def test_a_wrong_key_for_a_kind_fails_in_one_line_naming_it(fault, line):
    with pytest.raises(ConfigError) as e:
        FaultConfig(**fault)
    assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides, line", [
    (["fault=weight_decay", "+fault.decay=3"], "fault.decay: unknown key"),  # Hydra force-adds it; refused
    (["fault=update_scale", "fault.factor=abc"], "fault.factor=abc: expected a number"),
])
def test_hydra_overrides_are_refused_in_one_line_too(hydra_conf, overrides, line):
    with pytest.raises(ConfigError) as e:
        compose_check(overrides)
    assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)


def test_an_option_composes_and_kind_none_is_its_clean_twin(hydra_conf):
    """Through Hydra once (every option's keys go through the same schema: test_faults.py builds each)."""
    cfg = compose_check(["fault=dead_expert", "fault.layer=1"])
    assert cfg.fault.resolved() == {"kind": "dead_expert", "step": 100, "expert": 0, "layer": 1}
    assert compose_check(["fault=dead_expert", "fault.kind=none"]).fault.resolved() == {"kind": "none"}
