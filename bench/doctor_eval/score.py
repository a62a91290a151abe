"""Score the doctor on faults it has never seen (bench/doctor_eval/drills.py) and on clean runs.

    python -m bench.doctor_eval.score                      # every fault + 10 clean seeds, 2 runs at a time
    python -m bench.doctor_eval.score --faults noise_half lr_x3 --clean 2
    python -m bench.doctor_eval.score --reuse DIR          # re-diagnose runs already trained under DIR
    python -m bench.doctor_eval.score --faults --clean 10 --seed-from 10 --stop 200 --keep DIR   # a calibration
                                                      # set (then: python -m bench.doctor_eval.calibrate DIR)
    python -m bench.doctor_eval.score --job quickstart     # the same faults in the README's default job (S = 250)
    python -m bench.doctor_eval.score --step 120 --stop 400 --seed-from 20   # another fault step, longer clean runs
    python -m bench.doctor_eval.score --step 90 --seed 5 --clean 0             # the faults on another seed
    python -m bench.doctor_eval.score --registry                # the project's own drills (stability/drills/) instead

Each fault is planted by the launcher (no injector, fault=none, nothing in the run directory names it);
the doctor then reads the run directory with builtins.open / Path.read_text watched, and the score
fails a run whose diagnosis opened a file that names its fault. Scored: class, timeline layer, and
the earliest anomaly's step within ±1 of the first step the fault can be visible. A clean run scores
when the doctor says "healthy" (an environmental slowdown is a note, not a fault).
"""
from __future__ import annotations

import argparse
import builtins
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from bench.doctor_eval import drills
from bench.doctor_eval.drills import BY_NAME, FAULTS, JOBS, ROOT, Fault
from bench.report import Report

# NOTE: run as a module from the repository root, so the launcher (and under torchrun each rank) imports this
# checkout's modules, the ones it patches before train.py runs
LAUNCHER = ["-m", drills.__name__]
ANSWER_KEY = Path(drills.__file__).resolve()
BASE, S = JOBS["drill"]  # the job being scored (main() --job); module-level for the tests' helpers
STOP = S + 8
FAULT_SEED: list[str] = []  # the fault runs' seed overrides (--seed)


def use_job(job: str, step: int | None = None, seed: int | None = None) -> None:
    """The job, its fault step, and the seed the fault runs train with (None: the config's)."""
    global BASE, S, STOP, FAULT_SEED
    BASE, S = JOBS[job]
    S = step or S
    STOP = S + 8
    FAULT_SEED = [] if seed is None else [f"seed={seed}", f"data.seed={1000 + seed}"]


def _env() -> dict:
    e = dict(os.environ)
    e.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1",
             OMP_NUM_THREADS="1", BALLAST_DRILL_STEP=str(S))
    return e


def _launch(fault: str | None, run_dir: Path, extra: list[str], nproc: int = 1) -> None:
    cmd = [*LAUNCHER, "launch", fault or "none", str(run_dir), *BASE, *extra]
    cmd = [sys.executable, *cmd] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *cmd]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{fault or 'clean'} -> {run_dir}: exit {r.returncode}\n{r.stderr[-3000:]}")


def run_dir(root: Path, f: Fault) -> Path:
    """An opaque directory name: the run directory (and environment.json's argv) must not name the fault."""
    return root / f"run{FAULTS.index(f):02d}"


def train_fault(f: Fault, root: Path) -> Path:
    d = run_dir(root, f)
    if f.resume:  # a clean first process up to S - 1, then a resume with the fault planted on load
        _launch(None, d, [*FAULT_SEED, f"checkpoint.stop_after={S - 1}"])
        _launch(f.name, d, [*FAULT_SEED, f"checkpoint.stop_after={STOP}", "resume=latest", *f.resume_args])
    else:
        _launch(f.name, d, [*FAULT_SEED, f"checkpoint.stop_after={STOP}"], nproc=f.nproc)
    return d


def train_clean(seed: int, root: Path, resume: bool = False, busy: bool = False, stop: int | None = None) -> Path:
    stop = STOP if stop is None else stop
    d = root / f"clean_seed{seed}"
    extra = [f"seed={seed}", f"data.seed={1000 + seed}"]
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        if resume:  # a clean resume must not look like a resume fault
            _launch(None, d, [*extra, f"checkpoint.stop_after={S - 1}"])
            _launch(None, d, [*extra, f"checkpoint.stop_after={stop}", "resume=latest"])
        else:
            _launch(None, d, [*extra, f"checkpoint.stop_after={stop}"])
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return d


@contextmanager
def watch_reads():
    """Every path the code opens through builtins.open or Path.open / read_text / read_bytes."""
    seen: list[Path] = []
    o_open, o_popen = builtins.open, Path.open

    def open_(file, *a, **k):
        if isinstance(file, (str, os.PathLike)):
            seen.append(Path(file))
        return o_open(file, *a, **k)

    def popen(self, *a, **k):
        seen.append(Path(self))
        return o_popen(self, *a, **k)
    builtins.open, Path.open = open_, popen  # read_text / read_bytes go through Path.open
    try:
        yield seen
    finally:
        builtins.open, Path.open = o_open, o_popen


def diagnose(run_dir: Path, fault: str | None) -> dict:
    from doctor.cli import doctor
    with watch_reads() as seen:
        rep = doctor(run_dir, plots=False)
    for p in seen:  # the doctor's own report files are written, not read; check what it read
        if p.suffix in (".py",) or p.name.startswith("report"):
            continue
        if p.is_file() and fault and fault in p.read_text(errors="replace"):
            raise AssertionError(f"the doctor read {p}, which names the fault {fault}")
        if p.resolve() == ANSWER_KEY:
            raise AssertionError(f"the doctor read the answer key {p}")
    rep["_read"] = [str(p) for p in seen]
    return rep


def guard_at(d: Path, rep: dict) -> str:
    """What the online guard said at the doctor's step on a clean run: an alarm the guard shares is a
    natural incident of the run (a real spike), not the doctor seeing ghosts; still counted."""
    e = rep.get("earliest")
    if not e:
        return ""
    from stability.record import read_records
    trig = [x for r in read_records(d / "metrics.jsonl") if abs(r["step"] - e["step"]) <= 1
            for x in r.get("guard", {}).get("triggers", [])]
    z = e["z"] if isinstance(e["z"], str) else f"{e['z']:.1f}"
    return f" [{e['quantity']} z {z}; guard at ±1 step: {', '.join(trig) or 'silent'}]"


def scored_steps(d: Path) -> int:
    """Steps of a run the doctor scores (from its scoring start on)."""
    import yaml
    from doctor.timeline import scoring_start
    from stability.record import read_records
    start = scoring_start(yaml.safe_load((d / "config.yaml").read_text()) or {})
    return sum(r["step"] >= start for r in read_records(d / "metrics.jsonl"))


def guard_steps(d: Path) -> set[int]:
    """Steps at which the run's online guard fired (its triggers in the records)."""
    from stability.record import read_records
    return {r["step"] for r in read_records(d / "metrics.jsonl") if (r.get("guard") or {}).get("triggers")}


def score_fault(f: Fault, rep: dict, d: Path | None = None) -> dict:
    """Scored on the report's headline — its class and earliest anomaly, what a reader acts on (the first
    incident judged a fault) — at the fault's class, timeline layer and step ±1. Beside it, for the record,
    whether the fault's own incident (the first one from step S − 1 on) was right, and what the doctor judged
    natural before it."""
    step = S + f.lag
    e = rep.get("earliest") or {}
    ok_step = e.get("step") is not None and abs(e["step"] - step) <= 1
    incs = rep.get("incidents") or []
    mine = next((i for i in incs if i["step"] >= step - 1), {})
    natural = [i for i in incs if i["step"] < step - 1 and i.get("judgement") == "natural"]
    row = {"fault": f.name, "expect": f"{f.cls} / {f.layer} / {step}",
           "got": f"{rep['class']} / {e.get('layer')} / {e.get('step')}",
           "class": rep["class"] == f.cls, "layer": e.get("layer") == f.layer, "step": ok_step,
           "incident": mine.get("class") == f.cls and mine.get("step") is not None and abs(mine["step"] - step) <= 1,
           "before": f"{len(natural)} natural" if natural else ""}
    row["ok"] = row["class"] and row["layer"] and row["step"]
    return row


def train_drill(kind: str, root: Path) -> Path:
    """A drill of the project's own registry (stability/drills/), planted through fault=<kind> at step S on
    the job; 2-process drills under torchrun. The answer key is in events.jsonl (never read by the doctor)."""
    from stability.drills import registry
    d = root / f"drill_{kind}"
    nproc = registry()[kind].min_world
    cmd = ["train.py", *BASE, f"fault={kind}", f"fault.step={S}", f"checkpoint.stop_after={STOP}", f"hydra.run.dir={d}",
           *FAULT_SEED]
    cmd = [sys.executable, *cmd] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *cmd]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"drill {kind} -> {d}: exit {r.returncode}\n{r.stderr[-3000:]}")
    return d


def score_drills(kinds: list[str], root: Path, jobs: int, train: bool, out: Report) -> None:
    """The registry's drills scored on the headline: class (the drill's `expects`) and step ±1 of S."""
    from doctor.cli import doctor
    from stability.drills import registry
    if train:
        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(lambda k: train_drill(k, root), kinds))
    rows = []
    for k in kinds:
        rep = doctor(root / f"drill_{k}", plots=False)
        e = rep["earliest"] or {}
        hit = rep["class"] == registry()[k].expects and e.get("step") is not None and abs(e["step"] - S) <= 1
        rows.append((k, f"{registry()[k].expects} / {S}", f"{rep['class']} / {e.get('step')}", "✓" if hit else "✗"))
    out.table(["drill", "expected class / step", "doctor", "✓"], rows)
    out.add(f"registry drills scored on the headline: {sum(r[-1] == '✓' for r in rows)} of {len(kinds)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", nargs="*", default=[f.name for f in FAULTS])
    ap.add_argument("--clean", type=int, default=10, help="clean runs (seeds FROM..FROM+N-1)")
    ap.add_argument("--seed-from", type=int, default=0, help="first clean seed (calibration sets: 10)")
    ap.add_argument("--job", choices=sorted(JOBS), default="drill",
                    help="drill: the tiny model the thresholds were calibrated on; quickstart: the default job")
    ap.add_argument("--step", type=int, help="the fault step S (default: the job's)")
    ap.add_argument("--seed", type=int, help="the fault runs' seed (default: the config's; clean runs keep theirs)")
    ap.add_argument("--stop", type=int, help="clean runs stop after this step (default: S + 8; calibration: 200)")
    ap.add_argument("--reuse", help="a directory of runs trained before (skip training)")
    ap.add_argument("--keep", help="train into this directory (default: a temporary one)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", help="also write the table and the summary lines (markdown) to this file")
    ap.add_argument("--registry", nargs="*", help="score the project's own drills (stability/drills/; default: every "
                    "one that needs no rare data: all but mixture_switch) instead of the planted faults")
    args = ap.parse_args(argv)
    use_job(args.job, args.step, args.seed)
    unknown = [n for n in args.faults if n not in BY_NAME]
    if unknown:
        print(f"bench.doctor_eval.score: unknown fault {unknown[0]} (known: {', '.join(BY_NAME)})", file=sys.stderr)
        return 2
    root = Path(args.reuse or args.keep or tempfile.mkdtemp(prefix="doctor_score_"))
    root.mkdir(parents=True, exist_ok=True)
    what = "The registry's drills scored" if args.registry is not None else "Doctor scores"
    out = Report(f"{what} (job {args.job}, fault step {S})", "python -m bench.doctor_eval.score", argv)
    emit = out.add
    if args.registry is not None:
        from stability.drills import registry
        kinds = args.registry or [k for k in registry() if k not in ("none", "mixture_switch")]
        score_drills(kinds, root, args.jobs, not args.reuse, out)
        out.write(args.out)
        return 0
    faults = [BY_NAME[n] for n in args.faults]
    seeds = list(range(args.seed_from, args.seed_from + args.clean))
    if not args.reuse:
        jobs = [(train_fault, f, root) for f in faults]
        # NOTE: the second seed resumes cleanly; the last two train beside a CPU hog (a busy machine)
        jobs += [(train_clean, s, root, s == args.seed_from + 1, s >= max(seeds[-2:], default=0) and len(seeds) > 2,
                  args.stop) for s in seeds]
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda j: j[0](*j[1:]), jobs))
    rows = [score_fault(f, diagnose(run_dir(root, f), f.name), run_dir(root, f)) for f in faults]
    clean = []
    for s in seeds:
        rep = diagnose(root / f"clean_seed{s}", None)
        g = guard_at(root / f"clean_seed{s}", rep)
        nat = [i for i in rep.get("incidents") or [] if i.get("judgement") == "natural"]
        clean.append({"seed": s, "class": rep["class"], "ok": rep["class"] == "healthy", "natural": len(nat),
                      "scored": scored_steps(root / f"clean_seed{s}"), "summary": rep["summary"][:110] + g})
    emit("Scored on the report's headline (class, timeline layer, step ±1).", "")
    early = any(r["before"] for r in rows)  # incidents before the fault: a column only when there are any
    m = lambda b: "✓" if b else "✗"  # noqa: E731
    out.table(["fault", "expected class / layer / step", "doctor", "class", "layer", "step ±1"] + ["before S"] * early,
              [[r["fault"], r["expect"], r["got"], m(r["class"]), m(r["layer"]), m(r["step"])]
               + [r["before"] or "—"] * early for r in rows])
    emit(f"faults scored on the headline: {sum(r['ok'] for r in rows)} of {len(rows)} (class, layer and step ±1); "
          f"on the fault's own incident: {sum(r['incident'] for r in rows)} of {len(rows)}")
    for c in clean:
        emit(f"clean seed {c['seed']}: {c['class']} — {c['summary']}")
    bad, steps = sum(not c["ok"] for c in clean), sum(c["scored"] for c in clean)
    emit(f"clean runs: {bad} with a false fault in {len(clean)} ({1000 * bad / max(steps, 1):.2f} per 1000 scored "
          f"steps); {sum(c['natural'] for c in clean)} incident(s) judged natural")
    out.write(args.out)
    print(f"runs: {root}")
    if not args.keep and not args.reuse:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
