"""The doctor: a fault report for one run, from its records alone.

    python -m doctor runs/<run>            # writes report.md, report.json, doctor_timeline.png

It reads every segment of the run (split where a rollback or resume sends the step back), finds in each
the earliest deviating quantity across the four layers of the timeline (input → forward →
backward/update → system; point, change-point, sustained and guard tests, doctor/scores.py) and the exact
invariants (sample ids, tokens, per-rank sharding, doctor/invariants.py), walks the decision tree
(docs/course.md §5) and symptom table (doctor/rules.py, doctor/checks.py), and writes the report
(doctor/report.py): every incident in order, then for the first the earliest anomaly, the reproducible
batch and its replay command (doctor/replay.py), state and environment versions, the rejected
hypotheses with their evidence, one single-variable fix and the regression command.

Exit status: 0 with a report (what the records lack — a truncated last line, an older record version —
is one line each on stderr); 2 with a one-line error when the directory holds no complete record.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from doctor import report as doctor_report
from doctor.rules import Diagnosis, diagnose
from doctor.timeline import Run

ROOT = Path(__file__).resolve().parents[1]


def doctor(run_dir, plots: bool = True) -> dict:
    """Diagnose `run_dir`, write its report files, return report.json's content."""
    run, diag, devs = diagnose(run_dir)
    for note in run.notes:  # what the records lack: one line each, the diagnosis goes on without it
        print(f"doctor: {note}", file=sys.stderr)
    ckpt = checkpoint_before(run, diag.step)
    state = state_and_env(run, diag, ckpt)
    # NOTE: a fix is prescribed for a fault only: a healthy run (its incidents, if any, the run learning) gets none
    fix = fix_for(diag, run, ckpt) if diag.fault_class != "healthy" else None
    report = doctor_report.to_json(run, diag, devs, state, fix, commands(run, diag, fix))
    doctor_report.write(run, diag, report, plots)
    return report


# ---- state and environment ---------------------------------------------------------------------------
def git_commit() -> str:
    """The doctor's checkout (12 hex digits): only when the run did not record its own."""
    import subprocess
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def checkpoint_before(run: Run, step: int | None) -> tuple[int, Path] | None:
    """The newest complete checkpoint saved before `step` (its parameters fed a later forward).
    NOTE: the checkpoint package (torch.distributed.checkpoint) is imported only when the run has a
    checkpoint directory: a run without checkpoints is diagnosed from its JSON files alone."""
    if step is None or not checkpoint_root(run).is_dir():
        return None
    from checkpoint import publish
    found = [(s, p) for s, p in publish.list_steps(checkpoint_root(run)) if s < step]
    # NOTE: no hashing here (the replay verifies what it loads); only a marker makes a checkpoint complete
    found = [(s, p) for s, p in found if publish.check(p, verify_hashes=False) is None]
    return found[-1] if found else None


def checkpoint_root(run: Run) -> Path:
    d = (run.config.get("checkpoint") or {}).get("dir")
    return Path(d) if d else run.dir / "checkpoints"


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
    if diag.fault_class == "state.resume_fault":
        q = diag.anomaly.quantity if diag.anomaly else "the loss"
        grp = q.split("/", 1)[1] if q.startswith("fingerprint/") else None
        part = (f"the {'data manifest' if grp == 'data' else f'config group {grp}'} (changed at the resume, not "
                f"declared in resume.allow_{'data' if grp == 'data' else 'config'}_change)" if grp else
                "the data cursor (loader samples_consumed)" if q.startswith(("continuity.", "ranks.")) else
                "the LR scheduler state" if q.startswith("lr/") else
                "the MoE balancing bias (a model buffer)" if "moe_bias" in q else
                "the optimizer moments (exp_avg / exp_avg_sq)" if q.startswith(("state.", "update_ratio")) else
                "the resumed state (optimizer / scheduler / RNG / data cursor)")
        if grp:
            return {"variable": f"{part} at the resume of step {t}",
                    "change": "resume with the checkpoint's config; if the change is meant, list the changed key in "
                              f"resume.allow_{'data' if grp == 'data' else 'config'}_change (the resume check then "
                              "logs it) — and find what let the resume through without its check",
                    "override": None, "expect": f"{q} equal before and after the resume, or a declared change"}
        return {"variable": f"{part}, as the resume at step {t} loaded it ({q} left its baseline)",
                "change": "prove the resume: python -m checkpoint.verify with the run's config, then audit what "
                          f"loads or rewrites {part} after the checkpoint is read",
                "override": None, "expect": f"straight and resumed runs agree step for step; {q} continuous at step {t}"}
    if diag.fault_class == "data.distribution_shift":
        src = diag.anomaly.quantity.split("/", 1)[1]
        return {"variable": f"the data of source {src} from step {t}",
                "change": f"compare {src}'s documents before and after step {t} (generator / shard / preprocessing "
                          "version); restore the old ones or declare the change (a new data fingerprint)",
                "override": None, "expect": f"loss_by_source/{src} back on its trajectory"}
    if diag.fault_class == "state.config_change":
        grp = diag.anomaly.quantity.split("/", 1)[1]
        return {"variable": f"the {grp} config group (its fingerprint changed at step {t})",
                "change": "find what rewrote it mid-run; a change meant to happen belongs at a resume with "
                          "resume.allow_config_change listing the key", "override": None,
                "expect": "one fingerprint per config group for the whole run"}
    if diag.fault_class == "data.continuity":
        return {"variable": "the data cursor (sample ids per step)",
                "change": f"find what moved the loader's samples_consumed at step {t} (a repeated, skipped or "
                          "reset window); every id must be read once, in order", "override": None,
                "expect": f"batch.first of step {t} = batch.first + size of step {t - 1}"}
    if diag.fault_class == "rank.data":
        return {"variable": f"the inputs of rank {diag.rank}",
                "change": f"compare rank {diag.rank}'s sample ids and local loss at step {t} with the sharding "
                          "(rank r reads ids [first + r·b, first + (r+1)·b)); fix its sampler / data path",
                "override": None, "expect": "per-rank first ids on the sharding; per-rank losses within their spread"}
    if diag.fault_class == "system.slow_component":
        comp = diag.anomaly.quantity.split("/")[-1] if diag.anomaly else "?"
        return {"variable": f"the {comp} component of the step (from step {t})",
                "change": {"data": "profile the data path (loader, storage, decoding, workers) from that step",
                           "fwd_bwd": "profile forward/backward: shapes, routing load, recomputation, communication",
                           "optim": "profile the optimizer step and the guard / telemetry around it"}.get(comp, "profile it"),
                "override": None, "expect": f"{comp} time back to its share of the step"}
    if diag.fault_class in ("numerics.activation_outlier", "optim.gradient_spike"):
        return localised_fix(diag, run, ck)
    return {"variable": {"data.slow_worsening": "the data mixture / duplication / mask of the recent data",
                         "system.throughput": "shapes, routing load, communication of the slow steps"}.get(
                diag.fault_class, "the quantity that deviated first"),
            "change": f"change only that and rerun from {ck}", "override": None,
            "expect": "the earliest anomaly gone, nothing else moved"}


def localised_fix(diag: Diagnosis, run: Run, ck: str) -> dict:
    """The fix follows from the named model layer and quantity: a module upstream of the fault is never
    named (an embedding row's blow-up cannot be reached by the SwiGLU clamp)."""
    q, layer = diag.anomaly.quantity, diag.model_layer or "?"
    model = run.config.get("model") or {}
    if q.startswith(("act_rms", "clamp_hit_rate")) and layer.endswith(".mlp") and "swiglu_clamp" in model:
        cur = model.get("swiglu_clamp")
        return {"variable": f"the SwiGLU clamp bound of {layer} (model.swiglu_clamp, now {cur})",
                "change": f"lower it and rerun from {ck}; if the outlier persists, the input to {layer} grew: look "
                          "upstream", "override": f"model.swiglu_clamp={(cur or 100) / 2:g}" if cur else None,
                "expect": f"act_rms of {layer} within its baseline"}
    if q.startswith("act_rms") and layer == "emb":
        return {"variable": "the token-embedding rows the batch used",
                "change": f"find the rows whose norm grew (compare tok_emb.weight row norms in {ck} and after); "
                          "audit what writes them (a wrong update, weight tying, a load)", "override": None,
                "expect": "act_rms of emb within its baseline; no single row far above the others"}
    if q.startswith(("act_rms", "logit_max", "z_loss")):
        return {"variable": f"the output of {layer}",
                "change": f"replay the step (python -m doctor.replay) and compare {layer}'s output and weights "
                          f"with {ck}: the first module whose output grew is the one to fix", "override": None,
                "expect": f"act_rms of {layer} within its baseline"}
    if q.startswith(("grad_rms", "update_ratio")):
        return {"variable": f"the gradient of {layer}",
                "change": f"replay the step and compare {layer}'s gradient with its neighbours': a backward "
                          "hook, a loss term or a reduction that touches only that layer", "override": None,
                "expect": f"grad_rms of {layer} within its baseline"}
    clip = (run.config.get("train") or {}).get("max_grad_norm")
    return {"variable": f"the global-norm clip threshold (train.max_grad_norm, now {clip})",
            "change": f"lower it and rerun from {ck}", "override": f"train.max_grad_norm={clip / 2:g}" if clip else None,
            "expect": "the earliest anomaly gone, nothing else moved"}


def commands(run: Run, diag: Diagnosis, fix: dict) -> dict:
    d, world = run.dir, run.records[-1].get("world", 1)
    launch = "python" if world <= 1 else f"torchrun --standalone --nproc_per_node={world}"
    over = f" {fix['override']}" if fix and fix.get("override") else ""
    fixed = f"{d}-fix"
    return {"replay": f"python -m doctor.replay {d} --step {diag.step}" if diag.step else None,
            "replay_fp64": f"python -m doctor.replay {d} --step {diag.step} --dtype float64" if diag.step else None,
            "regression": (f"{launch} train.py --config-path {d.resolve()} --config-name config "
                           f"hydra.run.dir={fixed}{over}\npython -m doctor {fixed}") if fix else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run directory (holds metrics.jsonl)")
    ap.add_argument("--no-plots", action="store_true", help="skip doctor_timeline.png")
    args = ap.parse_args(argv)
    try:
        report = doctor(args.run_dir, plots=not args.no_plots)
    except (ValueError, OSError) as e:
        print(f"doctor: {e}", file=sys.stderr)
        return 2
    e = report["earliest"]
    summary = report["summary"]
    print(summary if summary.startswith(f"{report['class']}:") else f"{report['class']}: {summary}")
    for i in report.get("incidents", []):
        if e is None or (i["step"], i["segment"]) != (e["step"], report["segment"]):
            print(f"{'natural' if i['judgement'] == 'natural' else 'also a fault'}: {i['class']} at step {i['step']} "
                  f"({i['quantity']}, segment {i['segment']}): {i['reason']}")
    if e:
        print(f"earliest anomaly: step {e['step']}, {e['layer']} layer, {e['quantity']}"
              + (f" ({e['model_layer']})" if e["model_layer"] else "") + f"; rank {e['rank']}")
    print(f"report: {Path(args.run_dir) / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
