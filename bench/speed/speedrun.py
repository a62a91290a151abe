"""Steps and seconds to a validation loss: nanoGPT's README CPU run against ballast's speedrun recipe.

    python -m bench.speed.speedrun runs/speedrun-<time> [--target 1.8857]      # after bash bench/speed/speedrun.sh

Reads what bench/speed/speedrun.sh left in the directory, for each round r: nanogpt-r.log (nanoGPT's train.py
output, log_interval=1: one `iter N: ... time T ms` line per iteration and `step N: ... val loss V` per
evaluation), nanogpt-r/ckpt.pt (its best checkpoint), ballast-r/metrics.jsonl (StepRecords), and the
`uptime` lines taken before and after each run.

Seconds to the target are training-step seconds: every step up to the first evaluation at or below the
target, the first steps (and a compile) included, the time spent evaluating not. An iteration that
evaluated (nanoGPT: its dt spans its eval; ballast: the step's record holds an eval) counts as the
median step of its run instead, the same rule on both sides. Process start, data preparation and
imports are outside both.

The two sides evaluate differently (nanoGPT: 20 random batches of 12 × 64 = 15,360 tokens per split
every 250 iterations; ballast: train.eval_samples fixed windows of the same validation text, by default
2400 × 64 = 153,600 tokens, every train.eval_every steps), so nanoGPT's final checkpoint is also
evaluated with ballast's protocol (--nanogpt points at the checkout) and printed beside the target.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

from bench.report import Report

TARGET = 1.8857  # nanoGPT's val loss after its README CPU command's 2000 iterations (karpathy/nanoGPT 3adf61e)
ITER = re.compile(r"^iter (\d+): loss ([\d.]+), time ([\d.]+)ms")
EVAL = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)")


def crossing(evals: list[tuple[int, float]], target: float) -> int | None:
    """The first evaluated step whose loss is at or below the target."""
    return next((s for s, loss in evals if loss <= target), None)


def seconds_to(step_s: dict[int, float], eval_steps: set[int], upto: int) -> float:
    """Σ step seconds of steps ≤ upto, an evaluating step counted as the run's median plain step."""
    plain = [t for s, t in step_s.items() if s not in eval_steps]
    med = statistics.median(plain[10:] or plain)
    return sum(med if s in eval_steps else t for s, t in step_s.items() if s <= upto)


def read_nanogpt(log: Path) -> dict:
    """nanoGPT's iteration i runs update i+1: its dt is update i+1's, and `step N: val` is after N updates.
    An eval at iteration N sits in that iteration's dt (train.py evaluates at the top of the loop)."""
    step_s, evals = {}, []
    for line in log.read_text().splitlines():
        if m := ITER.match(line):
            step_s[int(m[1]) + 1] = float(m[3]) / 1e3
        elif m := EVAL.match(line):
            evals.append((int(m[1]), float(m[3])))
    eval_steps = {s + 1 for s, _ in evals}  # the update whose dt holds the eval at the top of its iteration
    return {"step_s": step_s, "evals": evals, "eval_steps": eval_steps}


def read_ballast(run_dir: Path) -> dict:
    from stability.record import read_records

    recs = read_records(run_dir / "metrics.jsonl")
    step_s = {r["step"]: r["time_s"]["total"] for r in recs}
    evals = [(r["step"], r["eval"]["loss"]) for r in recs if r.get("eval")]
    return {"step_s": step_s, "evals": evals, "eval_steps": {s for s, _ in evals},
            "eval_tokens": next((r["eval"]["tokens"] for r in recs if r.get("eval")), None)}


def summary(run: dict, target: float, fallback_last: bool) -> dict:
    """steps and seconds to the target; fallback_last: a run that never reaches it (nanoGPT's own noisy
    eval can land a hair above the figure it defines) counts its whole length."""
    step = crossing(run["evals"], target)
    reached = step is not None
    if not reached and fallback_last:
        step = max(run["step_s"])
    plain = [t for s, t in sorted(run["step_s"].items()) if s not in run["eval_steps"]][10:]
    return {"step": step, "reached": reached, "median_ms": statistics.median(plain) * 1e3,
            "seconds": seconds_to(run["step_s"], run["eval_steps"], step) if step else None,
            "final": run["evals"][-1] if run["evals"] else None}


def nanogpt_on_our_protocol(root: Path, ckpt: Path, run_dir: Path) -> tuple[float, int]:
    """nanoGPT's checkpoint evaluated on ballast's validation batches of that run (its config.yaml)."""
    from omegaconf import OmegaConf

    from bench import nanogpt
    from data import build_data
    from data.loader import eval_batches
    from run.config import Config

    cfg = Config.from_dict(OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True))
    ds = build_data(cfg.data)
    batches = eval_batches(ds, cfg.train.eval_samples, cfg.train.eval_batch_size)
    model, it = nanogpt.load_checkpoint(root, ckpt)
    return nanogpt.eval_loss(model, batches), it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, help="the directory bench/speed/speedrun.sh wrote")
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    ap.add_argument("--target", type=float, default=TARGET)
    ap.add_argument("--nanogpt", default=None, help="nanoGPT checkout, to evaluate its checkpoint (default $NANOGPT_DIR)")
    args = ap.parse_args()
    rep = Report("Time to nanoGPT's final val loss", "python -m bench.speed.speedrun")
    rounds = sorted(int(p.name.split("-")[1]) for p in args.runs.glob("ballast-*") if p.is_dir())
    if not rounds:
        sys.exit(f"bench: {args.runs}: no ballast-<round> run directory")
    rep.add(f"Target: val loss <= {args.target}.", "")
    rep.columns("round", "who", "ms/step", "steps to target", "step-seconds", "final val@step", "load (before \\| after)")
    ratios, short = [], False
    for r in rounds:
        ng = summary(read_nanogpt(args.runs / f"nanogpt-{r}.log"), args.target, fallback_last=True)
        ours = summary(read_ballast(args.runs / f"ballast-{r}"), args.target, fallback_last=False)
        short |= not ng["reached"]
        for who, s in (("nanoGPT", ng), ("ballast", ours)):
            load = (args.runs / f"{who.lower()}-{r}.uptime")
            load = " \\| ".join(ln.split("load average:")[-1].strip() for ln in load.read_text().splitlines()) \
                if load.exists() else "?"
            steps = f"{s['step']}{'' if s['reached'] else '*'}" if s["step"] else "never"
            secs = f"{s['seconds']:.1f}" if s["seconds"] else "-"
            fin = f"{s['final'][1]:.4f}@{s['final'][0]}" if s["final"] else "-"
            rep.row(r, who, f"{s['median_ms']:.1f}", steps, secs, fin, load)
        if ours["seconds"] and ng["seconds"]:
            ratios.append((r, ng["seconds"] / ours["seconds"], ng["step"] / ours["step"], ours["median_ms"] / ng["median_ms"]))
    rep.add()
    for r, sooner, fewer, step in ratios:
        rep.add(f"- round {r}: ballast reaches it {sooner:.2f}x sooner ({fewer:.2f}x fewer steps, step time {step:.3f}x "
                "nanoGPT's)")
    if short:
        rep.add("- \\* never at or below the target on nanoGPT's own eval: its whole run counts")
    if ratios:
        rep.add(f"- time to target, nanoGPT / ballast: {' '.join(f'{x[1]:.2f}' for x in ratios)} "
                f"(median {statistics.median(x[1] for x in ratios):.2f}x over {len(ratios)} rounds)")
    ev = read_ballast(args.runs / f"ballast-{rounds[0]}")
    rep.add(f"- eval protocols: ballast {ev['eval_tokens']} fixed validation tokens per eval; nanoGPT 15,360 random "
            f"validation tokens (eval_iters 20 × 12 × 64) every 250 iterations")
    ckpt = args.runs / f"nanogpt-{rounds[0]}" / "ckpt.pt"
    if ckpt.exists():
        from bench import nanogpt

        loss, it = nanogpt_on_our_protocol(nanogpt.nanogpt_dir(args.nanogpt), ckpt, args.runs / f"ballast-{rounds[0]}")
        rep.add(f"- nanoGPT's checkpoint (iteration {it}) on ballast's eval protocol: val loss {loss:.4f}")
    rep.write(args.out)


if __name__ == "__main__":
    main()
