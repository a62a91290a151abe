"""labs.run's knobs and breaks: `--set key=value` typed and validated against the lab's run(), one-line
errors, `--set break=KEY` planting a named bug for one run and restoring everything after it."""
from __future__ import annotations

import json

import pytest

import model.attention
import model.rope
import model.swiglu
from labs import LABS
from labs import run as labs_run
from labs.breaks import BREAKS, planted
from labs.claims import clip_always, clip_unscale


def test_knobs_are_the_run_keywords_and_values_are_typed_like_their_defaults():
    assert labs_run.knobs(clip_always) == {"high_lr": clip_always.HIGH_LR, "max_norm": clip_always.MAX_NORM}
    kw, breaks = labs_run.parse_sets("clip_always", clip_always, ["high_lr=0.003", "max_norm=none", "break=unscale_lost"])
    assert kw == {"high_lr": 0.003, "max_norm": None} and breaks == ["unscale_lost"]
    kw, _ = labs_run.parse_sets("clip_unscale", clip_unscale, ["scales=1,2.5"])
    assert kw == {"scales": (1.0, 2.5)}
    assert labs_run.parse_value("equal_lengths", "true", False) is True
    assert labs_run.parse_value("world", "3", 2) == 3
    with pytest.raises(ValueError, match="--set world=two"):
        labs_run.parse_value("world", "two", 2)


def test_unknown_knob_or_break_is_one_line_naming_the_knobs(capsys):
    assert labs_run.main(["--experiment", "clip_always", "--set", "lr=0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--set lr" in err[0] and "high_lr=0.7" in err[0] and "max_norm=1.0" in err[0]
    assert labs_run.main(["--experiment", "clip_always", "--set", "break=nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "break=nope" in err[0] and "wrong_rope_backward" in err[0]
    assert labs_run.main(["--experiment", "clip_always", "--set", "high_lr"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err


def test_list_shows_knobs_and_breaks(capsys):
    assert labs_run.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "knobs: high_lr=0.7, max_norm=1.0" in out
    assert all(k in out for k in BREAKS) and all(name in out for name in LABS)


def test_help_lists_the_knobs(capsys):
    with pytest.raises(SystemExit) as e:
        labs_run.main(["--help"])
    assert e.value.code == 0 and "knobs: high_lr=0.7, max_norm=1.0" in capsys.readouterr().out


def test_a_break_is_planted_for_the_run_only():
    rope, swiglu = model.rope.apply_rope, model.swiglu.swiglu
    with planted(["wrong_rope_backward", "straight_through_clamp"]):
        assert model.rope.apply_rope is not rope and model.swiglu.swiglu is not swiglu
        assert model.attention.apply_rope is model.rope.apply_rope  # every holder of the name is replaced
    assert model.rope.apply_rope is rope and model.attention.apply_rope is rope and model.swiglu.swiglu is swiglu
    with pytest.raises(ValueError, match="break=nope"):
        with planted(["nope"]):
            pass


def test_a_break_turns_its_lab_red_through_the_cli(tmp_path, capsys):
    code = labs_run.main(["--experiment", "swiglu_clamp", "--quick", "--set", "break=straight_through_clamp",
                          "--out", str(tmp_path)])
    assert code == 1 and "EXPECTED EFFECT ABSENT" in capsys.readouterr().out
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["settings"] == {"break": ["straight_through_clamp"]}
    assert r["checks"]["forward identical inside the bound (gate <= L, |up| <= L)"]


@pytest.mark.sweep
@pytest.mark.parametrize("key", list(BREAKS))
def test_every_break_turns_the_lab_that_guards_it_red(key, tmp_path):
    lab = BREAKS[key][1]
    assert labs_run.main(["--experiment", lab, "--quick", "--set", f"break={key}", "--out", str(tmp_path)]) == 1
