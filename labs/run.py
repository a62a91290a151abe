"""Run one lab: print its table, save result.json and <name>.png, exit 1 when its effect is absent.

    python -m labs.run --list [--exercises]
    python -m labs.run --experiment lowprec_gemm --seed 7 [--out DIR] [--quick] [--set KEY=VALUE ...]

Knobs: every keyword argument of a lab's run() (beyond seed and quick) can be set from the command
line, `--set high_lr=0.003`; `--set break=KEY[,KEY]` plants a named bug (labs/breaks.py) for the run.
`--list` shows each lab's knobs with their defaults.
"""
from __future__ import annotations

from run import omp_wait  # noqa: F401  (first: how OpenMP threads wait is fixed when torch loads)

import argparse
import contextlib
import importlib
import inspect
import json
import sys
import time
from pathlib import Path

from labs import LABS

ROOT = Path(__file__).resolve().parent


def knobs(lab) -> dict[str, object]:
    """name -> default of every keyword argument of lab.run beyond seed and quick."""
    params = inspect.signature(lab.run).parameters
    return {n: p.default for n, p in params.items() if n not in ("seed", "quick") and p.default is not inspect._empty}


def parse_value(key: str, text: str, default):
    """The text of `--set key=text`, typed like the knob's default (None default: a number if it is one)."""
    low = text.strip().lower()
    try:
        if low in ("none", "null"):
            return None
        if isinstance(default, bool):
            if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError("expected true or false")
            return low in ("true", "1", "yes", "on")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if isinstance(default, (tuple, list)):
            return tuple(float(x) for x in text.split(",") if x.strip())
        if isinstance(default, str):
            return text
        try:
            return float(text) if "," not in text else tuple(float(x) for x in text.split(","))
        except ValueError:
            return text
    except ValueError as e:
        raise ValueError(f"--set {key}={text}: {e}") from None


def parse_sets(lab_name: str, lab, items: list[str]) -> tuple[dict, list[str]]:
    """(run() keyword arguments, break keys) from `--set` items; ValueError with one line on bad input."""
    from labs.breaks import BREAKS

    known, kwargs, breaks = knobs(lab), {}, []
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--set {item}: expected KEY=VALUE")
        if key == "break":
            breaks += [b.strip() for b in text.split(",") if b.strip()]
            bad = [b for b in breaks if b not in BREAKS]
            if bad:
                raise ValueError(f"--set break={','.join(bad)}: expected one of {', '.join(BREAKS)}")
        elif key in known:
            kwargs[key] = parse_value(key, text, known[key])
        else:
            listed = ", ".join(f"{k}={v!r}" for k, v in known.items()) or "none"
            raise ValueError(f"--set {key}: {lab_name} has no such knob (knobs: {listed}; and break=KEY)")
    return kwargs, breaks


def list_labs() -> str:
    from labs.breaks import BREAKS

    lines = []
    for name, mod in LABS.items():
        lab = importlib.import_module(mod)
        lines.append(f"{name:<16}{lab.TITLE}")
        k = knobs(lab)
        if k:
            lines.append(f"{'':<16}knobs: " + ", ".join(f"{n}={v!r}" for n, v in k.items()))
    lines += ["", "breaks (--set break=KEY, any lab; the lab named is the one that catches it):"]
    lines += [f"  {k:<24}{what} → {lab}" for k, (what, lab, _) in BREAKS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # NOTE: the knobs come from importing every lab, so only --help pays for them in its epilog
    wants_help = any(a in ("-h", "--help") for a in argv)
    p = argparse.ArgumentParser(prog="python -m labs.run", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=list_labs() if wants_help else None)
    p.add_argument("--list", action="store_true", help="list the labs, their knobs and the breaks, and exit")
    p.add_argument("--exercises", action="store_true", help="with --list: print the exercises by course section")
    p.add_argument("--experiment", help="lab name (see --list)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", type=Path, help="output dir (default labs/out/<name>/)")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer steps (tests, a first look)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a knob of the lab's run() (see --list), or break=KEY to plant a named bug")
    args = p.parse_args(argv)
    if args.list:
        if args.exercises:
            from labs.exercises import format_exercises
            print(format_exercises())
        else:
            print(list_labs())
        return 0
    if args.experiment not in LABS:
        print(f"labs.run: --experiment={args.experiment}: expected one of {', '.join(LABS)}", file=sys.stderr)
        return 2
    lab = importlib.import_module(LABS[args.experiment])
    try:
        kwargs, breaks = parse_sets(args.experiment, lab, args.set)
    except ValueError as e:
        print(f"labs.run: {e}", file=sys.stderr)
        return 2
    out = args.out or ROOT / "out" / args.experiment
    out.mkdir(parents=True, exist_ok=True)
    settings = ", ".join([f"{k}={v!r}" for k, v in kwargs.items()] + [f"break={b}" for b in breaks])
    print(f"{lab.TITLE}\nseed {args.seed}{' (quick)' if args.quick else ''}"
          f"{f' [{settings}]' if settings else ''} → {out}\n", flush=True)
    t0 = time.perf_counter()
    from labs.breaks import planted
    with planted(breaks) if breaks else contextlib.nullcontext():
        try:
            result = lab.run(args.seed, quick=args.quick, **kwargs)
        except ValueError as e:  # a knob value the lab refuses (its own one-line message)
            print(f"labs.run: {args.experiment}: {e}", file=sys.stderr)
            return 2
    if kwargs or breaks:
        result["settings"] = {**{k: v for k, v in kwargs.items()}, **({"break": breaks} if breaks else {})}
    print(result["table"])
    (out / "result.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
    lab.plot(result, out / f"{args.experiment}.png")
    verdict = "expected effect present" if result["ok"] else "EXPECTED EFFECT ABSENT"
    print(f"\n{args.experiment}: {verdict} ({time.perf_counter() - t0:.0f} s) | {out / 'result.json'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
