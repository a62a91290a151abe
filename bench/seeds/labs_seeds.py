"""Every lab over seeds: which seeds show the lab's asserted effect, and which checks fail where not.

    OMP_NUM_THREADS=1 python -m bench.seeds.labs_seeds                      # every lab, seeds 0-9, quick sizes
    python -m bench.seeds.labs_seeds --labs clip_always zloss --seeds 0 1 2 --full --keep /tmp/labs_seeds
    python -m bench.seeds.labs_seeds --seeds 7 --out docs/results/labs.md      # every lab at the course's seed

Prints one row per (lab, seed): ok or the failing checks, and the seconds it took; then per lab the
seeds that failed, and each lab's own printed table at the first seed (its figures). --keep keeps each
result.json (for ranges over seeds).
"""
from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

import torch

from bench.report import Report
from labs import LABS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--labs", nargs="*", default=list(LABS))
    p.add_argument("--seeds", nargs="*", type=int, default=list(range(10)))
    p.add_argument("--full", action="store_true", help="the labs' full sizes (default: --quick sizes)")
    p.add_argument("--keep", type=Path, help="keep each result.json under this directory")
    p.add_argument("--out", help="also write the table and the labs' own tables (markdown) to this file")
    args = p.parse_args()
    torch.set_num_threads(1)
    rep = Report("The labs' checks over seeds", "python -m bench.seeds.labs_seeds")
    rep.add(f"{'Full' if args.full else 'Quick (`--quick`)'} sizes, 1 thread.", "")
    rep.columns("lab", "seed", "effect", "s", "failing checks")
    failed: dict[str, list[int]] = {}
    tables = {}
    for name in args.labs:
        lab = importlib.import_module(LABS[name])
        failed[name] = []
        for seed in args.seeds:
            t0 = time.perf_counter()
            r = lab.run(seed, quick=not args.full)
            bad = [k for k, v in r["checks"].items() if not v]
            if not r["ok"]:
                failed[name].append(seed)
            rep.row(name, seed, "ok" if r["ok"] else "ABSENT", f"{time.perf_counter() - t0:.1f}", " · ".join(bad) or "—")
            tables.setdefault(name, (seed, r["table"]))
            if args.keep:
                d = args.keep / name
                d.mkdir(parents=True, exist_ok=True)
                (d / f"seed{seed}.json").write_text(json.dumps(r, default=float) + "\n")
    rep.add("", f"failing seeds: {', '.join(f'{k} {v}' for k, v in failed.items() if v) or 'none'}", "")
    for name, (seed, table) in tables.items():
        rep.add(f"## {name} (seed {seed})", "")
        rep.block(table)
    rep.write(args.out)


if __name__ == "__main__":
    main()
