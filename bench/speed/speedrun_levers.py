"""Each lever of the speedrun recipe measured alone: the recipe against the recipe with that one lever undone.

    python -m bench.speed.speedrun_levers [--seeds 5] [--jobs 2] [--out docs/results/speedrun_levers.md]

The recipe is conf/experiment/speedrun.yaml as it stands; each arm changes one thing back to the plain choice
(ARMS below) and keeps the rest. Every arm runs train.py once per seed (seeds 0..N-1, one thread, eager,
checkpoints off), evaluated on the full validation text every fifth of its steps (the last step included).
Per arm: the mean final validation loss with its 95 % confidence interval over seeds (Student t), the mean
paired difference from the recipe (same seed) with its interval, how many seeds reached nanoGPT's final val
loss (bench/speed/speedrun.py's TARGET), and the CPU milliseconds per plain step (process CPU time: with one thread
it is the step's own compute, which other jobs on a shared machine move far less than wall time) times the
arm's steps.

A lever is kept in the recipe when undoing it costs loss beyond its interval (or time, for a lever that changes
the step itself: the optimizer, the batch); the README and conf/experiment/speedrun.yaml cite this file.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import ROOT
from bench.report import Report
from bench.speed.speedrun import TARGET
from bench.stats import mean_ci, p_below

DATA = os.environ.get("TINYSHAKESPEARE", "tinyshakespeare.txt")  # README: Running
# arm -> (what it undoes, the overrides that undo it)
ARMS: dict[str, tuple[str, list[str]]] = {
    "recipe": ("conf/experiment/speedrun.yaml as it stands", []),
    "adamw": ("AdamW on every matrix instead of Muon on the hidden ones", ["optim.name=adamw"]),
    "no_qk_norm": ("no QK-norm", ["model.qk_norm=false"]),
    "cosine": ("the repository's default schedule shape: cosine to 10 % instead of linear to 0",
               ["optim.schedule.name=cosine", "optim.schedule.min_lr_ratio=0.1"]),
    "batch_24": ("batch 24 for half the steps and half the warm-up (the same tokens)",
                 ["train.batch_size=24", "HALF_STEPS"]),
    "init_std_0.01": ("every matrix drawn at std 0.01 instead of 0.02 (the residual writers scaled as before)",
                      ["model.init_std=0.01"]),
}
QUIET = ["threads=1", "checkpoint.every=0", "logging.wandb=disabled", "logging.progress=false", "logging.plot=false"]


def recipe():
    """The recipe's config, as train.py composes it."""
    from bench.config import compose_config

    return compose_config(["+experiment=speedrun", f"data.path={DATA}"])


def one(arm: str, seed: int, steps: int, out: Path) -> dict:
    """train.py for one arm and seed; its final validation loss and median CPU ms per plain step."""
    over = list(ARMS[arm][1])
    if "HALF_STEPS" in over:
        over.remove("HALF_STEPS")
        steps, warmup = steps // 2, recipe().optim.schedule.warmup_steps // 2
        over += [f"train.steps={steps}", f"optim.schedule.warmup_steps={warmup}"]
    every = max(1, steps // 5)
    run = out / f"{arm}-s{seed}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "train.py", "+experiment=speedrun", f"data.path={DATA}", f"seed={seed}",
                        f"hydra.run.dir={run}", f"train.eval_every={every}", *QUIET, *over],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"bench.speed.speedrun_levers: {arm} seed {seed} failed: {r.stderr[-2000:]}")
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [(x["step"], x["eval"]["loss"]) for x in recs if x.get("eval")]
    plain = [x["time_s"]["cpu"] for x in recs[2:] if not x.get("eval")]
    return {"arm": arm, "seed": seed, "steps": steps, "final": evals[-1][1], "evals": evals,
            "cpu_ms": statistics.median(plain) * 1e3, "tokens": recs[-1]["tokens"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.speed.speedrun_levers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (the losses do not depend on it; the CPU "
                                                          "ms per step a little, through shared caches)")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    args = ap.parse_args(argv)
    if "recipe" not in args.arms:
        args.arms.insert(0, "recipe")
    rep = Report("The speedrun's levers, each undone alone", "python -m bench.speed.speedrun_levers", argv)
    steps = recipe().train.steps
    # seed-major, the arms' order rotating per seed: a drifting machine meets every arm alike
    jobs = [(arm, s) for s in range(args.seeds) for arm in args.arms[s % len(args.arms):] + args.arms[:s % len(args.arms)]]
    with tempfile.TemporaryDirectory(prefix="speedrun-levers-") as tmp, \
            concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda job: one(*job, steps, Path(tmp)), jobs))
    by = {arm: sorted((r for r in results if r["arm"] == arm), key=lambda r: r["seed"]) for arm in args.arms}
    rep.add(f"Recipe: `+experiment=speedrun`, {steps} steps; {args.seeds} seeds per arm (0..{args.seeds - 1}), "
            f"one thread, eager; target: nanoGPT's final val loss {TARGET}. Intervals: 95 % (Student t over seeds).", "")
    rep.columns("arm", "undoes", "steps", "final val loss, mean ± CI", "vs recipe (paired), mean ± CI",
                "seeds ≤ target", "p(mean < target)", "CPU ms/step", "CPU s of steps")
    base = {r["seed"]: r["final"] for r in by["recipe"]}
    for arm in args.arms:
        rs = by[arm]
        finals = [r["final"] for r in rs]
        m, h = mean_ci(finals)
        if arm == "recipe":
            diff = "-"
        else:
            dm, dh = mean_ci([r["final"] - base[r["seed"]] for r in rs])
            diff = f"{dm:+.4f} ± {dh:.4f}"
        rep.row(arm, ARMS[arm][0], rs[0]["steps"], f"{m:.4f} ± {h:.4f}", diff,
                f"{sum(f <= TARGET for f in finals)}/{len(finals)}", f"{p_below(finals, TARGET):.2g}",
                f"{statistics.median(r['cpu_ms'] for r in rs):.1f}",
                f"{statistics.median(r['cpu_ms'] for r in rs) * rs[0]['steps'] / 1e3:.1f}")
    rep.add("", "Validation loss by step (mean over seeds):", "")
    for arm in args.arms:
        steps_ = [s for s, _ in by[arm][0]["evals"]]
        means = [statistics.fmean(r["evals"][i][1] for r in by[arm]) for i in range(len(steps_))]
        rep.add(f"- {arm}: " + ", ".join(f"{s}: {v:.4f}" for s, v in zip(steps_, means)))
    rep.write(args.out)


if __name__ == "__main__":
    main()
