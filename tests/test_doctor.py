"""The doctor (doctor/cli.py) end to end on the fault drills, and its rules on synthetic records.

`-m slow`: each drill (shrunk as in tests/helpers.py, fault at step S) trains once per session, shared with
test_drills.py and test_doctor_verify.py; the doctor must name the injected fault's class from the records
alone (the specification check that failed first) and put the earliest anomaly within ±1 step of S, and its
report.md must hold every section. The synthetic-record tests pin the symptom-table cases a drill
does not produce (resume jump, slow worsening, throughput drop) and the timeline rules (segmentation
at a rollback, tie-break by timeline layer) in milliseconds.
"""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest
import yaml

from helpers import HANG_S, ROOT, SINGLE_PROCESS_DRILLS, S, env
from doctor.cli import doctor
from doctor.report import SECTIONS, runs_of
from stability.drills import registry

EXPECTED = {kind: d.expects for kind, d in registry().items()}  # drill -> the class the doctor must name


@pytest.fixture
def runs(drill_runs):
    return drill_runs


def check_drill(run_dir, drill: str) -> dict:
    rep = doctor(run_dir, plots=False)
    assert rep["class"] == EXPECTED[drill], rep["summary"]
    assert abs(rep["earliest"]["step"] - S) <= 1, rep["earliest"]
    md = (run_dir / "report.md").read_text()
    for section in SECTIONS:
        assert f"\n## {section}" in md, f"report.md lacks section {section!r}"
    assert json.loads((run_dir / "report.json").read_text())["class"] == rep["class"]
    assert rep["rejected"], "a report must say which hypotheses it rejected, and why"
    if rep["state"]["checkpoint_for_replay"]:  # only a command that can run on this run
        assert f"--step {rep['earliest']['step']}" in rep["commands"]["replay"]
    else:
        assert rep["commands"]["replay"] is None and "no complete checkpoint before" in \
            rep["state"]["replay_checkpoint_note"]
        assert "doctor.replay " not in md
    assert f"Ground truth for this drill" in md.splitlines()[-1]  # kept apart, last
    return rep


@pytest.mark.slow  # the drills' trainings (drill_runs)
@pytest.mark.parametrize("drill", SINGLE_PROCESS_DRILLS)
def test_doctor_names_the_drill(runs, drill):
    rep = check_drill(runs.get(drill), drill)
    if drill == "nan_activation":  # the drill's layer 1, sublayer mlp
        assert rep["earliest"]["model_layer"] == "block1.mlp"
        assert rep["earliest"]["layer"] == "forward"
    # every drill breaks the step's specification at its step: the doctor names the check that failed first
    assert rep["earliest"]["kind"] == "spec" and rep["earliest"]["quantity"].startswith("spec.")
    if drill in ("labels_shuffle", "repeat_token", "overlong_doc"):  # the batch is not its samples' content
        assert rep["earliest"]["layer"] == "input" and rep["earliest"]["quantity"] == "spec.data"
    if drill == "optim_state":  # the update's algebra broke, with the gradient, the LR and the input on spec
        assert rep["earliest"]["layer"] == "backward/update" and rep["earliest"]["quantity"] == "spec.optimizer"
        assert {"spec.lr", "spec.clip", "spec.data"} <= {c["name"] for c in rep["rejected"]}


@pytest.mark.slow  # the drills' trainings (drill_runs)
@pytest.mark.distributed
def test_doctor_names_rank_divergence(runs):
    rep = check_drill(runs.get("missing_reduce"), "missing_reduce")
    assert rep["earliest"]["layer"] == "system" and rep["earliest"]["quantity"] == "spec.reduce"


@pytest.mark.slow  # the drills' trainings (drill_runs)
def test_healthy_run_is_healthy(runs):
    rep = doctor(runs.get("healthy"), plots=False)
    assert rep["class"] == "healthy" and rep["earliest"] is None, rep["summary"]
    assert rep["ground_truth"] is None


@pytest.mark.slow  # the drills' trainings (drill_runs)
def test_cli_writes_report_and_plot(runs):
    d = runs.get("lr_spike")
    r = subprocess.run([sys.executable, "-m", "doctor", str(d)], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    assert "optim.lr_switch" in r.stdout
    assert (d / "report.md").is_file() and (d / "doctor_timeline.png").stat().st_size > 1000


@pytest.mark.slow  # the drills' trainings (drill_runs)
def test_diagnosis_ignores_the_fault_answer_key(runs, tmp_path):
    """Rewrite the drill's answer key (fault events, config fault node): the diagnosis must not move."""
    d = tmp_path / "run"
    shutil.copytree(runs.get("lr_spike"), d, ignore=shutil.ignore_patterns("checkpoints", "report*"))
    ev = [json.loads(x) for x in (d / "events.jsonl").read_text().splitlines()]
    ev = [{**e, "fault": "labels_shuffle"} if e["kind"] == "fault" else e for e in ev]
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    cfg["fault"] = {"kind": "nan_activation", "step": 3, "nan_activation": {"layer": 0}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    rep = doctor(d, plots=False)
    assert rep["class"] == "optim.lr_switch" and rep["earliest"]["step"] == S
    assert rep["ground_truth"].startswith("fault=labels_shuffle")  # printed, never used


def test_not_a_run_directory_is_a_one_line_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "doctor", str(tmp_path)], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1 and "metrics.jsonl" in r.stderr


# ---- the rules on synthetic records ---------------------------------------------------------------------
def fake_run(d, n: int = 90, world: int = 1, tweak=None):
    """A healthy-looking run: noisy flat loss, constant LR, fixed inputs; `tweak(t, rec)` edits a record."""
    rng = random.Random(0)
    u = lambda: rng.uniform(-1, 1)  # noqa: E731
    recs = []
    for t in range(1, n + 1):
        la, lb = 2.0 + 0.1 * u(), 3.0 + 0.1 * u()
        recs.append({
            "step": t, "tokens": 150 * t, "ckpt_id": None, "batch": {"first": 8 * (t - 1), "size": 8}, "world": world,
            "inputs": {"valid_frac": 0.6 + 0.05 * u(), "label_alignment": 1.0, "top_token_frac": 0.07 + 0.01 * u(),
                       "doc_start_frac": 1.0},
            "source_mix": {"a": 4, "b": 4}, "valid_tokens": 150, "tokens_by_source": {"a": 75, "b": 75},
            "loss": (la + lb) / 2, "loss_by_source": {"a": la, "b": lb}, "z_loss": 20 + u(), "logit_max": 5 + 0.2 * u(),
            "layers": {"emb": {"act_rms": 0.1 * (1 + 0.05 * u()), "grad_rms": 0.01,
                               "update_ratio": 0.01 * (1 + 0.1 * u())}},
            "nonfinite": {"loss": False, "logits": False, "grads": False, "optim_state": False},
            "update_ratio_max": 0.01 * (1 + 0.1 * u()), "lr": 1e-3, "grad_norm": 0.7 * (1 + 0.1 * u()),
            "clip_coef": 1.0,
            "skipped": False, "tokens_per_s": 1500 * (1 + 0.05 * u()),
            "replica": {"param_sum_spread": 0.0, "grad_norm_spread": 0.0} if world > 1 else {},
            "guard": {"triggers": [], "rollbacks": 0}, "events": []})
        if tweak:
            tweak(t, recs[-1])
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "config.yaml").write_text(yaml.safe_dump({"optim": {"lr": 1e-3, "schedule": {"name": "constant", "warmup_steps": 0}},
                                                   "train": {"steps": 400}}))
    return d


def _shift_loss(r, by):
    r["loss_by_source"] = {k: v + by for k, v in r["loss_by_source"].items()}
    r["loss"] += by


def test_fake_healthy(tmp_path):
    assert doctor(fake_run(tmp_path), plots=False)["class"] == "healthy"


@pytest.mark.parametrize("case, cls, layer", [
    ("lr", "optim.lr_switch", "backward/update"), ("rho", "optim.state", "backward/update"),
    ("replica", "system.rank_divergence", "system"), ("dup_and_loss", "data.corrupted_batch", "input"),
    ("resume", "state.resume_fault", "forward"), ("nan", "numerics.nonfinite", "forward"),
])
def test_fake_point_anomalies(tmp_path, case, cls, layer):
    """Each found at its step with its class and layer; a fault, judged so: an exact invariant, a non-finite value,
    an input statistic, a resume — or a level that stepped and held with no specification check to say the step
    did what it was told (the update ×100 from step 70 on)."""
    def tweak(t, r):
        if t != 70 and not (case in ("resume", "rho") and t > 70):
            return
        if case == "lr":
            r["lr"] *= 10
        elif case == "rho":
            r["update_ratio_max"] *= 100
            r["layers"]["emb"]["update_ratio"] *= 100
        elif case == "replica":
            r["replica"] = {"param_sum_spread": 0.01, "grad_norm_spread": 0.02}
        elif case == "dup_and_loss":  # the input and the loss move at the same step: input wins the tie
            r["inputs"]["top_token_frac"] = 1.0
            _shift_loss(r, 3.0)
        elif case == "resume":
            r["events"] = ["resumed from runs/x/checkpoints/step_000069 (step 69, 10000 tokens)"] if t == 70 else []
            _shift_loss(r, 1.5)
        elif case == "nan":
            r["loss"], r["nonfinite"]["loss"] = float("nan"), True
            r["layers"]["emb"]["act_rms"] = float("nan")
    rep = doctor(fake_run(tmp_path, world=2 if case == "replica" else 1, tweak=tweak), plots=False)
    assert rep["class"] == cls, rep["summary"]
    assert rep["earliest"]["step"] == 70 and rep["earliest"]["layer"] == layer, rep["earliest"]


def test_first_trajectory_is_analysed(tmp_path):
    """A rollback replays steps 61..70: the spike at 70 of the first pass is the incident; the
    replayed step 70 (finite, same batch) is evidence that it was transient."""
    d = fake_run(tmp_path, n=70, tweak=lambda t, r: t == 70 and r.update(
        loss=float("nan"), nonfinite={"loss": True, "logits": True, "grads": True, "optim_state": False}))
    recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    replay = [dict(r, guard={"triggers": [], "rollbacks": 1}, loss=2.5, nonfinite={}) for r in recs[60:70]]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs + replay))
    rep = doctor(d, plots=False)
    assert rep["class"] == "numerics.nonfinite" and rep["earliest"]["step"] == 70
    assert any("did not recur" in n["finding"] for n in rep["tree"])


@pytest.mark.parametrize("case, cls", [("slow", "data.slow_worsening"), ("throughput", "system.throughput"),
                                       ("resume", "state.resume_fault")])
def test_fake_slow_symptoms(tmp_path, case, cls):
    def tweak(t, r):
        if case == "resume" and t >= 60:  # a level shift too small for a point anomaly, right at the resume
            r["events"] = ["resumed from runs/x/checkpoints/step_000059 (step 59, 9000 tokens)"] if t == 60 else []
            _shift_loss(r, 0.4)
        if case == "slow" and t > 20:
            _shift_loss(r, 0.012 * (t - 20))  # 0.012 nats per step: never a point anomaly
        if case == "throughput" and t > 45:
            r["tokens_per_s"] *= 0.3
    rep = doctor(fake_run(tmp_path, tweak=tweak), plots=False)
    if case == "resume":  # the sustained test finds the level shift at the resume step itself
        assert rep["class"] == cls and rep["earliest"]["step"] == 60, rep["summary"]
        return
    assert rep["class"] == cls and rep["earliest"] is None, rep["summary"]


@pytest.mark.parametrize("mix, cls", [({"a": 4, "b": 4}, "data.corrupted_batch"), ({"a": 8, "b": 0}, "healthy")])
def test_an_improbable_source_mix_explains_its_token_distribution(tmp_path, mix, cls):
    """A batch whose token distribution left the run's is corrupted, unless its document mix is itself
    improbable under the declared weights (8 of 8 from a 0.5 source: χ² = 8, p ≈ 0.005), which moves the
    distribution by composition alone (the quickstart's seed 13 drew 9 of 16 markov documents at 0.25)."""
    def tweak(t, r):
        r["inputs"]["kl_running"] = 0.05 * (1 + 0.1 * ((7 * t) % 5 - 2))
        if t == 70:
            r["inputs"]["kl_running"], r["source_mix"] = 0.5, mix
    d = fake_run(tmp_path, tweak=tweak)
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    cfg["data"] = {"kind": "synthetic", "sources": [{"name": "a", "kind": "markov", "weight": 1.0},
                                                    {"name": "b", "kind": "copy", "weight": 1.0}]}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    rep = doctor(d, plots=False)
    assert rep["class"] == cls, rep.get("summary")
    if cls != "healthy":
        assert rep["earliest"]["step"] == 70 and rep["earliest"]["quantity"] == "input.kl_running"


def test_a_fault_that_persists_is_one_line_of_the_report():
    """Consecutive incidents alike (judgement, class, quantity, segment) are one run; anything else starts a new one."""
    def inc(step, cls="optim.settings", q="spec.optimizer", seg=0, j="fault"):
        return {"step": step, "class": cls, "quantity": q, "segment": seg, "judgement": j}
    got = runs_of([inc(2), inc(3), inc(5), inc(6, q="spec.clip"), inc(7), inc(8, seg=1), inc(9, j="natural")])
    assert [(i["step"], at) for i, at in got] == [(2, "3 steps, 2 to 5"), (6, "step 6"), (7, "step 7"), (8, "step 8"),
                                                  (9, "step 9")]
    assert runs_of([]) == []
