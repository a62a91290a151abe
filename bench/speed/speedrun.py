"""Time to nanoGPT's final val loss, side by side with nanoGPT: the table bench/speed/speedrun.sh ends with.

    python -m bench.speed.speedrun runs/speedrun-<time> [--target 1.8857] [--out docs/results/speedrun.md]

Reads what bench/speed/speedrun.sh left in the directory, for each round i: nanogpt-i.log (nanoGPT's train.py output,
log_interval=1: one `iter N: ... time T ms` line per iteration and `step N: ... val loss V` per evaluation),
nanogpt-i/ckpt.pt (its best checkpoint), speedrun-i/ and shape-i/ (ballast's StepRecords: the speedrun recipe
and nanoGPT's own recipe shape, seed i), compiled/ (the shape compiled: the cold start), the `uptime` lines
taken before and after each run, and `clock` (cpu: both sides timed in process CPU time; wall: wall time).

Seconds to the target are training-step seconds: every step up to the first evaluation at or below the
target, the first steps (and a compile when on) included, the time spent evaluating not: a ballast step that
evaluated counts its record's time less the evaluation's own (time_s.eval, eval_cpu); a nanoGPT iteration that
evaluated (its dt spans its eval, untimed apart) counts as the median iteration of its run. Process start, data
preparation and imports are outside both. ms/step is the mean over the steps after the first ten (nanoGPT's
evaluating iterations left out): ballast's telemetry and reference steps (every 10th, by default) are counted in,
the ones that also evaluated among them.

The two sides evaluate differently (nanoGPT: 20 random batches of 12 × 64 = 15,360 tokens per split
every 250 iterations; ballast: train.eval_samples fixed windows of the same validation text, by default
2400 × 64 = 153,600 tokens, every train.eval_every steps), so nanoGPT's final checkpoint is also
evaluated with ballast's protocol (--nanogpt points at the checkout) and printed beside the target.
Every claim is over the rounds' seeds: the mean with its 95 % Student-t interval, and for the speedrun's
final loss the one-sided p of "the mean is below the target" (modded-nanogpt's record rule: p < 0.01).
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


def read_ballast(run_dir: Path, clock: str = "wall") -> dict:
    from stability.record import read_records

    recs = read_records(run_dir / "metrics.jsonl")
    key, own = {"wall": ("total", "eval"), "cpu": ("cpu", "eval_cpu")}[clock]
    # an evaluating step less its evaluation's own time (time_s.eval, eval_cpu); a record without it (older) counts
    # as the median plain step
    step_s = {r["step"]: r["time_s"][key] - r["time_s"].get(own, 0.0) for r in recs}
    evals = [(r["step"], r["eval"]["loss"]) for r in recs if r.get("eval")]
    untimed = {r["step"] for r in recs if r.get("eval") and own not in r["time_s"]}
    return {"step_s": step_s, "evals": evals, "eval_steps": untimed,
            "eval_tokens": next((r["eval"]["tokens"] for r in recs if r.get("eval")), None)}


def summary(run: dict, target: float, fallback_last: bool) -> dict:
    """steps and seconds to the target; fallback_last: a run that never reaches it (nanoGPT's own noisy
    eval can land a hair above the figure it defines) counts its whole length."""
    step = crossing(run["evals"], target)
    reached = step is not None
    if not reached and fallback_last:
        step = max(run["step_s"])
    plain = [t for s, t in sorted(run["step_s"].items()) if s not in run["eval_steps"]][10:]
    return {"step": step, "reached": reached, "mean_ms": statistics.fmean(plain) * 1e3,
            "seconds": seconds_to(run["step_s"], run["eval_steps"], step) if step else None,
            "final": run["evals"][-1] if run["evals"] else None}


def nanogpt_on_our_protocol(root: Path, ckpt: Path, run_dir: Path) -> tuple[float, int]:
    """nanoGPT's checkpoint evaluated on ballast's validation batches of that run (its config.yaml)."""
    from omegaconf import OmegaConf

    from bench.speed import nanogpt
    from data import build_data
    from data.loader import eval_batches
    from run.config import Config

    cfg = Config.from_dict(OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True))
    ds = build_data(cfg.data)
    batches = eval_batches(ds, cfg.train.eval_samples, cfg.train.eval_batch_size)
    model, it = nanogpt.load_checkpoint(root, ckpt)
    return nanogpt.eval_loss(model, batches), it


def load_of(path: Path) -> str:
    """The load averages `uptime` logged before | after a run."""
    if not path.exists():
        return "?"
    return " \\| ".join(ln.split("load average:")[-1].strip() for ln in path.read_text().splitlines())


def cold_start(run_dir: Path) -> dict:
    """The compiled run's cold start (wall seconds: inductor compiles in worker processes too): its first step and
    its first telemetry step (a second graph), less two of its plain steps; and its plain steps' ms."""
    from stability.record import read_records

    recs = read_records(run_dir / "metrics.jsonl")
    first_tel = next((r["step"] for r in recs[1:] if r.get("layers")), None)
    slow = {1, first_tel} - {None}
    plain = [r for r in recs[2:] if r["step"] not in slow and not r.get("eval")]
    med_wall = statistics.median(r["time_s"]["total"] for r in plain)
    cold = sum(r["time_s"]["total"] - med_wall for r in recs if r["step"] in slow)
    return {"cold_s": cold, "graphs": len(slow), "cpu_ms": statistics.fmean(r["time_s"]["cpu"] for r in plain) * 1e3,
            "wall_ms": statistics.fmean(r["time_s"]["total"] for r in plain) * 1e3}


def ratio_line(name: str, xs: list[float]) -> str:
    """median, mean ± 95 % CI, range of per-round ratios."""
    from bench.stats import mean_ci

    med = statistics.median(xs)
    if len(xs) < 2:
        return f"- {name}: {med:.2f}x (1 round)"
    m, h = mean_ci(xs)
    return f"- {name}: median {med:.2f}x, mean {m:.2f}x ± {h:.2f} (95 % CI), range {min(xs):.2f}–{max(xs):.2f} over {len(xs)} rounds"


def main() -> None:
    from bench.stats import mean_ci, p_below
    from run.compile import MIN_STEPS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, help="the directory bench/speed/speedrun.sh wrote")
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    ap.add_argument("--target", type=float, default=TARGET)
    ap.add_argument("--nanogpt", default=None, help="nanoGPT checkout, to evaluate its checkpoint (default $NANOGPT_DIR)")
    args = ap.parse_args()
    rep = Report("Time to nanoGPT's final val loss, against nanoGPT", "python -m bench.speed.speedrun")
    rounds = sorted(int(p.stem.split("-")[1]) for p in args.runs.glob("nanogpt-*.log"))
    if not rounds:
        sys.exit(f"bench: {args.runs}: no nanogpt-<round>.log")
    clock = (args.runs / "clock").read_text().strip() if (args.runs / "clock").exists() else "wall"
    rep.add(f"Target: val loss <= {args.target} (nanoGPT's after its 2000 iterations). Clock: {clock} "
            f"({'process CPU time, one thread per process' if clock == 'cpu' else 'wall time'}); "
            f"round i runs nanoGPT, the speedrun with seed i and nanoGPT's shape with seed i.", "")
    rep.columns("round", "run", "ms/step", "steps to target", "step-seconds to target", "final val@step",
                "load (before \\| after)")
    table: dict[str, dict[int, dict]] = {"nanogpt": {}, "speedrun": {}, "shape": {}}
    for r in rounds:
        table["nanogpt"][r] = summary(read_nanogpt(args.runs / f"nanogpt-{r}.log"), args.target, fallback_last=True)
        for who in ("speedrun", "shape"):
            if (args.runs / f"{who}-{r}" / "metrics.jsonl").exists():
                table[who][r] = summary(read_ballast(args.runs / f"{who}-{r}", clock), args.target, fallback_last=False)
        for who, s in ((w, table[w].get(r)) for w in table):
            if s is None:
                continue
            steps = f"{s['step']}{'' if s['reached'] else '*'}" if s["step"] else "never"
            secs = f"{s['seconds']:.1f}" if s["seconds"] else "-"
            fin = f"{s['final'][1]:.4f}@{s['final'][0]}" if s["final"] else "-"
            rep.row(r, who, f"{s['mean_ms']:.1f}", steps, secs, fin, load_of(args.runs / f"{who}-{r}.uptime"))
    rep.add()
    if any(not s["reached"] for s in table["nanogpt"].values()):
        rep.add("- \\* never at or below the target on nanoGPT's own eval: its whole run counts")
    ng = table["nanogpt"]
    for who, what in (("speedrun", "the speedrun recipe"), ("shape", "nanoGPT's recipe shape (eager)")):
        pairs = [(ng[r], table[who][r]) for r in rounds if r in table[who] and table[who][r]["seconds"]]
        missed = [r for r in rounds if r in table[who] and not table[who][r]["seconds"]]
        if not pairs:
            rep.add(f"- {what}: no run reached the target")
            continue
        rep.add(f"**{what}** against nanoGPT, round by round ({len(pairs)} rounds"
                f"{f'; rounds {missed} never reached the target' if missed else ''}):")
        rep.add(ratio_line("sooner (nanoGPT's step-seconds / ballast's)", [n["seconds"] / o["seconds"] for n, o in pairs]))
        rep.add(ratio_line("fewer steps", [n["step"] / o["step"] for n, o in pairs]))
        rep.add(ratio_line("step time (ballast ms / nanoGPT ms)", [o["mean_ms"] / n["mean_ms"] for n, o in pairs]))
        rep.add()
    finals = [s["final"][1] for s in table["speedrun"].values() if s["final"]]
    if len(finals) >= 2:
        m, h = mean_ci(finals)
        last = {s["final"][0] for s in table["speedrun"].values() if s["final"]}
        rep.add(f"- the speedrun's final val loss (step {', '.join(map(str, sorted(last)))}) over {len(finals)} seeds: "
                f"{m:.4f} ± {h:.4f} (95 % CI); p(mean < {args.target}) = {p_below(finals, args.target):.2g} "
                "(the record rule: < 0.01)")
    if (args.runs / "compiled" / "metrics.jsonl").exists():
        c = cold_start(args.runs / "compiled")
        eager = [s["mean_ms"] for s in table["shape"].values()]
        line = (f"- nanoGPT's shape compiled (train.compile=true): cold start {c['cold_s']:.1f} s wall ({c['graphs']} "
                f"graphs: the first step and the first telemetry step; an empty Inductor cache), then "
                f"{c['cpu_ms']:.1f} ms/step CPU ({c['wall_ms']:.1f} wall)")
        if eager:
            saving = statistics.fmean(eager) - (c["cpu_ms"] if clock == "cpu" else c["wall_ms"])
            line += f" against {statistics.fmean(eager):.1f} eager"
            line += (f": the compile repays itself after {c['cold_s'] / (saving / 1e3):,.0f} steps"
                     if saving > 0 else ": no saving per step to repay it")
        rep.add(line + f" (run/compile.py compiles a CPU run by default from {MIN_STEPS['cpu']:,} steps; load "
                       f"{load_of(args.runs / 'compiled.uptime')})")
    speed = next((args.runs / f"speedrun-{r}" for r in rounds if (args.runs / f"speedrun-{r}").exists()), None)
    if speed is not None:
        ev = read_ballast(speed)
        rep.add(f"- eval protocols: ballast {ev['eval_tokens']} fixed validation tokens per eval; nanoGPT 15,360 random "
                f"validation tokens (eval_iters 20 × 12 × 64) every 250 iterations")
        ckpt = args.runs / f"nanogpt-{rounds[0]}" / "ckpt.pt"
        if ckpt.exists():
            from bench.speed import nanogpt

            loss, it = nanogpt_on_our_protocol(nanogpt.nanogpt_dir(args.nanogpt), ckpt, speed)
            rep.add(f"- nanoGPT's checkpoint (iteration {it}) on ballast's eval protocol: val loss {loss:.4f}")
    rep.write(args.out)


if __name__ == "__main__":
    main()
