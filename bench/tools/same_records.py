"""Do two commits train the same run? StepRecords compared field by field, before vs after a refactor.

    python -m bench.tools.same_records REF                  # REF (e.g. main~3) vs the working tree
    python -m bench.tools.same_records REF --steps 100 --drill drill_labels_shuffle
    python -m bench.tools.same_records REF --except spec     # a change declared to alter the checks' figures

Each side runs in its own checkout (REF in a temporary `git worktree`, the other side where this file
is), one thread, the same command: the quickstart's first `--steps` steps (its own 400-step schedule,
stopped by checkpoint.stop_after) and one fault drill in full. Every StepRecord field REF writes must be
equal — floats bit for bit — except the wall-clock ones (time_s, tokens_per_s, memory_mb) and `version`;
fields only the working tree writes (a newer record version) are listed, not compared; event lines are
compared with their durations blanked ("(0.12 s)"). events.jsonl is compared the same way. Exit 1 on
the first difference, with the step and the field.

NOTE: both sides run on this machine: a float result depends on the CPU's kernels (AVX2 vs AVX-512),
so records from another machine are no reference.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import ROOT

WALL_CLOCK = {"time_s", "tokens_per_s", "memory_mb"}
DURATION = re.compile(r"\d+\.\d+ ?s\b")
RUN_DIR = re.compile(r"\S*/same-records-[^/\s]+/[^/\s]+-(?:ref|now)")  # each side's own run directory
COMMON = ["threads=1", "logging.progress=false", "logging.wandb=disabled", "logging.plot=false"]


def runs(steps: int, drill: str) -> dict[str, list[str]]:
    return {"quickstart": [f"checkpoint.stop_after={steps}", *COMMON],
            drill: [f"+experiment={drill}", *COMMON]}


def train(checkout: Path, out: Path, overrides: list[str]) -> Path:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "train.py", f"hydra.run.dir={out}", *overrides], cwd=checkout, env=env,
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"same_records: {' '.join(overrides)} failed in {checkout} (exit {r.returncode}):\n{r.stderr[-2000:]}")
    return out


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def blank(x):
    """Wall-clock durations and each side's run directory inside event text are not part of the computation."""
    if isinstance(x, str):
        return RUN_DIR.sub("<run>", DURATION.sub("<t>", x))
    if isinstance(x, list):
        return [blank(v) for v in x]
    if isinstance(x, dict):
        return {k: blank(v) for k, v in x.items()}
    return x


def only_ref_keys(x, y, added: set, path: str = ""):
    """y restricted to the keys x has, recursively: what a newer record version adds is listed in `added`,
    not compared (the trajectory is the same when every field both sides have is)."""
    if not (isinstance(x, dict) and isinstance(y, dict)):
        return y
    added |= {f"{path}{k}" for k in y if k not in x}
    return {k: only_ref_keys(x[k], y[k], added, f"{path}{k}.") for k in y if k in x}


def first_difference(a: list[dict], b: list[dict], what: str, added: set | None = None,
                     excepted: frozenset = frozenset()) -> str | None:
    """The first field that differs, but the wall-clock ones, `version` and the `excepted` (a change's declared
    effect: e.g. the specification checks' own measurements when the checks change)."""
    if len(a) != len(b):
        return f"{what}: {len(a)} vs {len(b)} lines"
    added = set() if added is None else added
    skip = WALL_CLOCK | {"version"} | excepted
    for i, (x, y) in enumerate(zip(a, b)):
        x = {k: blank(v) for k, v in x.items() if k not in skip}
        y = only_ref_keys(x, {k: blank(v) for k, v in y.items() if k not in skip}, added)
        # NOTE: compared as JSON text: NaN == NaN there, and a float differs iff its repr does.
        for k in sorted(set(x) | set(y)):
            if json.dumps(x.get(k), sort_keys=True) != json.dumps(y.get(k), sort_keys=True):
                return f"{what} line {i + 1} (step {x.get('step')}): field {k!r}: {x.get(k)!r} vs {y.get(k)!r}"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tools.same_records", description=__doc__.split("\n\n")[0])
    ap.add_argument("ref", help="the commit to compare the working tree with (e.g. main~3)")
    ap.add_argument("--steps", type=int, default=100, help="quickstart steps compared (default 100)")
    ap.add_argument("--drill", default="drill_labels_shuffle", help="the drill experiment run in full")
    ap.add_argument("--except", dest="excepted", action="append", default=[], metavar="FIELD",
                    help="a record field the change is declared to alter: not compared (repeatable)")
    args = ap.parse_args(argv)
    ok = True
    with tempfile.TemporaryDirectory(prefix="same-records-") as tmp:
        tmp = Path(tmp)
        base = tmp / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.ref], cwd=ROOT, check=True)
        try:
            for name, overrides in runs(args.steps, args.drill).items():
                a = train(base, tmp / f"{name}-ref", overrides)
                b = train(ROOT, tmp / f"{name}-now", overrides)
                for f in ("metrics.jsonl", "events.jsonl"):
                    added: set = set()
                    diff = first_difference(lines(a / f), lines(b / f), f"{name} {f}", added,
                                            frozenset(args.excepted))
                    n = len(lines(a / f))
                    print(f"{name:>22} {f:<14} {n:>4} lines: " + ("identical" if diff is None else f"DIFFERENT — {diff}")
                          + (f" (fields only the working tree writes, not compared: {', '.join(sorted(added))})"
                             if added else ""))
                    ok &= diff is None
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    but = f" (but {', '.join(args.excepted)}, not compared)" if args.excepted else ""
    print(f"PASS: same records{but}" if ok else "FAIL: the records differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
