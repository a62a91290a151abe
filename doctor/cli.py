"""The doctor: a fault report for one run, from its records alone.

    python -m doctor runs/<run>            # writes report.md, report.json, doctor_timeline.png

It finds the earliest deviating quantity across the four layers of the timeline (input → forward →
backward/update → system; doctor/timeline.py), walks the decision tree (docs/course.md §5) and symptom table
(doctor/rules.py, doctor/checks.py), and writes the report (doctor/report.py): the earliest anomaly, the
reproducible batch and its replay command (doctor/replay.py), state and environment versions,
the rejected hypotheses with their evidence, one single-variable fix and the regression command.

Exit status: 0 with a report; 2 with a one-line error when the directory is not a run.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from checkpoint.state import git_commit
from doctor import report as doctor_report
from doctor.rules import Diagnosis, diagnose
from doctor.timeline import Run

ROOT = Path(__file__).resolve().parents[1]


def doctor(run_dir, plots: bool = True) -> dict:
    """Diagnose `run_dir`, write its report files, return report.json's content."""
    run, diag, devs = diagnose(run_dir)
    ckpt = checkpoint_before(run, diag.step)
    state = state_and_env(run, diag, ckpt)
    fix = fix_for(diag, run, ckpt)
    report = doctor_report.to_json(run, diag, devs, state, fix, commands(run, diag, fix))
    doctor_report.write(run, diag, report, plots)
    return report


# ---- state and environment ---------------------------------------------------------------------------
def checkpoint_before(run: Run, step: int | None) -> tuple[int, Path] | None:
    """The newest complete checkpoint saved before `step` (its parameters fed a later forward)."""
    from checkpoint import publish
    if step is None:
        return None
    found = [(s, p) for s, p in publish.list_steps(checkpoint_root(run)) if s < step]
    # NOTE: no hashing here (the replay verifies what it loads); only a marker makes a checkpoint complete
    found = [(s, p) for s, p in found if publish.check(p, verify_hashes=False) is None]
    return found[-1] if found else None


def checkpoint_root(run: Run) -> Path:
    d = (run.config.get("checkpoint") or {}).get("dir")
    return Path(d) if d else run.dir / "checkpoints"


def state_and_env(run: Run, diag: Diagnosis, ckpt) -> dict:
    from importlib.metadata import version
    rec = next((r for r in run.first if r["step"] == diag.step), run.first[-1])
    meta, fp = {}, None
    if ckpt is not None:
        from checkpoint import read_blobs
        blobs = read_blobs(ckpt[1], ("meta", "loader"))
        meta, fp = blobs["meta"], blobs["loader"].get("fingerprint")
    env_file = run.dir / "environment.json"  # written by train.py at start (versions + git commit)
    env = json.loads(env_file.read_text()) if env_file.is_file() else {}
    versions = meta.get("versions") or env
    prec = run.dir / "precision.json"
    canon = json.dumps(run.config, sort_keys=True, separators=(",", ":"), default=str)
    if ckpt is None:
        note = (f"no complete checkpoint before step {diag.step} under {checkpoint_root(run)}: rerun with "
                f"checkpoint.every=K (K < {diag.step}) to make the batch replayable" if diag.step else "—")
    elif ckpt[0] == diag.step - 1:
        note = f"{ckpt[1].name}: the parameters step {diag.step}'s forward used (exact replay)"
    else:
        note = (f"{ckpt[1].name}: the replay re-runs steps {ckpt[0] + 1}..{diag.step - 1} with the saved "
                f"optimizer state, exact when the run was deterministic")
    return {
        "checkpoint_id_in_record": rec.get("ckpt_id"),
        "checkpoint_for_replay": str(ckpt[1]) if ckpt else None,
        "replay_checkpoint_note": note,
        "config_hash": "sha256:" + hashlib.sha256(canon.encode()).hexdigest()[:16],
        "git_commit": env["git"] + " (environment.json: the run's checkout)" if env.get("git") else
                      git_commit() + " (the doctor's checkout: this run did not record its commit)",
        "torch_version": f"{versions['torch']} ({'checkpoint meta' if meta else 'environment.json'})" if versions.get("torch") else
                         f"{version('torch')} (the doctor's environment: no checkpoint before the incident)",
        "numpy_python": f"{versions.get('numpy', '—')} / {versions.get('python', '—')}",
        "precision_recipe": json.loads(prec.read_text()).get("recipe") if prec.is_file() else None,
        "world_size": rec.get("world", 1),
        "data_fingerprint": fp[:16] if fp else None,
        "guard_action": (run.config.get("guard") or {}).get("action"),
    }


# ---- the fix and the commands -------------------------------------------------------------------------
def fix_for(diag: Diagnosis, run: Run, ckpt) -> dict:
    """One single-variable change that tests the diagnosis (never "lower the LR until it stops")."""
    t, b, action = diag.step, diag.batch, (run.config.get("guard") or {}).get("action")
    ck = str(ckpt[1]) if ckpt else "<a checkpoint before the incident>"
    if diag.fault_class == "data.corrupted_batch":
        ids = f"samples [{b['first']}, {b['first'] + b['size']})"
        return {"variable": f"the batch of step {t} ({ids})",
                "change": f"train without it, then repair the data stage that produced it (the replay rebuilds {ids} "
                          f"from their ids: compare its input stats with the logged ones)",
                "override": "guard.rollback.data=skip" if action == "rollback" else "guard.action=skip",
                "expect": f"no second spike when the run reaches {ids} again; loss by source back on its trajectory"}
    if diag.fault_class == "numerics.nonfinite":
        return {"variable": f"the update of step {t} (non-finite in {diag.model_layer})",
                "change": "veto the non-finite update and keep the state; if the float64 replay is finite too, the "
                          "fault was transient (a kernel / device / injected event), not the state or the batch",
                "override": None if action in ("skip", "rollback") else "guard.action=skip",
                "expect": "no non-finite parameter or optimizer state after the step; the loss continues its "
                          "trajectory"}
    if diag.fault_class == "optim.lr_switch":
        return {"variable": f"the LR of steps {t}.. (off its schedule)",
                "change": "keep the LR on optim.schedule: find what replaced it (a resume with another schedule, a "
                          "manual change, a scheduler that was not restored)", "override": None,
                "expect": f"record lr / schedule = 1 at step {t}; no update-ratio jump"}
    if diag.fault_class == "optim.state":
        return {"variable": f"the optimizer state entering step {t}",
                "change": f"restore it from {ck} and rerun; audit what writes optimizer state between steps",
                "override": f"resume.path={ck}" if ckpt else None,
                "expect": f"update ratio at step {t} within its baseline"}
    if diag.fault_class == "system.rank_divergence":
        return {"variable": f"the gradient reduction of step {t}",
                "change": "audit the collective (DDP comm hook, buckets, shard ownership, a bad device); compare "
                          "per-rank grad norms", "override": None,
                "expect": "replica spreads exactly 0 at every step"}
    if diag.fault_class in ("objective.mixture", "data.switch"):
        return {"variable": "the data mixture weights (data.sources[*].weight)",
                "change": "an objective change, not an optimisation fault: restore the old weights if the switch was "
                          "unintended, else re-baseline the guard and compare per-source losses with their floors",
                "override": None,
                "expect": "per-source losses on their trajectories; total loss at the new mixture floor"}
    if diag.fault_class == "state.resume_jump":
        return {"variable": "the resumed state (optimizer / scheduler / RNG / data cursor)",
                "change": "prove the resume: python -m checkpoint.verify with the run's config",
                "override": None, "expect": "straight and resumed runs agree step for step"}
    if diag.fault_class == "healthy":
        return {"variable": "none", "change": "nothing to fix", "override": None,
                "expect": "the doctor finds no anomaly again"}
    return {"variable": {"optim.gradient_spike": "the global-norm clip threshold (train.max_grad_norm)",
                         "numerics.activation_outlier": "the SwiGLU clamp bound (model.swiglu_clamp)",
                         "data.slow_worsening": "the data mixture / duplication / mask of the recent data",
                         "system.throughput": "shapes, routing load, communication of the slow steps"}.get(
                diag.fault_class, "the quantity that deviated first"),
            "change": f"change only that and rerun from {ck}", "override": None,
            "expect": "the earliest anomaly gone, nothing else moved"}


def commands(run: Run, diag: Diagnosis, fix: dict) -> dict:
    d, world = run.dir, run.first[-1].get("world", 1)
    launch = "python" if world <= 1 else f"torchrun --standalone --nproc_per_node={world}"
    over = f" {fix['override']}" if fix.get("override") else ""
    fixed = f"{d}-fix"
    return {"replay": f"python -m doctor.replay {d} --step {diag.step}" if diag.step else None,
            "replay_fp64": f"python -m doctor.replay {d} --step {diag.step} --dtype float64" if diag.step else None,
            "regression": f"{launch} train.py --config-path {d.resolve()} --config-name config "
                          f"hydra.run.dir={fixed}{over}\npython -m doctor {fixed}"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run directory (holds metrics.jsonl)")
    ap.add_argument("--no-plots", action="store_true", help="skip doctor_timeline.png")
    args = ap.parse_args(argv)
    try:
        report = doctor(args.run_dir, plots=not args.no_plots)
    except ValueError as e:
        print(f"doctor: {e}", file=sys.stderr)
        return 2
    e = report["earliest"]
    print(f"{report['class']}: {report['summary']}")
    if e:
        print(f"earliest anomaly: step {e['step']}, {e['layer']} layer, {e['quantity']}"
              + (f" ({e['model_layer']})" if e["model_layer"] else "") + f"; rank {e['rank']}")
    print(f"report: {Path(args.run_dir) / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
