"""Every lab over seeds: which seeds show the lab's asserted effect, and which checks fail where not.

    OMP_NUM_THREADS=1 python -m bench.labs_seeds                      # every lab, seeds 0-9, quick sizes
    python -m bench.labs_seeds --labs clip_always zloss --seeds 0 1 2 --full --out /tmp/labs_seeds

Prints one line per (lab, seed): ok or the failing checks, and the seconds it took; then per lab the
seeds that failed. --out keeps each result.json (for the README's ranges over seeds).
"""
from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

import torch

from labs import LABS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--labs", nargs="*", default=list(LABS))
    p.add_argument("--seeds", nargs="*", type=int, default=list(range(10)))
    p.add_argument("--full", action="store_true", help="the labs' full sizes (default: --quick sizes)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    failed: dict[str, list[int]] = {}
    for name in args.labs:
        lab = importlib.import_module(LABS[name])
        failed[name] = []
        for seed in args.seeds:
            t0 = time.perf_counter()
            r = lab.run(seed, quick=not args.full)
            bad = [k for k, v in r["checks"].items() if not v]
            if not r["ok"]:
                failed[name].append(seed)
            print(f"{name:<16} seed {seed:>2}  {'ok  ' if r['ok'] else 'FAIL'}  {time.perf_counter() - t0:6.1f} s"
                  + (f"  | {' | '.join(bad)}" if bad else ""), flush=True)
            if args.out:
                d = args.out / name
                d.mkdir(parents=True, exist_ok=True)
                (d / f"seed{seed}.json").write_text(json.dumps(r, default=float) + "\n")
    print("\nfailing seeds:", {k: v for k, v in failed.items() if v} or "none")


if __name__ == "__main__":
    main()
