"""Score the doctor: faults planted from outside the project at random phases of full-length runs, and clean runs
never used for tuning — on the report's headline.

    python -m bench.doctor_eval.score --keep DIR                  # the whole grid (below), 2 runs at a time
    python -m bench.doctor_eval.score --keep DIR --seeds 0 1 --faults noise_half lr_x3 --clean-jobs default
    python -m bench.doctor_eval.score --reuse DIR --out docs/results/doctor_score.md   # re-diagnose, write
    python -m bench.doctor_eval.score --registry                  # the project's own drills (stability/drills/)

The grid. Clean: the default job (`python train.py`) at seeds --seeds (default 0–9), dense_tiny at --lengths,
moe_tiny and shakespeare_char (real text: /work/shared/data/tinyshakespeare.txt where the machine has it), each at
telemetry every --cadences (1 and 10); a run of the default job at 1000 steps with --long. Faults: every fault of
bench/doctor_eval/key.py (--faults; drills.py plants them) in the default job's full 400 steps at a step drawn (seeded,
--draw-seed) inside its natural transition (steps 60–110: the copy source's induction head forms there) and late
(250–380) — --phases — at telemetry every --cadences. Each fault run's directory is opaque (nothing in it names
the fault); the answer key is answers.json beside them, which the doctor must never read (watched).

Nothing here tunes the doctor: its thresholds follow from its false-alarm budget (doctor/budget.py), so every
fault family is held out and every clean run is a held-out run; the report says which runs it scored.

Scored: a fault run is right when the headline names the fault's class, its timeline layer and a step within ±1
of the first step the fault can be visible; a clean run when the headline is `healthy`. Per family, the share
right; on clean runs, the incidents judged a fault or a recipe instability per 1000 scored steps (false by
construction), and the natural incidents listed. A run that exists with a finished metrics.jsonl is not trained
again (`done` marker), so the grid can be grown or resumed.
"""
from __future__ import annotations

import argparse
import builtins
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import ROOT
from bench.doctor_eval import drills, key
from bench.doctor_eval.key import BY_NAME, FAULTS, JOBS, QUIET, TEXT, Fault
from bench.report import Report

# NOTE: run as a module from the repository root, so the launcher (and under torchrun each rank) imports this
# checkout's modules, the ones it patches before train.py runs
LAUNCHER = ["-m", drills.__name__]
ANSWER_KEY = Path(key.__file__).resolve()
ANSWERS = "answers.json"


@dataclass(frozen=True)
class Plan:
    """One run of the grid."""
    name: str                  # its directory (opaque for a fault run)
    job: str
    seed: int = 0
    steps: int | None = None   # train.steps (None: the job's own)
    every: int = 10            # telemetry.every
    fault: str | None = None
    at: int | None = None      # the fault step S
    phase: str | None = None   # transition | late
    stop: int | None = None    # checkpoint.stop_after (the unit tests' short runs only)

    def overrides(self) -> list[str]:
        job = JOBS[self.job]
        out = [*QUIET, *job.overrides, f"telemetry.every={self.every}"]
        if self.steps is not None:
            out.append(f"train.steps={self.steps}")
        if self.seed:  # NOTE: seed 0 is the job as the README runs it
            out += [f"seed={self.seed}", f"data.seed={1234 + self.seed}"]
        return out


def _env(at: int | None) -> dict:
    e = dict(os.environ)
    e.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1",
             OMP_NUM_THREADS="1", BALLAST_DRILL_STEP=str(at or 0))
    return e


def _launch(fault: str | None, run_dir: Path, extra: list[str], at: int | None, nproc: int = 1) -> None:
    cmd = [*LAUNCHER, "launch", fault or "none", str(run_dir), *extra]
    cmd = [sys.executable, *cmd] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *cmd]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(at), capture_output=True, text=True, timeout=6 * 3600)
    if r.returncode not in (0, 3):  # 3: the guard stopped it (its records stand)
        raise RuntimeError(f"{fault or 'clean'} -> {run_dir}: exit {r.returncode}\n{r.stderr[-3000:]}")


def train(plan: Plan, root: Path) -> Path:
    """Train one run of the grid (skipped when its `done` marker exists)."""
    d = root / plan.name
    if (d / "done").is_file():
        return d
    if d.exists():
        shutil.rmtree(d)
    over = plan.overrides()
    stop = [f"checkpoint.stop_after={plan.stop}"] if plan.stop else []
    f = BY_NAME.get(plan.fault) if plan.fault else None
    if f is not None and f.resume:  # a clean first process up to S − 1, then a resume with the fault planted on load
        _launch(None, d, [*over, f"checkpoint.stop_after={plan.at - 1}"], plan.at)
        _launch(f.name, d, [*over, *stop, "resume=latest", *f.resume_args], plan.at)
    else:
        _launch(plan.fault, d, [*over, *stop], plan.at, nproc=f.nproc if f else 1)
    (d / "done").write_text("")
    return d


# ---- the grid ---------------------------------------------------------------------------------------------
def clean_plans(seeds: list[int], jobs: list[str], cadences: list[int], lengths: list[int], long: bool) -> list[Plan]:
    out = []
    for every in cadences:
        if "default" in jobs:
            out += [Plan(f"clean-default-s{s}-t{every}", "default", s, None, every) for s in seeds]
            if long:
                out.append(Plan(f"clean-default-s0-t{every}-n1000", "default", 0, 1000, every))
        if "dense_tiny" in jobs:
            out += [Plan(f"clean-dense_tiny-t{every}-n{n}", "dense_tiny", 0, n, every) for n in lengths]
        if "moe_tiny" in jobs:
            out.append(Plan(f"clean-moe_tiny-t{every}", "moe_tiny", 0, None, every))
        if "shakespeare_char" in jobs and TEXT.is_file():
            out.append(Plan(f"clean-shakespeare_char-t{every}", "shakespeare_char", 0, None, every))
    return out


def fault_plans(faults: list[str], phases: list[str], cadences: list[int], draw_seed: int, every_combo: bool = True
                ) -> list[Plan]:
    """Each fault at each phase and cadence (every_combo), or — the smaller grid — each fault once, its phase and
    cadence taking turns down the list; S drawn uniformly in the phase's steps (seeded)."""
    rng = random.Random(draw_seed)
    job = JOBS["default"]
    combos = [(p, c) for p in phases for c in cadences]
    out, k = [], 0
    for i, name in enumerate(faults):
        mine = combos if every_combo else [combos[i % len(combos)]]
        for phase, every in mine:
            lo, hi = job.transition if phase == "transition" else job.late
            out.append(Plan(f"f{k:03d}", "default", 0, None, every, name, rng.randint(lo, hi), phase))
            k += 1
    return out


# ---- reading a run as the doctor does ------------------------------------------------------------------------
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
    """The doctor's report on a run, failing when it read a file that names the fault or the answer key."""
    from doctor.cli import doctor
    with watch_reads() as seen:
        rep = doctor(run_dir, plots=False)
    for p in seen:  # the doctor's own report files are written, not read; check what it read
        if p.suffix in (".py",) or p.name.startswith("report"):
            continue
        if p.is_file() and fault and fault in p.read_text(errors="replace"):
            raise AssertionError(f"the doctor read {p}, which names the fault {fault}")
        if p.resolve() == ANSWER_KEY or p.name == ANSWERS:
            raise AssertionError(f"the doctor read the answer key {p}")
    rep["_read"] = [str(p) for p in seen]
    return rep


def scored_steps(d: Path) -> int:
    """Steps of a run the doctor scores (from its scoring start on)."""
    import yaml
    from doctor.timeline import scoring_start
    from stability.record import read_records
    start = scoring_start(yaml.safe_load((d / "config.yaml").read_text()) or {})
    return sum(r["step"] >= start for r in read_records(d / "metrics.jsonl"))


def score_fault(f: Fault, rep: dict, at: int) -> dict:
    """Scored on the report's headline — its class and earliest anomaly, what a reader acts on — at the fault's
    class, timeline layer and step ±1; beside it, what the doctor judged before the fault."""
    step = at + f.lag
    e = rep.get("earliest") or {}
    ok_step = e.get("step") is not None and abs(e["step"] - step) <= 1
    incs = rep.get("incidents") or []
    before = [i for i in incs if i["step"] < step - 1]
    row = {"fault": f.name, "family": f.family, "expect": f"{f.cls} / {f.layer} / {step}",
           "got": f"{rep['class']} / {e.get('layer')} / {e.get('step')}",
           "class": rep["class"] == f.cls, "layer": e.get("layer") == f.layer, "step": ok_step,
           "before": ", ".join(f"{i['step']} {i['judgement']}" for i in before)}
    row["ok"] = row["class"] and row["layer"] and row["step"]
    return row


def score_clean(d: Path) -> dict:
    rep = diagnose(d, None)
    incs = rep.get("incidents") or []
    bad = [i for i in incs if i["judgement"] != "natural"]
    return {"run": d.name, "class": rep["class"], "ok": rep["class"] == "healthy", "scored": scored_steps(d),
            "false": len(bad), "natural": [f"{i['step']} {i['class']}" for i in incs if i["judgement"] == "natural"],
            "headline": rep["summary"][:100]}


def prefix(d: Path, n: int, root: Path) -> Path:
    """The same run stopped at step n: a copy of its first n records (and its config), for the doctor."""
    out = root / f"{d.name}-first{n}"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    lines = (d / "metrics.jsonl").read_text().splitlines()
    keep = [x for x in lines if json.loads(x)["step"] <= n]
    (out / "metrics.jsonl").write_text("\n".join(keep) + "\n")
    for name in ("config.yaml", "environment.json"):
        if (d / name).is_file():
            shutil.copy(d / name, out / name)
    return out


# ---- the project's own drills -----------------------------------------------------------------------------
def score_drills(kinds: list[str], root: Path, jobs: int, train_them: bool, out: Report) -> None:
    """The registry's drills (stability/drills/) in the default job's full length, each at a step of its natural
    transition, scored on the headline: class (the drill's `expects`) and step ±1."""
    from stability.drills import registry
    rng = random.Random(0)
    at = {k: rng.randint(*JOBS["default"].transition) for k in kinds}

    def one(k: str) -> None:
        d = root / f"drill_{k}"
        if (d / "done").is_file():
            return
        nproc = registry()[k].min_world
        quiet = [x for x in QUIET if not x.startswith("fault=")]
        cmd = ["train.py", *quiet, f"fault={k}", f"fault.step={at[k]}", f"hydra.run.dir={d}"]
        cmd = [sys.executable, *cmd] if nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *cmd]
        r = subprocess.run(cmd, cwd=ROOT, env=_env(None), capture_output=True, text=True, timeout=6 * 3600)
        if r.returncode not in (0, 3):
            raise RuntimeError(f"drill {k} -> {d}: exit {r.returncode}\n{r.stderr[-3000:]}")
        (d / "done").write_text("")
    if train_them:
        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(one, kinds))
    from doctor.cli import doctor
    rows = []
    for k in kinds:
        rep = doctor(root / f"drill_{k}", plots=False)
        e = rep["earliest"] or {}
        hit = rep["class"] == registry()[k].expects and e.get("step") is not None and abs(e["step"] - at[k]) <= 1
        rows.append((k, f"{registry()[k].expects} / {at[k]}", f"{rep['class']} / {e.get('step')}", "✓" if hit else "✗"))
    out.table(["drill", "expected class / step", "doctor", "✓"], rows)
    out.add(f"registry drills scored on the headline: {sum(r[-1] == '✓' for r in rows)} of {len(kinds)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", nargs="*", default=[f.name for f in FAULTS])
    ap.add_argument("--phases", nargs="*", default=["transition", "late"], choices=["transition", "late"])
    ap.add_argument("--cadences", nargs="*", type=int, default=[10, 1], help="telemetry.every of the runs")
    ap.add_argument("--one-each", action="store_true",
                    help="each fault once, its phase and cadence taking turns down the list (default: every fault at "
                         "every phase and cadence)")
    ap.add_argument("--draw-seed", type=int, default=0, help="the seed of the fault steps' draw")
    ap.add_argument("--seeds", nargs="*", type=int, default=list(range(10)), help="the default job's clean seeds")
    ap.add_argument("--clean-jobs", nargs="*", default=["default", "dense_tiny", "moe_tiny", "shakespeare_char"],
                    choices=sorted(set(JOBS) - {"drill", "drill_deep"}))
    ap.add_argument("--lengths", nargs="*", type=int, default=[120, 150, 400, 1000], help="dense_tiny's lengths")
    ap.add_argument("--long", action="store_true", help="also the default job at 1000 steps")
    ap.add_argument("--prefixes", nargs="*", type=int, default=[120, 200],
                    help="also read every clean run stopped at these steps (the same records, fewer of them)")
    ap.add_argument("--reuse", help="a directory of runs trained before (skip training)")
    ap.add_argument("--keep", help="train into this directory (default: a temporary one, removed after)")
    ap.add_argument("--parallel", type=int, default=2, help="runs trained at a time")
    ap.add_argument("--out", help="also write the tables and the summary lines (markdown) to this file")
    ap.add_argument("--registry", nargs="*", help="score the project's own drills (stability/drills/; default: every "
                    "one that needs no rare data: all but mixture_switch) instead")
    args = ap.parse_args(argv)
    unknown = [n for n in args.faults if n not in BY_NAME]
    if unknown:
        print(f"bench.doctor_eval.score: --faults {unknown[0]}: unknown (known: {', '.join(BY_NAME)})", file=sys.stderr)
        return 2
    root = Path(args.reuse or args.keep or tempfile.mkdtemp(prefix="doctor_score_"))
    root.mkdir(parents=True, exist_ok=True)
    if args.registry is not None:
        out = Report("The registry's drills scored (default job, full length)", "python -m bench.doctor_eval.score",
                     argv)
        from stability.drills import registry
        kinds = args.registry or [k for k in registry() if k not in ("none", "mixture_switch")]
        score_drills(kinds, root, args.parallel, not args.reuse, out)
        out.write(args.out)
        return 0
    faults = fault_plans(args.faults, args.phases, args.cadences, args.draw_seed, not args.one_each)
    clean = clean_plans(args.seeds, args.clean_jobs, args.cadences, args.lengths, args.long)
    if args.reuse:  # the runs the directory holds (its answer key says which are faults)
        key = json.loads((root / ANSWERS).read_text()) if (root / ANSWERS).is_file() else []
        faults = [Plan(**p) for p in key if (root / p["name"] / "done").is_file()]
        clean = [p for p in clean if (root / p.name / "done").is_file()]
    else:
        known = json.loads((root / ANSWERS).read_text()) if (root / ANSWERS).is_file() else []
        names = {p.name for p in faults}
        (root / ANSWERS).write_text(json.dumps([*[p for p in known if p["name"] not in names],
                                                *map(asdict, faults)], indent=1))
        with ThreadPoolExecutor(args.parallel) as pool:
            list(pool.map(lambda p: train(p, root), faults + clean))
    out = Report("The doctor scored: planted faults and clean runs (held out: nothing was tuned)",
                 "python -m bench.doctor_eval.score", argv)
    rows = [(p, score_fault(BY_NAME[p.fault], diagnose(root / p.name, p.fault), p.at)) for p in faults]
    m = lambda b: "✓" if b else "✗"  # noqa: E731
    if rows:
        out.add(f"## Planted faults ({len(rows)} runs of the default job, full length)", "")
        out.table(["fault", "family", "phase", "telemetry", "expected class / layer / step", "doctor (headline)",
                   "class", "layer", "step ±1", "incidents before the fault"],
                  [[r["fault"], r["family"], p.phase, f"every {p.every}", r["expect"], r["got"], m(r["class"]),
                    m(r["layer"]), m(r["step"]), r["before"] or "—"] for p, r in rows])
        fams = sorted({r["family"] for _, r in rows})
        out.add("", "Per family (right in class, layer and step ±1, on the headline):", "")
        out.table(["family", "right", "runs", "at the transition", "late"],
                  [[fam, sum(r["ok"] for _, r in rows if r["family"] == fam),
                    sum(1 for _, r in rows if r["family"] == fam),
                    f"{sum(r['ok'] for p, r in rows if r['family'] == fam and p.phase == 'transition')} of "
                    f"{sum(1 for p, r in rows if r['family'] == fam and p.phase == 'transition')}",
                    f"{sum(r['ok'] for p, r in rows if r['family'] == fam and p.phase == 'late')} of "
                    f"{sum(1 for p, r in rows if r['family'] == fam and p.phase == 'late')}"] for fam in fams])
        out.add(f"faults scored on the headline: {sum(r['ok'] for _, r in rows)} of {len(rows)}")
    runs = [root / p.name for p in clean]
    pre = root / "prefixes"
    runs += [prefix(d, n, pre) for d in list(runs) for n in args.prefixes
             if json.loads((d / "metrics.jsonl").read_text().splitlines()[-1])["step"] > n]
    cl = [score_clean(d) for d in runs]
    if cl:
        out.add("", f"## Clean runs ({len(clean)} trained; {len(cl) - len(clean)} more read stopped early)", "")
        out.table(["run", "steps scored", "headline", "incidents judged fault / instability", "natural incidents"],
                  [[c["run"], c["scored"], c["class"], c["false"], "; ".join(c["natural"]) or "—"] for c in cl])
        steps, false = sum(c["scored"] for c in cl), sum(c["false"] for c in cl)
        out.add(f"clean runs: {sum(not c['ok'] for c in cl)} of {len(cl)} not healthy; {false} incident(s) judged a "
                f"fault or a recipe instability in {steps} scored steps: {1000 * false / max(steps, 1):.2f} per 1000 "
                f"steps; {sum(len(c['natural']) for c in cl)} natural incident(s) listed")
    out.write(args.out)
    print(f"runs: {root}")
    if not args.keep and not args.reuse:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
