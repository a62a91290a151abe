"""Everything a fork needs is in the repository: no tracked file points at the course notes or design
notes outside it (they are summarised in docs/course.md and docs/design.md), and every
"docs/course.md §N" / "docs/design.md §N" a file cites exists."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The ways the external notes used to be cited; THIS file names them only inside these patterns.
OUTSIDE = [r"\bDESIGN(\.md| §)", r"shared/course", r"course/00\d_", r"course note \d", r"\bnote 00[04]\b"]


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = [ROOT / f for f in out.splitlines() if Path(f).suffix in (".py", ".md", ".yaml", ".sh", ".toml", ".txt")]
    return [f for f in files if f.exists() and f.name != Path(__file__).name]


def test_no_reference_points_outside_the_repository():
    hits = []
    for f in tracked_text_files():
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if any(re.search(p, line) for p in OUTSIDE):
                hits.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "references outside the repository:\n" + "\n".join(hits)


def test_cited_sections_exist():
    sections = {doc: set(re.findall(r"^## §(\d+)", (ROOT / "docs" / doc).read_text(), re.M))
                for doc in ("course.md", "design.md")}
    assert len(sections["course.md"]) >= 10 and len(sections["design.md"]) >= 6
    bad = []
    for f in tracked_text_files():
        text = f.read_text(encoding="utf-8")
        for doc, sec in re.findall(r"docs/(course|design)\.md\s+§(\d+)", text):
            if sec not in sections[f"{doc}.md"]:
                bad.append(f"{f.relative_to(ROOT)}: docs/{doc}.md §{sec}")
    assert not bad, "cited sections that do not exist:\n" + "\n".join(bad)
