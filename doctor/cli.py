"""The doctor: a fault report for one run, from its records alone.

    python -m doctor runs/<run>            # writes report.md, report.json, doctor_timeline.png

It reads every segment of the run (split where a rollback or resume sends the step back), finds in each
the earliest deviating quantity across the four layers of the timeline (input → forward →
backward/update → system; point, change-point, sustained and guard tests, doctor/scores.py) and the exact
invariants (sample ids, tokens, per-rank sharding, doctor/invariants.py), walks the decision tree
(docs/course.md §5) and symptom table (doctor/classify.py, doctor/checks.py), and writes the report
(doctor/report.py): every incident in order, then for the first the earliest anomaly, the reproducible
batch and its replay command (doctor/replay.py), state and environment versions, the rejected
hypotheses with their evidence, one single-variable fix and the regression command.

    python -m doctor runs/<run> --verify   # and prove it (doctor/verify.py): the "Verified" section

Exit status: 0 with a report (what the records lack — a truncated last line, an older record version —
is one line each on stderr); 2 with a one-line error when the directory holds no complete record, or
when --verify cannot verify (the report then says why).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from doctor import checkpoints
from doctor import report as doctor_report
from doctor.classes import fix_for
from doctor.diagnosis import Diagnosis
from doctor.rules import diagnose
from doctor.timeline import Run
from doctor.verify import Verifier, VerifyError
from run.argv import without

ROOT = Path(__file__).resolve().parents[1]
WORDS = {"natural": "natural", "fault": "also a fault", "instability": "also a recipe instability"}


def doctor(run_dir, plots: bool = True, verify: bool = False, budget: int = 1000, say=print) -> dict:
    """Diagnose `run_dir`, write its report files, return report.json's content; with `verify`, prove the
    diagnosis first (doctor/verify.py: re-execution, two counterfactuals, the fix) into its `verified`."""
    verified = verify_or_why(run_dir, budget, say) if verify else None
    run, diag, devs = diagnose(run_dir)
    for note in run.notes:  # what the records lack: one line each, the diagnosis goes on without it
        print(f"doctor: {note}", file=sys.stderr)
    ckpt = checkpoints.before(run.dir, run.config, diag.step)
    state = state_and_env(run, diag, ckpt)
    # NOTE: a fix is prescribed for a fault only: a healthy run (its incidents, if any, the run learning) gets none
    fix = fix_for(diag, run, ckpt) if diag.fault_class != "healthy" else None
    report = doctor_report.to_json(run, diag, devs, state, fix, commands(run, diag, fix, ckpt))
    if verified is not None:
        report["verified"] = verified
    doctor_report.write(run, diag, report, plots)
    return report


def verify_or_why(run_dir, budget: int, say) -> dict:
    try:
        return Verifier(Path(run_dir), budget, say).verify()
    except VerifyError as e:
        return {"status": "refused", "why": str(e)}


# ---- state and environment ---------------------------------------------------------------------------
def git_commit() -> str:
    """The doctor's checkout (12 hex digits): only when the run did not record its own."""
    import subprocess
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def state_and_env(run: Run, diag: Diagnosis, ckpt) -> dict:
    from importlib.metadata import version
    seg = run.paths[diag.seg_index]
    rec = next((r for r in seg if r["step"] == diag.step), seg[-1])
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
        note = (f"no complete checkpoint before step {diag.step} under {checkpoints.root(run.dir, run.config)}: rerun with "
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


def commands(run: Run, diag: Diagnosis, fix: dict | None, ckpt) -> dict:
    """Only commands that can run on this run: a replay needs a checkpoint before the step (else None, and
    the state section says why); the regression run repeats the run's own command line (environment.json)
    into a new directory with the fix's override."""
    d, world = run.dir, run.records[-1].get("world", 1)
    launch = "python" if world <= 1 else f"torchrun --standalone --nproc_per_node={world}"
    replayable = bool(diag.step and ckpt)
    env_file = d / "environment.json"
    argv = json.loads(env_file.read_text()).get("argv") if env_file.is_file() else None
    regression = None
    if fix and argv is not None:
        over = fix["override"].split() if fix.get("override") else []
        keep = without(argv, ("hydra.run.dir", "resume", *(o.split("=", 1)[0].lstrip("+") for o in over)))
        regression = (" ".join([launch, "train.py", *keep, f"hydra.run.dir={d}-fix", *over])
                      + f"\npython -m doctor {d}-fix")
    return {"replay": f"python -m doctor.replay {d} --step {diag.step}" if replayable else None,
            "replay_fp64": f"python -m doctor.replay {d} --step {diag.step} --dtype float64" if replayable else None,
            "regression": regression}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run directory (holds metrics.jsonl)")
    ap.add_argument("--no-plots", action="store_true", help="skip doctor_timeline.png")
    ap.add_argument("--verify", action="store_true", help="prove the diagnosis: re-execute the incident, two "
                    "counterfactual replays, the fix over a short window (runs under RUN/verify/)")
    ap.add_argument("--budget", type=int, default=1000, help="--verify: optimizer steps it may replay in all")
    args = ap.parse_args(argv)
    if args.budget < 1:
        print(f"doctor: --budget={args.budget}: must be >= 1", file=sys.stderr)
        return 2
    try:
        report = doctor(args.run_dir, plots=not args.no_plots, verify=args.verify, budget=args.budget)
    except (ValueError, OSError) as e:
        print(f"doctor: {e}", file=sys.stderr)
        return 2
    e = report["earliest"]
    summary = report["summary"]
    print(summary if summary.startswith(f"{report['class']}:") else f"{report['class']}: {summary}")
    headline = [i for i in report.get("incidents", [])
                if e is None or (i["step"], i["segment"]) != (e["step"], report["segment"])]
    for i, at in doctor_report.runs_of(headline):
        print(f"{WORDS[i['judgement']]}: {i['class']} at {at} ({i['quantity']}, segment {i['segment']}): {i['reason']}"
              + (" (the first of them)" if "steps" in at else ""))
    for c in report.get("declared", []):
        print(f"declared: {c}")
    if e:
        print(f"earliest anomaly: step {e['step']}, {e['layer']} layer, {e['quantity']}"
              + (f" ({e['model_layer']})" if e["model_layer"] else "") + f"; rank {e['rank']}")
    v = report.get("verified")
    if v is not None:
        for line in doctor_report.verified_lines(v):
            print(line)
    print(f"report: {Path(args.run_dir) / 'report.md'}")
    return 2 if v is not None and v["status"] == "refused" else 0


if __name__ == "__main__":
    sys.exit(main())
