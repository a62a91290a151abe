"""The precision table every run prints and saves: one stated precision per quantity, and per module.

"Use BF16/FP8" does not describe a run (docs/course.md §3): matmul inputs, accumulation, master
weights, gradients, reductions, communication and optimizer state each have their own precision, and
some modules stay in high precision on purpose. run_dir/precision.json is the machine-readable copy,
run_dir/precision.md the one a person reads.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The quantities every recipe must state, in print order.
QUANTITIES = ("matmul inputs", "accumulation", "activations", "master weights", "gradients", "reduction",
              "communication", "optimizer state", "loss scaling")


@dataclass
class ModuleDecision:
    name: str       # qualified module name, e.g. "blocks.1.mlp.experts"
    kind: str       # module class, e.g. "Linear", "GroupedExperts"
    precision: str  # e.g. "fp8 e4m3 (block)", "fp32"
    reason: str


@dataclass
class PrecisionTable:
    recipe: str
    rows: dict[str, str]
    modules: list[ModuleDecision] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        missing = [q for q in QUANTITIES if q not in self.rows]
        if missing:
            raise ValueError(f"precision table of {self.recipe}: no entry for {missing[0]!r}")

    def grouped_modules(self) -> list[tuple[str, str, str, str, int]]:
        """(pattern, kind, precision, reason, count): layer indices folded into `*`, so a 12-layer
        model's table stays as long as a 2-layer one's."""
        groups: dict[tuple[str, str, str, str], int] = {}
        for m in self.modules:
            key = (re.sub(r"\.\d+(?=\.|$)", ".*", m.name), m.kind, m.precision, m.reason)
            groups[key] = groups.get(key, 0) + 1
        return [(*k, n) for k, n in groups.items()]

    def to_markdown(self) -> str:
        lines = [f"precision recipe: {self.recipe}", "", "| quantity | precision |", "|---|---|"]
        lines += [f"| {q} | {self.rows[q]} |" for q in QUANTITIES]
        lines += [f"| {q} | {v} |" for q, v in self.rows.items() if q not in QUANTITIES]
        if self.modules:
            lines += ["", "| modules | kind | precision | why |", "|---|---|---|---|"]
            lines += [f"| {p} ×{n} | {k} | {prec} | {why} |" if n > 1 else f"| {p} | {k} | {prec} | {why} |"
                      for p, k, prec, why, n in self.grouped_modules()]
        lines += [f"NOTE: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"recipe": self.recipe, "rows": dict(self.rows), "modules": [asdict(m) for m in self.modules],
                "notes": list(self.notes)}

    def save(self, run_dir: Path | str) -> None:
        from checkpoint.publish import write_atomic  # a resume rewrites them: never a truncated file
        run_dir = Path(run_dir)
        write_atomic(run_dir / "precision.json", json.dumps(self.to_dict(), indent=1) + "\n")
        write_atomic(run_dir / "precision.md", self.to_markdown() + "\n")
