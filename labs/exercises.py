"""The exercises of docs/exercises.md, parsed: `python -m labs.run --list --exercises` prints them by
course section, and tests/test_exercises.py runs their commands (a sample by default, all with -m sweep).

docs/exercises.md is the one source: a `## §N title` line opens a section, `### EK. title` an exercise,
and its `- run:`, `- expect:` (present | absent: the lab's exit 0 or 1), `- observe:`, `- questions:`
items follow (an item may continue on indented lines).
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "exercises.md"


@dataclass
class Exercise:
    id: str
    title: str
    section: str
    command: str = ""
    expect: str = ""
    items: dict[str, str] = field(default_factory=dict)

    def argv(self) -> list[str]:
        """The labs.run arguments of the command (it must be `python -m labs.run ...`)."""
        words = shlex.split(self.command)
        if words[:3] != ["python", "-m", "labs.run"]:
            raise ValueError(f"{self.id}: command {self.command!r} is not `python -m labs.run ...`")
        return words[3:]


def load(path: Path = DOC) -> list[Exercise]:
    out, section, key = [], "", None
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section, key = line[3:].strip(), None
        elif m := re.match(r"### (E\d+)\. (.+)", line):
            out.append(Exercise(m[1], m[2].strip(), section))
            key = None
        elif out and (m := re.match(r"- (\w+): (.*)", line)):
            key = m[1]
            out[-1].items[key] = m[2].strip()
        elif out and key and line.startswith("  ") and line.strip():
            out[-1].items[key] += " " + line.strip()
        else:
            key = None
    for ex in out:
        ex.command = ex.items.get("run", "").strip("`")
        ex.expect = ex.items.get("expect", "")
        if not ex.command or ex.expect not in ("present", "absent"):
            raise ValueError(f"{path.name}: {ex.id} needs `- run:` and `- expect: present|absent`")
    return out


def format_exercises() -> str:
    lines, section = [], None
    for ex in load():
        if ex.section != section:
            section = ex.section
            lines += ["", section]
        lines.append(f"  {ex.id:<4} {ex.title}")
        lines.append(f"       $ {ex.command}   (expect: effect {ex.expect})")
        for key in ("observe", "questions"):
            if key in ex.items:
                lines.append(f"       {key}: {ex.items[key]}")
    lines += ["", f"answers: {DOC.with_name('exercises_answers.md').relative_to(DOC.parents[1])}"]
    return "\n".join(lines).lstrip("\n")
