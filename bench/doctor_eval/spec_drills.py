"""The project's own fault drills against the specification checks: which check fails first, at which step, and
what the doctor headlines, beside the class each drill expects.

    python -m bench.doctor_eval.spec_drills                        # every drill, shrunk as the tests run them
    python -m bench.doctor_eval.spec_drills --out docs/results/spec_drills.md
    python -m bench.doctor_eval.spec_drills --drills lr_spike weight_decay --telemetry 1
    python -m bench.doctor_eval.spec_drills --step 83 --out docs/results/spec_drills_between.md   # between references

Each drill trains once (`+experiment=drill_<kind>` where the experiment exists, else `fault=<kind>`) on the tests'
shrunk job (tests/helpers.py DRILL: a tiny mixed dense + MoE model, the fault at step S = 80 — a reference step
at telemetry every 10 — or --step, stopped 4 steps later), a drill that needs two processes under torchrun, two runs at a time. The table reads each run's records
(the first step whose `spec.fail` is not empty, and its first failure) and the doctor's report.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import ROOT
from bench.report import Report

S = 80  # the default fault step: a reference step at the default telemetry cadence
SMALL = ["train.eval_every=1000", "train.eval_samples=32", "train.eval_batch_size=16", "train.batch_size=8",
         "logging.wandb=disabled", "logging.progress=false", "logging.plot=false", "data.seq_len=32",
         "data.min_doc_len=4", "model.d_model=32", "model.n_heads=2", "model.n_layers=2", "threads=1",
         "optim.schedule.warmup_steps=10", "guard.detector.warmup=40", "data.sources.0.weight=0.5",
         "data.sources.1.weight=0.5"]


def train(kind: str, out: Path, telemetry: int, S: int = S) -> Path:
    from stability.drills import registry
    nproc = registry()[kind].min_world
    exp = ROOT / "conf" / "experiment" / f"drill_{kind}.yaml"
    pick = f"+experiment=drill_{kind}" if exp.is_file() else f"fault={kind}"
    args = [f"hydra.run.dir={out}", pick, f"fault.step={S}", "train.steps=400", f"checkpoint.stop_after={S + 4}",
            "optim.lr=3e-3", f"telemetry.every={telemetry}", *SMALL]
    cmd = ([sys.executable, "train.py"] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"])
    r = subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode not in (0, 3):  # 3: the guard stopped the run (its records stand)
        raise RuntimeError(f"{kind}: {(r.stderr or r.stdout)[-400:]}")
    subprocess.run([sys.executable, "-m", "doctor", str(out), "--no-plots"], cwd=ROOT, capture_output=True, text=True)
    return out


def row(kind: str, d: Path) -> list:
    from stability.drills import registry
    recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    first = next((r for r in recs if (r.get("spec") or {}).get("fail")), None)
    rep = json.loads((d / "report.json").read_text()) if (d / "report.json").is_file() else {}
    e = rep.get("earliest") or {}
    f = first["spec"]["fail"][0] if first else None
    expects = registry()[kind].expects
    return [kind, expects, f"{f['check']} ({f['kind']}) at {f['where']}" if f else "—",
            first["step"] if first else "—", f["class"] if f else "—",
            f"{rep.get('class', '?')} at {e.get('step', '—')}", "yes" if rep.get("class") == expects else "no"]


def main() -> None:
    from stability.drills import registry
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drills", nargs="*", help="drill kinds (default: every drill)")
    p.add_argument("--telemetry", type=int, default=10, help="telemetry.every (the reference checks' cadence)")
    p.add_argument("--step", type=int, default=S, help="the fault step (83: between the reference steps 80 and 90)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", help="also write the table (markdown) to this file")
    args = p.parse_args()
    kinds = args.drills or list(registry())
    rep = Report("The fault drills against the specification checks", "python -m bench.doctor_eval.spec_drills")
    step = args.step
    rep.add(f"Each drill at step {step} of the tests' shrunk job (tests/helpers.py DRILL), telemetry.every="
            f"{args.telemetry}; 'first failure': the first step with a failed check, and its first check.")
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=args.jobs) as pool:
        dirs = dict(zip(kinds, pool.map(lambda k: train(k, Path(tmp) / k, args.telemetry, step), kinds)))
        rows = [row(k, d) for k, d in dirs.items()]
    rep.table(["drill", "expects", "first failed check", "step", "its class", "doctor's headline", "as expected"],
              rows)
    at = sum(1 for r in rows if r[3] == step)
    rep.add(f"{at} of {len(rows)} drills fail a check at their own step {step}; the doctor headlines the expected class "
            f"for {sum(r[-1] == 'yes' for r in rows)} of {len(rows)}.")
    rep.write(args.out)


if __name__ == "__main__":
    main()
