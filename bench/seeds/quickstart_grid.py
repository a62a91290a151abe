"""Does the quickstart's effect (the copy source's head forms, the run ends at its floor) hold on every
seed, data seed, thread count and a 1e-6 perturbation of the initial weights? train.py itself, run per
grid point; prints one row each and the worst case.

    OMP_NUM_THREADS=1 python -m bench.seeds.quickstart_grid             # 5 seeds x 2 data seeds x {1, 2} threads
    python -m bench.seeds.quickstart_grid --seeds 0 --data-seeds 1234 --out docs/results/quickstart.md  # README run
    python -m bench.seeds.quickstart_grid --seeds 0 1 2 --data-seeds 1234 --threads 1 --steps 300 -- optim.lr=2e-3
    python -m bench.seeds.quickstart_grid --seeds 0 --noise 1e-6        # the perturbation test

Columns: `forms` = first step where the copy source's train loss, averaged over 10 steps, is below the
midpoint between log(alphabet) (no head) and its floor (head formed), or "-" if never; `copy gap` and
`gap` = final eval loss of the copy source / of the whole mixture minus its exact floor on the same
evaluation tokens; `eval` = final eval loss (its exact floor and each source's loss beside it: the lines
`python train.py` prints); `largest ‖g‖` = the run's largest pre-clip grad norm, its step and the median
of the run's; `ckpt MB` = one checkpoint's size; `wall s` = the run's wall time, start-up included. A row
passes when both gaps are <= --tol (0.05 nats). --jobs (default 2) runs at a time; each run gets
`threads` intra-op threads. With --keep DIR, a point whose DIR/<point>/row.json exists is read, not
trained again: a grid stopped half-way resumes.

NOTE: on a machine busier than its cores, set OMP_WAIT_POLICY=PASSIVE for the 2-thread points: OpenMP's
spinning barrier then slows a step 20x (measured at load average ~12 on 2 cores); the numbers do not
depend on the wait policy.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import ROOT
from bench.report import Report

QUIET = ["logging.progress=false", "logging.wandb=disabled", "logging.plot=false"]


def child(noise: float, overrides: list[str]) -> None:
    """train.py's main, with the initial weights scaled by (1 + noise·N(0,1)) elementwise when noise > 0."""
    import runpy

    import torch

    import model

    if noise > 0:
        base = model.Transformer

        class Perturbed(base):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                g = torch.Generator().manual_seed(12345)  # NOTE: its own stream: the global RNG is untouched
                with torch.no_grad():
                    for p in self.parameters():
                        p.mul_(1 + noise * torch.randn(p.shape, generator=g, dtype=p.dtype))

        model.Transformer = Perturbed  # train.py's `from model import Transformer` then picks this one
    sys.argv = [str(ROOT / "train.py"), *overrides]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")  # as a script: Hydra finds conf/ beside it


def copy_floor(run_dir: Path) -> tuple[float, float]:
    """(copy floor, whole floor) of the run's own evaluation tokens, exactly (data/synthetic.py)."""
    import torch

    from data import build_data
    from data.loader import eval_batches
    from run.config import Config

    cfg = Config.from_dict(json.loads((run_dir / "config.json").read_text()))
    ds = build_data(cfg.data)
    names = ds.source_names
    f_S, n_S = torch.zeros(len(names), dtype=torch.float64), torch.zeros(len(names), dtype=torch.float64)
    for b in eval_batches(ds, cfg.train.eval_samples, cfg.train.eval_batch_size):
        valid = b.labels != -100
        f_S.index_add_(0, b.sources, (b.floor.double() * valid).sum(1))
        n_S.index_add_(0, b.sources, valid.sum(1).double())
    return (f_S[names.index("copy")] / n_S[names.index("copy")]).item(), (f_S.sum() / n_S.sum()).item()


def one(point: dict, steps: int | None, noise: float, extra: list[str], root: Path) -> dict:
    """Train one grid point (or reuse its row.json under a kept directory) and summarise it."""
    seed, data_seed, threads = point["seed"], point["data_seed"], point["threads"]
    run_dir = root / f"s{seed}-d{data_seed}-t{threads}-n{noise:g}"
    if (run_dir / "row.json").exists():  # --keep DIR twice: the grid resumes where it stopped
        return json.loads((run_dir / "row.json").read_text())
    overrides = [f"hydra.run.dir={run_dir}", f"seed={seed}", f"data.seed={data_seed}", f"threads={threads}",
                 *([f"train.steps={steps}"] if steps else []), *QUIET, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "disabled"}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "bench.seeds.quickstart_grid", "--child", "--noise", str(noise), "--",
                        *overrides],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        return {**point, "error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
    row = summarize(run_dir, point, wall)
    (run_dir / "row.json").write_text(json.dumps(row))
    return row


def summarize(run_dir: Path, point: dict, wall: float) -> dict:
    """One row of the grid from a finished run directory."""
    import yaml

    (run_dir / "config.json").write_text(json.dumps(yaml.safe_load((run_dir / "config.yaml").read_text())))
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    copy_f, floor = copy_floor(run_dir)
    alphabet = next(s["alphabet"] for s in json.loads((run_dir / "config.json").read_text())["data"]["sources"]
                    if s["kind"] == "copy")
    mid = (math.log(alphabet) + copy_f) / 2
    train_copy = [r_["loss_by_source"].get("copy", math.nan) for r_ in recs]
    forms = next((recs[i]["step"] for i in range(9, len(recs))
                  if sum(train_copy[i - 9:i + 1]) / 10 < mid), None)
    last = next(r_["eval"] for r_ in reversed(recs) if r_.get("eval"))
    spikes = [r_["step"] for r_ in recs if r_["grad_norm"] > 10]
    top = max(recs, key=lambda r_: r_["grad_norm"])
    ckpts = [d for d in (run_dir / "checkpoints").glob("step_*") if d.is_dir()]
    return {**point, "forms": forms, "steps": recs[-1]["step"], "copy_gap": last["by_source"]["copy"] - copy_f,
            "gap": last["loss"] - floor, "eval": last["loss"], "floor": floor, "by_source": last["by_source"],
            "max_gnorm": top["grad_norm"], "max_gnorm_step": top["step"],
            "median_gnorm": sorted(r_["grad_norm"] for r_ in recs)[len(recs) // 2],
            "ckpt_mb": sum(f.stat().st_size for f in ckpts[0].rglob("*") if f.is_file()) / 1e6 if ckpts else None,
            "gnorm_gt10_steps": spikes[:5], "wall_s": wall,
            "ms_per_step": 1e3 * sum(r_["time_s"]["total"] for r_ in recs) / len(recs)}


def passes(row: dict, tol: float = 0.05) -> bool:
    """The quickstart's claim on one run: both the copy source and the mixture end within tol of their floor."""
    return "error" not in row and row["copy_gap"] <= tol and row["gap"] <= tol


def map_jobs(fn, items, jobs: int, show=None) -> list:
    """fn over the items, `jobs` at a time (each a train.py subprocess), in order; show(row) as each comes."""
    rows = []
    with ThreadPoolExecutor(jobs) as pool:
        for row in pool.map(fn, items):
            rows.append(row)
            if show:
                show(row)
    return rows


def run_grid(points: list[dict], steps: int | None, noise: float, extra: list[str], root: Path, jobs: int = 2,
             show=None) -> list[dict]:
    return map_jobs(lambda pt: one(pt, steps, noise, extra, root), points, jobs, show)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--data-seeds", nargs="*", type=int, default=[1234, 99])
    p.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    p.add_argument("--steps", type=int, default=None, help="train.steps (default: the recipe's own)")
    p.add_argument("--noise", type=float, default=0.0, help="relative noise on the initial weights")
    p.add_argument("--tol", type=float, default=0.05)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--keep", type=Path, help="keep the run directories here (a point with a row.json is reused)")
    p.add_argument("--out", type=Path, help="also write the table (markdown) to this file")
    p.add_argument("overrides", nargs="*", help="after --: train.py overrides (the recipe to test)")
    args = p.parse_args()
    if args.child:
        return child(args.noise, args.overrides)
    rep = Report("The default job over seeds, data seeds and threads", "python -m bench.seeds.quickstart_grid")
    root = args.keep or Path(tempfile.mkdtemp(prefix="quickstart_grid-"))
    points = [{"seed": s, "data_seed": d, "threads": t}
              for s, d, t in itertools.product(args.seeds, args.data_seeds, args.threads)]
    print(f"dirs under {root}", flush=True)
    rep.add(f"{len(points)} runs of {args.steps or 'the recipe'} steps, noise {args.noise:g} on the initial weights, "
            f"recipe overrides: {' '.join(args.overrides) or '(the default)'}; a run passes when both gaps are <= "
            f"{args.tol} nats.", "")
    rep.columns("seed", "data seed", "threads", "head forms at step", "final eval (exact floor)", "markov / copy",
                "copy gap", "gap", "largest ‖g‖ (step; median)", "ckpt MB", "ms/step", "wall s", "")
    rows = []

    def show(row: dict) -> None:
        rows.append(row)
        if "error" in row:
            rep.row(row["seed"], row["data_seed"], row["threads"], f"ERROR {row['error']}", *[""] * 9)
            return
        src = row["by_source"]
        rep.row(row["seed"], row["data_seed"], row["threads"], row["forms"] or "never",
                f"{row['eval']:.4f} ({row['floor']:.4f})", f"{src.get('markov', float('nan')):.4f} / {src['copy']:.4f}",
                f"{row['copy_gap']:+.4f}", f"{row['gap']:+.4f}",
                f"{row['max_gnorm']:.1f} ({row['max_gnorm_step']}; {row['median_gnorm']:.2f})",
                "—" if row["ckpt_mb"] is None else f"{row['ckpt_mb']:.1f}", f"{row['ms_per_step']:.0f}",
                f"{row['wall_s']:.0f}", "pass" if passes(row, args.tol) else "FAIL")

    run_grid(points, args.steps, args.noise, args.overrides, root, args.jobs, show)
    good = [r for r in rows if "error" not in r]
    rep.add()
    if good:
        passed = sum(passes(r, args.tol) for r in good)
        formed = [r["forms"] for r in good if r["forms"]]
        rep.add(f"{passed}/{len(rows)} pass (copy gap and gap <= {args.tol}); copy gap "
                f"{min(r['copy_gap'] for r in good):+.4f}..{max(r['copy_gap'] for r in good):+.4f}, gap "
                f"{min(r['gap'] for r in good):+.4f}..{max(r['gap'] for r in good):+.4f}; head forms at steps "
                f"{min(formed) if formed else '-'}..{max(formed) if formed else '-'} "
                f"({len(good) - len(formed)} never)")
    rep.write(args.out)


if __name__ == "__main__":
    main()
