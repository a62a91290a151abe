"""docs/exercises.md: every exercise parses, names a real lab and real knobs or breaks, and its command
gives the exit status the exercise expects (0: effect present, 1: absent). The default suite runs a
cheap sample; `-m sweep` runs them all."""
from __future__ import annotations

import importlib

import pytest

from labs import LABS
from labs import run as labs_run
from labs.exercises import format_exercises, load

EXERCISES = load()
SAMPLE = ("E19", "E21")  # microbatch_mean: a few seconds each, one present and one absent


def test_the_exercises_cover_the_course_and_every_command_is_valid():
    assert len(EXERCISES) >= 15
    assert len({e.section for e in EXERCISES}) >= 7
    for ex in EXERCISES:
        argv = ex.argv()
        name = argv[argv.index("--experiment") + 1]
        assert name in LABS, ex.id
        sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        labs_run.parse_sets(name, importlib.import_module(LABS[name]), sets)  # raises on a bad knob / break
        assert ex.items.get("questions"), ex.id
    printed = format_exercises()
    assert all(e.command in printed for e in EXERCISES) and "§2" in printed


def test_list_exercises_through_the_cli(capsys):
    assert labs_run.main(["--list", "--exercises"]) == 0
    out = capsys.readouterr().out
    assert "E1" in out and "expect: effect absent" in out


def _run(ex, tmp_path) -> int:
    return labs_run.main(ex.argv() + ["--out", str(tmp_path / ex.id)])


@pytest.mark.parametrize("ex", [e for e in EXERCISES if e.id in SAMPLE], ids=lambda e: e.id)
def test_a_sample_of_exercises_gives_the_expected_outcome(ex, tmp_path):
    assert _run(ex, tmp_path) == (0 if ex.expect == "present" else 1)


@pytest.mark.sweep
@pytest.mark.parametrize("ex", EXERCISES, ids=lambda e: e.id)
def test_every_exercise_gives_the_expected_outcome(ex, tmp_path):
    assert _run(ex, tmp_path) == (0 if ex.expect == "present" else 1)
