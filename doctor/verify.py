"""The doctor proves its diagnosis: re-execute the incident, test two hypotheses by counterfactual replay, and
run the one-variable fix (docs/course.md §5: "two hypotheses refuted, one single-variable fix, and the
regression result").

    python -m doctor runs/<run> --verify [--budget STEPS]

For the first incident judged a fault (or, on a healthy run, the first natural one), at step S:

1. Rebuild the state before it: the run's own command line (environment.json) re-run from the newest
   checkpoint at or before S − 3, or from step 0 when there is none (refused when this checkout is not the
   run's commit), saving steps S − 2 and S − 1. Its records must equal the run's bit for bit, else stop.
2. Re-execute step S from S − 1 (train.py, FP32, drills and guard as configured) and in FP64 (doctor/replay.py,
   forward only). Attribution: reproduced bit for bit (deterministic: the data, the state or the
   computation), not reproduced (transient: outside the recorded run), and whether FP64 agrees (numerics).
3. Two counterfactuals chosen by the class (COUNTERFACTUALS), each a replay that changes one thing
   (stability/intervene.py): the deviation of the incident's quantity stays (the hypothesis is refuted) or goes
   (supported), with the numbers.
4. The fix (its class's declared fix, doctor/classes: its `override`) from the state before the incident, over
   S .. S + 2 × the detector window: the doctor on that window must find no fault from S on, and the loss gap to
   the exact floor by source no worse than the run's; a natural incident gets no fix (the run recovered by itself).
   A recipe instability's lever (doctor/levers.py) runs to the run's last step (its damage is what lasts): it
   worked when the doctor finds no fault and no instability in its rerun and the damaged source ends nearer its
   floor than the run did, beyond its noise — from step 0 when a resume cannot apply the lever (QK-norm reshapes
   the model; the LR and its warm-up live in the scheduler state a resume restores).
   A spike the rerun meets on another path is judged like any other: natural unless it does lasting damage.

Every run is a directory under runs/<run>/verify/ with its config and records; report.json gains `verified`
and report.md a "Verified" section with each command.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from doctor import checkpoints
from doctor.classes import fix_for
from doctor.diagnosis import FAULT, INSTABILITY, NATURAL, Diagnosis
from doctor.rules import diagnose
from doctor.timeline import Run
from doctor.replay import trajectory
from doctor.verify_records import (VerifyError, compare_gaps, first_record, gap_by_source, noise_by_source,
                                   record_diff, value_in, without_inputs)
from run.argv import without
from stability.record import read_records
from stability.signals import family

ROOT = Path(__file__).resolve().parents[1]
# class -> the two hypotheses its counterfactuals test (a hypothesis: HYPOTHESES below); every other class
# tests the batch against the state that met it
COUNTERFACTUALS = {"optim.state": ("batch", "moments"), "optim.lr_switch": ("batch", "lr")}
DEFAULT_CF = ("batch", "state")
HYPOTHESES = {
    "batch": "the batch: the same state with the neighbouring batch (step S + 1's ids)",
    "state": "the state: the same batch one step earlier (the parameters and moments of step S − 2)",
    "moments": "the optimizer state: the moments as the optimizer's own update wrote them (a later writer undone)",
    "lr": "the schedule: step S with every group's LR on its schedule",
}
# the deviation's remaining share: at most a quarter supports the hypothesis (three quarters of it gone), at least
# half refutes it (the change left most of it); between the two it is inconclusive
GOES, STAYS = 0.25, 0.5
RUN_CONTROL = ("hydra.run.dir", "resume", "checkpoint.every", "checkpoint.stop_after", "checkpoint.keep_last",
               "logging.progress", "logging.wandb", "logging.plot", "intervene")
QUIET = ["logging.progress=false", "logging.wandb=disabled", "logging.plot=false"]


@dataclass
class Launch:
    name: str
    overrides: list[str]
    steps: int                 # optimizer steps it runs
    command: str = ""
    seconds: float = 0.0


@dataclass
class Verifier:
    run_dir: Path
    budget: int = 1000         # replayed optimizer steps, all runs together: a rebuild, the replays and a fix to the
    #                            end of a default-job run (400 steps) fit twice over
    say: object = print
    launches: list[Launch] = field(default_factory=list)

    # ---- the runs ----------------------------------------------------------------------------------------
    def launch(self, name: str, overrides: list[str], steps: int, seed_records: list[dict] | None = None) -> Path:
        """train.py with the run's own argv and `overrides` into verify/<name> (seeded with records when a
        window is continued); raises VerifyError with train.py's last line when it fails."""
        out = self.run_dir / "verify" / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        if seed_records:
            (out / "metrics.jsonl").write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in seed_records))
        argv = [*without(self.argv, RUN_CONTROL), *self.threads(), f"hydra.run.dir={out}", *QUIET, *overrides]
        cmd = [*self.launcher, "train.py", *argv]
        shown = " ".join(cmd[1:] if cmd[0] == sys.executable else cmd)
        used = sum(x.steps for x in self.launches)
        self.say(f"verify: {name}: {steps} step(s) ({used + steps}/{self.budget} of the budget)")
        t0 = time.perf_counter()
        env = {**os.environ, "WANDB_MODE": "disabled"}
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        self.launches.append(Launch(name, overrides, steps, ("python " if cmd[0] == sys.executable else "") + shown,
                                    time.perf_counter() - t0))
        (out / "train.log").write_text(r.stdout + r.stderr)
        if r.returncode not in (0, 3):  # 3: the guard stopped it (its records stand)
            last = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or ["no output"]
            raise VerifyError(f"the {name} run failed ({r.returncode}): {last[0]} (see {out / 'train.log'})")
        return out

    def threads(self) -> list[str]:
        """The run's intra-op thread count, where its command line did not set it: the rebuild is compared with the
        run bit for bit, and a CPU matmul's rounding can depend on the count (a run trained under OMP_NUM_THREADS=1,
        verified from a shell without it, would depart at its first step)."""
        n = self.env.get("threads")
        given = any(a.lstrip("+").startswith("threads=") for a in self.argv)
        return [] if n is None or given else [f"threads={int(n)}"]

    # ---- the protocol ------------------------------------------------------------------------------------
    def verify(self) -> dict:
        run, diag, _ = diagnose(self.run_dir)
        # the headline (the first fault, else the first recipe instability), else the first natural incident
        natural = diag.judgement is None or diag.judgement.verdict == NATURAL
        target = next(iter(diag.incidents), None) if natural else diag
        if target is None or target.step is None:
            return {"status": "nothing to verify", "why": "no incident: the run is healthy and nothing deviated"}
        self.prepare(run, target)
        S, q = target.step, target.anomaly.quantity
        self.say(f"verify: {'natural incident' if natural else target.fault_class} at step {S} ({q})")
        cps = self.rebuild(run, S)
        attribution = self.attribute(run, target, cps)
        if not attribution["reproduced"]:  # nothing in the rerun to change: its cause was outside the records
            why = ("the incident does not reproduce from the state and the batch: a replay that changes one thing "
                   "has no deviation to remove")
            cfs, fix = [], {"ran": False, "why": "no rerun contains its cause: guard against it online "
                                                 "(guard.action=skip or rollback)", "counterfactuals": why}
        else:
            cfs = [self.counterfactual(run, target, kind, cps)
                   for kind in COUNTERFACTUALS.get(target.fault_class, DEFAULT_CF)]
            fix = self.recovered(target) if natural else self.fix(run, diag, target, cps)
        return {"status": "verified", "step": S, "class": target.fault_class, "quantity": q,
                "judgement": target.judgement.verdict if target.judgement else NATURAL, "attribution": attribution,
                "counterfactuals": cfs, "fix": fix, "budget": self.budget,
                "replayed_steps": sum(x.steps for x in self.launches),
                "runs": [{"name": x.name, "steps": x.steps, "seconds": round(x.seconds, 1), "command": x.command}
                         for x in self.launches]}

    def prepare(self, run: Run, target: Diagnosis) -> None:
        env_file = self.run_dir / "environment.json"
        env = json.loads(env_file.read_text()) if env_file.is_file() else {}
        if env.get("argv") is None:
            raise VerifyError(f"{env_file}: no recorded command line (argv) to re-execute")
        self.argv, self.env = list(env["argv"]), env
        world = int(env.get("world") or 1)
        self.launcher = [sys.executable] if world <= 1 else ["torchrun", "--standalone", f"--nproc_per_node={world}"]
        self.path = trajectory(run.records, target.step)  # the records that led to the incident
        self.config = run.config

    def rebuild(self, run: Run, S: int) -> dict[int, Path]:
        """Checkpoints of steps S − 2 and S − 1, from the run's own newest checkpoint at or before S − 3 or
        from step 0; the rebuilt records compared with the run's, bit for bit."""
        if S < 3:
            raise VerifyError(f"step {S}: too early to rebuild the two steps before it")
        from checkpoint import publish
        start = checkpoints.before(run.dir, run.config, S - 3, inclusive=True)
        if start is None:
            from checkpoint.state import git_commit
            was, now = str(self.env.get("git", "unknown")), git_commit()
            if was != now:
                raise VerifyError(f"the run was trained at commit {was}, this checkout is {now}: a rebuild from "
                                  f"step 0 would not be the same run (check out {was}, or keep a checkpoint before "
                                  f"step {S})")
        k = start[0] if start else 0
        steps = S - 1 - k
        if steps + 4 > self.budget:
            raise VerifyError(f"--budget={self.budget}: rebuilding steps {k + 1}..{S - 1} alone needs {steps} steps")
        over = [f"checkpoint.stop_after={S - 1}", f"checkpoint.every={S - 2}", "checkpoint.keep_last=3"]
        if start:
            over.append(f"resume.path={start[1].resolve()}")
        out = self.launch("rebuild", over, steps)
        from stability.inputs import InputBaseline
        running = InputBaseline.RUNNING if start else ()  # not in a checkpoint: a resumed process restarts them
        mine = read_records(out / "metrics.jsonl")
        for r in mine:
            ref = self.path.get(r["step"])
            diff = record_diff(without_inputs(ref, running), without_inputs(r, running)) if ref else \
                "no such step in the run"
            if diff:
                raise VerifyError(f"the rebuild departs from the run at step {r['step']}: {diff} (the run is not "
                                  f"reproducible here: another machine, thread count or code)")
        cps = {s: p for s, p in publish.list_steps(out / "checkpoints")}
        if S - 1 not in cps or S - 2 not in cps:
            raise VerifyError(f"the rebuild saved no checkpoint of step {S - 2} and {S - 1} (under {out})")
        self.rebuilt = {"from": f"checkpoint {start[1].name}" if start else "step 0 (the run's config)",
                        "steps": [k + 1, S - 1], "records_equal": len(mine)}
        return cps

    def attribute(self, run: Run, target: Diagnosis, cps: dict[int, Path]) -> dict:
        S = target.step
        out = self.launch("replay", [f"resume.path={cps[S - 1].resolve()}", f"checkpoint.stop_after={S}",
                                     "checkpoint.every=0"], 1)
        rec = first_record(out, S)
        orig = self.path[S]
        from stability.inputs import InputBaseline
        # the whole record (the wall clock aside; the replay is a resumed process: see rebuild)
        diff = record_diff(without_inputs(orig, InputBaseline.RUNNING), without_inputs(rec, InputBaseline.RUNNING))
        same = diff is None
        share = self.share(target, rec, S)
        reproduced = share >= STAYS if share is not None else same
        from doctor.replay import replay
        self.say("verify: replay in float64 (forward only)")
        r64 = replay(self.run_dir, S, "float64", checkpoint=cps[S - 1])
        r32 = replay(self.run_dir, S, "float32", checkpoint=cps[S - 1])
        rel = abs(r64.loss - r32.loss) / max(abs(r32.loss), 1e-30) if math.isfinite(r64.loss + r32.loss) else math.nan
        if reproduced and same:
            verdict = ("reproduced bit for bit in FP32 from the state before it: deterministic — the data, the "
                       "state or the computation, not a transient event")
        elif reproduced:
            verdict = f"reproduced in FP32, not bit for bit (first difference: {diff}): deterministic in its size"
        else:
            verdict = ("not reproduced from the state and the batch: transient (outside the recorded run: a device, "
                       "a non-deterministic kernel or an injected event; on a CPU every kernel here is deterministic)")
        if r32.first_nonfinite and not r64.first_nonfinite:
            numerics = f"FP64 removes it (FP32's first non-finite layer {r32.first_nonfinite} is finite in FP64): numerics"
        elif math.isfinite(rel):
            numerics = (f"the FP64 forward agrees with FP32 to {rel:.1e} relative (loss {r64.loss:.8g} vs "
                        f"{r32.loss:.8g}): precision does not explain it")
        else:
            numerics = f"non-finite in FP64 too ({r64.first_nonfinite or 'the loss'}): not a precision effect"
        return {"verdict": verdict, "bit_identical": same, "reproduced": reproduced,
                "deviation_share": share, "fp64": numerics,
                "fp64_loss": r64.loss, "fp32_loss": r32.loss, "rebuilt": self.rebuilt,
                "replay_loss": rec.get("loss"), "logged_loss": orig.get("loss")}

    def counterfactual(self, run: Run, target: Diagnosis, kind: str, cps: dict[int, Path]) -> dict:
        S, b = target.step, self.path[target.step]["batch"]
        nxt = self.path.get(S + 1, {}).get("batch") or {"first": b["first"] + b["size"]}
        if kind == "state":  # the incident's batch one step earlier, on the state of step S − 2
            over, at = [f"resume.path={cps[S - 2].resolve()}", f"checkpoint.stop_after={S - 1}",
                        "intervene.kind=batch", f"intervene.step={S - 1}", f"intervene.first_id={b['first']}"], S - 1
        elif kind == "batch":
            over, at = [f"resume.path={cps[S - 1].resolve()}", f"checkpoint.stop_after={S}", "intervene.kind=batch",
                        f"intervene.step={S}", f"intervene.first_id={nxt['first']}"], S
        elif kind == "moments":  # the moments step T's update wrote: T = S for the state S recorded, else S − 1
            T = moments_step(target)
            over, at = [f"resume.path={cps[T - 1].resolve()}", f"checkpoint.stop_after={S}", "intervene.kind=moments",
                        f"intervene.step={T}"], S
        else:
            over, at = [f"resume.path={cps[S - 1].resolve()}", f"checkpoint.stop_after={S}", "intervene.kind=lr",
                        f"intervene.step={S}"], S
        first = S - 2 if kind == "state" else moments_step(target) - 1 if kind == "moments" else S - 1  # resumed at
        out = self.launch(f"cf-{kind}", [*over, "checkpoint.every=0"], at - first)
        rec = first_record(out, at)
        share = self.share(target, rec, at)
        if share is None:
            verdict = "inconclusive: the quantity is not in the replayed record"
        elif share <= GOES:
            verdict = "supported: the deviation goes"
        elif share >= STAYS:
            verdict = "refuted: the deviation stays"
        else:
            verdict = "inconclusive: the deviation shrinks only in part"
        return {"hypothesis": kind, "tests": HYPOTHESES[kind], "verdict": verdict, "deviation_share": share,
                "value": value_in(self.path, rec, at, target.anomaly.quantity, self.config),
                "logged": target.anomaly.value, "baseline": target.anomaly.baseline,
                "loss": rec.get("loss"), "grad_norm": rec.get("grad_norm"), "command": self.launches[-1].command}

    def share(self, target: Diagnosis, rec: dict, at: int) -> float | None:
        """How much of the incident's deviation a replayed record keeps: (f(v) − f(base)) / (f(logged) − f(base)),
        f = log for a log-scored signal; a non-finite value keeps all of a non-finite deviation."""
        a = target.anomaly
        v = value_in(self.path, rec, at, a.quantity, self.config)
        if v is None:
            return None
        if not math.isfinite(a.value):
            return 1.0 if not math.isfinite(v) else 0.0
        if not math.isfinite(v):
            return math.inf
        if a.baseline is None:
            return None
        sig = family(a.quantity)
        f = (lambda x: math.log(max(x, 1e-30))) if sig and sig.log else (lambda x: x)
        d = f(a.value) - f(a.baseline)
        return (f(v) - f(a.baseline)) / d if d else None

    def fix(self, run: Run, diag: Diagnosis, target: Diagnosis, cps: dict[int, Path]) -> dict:
        S = target.step
        fx = fix_for(target, run, checkpoints.before(run.dir, run.config, S))
        over = (fx.get("override") or "").split()
        if not over:
            return {"ran": False, "fix": fx, "why": "the fix is not a config change (" + fx["change"] + ")"}
        unstable = target.judgement is not None and target.judgement.verdict == INSTABILITY
        window = self.window
        last = max(r["step"] for r in run.records)
        # capped at the run's own last step: the window is compared with what the run did without the fix; a
        # recipe instability's damage is what lasts, so its window is the rest of the run
        end = min(last if unstable else S + 2 * window, int(self.config["train"]["steps"]), last)
        at = [int(o.split("=", 1)[1]) for o in over if o.startswith("intervene.step=")]
        start = 0 if unstable and (target.lever or {}).get("from_start") else min([S - 1, *(t - 1 for t in at)])
        if start and start not in cps:
            return {"ran": False, "fix": fx, "why": f"the fix acts at step {start + 1}, before the rebuilt state"}
        left = self.budget - sum(x.steps for x in self.launches)
        end = min(end, start + left)
        if end <= S:
            return {"ran": False, "fix": fx, "why": f"--budget={self.budget} leaves no step past {S} for the fix"}
        keys = [o.split("=", 1)[0].lstrip("+") for o in over]
        if start:
            # NOTE: imported here: the checkpoint package loads torch, which the doctor's reading never needs
            from checkpoint.resume import MUST_MATCH, _under
            defining = [k for k in keys if _under(k, MUST_MATCH)]  # a resume must be told of these
            allow = [f"resume.allow_config_change=[{','.join(defining)}]"] if defining else []
            seed = [r for t, r in sorted(self.path.items()) if t <= start]
            out = self.launch("fix", [f"resume.path={cps[start].resolve()}", f"checkpoint.stop_after={end}",
                                      "checkpoint.every=0", *allow, *over], end - start, seed_records=seed)
        else:  # a resume cannot apply the lever (doctor/levers.py): the run's own command line from step 0, with it
            out = self.launch("fix", [f"checkpoint.stop_after={end}", "checkpoint.every=0", *over], end)
        _, fdiag, _ = diagnose(out)
        # NOTE: a spike the rerun meets on its own path is judged like any other (natural unless it does lasting
        # damage): only a fault, or the damage the fix is for, counts against it
        bad = (FAULT, INSTABILITY) if unstable else (FAULT,)
        faults = [i for i in fdiag.incidents if i.judgement and i.judgement.verdict in bad and i.step >= S - 1]
        # NOTE: the run's other faults in the window are not the fix's to remove: only a fault the run without
        # the fix did not have (within 2 steps: the step and its update's) counts against it
        theirs = [i for i in diag.incidents if i is not target and i.judgement and i.judgement.verdict == FAULT]
        again = [i for i in faults if (i.fault_class == target.fault_class or unstable) and abs(i.step - S) <= 2]
        new = [i for i in faults if i not in again and not any(
            o.fault_class == i.fault_class and abs(o.step - i.step) <= 2 for o in theirs)]
        # "nothing else moved": the window's floor gap by source against the clean run before the incident
        # (a learning run's gap falls, so the fix must not leave it above where it was), two means of different
        # batches, each with the per-step spread / √n; one-sided, at the budget's threshold over the sources
        tail = self.tail(S, end)
        half = S + (end - S) // 2 if not unstable else max(S, end - window)
        fixed = read_records(out / "metrics.jsonl")
        after = gap_by_source(fixed, half, end)
        before = gap_by_source(list(self.path.values()), S - max((end - S) // 2, 1) - 1, S - 1)
        without = gap_by_source(list(self.path.values()) + tail, half, end)
        noise = noise_by_source(self.path, S, window)
        damaged = {e.get("series") for e in (target.judgement.evidence.get("outcome") or []) if e.get("series")} \
            if unstable else set()
        worse, better, missing = compare_gaps(after, before, without, noise, window,
                                              {q.split("/", 1)[-1] for q in damaged})
        # a failed specification check is its own oracle: the fix worked only where that check passes again
        recheck = spec_again(target, fixed, S, end)
        if recheck:
            verdict = f"did not work: check {recheck[0]} failed again at step {recheck[1]}"
        elif not again and not new and not worse and not missing:
            held = (f", check {target.anomaly.quantity.removeprefix('spec.')} passing at every step"
                    if target.anomaly is not None and target.anomaly.kind == "spec" else "")
            verdict = (f"worked: {target.fault_class} gone{held}, no new fault from step {S} to {end}, and "
                       + ("the damaged source(s) " + ", ".join(f"{s} {a:+.3f} against {b:+.3f} without the fix"
                                                              for s, (a, b) in better.items()) + " nearer the floor"
                          if unstable and better else "no source's floor gap above the run's before the incident"))
        elif again:
            verdict = f"did not work: {again[0].fault_class} again at step {again[0].step}"
        elif new:
            verdict = f"did not work: {new[0].fault_class} at step {new[0].step} instead"
        elif missing:
            verdict = "did not work: the damage stays for " + ", ".join(missing)
        else:
            verdict = "did not work: the floor gap grew for " + ", ".join(sorted(worse))
        return {"ran": True, "fix": fx, "overrides": over, "window": [S, end], "verdict": verdict,
                "from": "step 0" if not start else f"step {start}",
                "faults_left": [{"step": i.step, "class": i.fault_class, "also_without_fix": i not in again + new}
                                for i in faults],
                "floor_gap": {"fix": {s: m for s, (m, _) in after.items()},
                              "before": {s: m for s, (m, _) in before.items()},
                              "without_fix": {s: m for s, (m, _) in without.items()}}, "noise_per_step": noise,
                "command": self.launches[-1].command}

    @property
    def window(self) -> int:
        """The run's baseline window (its guard's: doctor/scores.py)."""
        from doctor.scores import guard_test
        return guard_test(self.config).window

    def tail(self, S: int, end: int) -> list[dict]:
        """The run's own records after the incident on the path (the comparison's "without the fix")."""
        recs = read_records(self.run_dir / "metrics.jsonl")
        last = {}
        for r in recs:
            if S <= r["step"] <= end:
                last.setdefault(r["step"], r)  # the first execution of each step: what happened without a fix
        return [last[t] for t in sorted(last) if t not in self.path]

    def recovered(self, target: Diagnosis) -> dict:
        j = target.judgement
        return {"ran": False, "why": f"a natural incident is not fixed: the run recovers without intervention "
                                     f"({j.reason if j else 'judged natural'})"}


def spec_again(target: Diagnosis, records: list[dict], S: int, end: int) -> tuple[str, int] | None:
    """(check, step) where the specification check that headlined `target` fails again in [S, end]; None when
    the target was not a check's failure or the check held."""
    if target.anomaly is None or target.anomaly.kind != "spec":
        return None
    check = target.anomaly.quantity.removeprefix("spec.")
    for r in records:
        if S <= r["step"] <= end and any(f["check"] == check for f in (r.get("spec") or {}).get("fail") or []):
            return check, r["step"]
    return None


def moments_step(target: Diagnosis) -> int:
    """The step whose update wrote the moments in question: the incident's own when its quantity is the
    optimizer state it recorded after that update, else the step before (its update used them)."""
    q = target.anomaly.quantity
    # the state a step recorded after its update, or the optimizer check's finding at the end of that step
    return target.step if q.startswith(("state.", "spec.optimizer")) else target.step - 1
