"""`python -m doctor RUN --verify` proves a diagnosis on the shrunk drills (tests/helpers.py DRILL): the
state rebuilt bit for bit, the incident re-executed, two counterfactuals whose verdicts follow the fault —
the batch counterfactual supports "the batch" for a data fault and refutes it for a state or an LR fault,
so no verdict is hard-coded — and the one-variable fix verified over the window. These run under `-m slow` (on
the drills' trainings); the default suite checks the fix's oracle on records."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, S

# drill -> (the class the doctor names, the two counterfactuals' verdicts, the fix's override)
CASES = {
    "labels_shuffle": ("data.corrupted_batch", {"batch": "supported", "state": "refuted"}, "train.skip_batches"),
    "optim_state": ("optim.state", {"batch": "refuted", "moments": "supported"}, "intervene.kind=moments"),
    "lr_spike": ("optim.lr_switch", {"batch": "refuted", "lr": "supported"}, "intervene.kind=lr"),
}


def doctor(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "doctor", str(run_dir), "--no-plots", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("verify", "report.*", "run.lock"))
    return dst


@pytest.fixture(scope="module")
def verified(drill_runs, tmp_path_factory):
    """A drill's copy verified once per module (each verify is a handful of train.py launches)."""
    root, done = tmp_path_factory.mktemp("verify"), {}

    def get(drill: str) -> tuple[Path, dict, str]:
        if drill not in done:
            d = copy_run(drill_runs.get(drill), root / drill)
            r = doctor(d, "--verify")
            assert r.returncode == 0, f"{drill}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
            done[drill] = (d, json.loads((d / "report.json").read_text())["verified"], r.stdout)
        return done[drill]
    return get


# a data fault, a state fault and an LR fault (the batch refuted): each a handful of train.py launches
@pytest.mark.slow
@pytest.mark.parametrize("drill", sorted(CASES))
def test_verify_rebuilds_reexecutes_and_tests_two_hypotheses(verified, drill):
    run_dir, v, out = verified(drill)
    cls, verdicts, fix = CASES[drill]
    assert v["status"] == "verified" and v["class"] == cls and v["step"] == S
    a = v["attribution"]
    # from step 0 (the shrunk drills keep no checkpoint before S): every record up to S − 1 equal, bit for bit
    assert a["rebuilt"]["steps"] == [1, S - 1] and a["rebuilt"]["records_equal"] == S - 1
    assert a["bit_identical"] and a["verdict"].startswith("reproduced bit for bit")
    assert {c["hypothesis"]: c["verdict"].split(":")[0] for c in v["counterfactuals"]} == verdicts
    for c in v["counterfactuals"]:  # the figures behind each verdict
        share = c["deviation_share"]
        assert share <= 0.25 if c["verdict"].startswith("supported") else share >= 0.5
    f = v["fix"]
    assert f["ran"] and any(o.startswith(fix) for o in f["overrides"]), f
    assert f["verdict"].startswith("worked"), f["verdict"]
    for name in ("rebuild", "replay", "fix", *(f"cf-{k}" for k in verdicts)):  # every run, with its config
        assert (run_dir / "verify" / name / "config.yaml").is_file()
        assert (run_dir / "verify" / name / "metrics.jsonl").is_file()
    report = (run_dir / "report.md").read_text()
    assert "## Verified" in report and "verify/fix" in report
    assert "verify: attribution:" in out


@pytest.mark.slow  # a rebuild of 49 steps; the refusal's logic is the same as the commit check's below
def test_a_rebuild_that_departs_from_the_records_is_refused(drill_runs, tmp_path):
    run_dir = copy_run(drill_runs.get("lr_spike"), tmp_path / "run")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rec = json.loads(lines[49])
    rec["loss"] = rec["loss"] + 1e-12  # one bit of a record that the rebuild must reproduce
    lines[49] = json.dumps(rec)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    r = doctor(run_dir, "--verify", "--budget", "100")
    assert r.returncode == 2
    v = json.loads((run_dir / "report.json").read_text())["verified"]
    assert v["status"] == "refused" and "departs from the run at step 50: loss" in v["why"]


@pytest.mark.slow  # the drills' trainings (drill_runs)
def test_a_rebuild_from_scratch_needs_the_runs_commit(drill_runs, tmp_path):
    run_dir = copy_run(drill_runs.get("lr_spike"), tmp_path / "run")
    env = json.loads((run_dir / "environment.json").read_text())
    env["git"] = "0123456789ab"
    (run_dir / "environment.json").write_text(json.dumps(env))
    r = doctor(run_dir, "--verify")
    [line] = [x for x in r.stdout.splitlines() if x.startswith("verify: refused: ")]
    assert r.returncode == 2 and "the run was trained at commit 0123456789ab" in line
    assert not (run_dir / "verify").exists()  # refused before any run


@pytest.mark.slow  # the drills' trainings (drill_runs)
def test_the_budget_caps_the_replayed_steps(drill_runs, tmp_path):
    run_dir = copy_run(drill_runs.get("lr_spike"), tmp_path / "run")
    r = doctor(run_dir, "--verify", "--budget", "20")
    assert r.returncode == 2 and f"--budget=20: rebuilding steps 1..{S - 1} alone needs {S - 1} steps" in r.stdout
    assert doctor(run_dir, "--verify", "--budget", "0").returncode == 2


@pytest.mark.sweep
def test_a_natural_incident_is_not_fixed(tmp_path):
    """The default run, stopped after its induction head formed: its incident (the README's natural spike on an
    AVX2 machine) is re-executed and tested, and verify says the run recovers without intervention."""
    from helpers import run_train
    run_dir = tmp_path / "quickstart"
    r = run_train(run_dir, "checkpoint.stop_after=120", "logging.progress=false", "logging.wandb=disabled",
                  "logging.plot=false")
    assert r.returncode == 0, r.stderr[-2000:]
    assert doctor(run_dir, "--verify").returncode == 0
    v = json.loads((run_dir / "report.json").read_text())["verified"]
    if v["status"] == "nothing to verify":  # another machine's floating-point path: no incident to judge
        assert json.loads((run_dir / "report.json").read_text())["incidents"] == []
        return
    assert v["judgement"] == "natural" and v["attribution"]["bit_identical"]
    assert not v["fix"]["ran"] and "recovers without intervention" in v["fix"]["why"]
    assert [c["hypothesis"] for c in v["counterfactuals"]] == ["batch", "state"]


def test_a_failed_check_is_the_fixs_oracle():
    """The fix of a specification failure worked only where that check passes again in the fix's window."""
    from doctor.timeline import Deviation
    from doctor.rules import Diagnosis
    from doctor.verify import spec_again

    dev = Deviation("spec.lr", "optimizer", 0, 80, 3.0, 1.0, float("inf"), "no_decay", kind="spec")
    target = Diagnosis("optim.lr_switch", "", dev, 80, None, None, None)
    fail = {"check": "lr", "kind": "lr", "where": "no_decay"}
    recs = [{"step": t, "spec": {"fail": [fail] if t == 83 else []}} for t in range(79, 90)]
    assert spec_again(target, recs, 80, 89) == ("lr", 83)
    assert spec_again(target, recs, 84, 89) is None  # held over the window
    other = {"step": 85, "spec": {"fail": [{**fail, "check": "clip"}]}}
    assert spec_again(target, [other], 80, 89) is None  # another check is not this one's oracle
    target.anomaly = Deviation("loss", "forward", 0, 80, 3.0, 1.0, 9.0)
    assert spec_again(target, recs, 80, 89) is None  # not a check's failure: the doctor's own judgement decides


def test_the_rebuild_runs_at_the_runs_thread_count(tmp_path):
    """A CPU matmul's rounding can depend on the intra-op thread count, and the rebuild is compared with the run bit for
    bit: the run records the count in force (environment.json; here torch's default under the tests' OMP_NUM_THREADS=1,
    the config leaving it null) and verify's runs take it — unless the run's own command line set it."""
    from doctor.verify import Verifier
    from helpers import SMALL, run_train
    run_dir = tmp_path / "run"
    r = run_train(run_dir, *[o for o in SMALL if not o.startswith("threads=")], "train.steps=2", "checkpoint.every=0",
                  "spec.enabled=false")
    assert r.returncode == 0, r.stderr[-2000:]
    env = json.loads((run_dir / "environment.json").read_text())
    assert env["threads"] == 1
    v = Verifier(run_dir)
    v.argv, v.env = env["argv"], env
    assert v.threads() == ["threads=1"]
    v.argv = [*env["argv"], "threads=2"]
    assert v.threads() == []
