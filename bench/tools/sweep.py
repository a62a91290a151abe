"""Compare the runs of a Hydra sweep: one table, one PNG of the loss curves.

    python train.py -m optim.lr=3e-4,1e-3,3e-3 +experiment=dense_tiny     # → runs/sweep-<name>-<time>/<n>/
    python -m bench.tools.sweep runs/sweep-dense_tiny-<time>                     # table + <dir>/sweep.png

A run is any directory under DIR holding metrics.jsonl and config.yaml. The table shows the config keys
whose values differ between the runs (what the sweep varied), then per run:
  final loss   the last evaluation's loss (nats per valid token)
  gap          final loss − the exact loss floor (synthetic data; "-" when unknown)
  spikes       steps on which the stability guard's detector fired (any metric, acted on or not)
  skipped      optimizer steps not applied (non-finite gradients, guard vetoes)
  time         the training loop's wall time, Σ of the per-step totals (s)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from checkpoint.resume import flatten
from stability.record import read_records

# keys that differ between any two runs without being a choice of the sweep
_NOISE = ("run_name",)


def find_runs(root: Path) -> list[Path]:
    runs = [p.parent for p in root.rglob("metrics.jsonl") if (p.parent / "config.yaml").is_file()]
    return sorted(runs, key=lambda p: (len(p.relative_to(root).parts), _num(p.name), str(p)))


def _num(name: str) -> float:
    return int(name) if name.isdigit() else float("inf")


def summarise(run: Path) -> dict:
    recs = read_records(run / "metrics.jsonl")
    evals = [r["eval"] for r in recs if r.get("eval")]
    last = evals[-1] if evals else None
    return {
        "final_loss": last["loss"] if last else None,
        "floor": last.get("floor") if last else None,
        "spikes": sum(bool(r.get("guard", {}).get("triggers") or r.get("guard", {}).get("suppressed")) for r in recs),
        "skipped": sum(bool(r.get("skipped")) for r in recs),
        "time_s": sum(r["time_s"]["total"] for r in recs),
        "steps": len(recs),
        "curve": [(r["step"], r["loss"]) for r in recs],
        "eval_curve": [(r["step"], r["eval"]["loss"]) for r in recs if r.get("eval")],
    }


def varied_keys(configs: list[dict]) -> list[str]:
    flat = [flatten(c) for c in configs]
    keys = sorted(set().union(*flat))
    return [k for k in keys if k not in _NOISE and len({repr(f.get(k)) for f in flat}) > 1]


def plot(runs: list[Path], stats: list[dict], labels: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for s, label in zip(stats, labels):
        steps, loss = zip(*s["curve"]) if s["curve"] else ((), ())
        line, = ax.plot(steps, loss, lw=1, alpha=0.8, label=label)
        if s["eval_curve"]:
            ax.plot(*zip(*s["eval_curve"]), "o", color=line.get_color(), ms=3)
    floors = {s["floor"] for s in stats if s["floor"] is not None}
    if len(floors) == 1:
        ax.axhline(floors.pop(), color="k", ls="--", lw=1, label="exact loss floor")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (lines), eval loss (dots)")
    ax.set_title(f"sweep {out.parent.name}: {len(runs)} runs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def table(root: Path) -> tuple[str, list[Path], list[dict], list[str]]:
    runs = find_runs(root)
    if not runs:
        raise ValueError(f"{root}: no run directories (metrics.jsonl + config.yaml) under it")
    configs = [yaml.safe_load((r / "config.yaml").read_text()) for r in runs]
    keys = varied_keys(configs)
    flat = [flatten(c) for c in configs]
    stats = [summarise(r) for r in runs]
    labels = [", ".join(f"{k}={f.get(k)}" for k in keys) or str(r.relative_to(root)) for r, f in zip(runs, flat)]
    head = ["run", *keys, "steps", "final loss", "gap to floor", "spikes", "skipped", "time s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, f, s in zip(runs, flat, stats):
        gap = f"{s['final_loss'] - s['floor']:+.4f}" if s["final_loss"] is not None and s["floor"] is not None else "-"
        loss = f"{s['final_loss']:.4f}" if s["final_loss"] is not None else "-"
        cells = [str(r.relative_to(root)), *(str(f.get(k)) for k in keys), str(s["steps"]), loss, gap,
                 str(s["spikes"]), str(s["skipped"]), f"{s['time_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), runs, stats, labels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tools.sweep", description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("--png", type=Path, default=None, help="default: <sweep_dir>/sweep.png")
    args = ap.parse_args(argv)
    try:
        text, runs, stats, labels = table(args.sweep_dir)
    except ValueError as e:
        print(f"sweep: {e}", file=sys.stderr)
        return 2
    print(text)
    png = args.png or args.sweep_dir / "sweep.png"
    plot(runs, stats, labels, png)
    print(f"loss curves: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
