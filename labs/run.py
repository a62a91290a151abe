"""Run one lab: print its table, save result.json and <name>.png, exit 1 when its effect is absent.

    python -m labs.run --list
    python -m labs.run --experiment lowprec_gemm --seed 7 [--out DIR] [--quick]
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

from labs import LABS

ROOT = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labs.run", description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="list the labs and exit")
    p.add_argument("--experiment", help="lab name (see --list)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", type=Path, help="output dir (default labs/out/<name>/)")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer steps (tests, a first look)")
    args = p.parse_args(argv)
    if args.list:
        for name, mod in LABS.items():
            print(f"{name:<16}{importlib.import_module(mod).TITLE}")
        return 0
    if args.experiment not in LABS:
        print(f"labs.run: --experiment={args.experiment}: expected one of {', '.join(LABS)}", file=sys.stderr)
        return 2
    lab = importlib.import_module(LABS[args.experiment])
    out = args.out or ROOT / "out" / args.experiment
    out.mkdir(parents=True, exist_ok=True)
    print(f"{lab.TITLE}\nseed {args.seed}{' (quick)' if args.quick else ''} → {out}\n", flush=True)
    t0 = time.perf_counter()
    result = lab.run(args.seed, quick=args.quick)
    print(result["table"])
    (out / "result.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
    lab.plot(result, out / f"{args.experiment}.png")
    verdict = "expected effect present" if result["ok"] else "EXPECTED EFFECT ABSENT"
    print(f"\n{args.experiment}: {verdict} ({time.perf_counter() - t0:.0f} s) | {out / 'result.json'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
