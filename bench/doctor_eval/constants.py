"""The doctor's numeric constants, counted: how many numbers decide what it reports, and how many say beside them
where their value comes from (issue 36: every constant in doctor/ and stability/signals.py does).

    python -m bench.doctor_eval.constants [--before REV] [--out docs/results/doctor_constants.md]

Counted per file, in the working tree and at git revision --before: numeric literals other than 0 and 1 (a format
spec's width is no constant), and named module-level constants (UPPER_CASE = a number or an arithmetic expression of numbers); a named
constant is explained when a comment stands on its line or on the line above it. A literal's reason is usually its
expression's own comment, which this count cannot tell apart from any other: only the named ones are checked.
"""
from __future__ import annotations

import argparse
import ast
import subprocess
import sys

from bench import ROOT
from bench.report import Report

SCOPE = ("doctor", "stability/signals.py")


def files(rev: str | None) -> dict[str, str]:
    """path -> source of every Python file in SCOPE, in the working tree (rev None) or at git revision rev."""
    if rev is None:
        paths = [p for s in SCOPE for p in ([ROOT / s] if s.endswith(".py") else sorted((ROOT / s).rglob("*.py")))]
        return {str(p.relative_to(ROOT)): p.read_text() for p in paths}
    listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "--", *SCOPE], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split()
    return {p: subprocess.run(["git", "show", f"{rev}:{p}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout for p in listed if p.endswith(".py")}


def count(src: str) -> tuple[int, int, int]:
    """(numeric literals other than 0 and 1, named numeric constants, named ones without a comment beside them)."""
    tree, lines = ast.parse(src), src.splitlines()
    fmt = {id(n) for node in ast.walk(tree) if isinstance(node, ast.FormattedValue) and node.format_spec is not None
           for n in ast.walk(node.format_spec)}
    literals = sum(1 for n in ast.walk(tree) if isinstance(n, ast.Constant) and type(n.value) in (int, float)
                   and id(n) not in fmt and n.value not in (0, 1))
    named = [n for n in tree.body if isinstance(n, ast.Assign) and len(n.targets) == 1
             and isinstance(n.targets[0], ast.Name) and n.targets[0].id.isupper()
             and isinstance(n.value, (ast.Constant, ast.UnaryOp, ast.BinOp))  # a number, not a path's parents[1]
             and any(isinstance(c, ast.Constant) and type(c.value) in (int, float) for c in ast.walk(n.value))]

    def explained(n: ast.Assign) -> bool:
        here, above = lines[n.lineno - 1], lines[n.lineno - 2] if n.lineno > 1 else ""
        return "#" in here or above.lstrip().startswith("#")
    return literals, len(named), sum(not explained(n) for n in named)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="1aa415c", help="the git revision to compare with (default: the doctor "
                                                         "before issue 36)")
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    args = ap.parse_args(argv)
    out = Report("The doctor's numeric constants", "python -m bench.doctor_eval.constants", argv)
    rows, totals = [], {}
    for label, rev in ((args.before, args.before), ("working tree", None)):
        per = {p: count(s) for p, s in files(rev).items()}
        totals[label] = [sum(v[i] for v in per.values()) for i in range(3)]
        rows += [(label, p, *v) for p, v in sorted(per.items()) if any(v)]
    out.table(["revision", "file", "numeric literals (not 0, 1)", "named constants", "named, no comment beside"], rows)
    for label, (lit, named, bare) in totals.items():
        out.add(f"{label}: {lit} numeric literals, {named} named constants, {bare} of them without a comment beside")
    out.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
