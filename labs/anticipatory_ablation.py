"""Anticipatory routing on vs off, on a spike-prone MoE run under rollback (docs/course.md §9).

DeepSeek-V4 reports that after a loss spike, rolling back and training for a while on expert ids chosen
Δt steps earlier (features from the current parameters) helps the run recover; the report gives no Δt,
threshold, window or ablation. This lab is that ablation at toy scale: the same MoE run (moe_tiny on
the synthetic mixture, the moe_spike_drill experiment without its injected fault) whose peak-LR phase
has natural loss / grad-norm spikes, with guard=rollback and the detector scoring from step 50, twice —
anticipatory routing on (Δt = `delay`) and off — through train.py itself (subprocesses, one thread).

Measured from each run's own records (metrics.jsonl, events.jsonl):
  recurrence   detector triggers after the first rollback (spikes that came back)
  rollbacks    rollbacks and vetoed skips in the whole run
  recovery     the guard's "recovered" events: steps from a rollback until the loss is back at its
               pre-incident median (mean over incidents)
  churn        expert-load churn: ½ Σ_e |p_t(e) − p_{t−1}(e)| averaged over MoE layers and over the
               WINDOW steps after the first rollback (how fast the load distribution moves)
  staleness    the route delay actually served (StepRecord.routing), and for how many steps
The checks are about the mechanism (the run is spike-prone, the on-arm served Δt-stale routes, the
off-arm never did); whether V4's claimed benefit appears is reported, not asserted, with the
difference in units of the spread between the two arms' incident-free steps.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from stability.events import read_events as read_jsonl  # one JSONL reader: [] where no file was written

TITLE = "anticipatory: rollback with anticipatory routing on vs off on a spike-prone MoE run"
ROOT = Path(__file__).resolve().parents[1]
WINDOW = 40
COMPARED = ("recurrence", "rollbacks", "recovery_mean", "churn_mean", "final_eval")


def train(run_dir: Path, seed: int, steps: int, enabled: bool, delay: int) -> None:
    # NOTE: data=synthetic and lr 3e-3 keep this lab's spike-prone run: the drill itself moved to the
    # quickstart's mixture at lr 1e-3 so that it is quiet before its fault (issue 15)
    cmd = [sys.executable, "train.py", "+experiment=moe_spike_drill", "fault.kind=none", "guard.detector.warmup=50",
           "data=synthetic", "optim.lr=3e-3", f"train.steps={steps}", f"seed={seed}", "threads=1", f"hydra.run.dir={run_dir}",
           "logging.wandb=disabled", "logging.progress=false", f"guard.anticipatory.enabled={str(enabled).lower()}",
           f"guard.anticipatory.delay={delay}", "checkpoint.every=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"anticipatory: train.py failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}")


def measure(run_dir: Path) -> dict:
    recs, events = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "events.jsonl")
    # NOTE: after a rollback the step numbers go back; the last record of a step is the one that stood
    final = {}
    for r in recs:
        final[r["step"]] = r
    steps = sorted(final)
    kinds = [e["kind"] for e in events]
    rollbacks = [e for e in events if e["kind"] == "rollback"]
    first_rb = rollbacks[0]["step"] if rollbacks else None
    triggers = [e for e in events if e["kind"] == "trigger"]
    # NOTE: in event order, not by step: after a rollback the steps go back, and a spike on the replay
    # has a smaller step number than the one that caused the rollback
    i_rb = kinds.index("rollback") if rollbacks else len(events)
    recurrence = sum(1 for e in events[i_rb + 1:] if e["kind"] == "trigger")
    recovered = [e["recovered_steps"] for e in events if e["kind"] == "recovered"]

    def churn(a: dict, b: dict) -> float:
        layers = [k for k in a.get("expert_load", {}) if k in b.get("expert_load", {})]
        if not layers:
            return float("nan")
        return statistics.mean(0.5 * sum(abs(x - y) for x, y in zip(a["expert_load"][k], b["expert_load"][k]))
                               for k in layers)

    lo = (rollbacks[0]["to_step"] if rollbacks else steps[0]) + 1
    window = [s for s in steps if lo <= s < lo + WINDOW and s - 1 in final]
    churns = [churn(final[s - 1], final[s]) for s in window]
    served = [final[s].get("routing", {}).get("delay") for s in steps if final[s].get("routing", {}).get("on")]
    evals = [final[s]["eval"]["loss"] for s in steps if final[s].get("eval")]
    return {"records": len(recs), "steps": len(steps), "triggers": len(triggers), "rollbacks": len(rollbacks),
            "skips": kinds.count("skip"), "first_rollback": first_rb, "recurrence": recurrence,
            "recovered_steps": recovered, "recovery_mean": statistics.mean(recovered) if recovered else None,
            "churn_mean": statistics.mean(churns) if churns else float("nan"), "churn": churns,
            "on_steps": len(served), "delays_served": sorted({d for d in served if d is not None}),
            "loss": [final[s]["loss"] for s in steps], "final_eval": evals[-1] if evals else None}


def run(seed: int, quick: bool = False, delay: int = 2, enabled: bool = True) -> dict:
    """delay: Δt of the on-arm; enabled: False turns anticipatory routing off in the on-arm too (the
    test's negative: nothing left to compare)."""
    steps = 140 if quick else 220
    with tempfile.TemporaryDirectory() as tmp:
        arms = {}
        for name, on in (("on", enabled), ("off", False)):
            d = Path(tmp) / name
            train(d, seed, steps, on, delay)
            arms[name] = measure(d)
    on, off = arms["on"], arms["off"]
    checks = {
        "spike-prone: the off-arm's guard rolled back at least once": off["rollbacks"] >= 1,
        "spike-prone: the on-arm's guard rolled back at least once": on["rollbacks"] >= 1,
        f"on-arm: anticipatory routing ran after its rollback and served Δt = {delay} stale routes":
            on["on_steps"] > 0 and delay in on["delays_served"],
        "off-arm: never ran (no stale routes)": off["on_steps"] == 0,
    }
    # lower is better for each; compared only where both arms have a number
    compared = [k for k in COMPARED if on[k] is not None and off[k] is not None]
    better = [k for k in compared if on[k] < off[k]]
    worse = [k for k in compared if on[k] > off[k]]
    r = {"seed": seed, "quick": quick, "steps": steps, "delay": delay, "window": WINDOW, "arms": arms,
         "on_better_in": better, "on_worse_in": worse, "claim_appears": bool(compared) and len(better) == len(compared),
         "checks": checks, "ok": all(checks.values())}
    r["table"] = table(r)
    return r


def table(r: dict) -> str:
    on, off = r["arms"]["on"], r["arms"]["off"]

    def f(x, fmt):
        return "—" if x is None else format(x, fmt)

    rows = [("detector triggers", "triggers", "d"), ("rollbacks", "rollbacks", "d"), ("vetoed skips", "skips", "d"),
            ("first rollback at step", "first_rollback", "d"), ("triggers after it (recurrence)", "recurrence", "d"),
            ("recovery, steps (mean)", "recovery_mean", ".1f"),
            (f"expert-load churn, {r['window']} steps after", "churn_mean", ".4f"),
            ("steps with anticipatory routing", "on_steps", "d"), ("final eval loss", "final_eval", ".4f")]
    lines = [f"moe_spike_drill without its fault, {r['steps']} steps, guard=rollback scoring from step 50; "
             f"on-arm Δt = {r['delay']}", "", f"{'':<40}{'on':>10}{'off':>10}"]
    lines += [f"{label:<40}{f(on[k], fmt):>10}{f(off[k], fmt):>10}" for label, k, fmt in rows]
    lines.append(f"{'route delay served':<40}{str(on['delays_served'] or '—'):>10}{str(off['delays_served'] or '—'):>10}")
    better, worse = ", ".join(r["on_better_in"]) or "nothing", ", ".join(r["on_worse_in"]) or "nothing"
    verdict = ("on is better on every measure" if r["claim_appears"] else
               "NOT established here: the comparison is mixed")
    lines += ["", f"on better in: {better}; on worse in: {worse}",
              f"V4's claimed recovery benefit at this scale: {verdict}. One seed, one paired comparison, no error "
              "bars: a difference here is not evidence either way (rerun with --seed N to see it move)."]
    return "\n".join(lines + [""] + [f"[{'ok' if v else 'FAIL'}] {k}" for k, v in r["checks"].items()])


def plot(r: dict, path) -> None:
    from labs.claims.tiny import figure, save

    fig, (a, b) = figure(2)
    for name, color in (("on", "C0"), ("off", "C3")):
        x = r["arms"][name]
        a.plot(range(1, len(x["loss"]) + 1), x["loss"], color=color, lw=0.9,
               label=f"{name}: {x['rollbacks']} rollbacks, {x['recurrence']} recurrences")
        if x["first_rollback"]:
            a.axvline(x["first_rollback"], color=color, ls=":", lw=1)
        b.plot(range(len(x["churn"])), x["churn"], color=color, lw=0.9, label=f"{name}: mean {x['churn_mean']:.4f}")
    a.set_xlabel("step (dotted: first rollback)")
    a.set_ylabel("train loss (the standing record of each step)")
    a.set_title(f"anticipatory routing on (Δt={r['delay']}) vs off")
    a.legend(fontsize=8)
    b.set_xlabel("steps after the first rollback")
    b.set_ylabel("expert-load churn ½Σ|p_t − p_{t−1}|")
    b.set_title("how fast the expert load moves")
    b.legend(fontsize=8)
    save(fig, path)
