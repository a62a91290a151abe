"""The run's checkpoints as the doctor reads them: where they are, and the newest complete one before a step.

NOTE: the checkpoint package (torch.distributed.checkpoint) is imported only when the run has a checkpoint
directory: a run without checkpoints is diagnosed from its JSON files alone.
"""
from __future__ import annotations

from pathlib import Path


def root(run_dir: Path, config: dict) -> Path:
    d = (config.get("checkpoint") or {}).get("dir")
    return Path(d) if d else Path(run_dir) / "checkpoints"


def complete(run_dir: Path, config: dict) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint (its marker written; no hashing: the replay verifies what it
    loads), oldest first."""
    r = root(run_dir, config)
    if not r.is_dir():
        return []
    from checkpoint import publish
    return [(s, p) for s, p in publish.list_steps(r) if publish.check(p, verify_hashes=False) is None]


def before(run_dir: Path, config: dict, step: int | None, inclusive: bool = False) -> tuple[int, Path] | None:
    """The newest complete checkpoint saved before `step` (at or before, when inclusive): its parameters fed a
    later forward."""
    if step is None:
        return None
    found = [(s, p) for s, p in complete(run_dir, config) if s < step or (inclusive and s == step)]
    return found[-1] if found else None
