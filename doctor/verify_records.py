"""Reading the records doctor/verify.py compares: a step's value as the doctor reads it, two StepRecords field by
field, and the loss gap to the exact floor by source over a window."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from doctor.timeline import timeline
from stability.record import read_records


class VerifyError(ValueError):
    """One line: why the diagnosis cannot be verified."""


# the wall clock, and what run control changes (eval: the rebuild stops earlier, and a run evaluates at its last step)
NOT_COMPARED = {"time_s", "tokens_per_s", "memory_mb", "events", "ckpt_id", "resume", "eval"}


def first_record(run_dir: Path, step: int) -> dict:
    for r in read_records(run_dir / "metrics.jsonl"):
        if r["step"] == step:
            return r
    raise VerifyError(f"{run_dir}: no record of step {step}")


def value_in(path: dict[int, dict], rec: dict, at: int, quantity: str, config: dict) -> float | None:
    """The quantity's value in `rec`, read as the doctor reads it, with the run's records before `at` as context."""
    # NOTE: a replayed record is its run's first after a resume; read as the run's own next step (a restart
    # would mark the input histogram cold and hide the input statistics)
    recs = [r for t, r in sorted(path.items()) if t < at] + [{**rec, "resume": None, "events": []}]
    s = timeline(recs[-3:], config).get(quantity)
    return s.values.get(at) if s else None


def record_diff(a: dict, b: dict, only: tuple[str, ...] | None = None) -> str | None:
    """The first field where two StepRecords differ (floats bit for bit), or None."""
    keys = only or sorted((set(a) | set(b)) - NOT_COMPARED)
    for k in keys:
        x, y = a.get(k), b.get(k)
        if json.dumps(x, sort_keys=True, allow_nan=True) != json.dumps(y, sort_keys=True, allow_nan=True):
            return f"{k}: {str(x)[:60]} vs {str(y)[:60]}"
    return None


def without_inputs(rec: dict, keys: tuple[str, ...]) -> dict:
    return {**rec, "inputs": {k: v for k, v in (rec.get("inputs") or {}).items() if k not in keys}} if keys else rec


def gap_by_source(records: list[dict], lo: int, end: int) -> dict[str, tuple[float, int]]:
    """(mean, n) of loss − exact floor per source over steps lo..end, each step's first record (the batch's
    own floor, record v4): the damage a fault left, or a fix did."""
    rows: dict[str, list[float]] = {}
    seen = set()
    for r in records:
        t = r["step"]
        if lo <= t <= end and t not in seen and r.get("floor_by_source"):
            seen.add(t)
            for s, v in (r.get("loss_by_source") or {}).items():
                f = r["floor_by_source"].get(s)
                if f is not None and math.isfinite(v):
                    rows.setdefault(s, []).append(v - f)
    return {s: (statistics.fmean(v), len(v)) for s, v in rows.items() if v}


def noise_by_source(path: dict[int, dict], S: int, window: int) -> dict[str, float]:
    """The per-step spread of the floor gap in the window before the incident, from step-to-step
    differences (/√2), so the slow fall of a learning run does not count as noise."""
    out = {}
    recs = [path[t] for t in sorted(path) if S - window <= t < S and path[t].get("floor_by_source")]
    for s in (recs[-1].get("loss_by_source") or {}) if recs else ():
        g = [r["loss_by_source"][s] - r["floor_by_source"][s] for r in recs if s in r.get("loss_by_source", {})
             and s in r["floor_by_source"]]
        d = [b - a for a, b in zip(g, g[1:])]
        out[s] = statistics.pstdev(d) / math.sqrt(2) if len(d) > 1 else 0.0
    return out


def compare_gaps(after: dict, before: dict, without: dict, noise: dict, window: int, damaged: set[str]
                 ) -> tuple[dict, dict, list[str]]:
    """The fix's window against the run's, source by source ((mean, n) gaps of gap_by_source): (worse — a source
    left above its gap before the incident —, better — a damaged source nearer its floor than without the fix —,
    missing — a damaged source the fix did not bring nearer). Two means of different batches, each with the
    per-step spread / √n; one-sided, at the budget's threshold over the sources (doctor/budget.py). Where sources
    were damaged (a recipe instability) the damage is what the fix is for: the others may end anywhere nearer."""
    from doctor.budget import threshold
    lim = threshold(max(len(after), 1), window, 0.0, 1)

    def apart(s: str, x: tuple, y: tuple) -> float:
        return lim * noise.get(s, 0.0) * math.sqrt(1 / x[1] + 1 / y[1])
    better = {s: (after[s][0], without[s][0]) for s in damaged if s in after and s in without
              and after[s][0] < without[s][0] - apart(s, after[s], without[s])}
    missing = sorted(s for s in damaged if s in without and s not in better)
    worse = {} if damaged else {s: (after[s][0], before[s][0]) for s in after if s in before
                                and after[s][0] > before[s][0] + apart(s, after[s], before[s])}
    return worse, better, missing
