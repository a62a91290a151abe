"""Figures of a finished run from its metrics.jsonl: step time, throughput, eval loss vs floor.

    python -m bench.tools.run_summary runs/<run>

Step time is the median over steps that ran no evaluation (an eval step also pays for the eval), with
the first 10 steps dropped as warm-up. tokens/s = positions per step / median step time.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from stability.record import read_records


def summarise(run_dir: Path) -> dict:
    recs = read_records(run_dir / "metrics.jsonl")
    plain = [r for r in recs[10:] if not r.get("eval")] or recs
    step_s = statistics.median(r["time_s"]["total"] for r in plain)
    positions = statistics.median(r["tokens_per_s"] * r["time_s"]["total"] for r in plain)
    split = {k: statistics.median(r["time_s"][k] for r in plain) for k in plain[0]["time_s"]}
    last = next(r["eval"] for r in reversed(recs) if r.get("eval"))
    wall = sum(r["time_s"]["total"] for r in recs)
    return {"steps": len(recs), "median_step_ms": step_s * 1e3, "tokens_per_s": positions / step_s,
            "split_ms": {k: v * 1e3 for k, v in split.items()}, "train_wall_s": wall,
            "eval_loss": last["loss"], "floor": last.get("floor")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    s = summarise(ap.parse_args().run_dir)
    print(f"steps {s['steps']} | median step {s['median_step_ms']:.1f} ms | {s['tokens_per_s'] / 1e3:.2f}k tokens/s"
          f" | loop wall {s['train_wall_s']:.1f} s")
    print("median split (ms): " + "  ".join(f"{k} {v:.2f}" for k, v in s["split_ms"].items()))
    gap = f" | floor {s['floor']:.4f} | gap {s['eval_loss'] - s['floor']:+.4f}" if s["floor"] is not None else ""
    print(f"final eval loss {s['eval_loss']:.4f}{gap}")


if __name__ == "__main__":
    main()
