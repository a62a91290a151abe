"""Every code reference in README.md and docs/ resolves: a backticked repository path exists, and a symbol
it names is defined in that file. The forms read, inside backticks:

    `model/moe.py`  `conf/experiment/speedrun.yaml`       a path under one of the repository's folders
    `stability/signals.py:declare`  `tests/test_x.py::test_y`   a path and a symbol (`Class.method` too)
    `stability/signals.py` `declare`                      a path, then a symbol in the next backticks
    `stability.signals.declare`                           a dotted module path and a symbol

A path a command writes (`--out docs/results/x.md`) is an output, not a reference: it need not exist.
A symbol is defined when the file's top level has a def, class, assignment or import of it, a method
of one of its classes (`Class.method` or the bare name), or a registry declaration naming it (the first
string of a top-level call: `declare("below_floor", ...)`, `@fix("...")`). A dotted form that starts with
a config group (`model.qk_norm`, `optim.qk_clip.tau`) is a config key unless it names a module or a
defined symbol; config keys are not code references (tests/test_config.py owns them). Reads files as
text and parses Python with ast: no project module is imported, so the test needs no torch.
"""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}  # folders and root files
EXT = r"(?:py|yaml|md|sh|toml|txt)"
SPAN = re.compile(r"`([^`\n]+)`")
PATH = re.compile(rf"(?<![\w./~-])((?:[\w-]+/)*[\w-]+\.{EXT})(?::{{1,2}}([A-Za-z_][\w.]*))?(?![\w/])")
# the root config's keys (run/config.py Config): a dotted span starting with one may be a config key
GROUPS = {n.target.id for c in ast.parse((ROOT / "run/config.py").read_text(encoding="utf-8")).body
          if isinstance(c, ast.ClassDef) and c.name == "Config" for n in c.body if isinstance(n, ast.AnnAssign)}
DOTTED = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[A-Za-z_]\w*)+)(?:\(\))?$")
OUTPUT = ("--out ", "--out=")  # the option a bench script writes its figures with
SYMBOL = re.compile(r"^([A-Za-z_][\w.]*)(?:\(\))?$")


@cache
def defined(path: Path) -> frozenset[str]:
    """Names defined in a Python file: top-level defs, classes, assignments, imports; `Class.member`."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        calls = [node.value] if isinstance(node, ast.Expr) else getattr(node, "decorator_list", [])
        for call in calls:  # a registry declaration: declare("name", ...), @fix("name")
            if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.Constant) \
                    and isinstance(call.args[0].value, str):
                names.add(call.args[0].value)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.update((f"{node.name}.{sub.name}", sub.name))
                    for t in sub.targets if isinstance(sub, ast.Assign) else [getattr(sub, "target", None)]:
                        if isinstance(t, ast.Name):
                            names.add(f"{node.name}.{t.id}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def module_file(dotted: str) -> Path | None:
    p = ROOT.joinpath(*dotted.split("."))
    for f in (p.with_suffix(".py"), p / "__init__.py"):
        if f.is_file():
            return f
    return None


def check_symbol(path: Path, symbol: str) -> str | None:
    if path.suffix != ".py":
        return None
    names = defined(path)
    # `Class.method.attr` and `obj.attr` forms: the longest prefix that is defined must be a class member
    # or the name itself; `name.attr` on a non-class value is taken as defined by `name`
    parts = symbol.split(".")
    if parts[0] not in names:
        return f"{symbol} is not defined in {path.relative_to(ROOT)}"
    if len(parts) > 1 and parts[0] in {n.split(".")[0] for n in names if "." in n} and \
            ".".join(parts[:2]) not in names:
        return f"{'.'.join(parts[:2])} is not defined in {path.relative_to(ROOT)}"
    return None


def references(text: str):
    """(path, symbol or None, line) for every reference in a markdown text."""
    for n, line in enumerate(text.splitlines(), 1):
        spans = list(SPAN.finditer(line))
        for i, m in enumerate(spans):
            span = m.group(1).strip()
            if "…" in span or "<" in span or "*" in span:
                continue
            found = False
            for pm in PATH.finditer(span):
                path, symbol = pm.group(1), pm.group(2)
                if span[:pm.start()].endswith(OUTPUT):
                    continue  # what the command writes
                if path.split("/")[0] not in TOP or ("/" not in path and not (ROOT / path).is_file()):
                    continue  # not this repository's path (another project's, a bare file name of a folder)
                found = True
                if symbol is None and i + 1 < len(spans) and line[m.end():spans[i + 1].start()].strip() == "":
                    nxt = SYMBOL.match(spans[i + 1].group(1).strip())  # `file.py` `symbol`
                    symbol = nxt.group(1) if nxt and path.endswith(".py") else None
                yield path, symbol, n
            if found:
                continue
            dm = DOTTED.match(span)
            if dm:  # `pkg.module.symbol`: the longest module prefix that is a file of this repository
                parts = dm.group(1).split(".")
                if parts[0] not in TOP or module_file(dm.group(1)):
                    continue  # not this repository's, or a module (`python -m checkpoint.verify`)
                for k in range(len(parts) - 1, 0, -1):
                    f = module_file(".".join(parts[:k]))
                    if f is not None:
                        symbol = ".".join(parts[k:])
                        if parts[0] not in GROUPS or check_symbol(f, symbol) is None:
                            yield str(f.relative_to(ROOT)), symbol, n  # else a config key: not code
                        break


def broken(doc: Path) -> list[str]:
    out = []
    for path, symbol, n in references(doc.read_text(encoding="utf-8")):
        where = f"{doc.relative_to(ROOT)}:{n}"
        f = ROOT / path
        if not f.exists():
            out.append(f"{where}: {path} does not exist")
        elif symbol and (why := check_symbol(f, symbol)):
            out.append(f"{where}: {why}")
    return out


def test_every_code_reference_in_the_docs_resolves():
    bad = [b for doc in DOCS for b in broken(doc)]
    assert not bad, "broken code references:\n" + "\n".join(bad)


def test_the_reader_finds_each_form_and_a_broken_one():
    text = ("`model/moe.py` `MoE`, `stability/signals.py:declare`, `tests/test_docs_references.py::nope`, "
            "`stability.signals.declare`, `model/nope.py`, `conf/experiment/…yaml`, `runs/<run>/x.py`, "
            "`model.qk_norm`, `optim.qk_clip.tau`, `checkpoint.verify`, `nanoGPT/data/x/prepare.py`, "
            "`python -m bench.x --out docs/results/new.md`")
    refs = [(p, s) for p, s, _ in references(text)]
    assert refs == [("model/moe.py", "MoE"), ("stability/signals.py", "declare"),
                    ("tests/test_docs_references.py", "nope"), ("stability/signals.py", "declare"),
                    ("model/nope.py", None)]
    assert check_symbol(ROOT / "stability/signals.py", "declare") is None
    assert check_symbol(ROOT / "stability/signals.py", "below_floor") is None  # declare("below_floor", ...)
    assert check_symbol(ROOT / "model/moe.py", "MoE.forward") is None
    assert check_symbol(ROOT / "model/moe.py", "MoE.nope") is not None
    assert check_symbol(ROOT / "tests/test_docs_references.py", "nope") is not None
