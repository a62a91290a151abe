"""Blind incidents (labs/incident.py): the sealed answer grades class, layer and step separately; the
scrub leaves no file or field naming the fault. The end-to-end run (train.py) is under -m sweep."""
from __future__ import annotations

import json

import pytest

from labs import incident


def test_grading_accepts_the_right_answer_and_rejects_a_wrong_layer_class_or_step():
    sealed = incident.seal({"class": "forward", "layer": "block2.mlp", "step": 130})
    hashes = json.dumps({k: v for k, v in sealed.items() if k != "format"})  # format: the list of classes
    assert "forward" not in hashes and "block2" not in hashes and all(len(h) == 128 for h in sealed["step"])
    assert incident.grade(sealed, "forward: block2.mlp", 130) == {"class": True, "layer": True, "step": True}
    assert incident.grade(sealed, " Forward :  block2.mlp ", 131)["step"]  # ±1 step, case and spaces
    assert incident.grade(sealed, "forward: block1.mlp", 130) == {"class": True, "layer": False, "step": True}
    assert incident.grade(sealed, "input: block2.mlp", 130)["class"] is False
    assert incident.grade(sealed, "forward: block2.mlp", 132)["step"] is False


def test_the_draw_is_seeded_and_covers_the_catalogue():
    assert incident.draw(12) == incident.draw(12)
    draws = [incident.draw(s) for s in range(40)]
    assert {d["kind"] for d in draws} == set(incident.CATALOGUE)
    for d in draws:
        assert incident.STEP_RANGE[0] <= d["step"] <= incident.STEP_RANGE[1]
        assert (d["layer"] != "-") == (d["kind"] == "nan_activation")


def test_scrub_removes_every_trace_and_keeps_the_effects(tmp_path):
    (tmp_path / "config.yaml").write_text("run_name: incident\nfault:\n  kind: nan_activation\n  step: 128\n")
    (tmp_path / "environment.json").write_text(json.dumps({"argv": ["fault=nan_activation", "fault.step=128", "seed=0"]}))
    (tmp_path / "events.jsonl").write_text(
        json.dumps({"step": 128, "kind": "fault", "summary": "nan_activation injected"}) + "\n"
        + json.dumps({"step": 128, "kind": "trigger", "metric": "loss", "summary": "loss non-finite"}) + "\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps(
        {"step": 128, "loss": float("nan"), "nonfinite": {"optim_state": False, "loss": True},
         "events": ["fault: nan_activation injected into block1.attn", "trigger: loss non-finite"]}) + "\n")
    (tmp_path / "train.log").write_text("step 127 ok\ndrill: injecting NaN\nstep 128 loss nan\n")
    incident.scrub(tmp_path)
    text = "".join(p.read_text() for p in tmp_path.iterdir())
    for word in ("nan_activation", "inject", "drill", "block1.attn"):
        assert word not in text
    rec = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert rec["events"] == ["trigger: loss non-finite"] and rec["nonfinite"]["loss"] is True
    assert [json.loads(x)["kind"] for x in (tmp_path / "events.jsonl").read_text().splitlines()] == ["trigger"]
    assert json.loads((tmp_path / "environment.json").read_text())["argv"] == ["seed=0"]
    assert "step 128 loss nan" in (tmp_path / "train.log").read_text()


def test_a_trace_the_scrub_cannot_remove_stops_it(tmp_path):
    (tmp_path / "config.yaml").write_text("fault:\n  kind: none\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "note": "lr_spike here"}) + "\n")
    with pytest.raises(RuntimeError, match="scrub left a trace"):
        incident.scrub(tmp_path)


@pytest.mark.sweep
def test_a_generated_incident_names_no_fault_and_grades_its_own_answer(tmp_path):
    out = tmp_path / "incident-13"
    assert incident.main(["new", "--seed", "13", "--out", str(out)]) == 0
    truth = incident.draw(13)
    for p in out.rglob("*"):
        if p.is_file() and p.name != "answer.json" and p.suffix != ".png":
            text = incident.CLEAN_NODE.sub("", p.read_text(errors="replace"))
            assert incident.telltale(text) is None, p.name
            assert truth["kind"] not in text
    right = f"{truth['class']}: {truth['layer']}"
    assert incident.main(["check", str(out), "--answer", right, "--step", str(truth["step"])]) == 0
    assert incident.main(["check", str(out), "--answer", f"{truth['class']}: block3.mlp",
                          "--step", str(truth["step"])]) == 1
    wrong_class = next(c for c in incident.CLASSES if c != truth["class"])
    assert incident.main(["check", str(out), "--answer", f"{wrong_class}: {truth['layer']}",
                          "--step", str(truth["step"])]) == 1
