"""The config schema (run/config.py and the groups' dataclasses): every shipped config composes, and a
bad key, type, range or key combination is one line naming it, from the command line as from a dict."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from model.config import MoEConfig
from run.config import Config, compose_check
from stability.config import DetectorConfig, FaultConfig, GuardConfig

CONF = str(Path(__file__).resolve().parents[1] / "conf")
EXPERIMENTS = sorted(p.stem for p in Path(CONF, "experiment").glob("*.yaml"))


@pytest.fixture(scope="module", autouse=True)
def hydra_conf():
    with initialize_config_dir(config_dir=CONF, version_base=None):  # once: each init costs ~0.5 s
        yield


def compose(*overrides: str) -> Config:
    return compose_check(list(overrides))


def test_default_and_every_experiment_compose():
    assert len(EXPERIMENTS) >= 13
    cfg = compose()
    assert isinstance(cfg, Config) and cfg.run_name == "quickstart" and cfg.model.moe.every == 2
    for name in EXPERIMENTS:
        extra = ["data.path=input.txt"] if name in ("shakespeare_char", "speedrun") else []  # its one required value
        cfg = compose(f"+experiment={name}", *extra)
        assert cfg.run_name == name


def test_options_set_only_what_they_change_and_defaults_come_from_the_schema():
    cfg = compose("+experiment=drill_lr_spike")
    # the fault file sets kind, step, factor, steps; the experiment moves the step; the rest are defaults
    f = cfg.fault
    assert (f.kind, f.step, f.lr_spike.factor, f.lr_spike.steps) == ("lr_spike", 80, 50.0, 3)
    assert cfg.guard.action == "rollback" and cfg.guard.detector.window == 30 and cfg.guard.rollback.keep == 4
    assert set(cfg.guard.detector.metrics) == {"loss", "loss_by_source", "grad_norm", "update_ratio_max"}
    text = compose("data=text", "data.path=input.txt")
    assert (text.data.kind, text.data.seq_len, text.data.tokenizer) == ("text", 64, "byte")


@pytest.mark.parametrize("override, message", [
    ("train.stpes=100", "train.stpes: unknown key (did you mean train.steps?)"),
    ("model.moe.top_kk=1", "model.moe.top_kk: unknown key (did you mean model.moe.top_k?)"),
    ("guard.detector.windw=3", "guard.detector.windw: unknown key (did you mean guard.detector.window?)"),
    ("+optim.schedule.warmup=3", "optim.schedule.warmup: unknown key (did you mean optim.schedule.warmup_steps?)"),
    ("fault=lr_spkie", "fault=lr_spkie: no such option in conf/fault/ (did you mean fault=lr_spike?)"),
    ("resume.pth=x", "resume.pth: unknown key (did you mean resume.path?)"),
])
def test_unknown_key_names_the_nearest_known_one(override, message):
    with pytest.raises(ValueError) as e:
        compose(override)
    assert str(e.value) == message


@pytest.mark.parametrize("override, message", [
    ("train.steps=abc", "train.steps=abc: expected an integer (got str)"),
    ("optim.lr=fast", "optim.lr=fast: expected a number (got str)"),
    ("guard.rollback.keep=1.5", "guard.rollback.keep=1.5: expected an integer (got float)"),
    ("logging.plot=maybe", "logging.plot=maybe: expected true or false (got str)"),
])
def test_wrong_type_is_one_line(override, message):
    with pytest.raises(ValueError) as e:
        compose(override)
    assert str(e.value) == message


@pytest.mark.parametrize("overrides, message", [
    (["train.steps=0"], "train.steps=0: must be a positive integer"),
    (["optim.schedule.min_lr_ratio=2"], "optim.schedule.min_lr_ratio=2.0: must be in [0, 1]"),
    (["guard.detector.window=2"], "guard.detector.window=2: must be >= 3"),
    (["checkpoint.keep_last=0"], "checkpoint.keep_last=0: must be an integer >= 1"),
    (["fault=lr_spike", "fault.lr_spike.factor=-1"], "fault.lr_spike.factor=-1.0: must be > 0"),
    (["precision=fp16", "precision.loss_scale.backoff_factor=2"],
     "precision.loss_scale.backoff_factor=2.0: must be in (0, 1)"),
])
def test_range_rules(overrides, message):
    with pytest.raises(ValueError) as e:
        compose(*overrides)
    assert str(e.value) == message


@pytest.mark.parametrize("overrides, message", [
    (["data.path=input.txt"], "data.path=input.txt: not used by data.kind=synthetic"),
    (["data=text"], "data.path: required for data=text (e.g. data.path=input.txt)"),
    (["fault=lr_spike", "fault.labels_shuffle.seed=3"],
     "fault.labels_shuffle.seed=3: not used by fault.kind=lr_spike"),
    (["precision=fp16", "precision.margin=3"], "precision.margin=3: not used by precision=fp16"),
    (["model.vocab_size=100"], "model.vocab_size=100: set by the data (data.kind=synthetic); drop it"),
    (["checkpoint.stop_after=500"], "checkpoint.stop_after=500: beyond train.steps=400"),
    (["train.batch_size=7"], "train.batch_size=7 is not divisible by train.micro_batches=2"),
    (["model.moe.first_dense=4"], "model.moe.first_dense=4 leaves no MoE layer (model.n_layers=4)"),
])
def test_cross_key_rules(overrides, message):
    with pytest.raises(ValueError) as e:
        compose(*overrides)
    assert str(e.value) == message


def test_fault_kind_none_ignores_the_other_keys():
    drill = compose("+experiment=drill_lr_spike")
    twin = compose("+experiment=drill_lr_spike", "fault.kind=none", "fault.lr_spike.factor=-3")
    assert twin.fault.kind == "none" and twin.fault.resolved() == {"kind": "none"}
    assert drill.fault.resolved() == {"kind": "lr_spike", "step": 80, "lr_spike": {"factor": 50.0, "steps": 3}}


def test_a_component_config_built_in_code_runs_the_same_checks():
    # labs and tests build a component's dataclass directly: its __post_init__ is the schema's one check
    with pytest.raises(ValueError, match=r"^guard\.detector\.window=2: must be >= 3$"):
        GuardConfig(detector=DetectorConfig(window=2))
    with pytest.raises(ValueError, match=r"^fault\.step=0: must be >= 1$"):
        FaultConfig(kind="lr_spike", step=0)
    # a given metrics dict replaces the default set instead of merging into it
    g = GuardConfig(detector=DetectorConfig(metrics={"loss": {}}))
    assert list(g.detector.metrics) == ["loss"]
    assert OmegaConf.to_container(OmegaConf.structured(g))["detector"]["metrics"] == {"loss": {"direction": "up", "log": False}}


def test_a_saved_config_reads_back_typed_through_the_same_schema():
    saved = OmegaConf.to_container(OmegaConf.structured(compose()), resolve=True)  # what config.yaml holds
    cfg = Config.from_dict(saved)
    assert cfg == compose() and isinstance(cfg.model.moe, MoEConfig)
    with pytest.raises(ValueError, match=r"^model\.d_modle: unknown key \(did you mean model\.d_model\?\)$"):
        Config.from_dict({**saved, "model": {**saved["model"], "d_modle": 64}})
    # a text run saved when the synthetic sources (which it never read) had another default reads back
    text = {**saved, "data": {**saved["data"], "kind": "text", "path": "input.txt",
                              "sources": [{"name": "markov", "kind": "markov", "weight": 0.5}]}}
    assert Config.from_dict(text).data.kind == "text"
