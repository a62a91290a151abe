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


def test_the_fault_schema_is_one_namespace_per_drill():
    from dataclasses import fields

    assert {f.name for f in fields(FaultConfig)} == {"kind", "step", *DRILLS}
    for kind, d in DRILLS.items():  # kind + step alone: the drill's own defaults fill in the rest
        own = {f.name for f in fields(d.Config)}
        assert {f.name for f in fields(FaultConfig.nodes()[kind])} == own
        keys = {kind: {"weights": [1, 0]}} if kind == "mixture_switch" else {}
        r = FaultConfig(kind=kind, step=3, **keys).resolved()
        assert set(r) == {"kind", "step", kind} and set(r[kind]) == own


@pytest.fixture
def student(tmp_path, monkeypatch):
    """docs/hacking.md's drill (tests/test_hacking.py), dropped into the package (a folder on its path) and
    gone again after the test: its key `scale` is a str, optim_state's `scale` a float."""
    import stability.drills as drills
    from stability.drills.base import REGISTRY
    from test_hacking import DRILL

    (tmp_path / "student_noop.py").write_text(DRILL)
    monkeypatch.setattr(drills, "__path__", [*drills.__path__, str(tmp_path)])
    yield tmp_path
    REGISTRY.pop("student_noop", None)
    sys.modules.pop("stability.drills.student_noop", None)


def test_two_drills_may_give_one_key_name_different_types(student):
    from omegaconf import OmegaConf

    from run.config_errors import from_mapping
    from stability.config import fault_schema

    schema = fault_schema(registry())  # what stability/config.py builds at import, with the student in

    def compose(*overrides: str):  # as the run does: the schema, the command line's dotlist, one-line errors
        return from_mapping(schema, OmegaConf.from_dotlist(list(overrides)), "fault")

    assert compose("kind=none").resolved() == {"kind": "none"}
    theirs = compose("kind=student_noop", "step=2", "student_noop.scale=linear")
    ours = compose("kind=optim_state", "step=2", "optim_state.mode=scale", "optim_state.scale=0.5")
    assert theirs.resolved() == {"kind": "student_noop", "step": 2, "student_noop": {"scale": "linear"}}
    assert ours.drill_config().scale == 0.5 and compose("kind=student_noop", "step=2").drill_config().scale == "log"
    with pytest.raises(ConfigError, match=r"^fault.optim_state.scale=linear: expected a number"):
        compose("kind=optim_state", "step=2", "optim_state.scale=linear")
    with pytest.raises(ConfigError, match=r"^fault.student_noop.scale=linear: not used by fault.kind=optim_state$"):
        compose("kind=optim_state", "step=2", "student_noop.scale=linear")


def test_fault_none_runs_with_two_drills_that_share_a_key_name(student, tmp_path):
    """The whole run, fault=none, with the student's drill in the package: the schema builds, the run trains."""
    import subprocess

    from helpers import TINY, env

    run = tmp_path / "run"
    boot = (f"import sys, runpy, stability.drills as d; d.__path__.append({str(student)!r}); "
            f"sys.argv = ['train.py', *sys.argv[1:]]; runpy.run_path('train.py', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", boot, f"hydra.run.dir={run}", *TINY, "train.steps=2",
                        "train.eval_every=2", "logging.plot=false", "fault=none"],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run / "metrics.jsonl").read_text().count("\n") == 2


@pytest.fixture(scope="module")
def hydra_conf():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        yield


@pytest.mark.parametrize("fault, line", [
    ({"kind": "dead_expert", "step": 2, "lr_spike": {"factor": 3.0}},
     "fault.lr_spike.factor=3.0: not used by fault.kind=dead_expert"),
    ({"kind": "clip_threshold", "step": 2, "clip_threshold": {"factor": 0.0}},
     "fault.clip_threshold.factor=0.0: must be > 0"),
    ({"kind": "dead_expert", "step": 2, "dead_expert": {"expert": -1}}, "fault.dead_expert.expert=-1: must be >= 0"),
    ({"kind": "causal_lek", "step": 2}, "fault.kind=causal_lek: expected one of"),
])
def test_a_wrong_key_for_a_kind_fails_in_one_line_naming_it(fault, line):
    with pytest.raises(ConfigError) as e:
        FaultConfig(**fault)
    assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides, line", [
    (["fault=weight_decay", "+fault.weight_decay.decay=3"],  # Hydra force-adds it; refused
     "fault.weight_decay.decay: unknown key (known: factor)"),
    (["fault=update_scale", "fault.update_scale.factor=abc"], "fault.update_scale.factor=abc: expected a number"),
    (["fault=lr_spike", "fault.lr_spike.factr=3"],
     "fault.lr_spike.factr: unknown key (did you mean fault.lr_spike.factor?)"),
    (["fault=lr_spike", "fault.lr_spik.factor=3"], "fault.lr_spik: unknown key (did you mean fault.lr_spike?)"),
    # a drill's key given flat: the drills that have it
    (["fault=nan_activation", "fault.layer=1"],
     "fault.layer: unknown key (did you mean fault.dead_expert.layer or fault.nan_activation.layer?)"),
])
def test_hydra_overrides_are_refused_in_one_line_too(hydra_conf, overrides, line):
    with pytest.raises(ConfigError) as e:
        compose_check(overrides)
    assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)


def test_an_option_composes_and_kind_none_is_its_clean_twin(hydra_conf):
    """Through Hydra once (every option's keys go through the same schema: test_faults.py builds each)."""
    cfg = compose_check(["fault=dead_expert", "fault.dead_expert.layer=1"])
    assert cfg.fault.resolved() == {"kind": "dead_expert", "step": 100, "dead_expert": {"expert": 0, "layer": 1}}
    assert compose_check(["fault=dead_expert", "fault.kind=none"]).fault.resolved() == {"kind": "none"}


def test_a_run_saved_with_flat_fault_keys_reads_back_under_its_drill():
    from stability.config import read_saved

    saved = {"kind": "lr_spike", "step": 80, "factor": 50.0, "steps": 3, "layer": None, "seed": None}
    assert FaultConfig(**read_saved(saved)).resolved() == {"kind": "lr_spike", "step": 80,
                                                          "lr_spike": {"factor": 50.0, "steps": 3}}
    assert read_saved({"kind": "none", "step": None, "factor": None}) == {"kind": "none", "step": None}
    new = {"kind": "lr_spike", "step": 80, "lr_spike": {"factor": 50.0}}
    assert read_saved(new) == new
