"""events.jsonl: one JSON object per guard action (and per injected fault), the story of an incident.

Kinds written by the guard: trigger, skip, rollback, rollback_failed, anticipatory_on, anticipatory_off,
recovered; by the fault injector: fault; by the loop: interrupted (a signal stopped it at a step boundary). Every event carries `step` (the optimizer step it belongs to)
and `kind`; the rest are the fields docs/design.md §4 lists (trigger metric / value / threshold / cooldown,
rollback checkpoint and data cursor, policy versions and delay, activation duration, recovered steps,
expert-load and loss trajectories).
"""
from __future__ import annotations

import json
from pathlib import Path


class EventLog:
    def __init__(self, run_dir: Path | None, is_main: bool = True):
        # NOTE: rank 0 writes; every rank runs the same guard logic on the same (all-reduced) numbers.
        # NOTE: opened at the first event, so a run that never has one writes no file (and building
        # the log before the run directory exists is fine).
        self.path = Path(run_dir) / "events.jsonl" if (run_dir is not None and is_main) else None
        self.f = None
        self.pending: list[str] = []  # one-line summaries for this step's StepRecord.events

    def emit(self, step: int, kind: str, summary: str, **fields) -> None:
        row = {"step": step, "kind": kind, **fields, "summary": summary}
        if self.path is not None:
            if self.f is None:
                self.f = open(self.path, "a", buffering=1)  # line-buffered: a crash loses one line at most
            try:
                self.f.write(json.dumps(row, default=_json_default, allow_nan=True) + "\n")
            except OSError as e:  # a full disk: the error names the file (a write's own error does not)
                raise OSError(e.errno, e.strerror, str(self.path)) from None
        self.pending.append(f"{kind}: {summary}")

    def pop(self) -> list[str]:
        out, self.pending = self.pending, []
        return out

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def _json_default(x):  # a tensor or array as its values, anything else as its str
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


def read_events(path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
