"""Exact invariants a healthy run holds, and the per-step system time, read from the records.

    continuity(run)      -> [(record index, Deviation)]   sample ids consumed once and in order, steps and
                                                          tokens monotone, per-rank ids on the sharding,
                                                          a replayed batch holding the same content, and
                                                          no content read again under other ids
    system_change(recs)  -> (Deviation | None, note | None)  a component's share of the step grew (run-
                                                          caused), or every component slowed in proportion
                                                          (machine-wide: environmental, not the run's fault)

Continuity rules (data/loader.py: step t reads global ids [first, first + size), rank r the r-th
contiguous share): a record's first id is its predecessor's first + size, the predecessor being the
latest earlier record of step t − 1 (so a rollback's replay and a resume continue from the step they
restart at). Explained departures: a rollback with guard.rollback.data=skip — or one whose event says it skipped
the window (the same batch triggered again on replay) — moves the cursor forward; a batch ID listed in
train.skip_batches is never served (quarantined data).
A step that goes back needs a rollback (the previous record says so) or a resume (this record says so).
"""
from __future__ import annotations

import math
import statistics

import numpy as np

from doctor.timeline import BACKWARD, FORWARD, INPUT, SYSTEM, Deviation, Run

COMPONENTS = ("data", "fwd_bwd", "optim")  # NOTE: ckpt and log_eval are periodic by design: left out
# NOTE: wall-clock effect sizes, not statistics (a slow step changes no number of the model's): on a shared
# machine a process gets its core or shares it, so a component's time doubles when another process wakes up
# beside it; a run-caused slowdown is one beyond that sharing, and persistent.
SLOW = 3.0          # a component this many times its baseline (median of the K_SYS steps from t): past the ×2 of
                    # sharing a core, by half again ...
SLOW_MIN = 2.0      # ... and every one of those steps at least ×2, the sharing itself: a slowdown that persists
                    # (a busy machine preempts a short component now and then: spikes, not a floor)
SHARE_MOVE = 0.1    # ... and its share of the step up by a tenth: the step's other components did not slow with it
K_SYS = 8           # steps the slowdown must persist: longer than a burst of preemption (a few scheduler slices of
                    # a step each), short enough to name the step it began
ENV_SLOW = 1.5      # the whole step this many times slower, shares unchanged: machine-wide (half again: a second
                    # process on one of two cores); and a slow component's growth is this many times the others'
MIN_ROWS = 10       # timed steps before a slowdown is looked for: the baseline median's own (a tenth of a step's
                    # spread at worst)


def _inv(q: str, step: int, value: float, expected: float | None, layer: str = INPUT,
         cls: str = "data.continuity") -> Deviation:
    """An invariant's deviation, with the class it declares (doctor/classes.py)."""
    return Deviation(q, layer, -1, step, float(value), None if expected is None else float(expected), math.inf,
                     None, "invariant", cls)


def resumed(rec: dict) -> bool:
    return bool(rec.get("resume")) or any(str(e).startswith("resumed from") for e in rec.get("events", []))


def continuity(run: Run) -> list[tuple[int, Deviation]]:
    out: list[tuple[int, Deviation]] = []
    recs = run.records
    skip = ((run.config.get("guard") or {}).get("rollback") or {}).get("data") == "skip"
    quarantine = set((run.config.get("train") or {}).get("skip_batches") or ())  # declared: never served
    last_at: dict[int, int] = {}        # step -> index of its latest record so far
    content: dict[int, list] = {}       # first sample id -> per-rank hashes first seen
    owner: dict[tuple, tuple] = {}      # (rank, content hash) -> (first sample id, step) first seen with it
    for i, r in enumerate(recs):
        t, b = r["step"], r.get("batch") or {}
        if i and t <= recs[i - 1]["step"] and not (recs[i - 1].get("guard", {}).get("rollback") or resumed(r)):
            out.append((i, _inv("continuity.step", t, t, recs[i - 1]["step"] + 1)))
        elif i and t > recs[i - 1]["step"] + 1 and not resumed(r):
            out.append((i, _inv("continuity.step", t, t, recs[i - 1]["step"] + 1)))
        p = last_at.get(t - 1)
        if p is not None and "first" in b and "first" in (recs[p].get("batch") or {}):
            pb = recs[p]["batch"]
            expect = pb["first"] + pb["size"]
            while expect in quarantine:
                expect += pb["size"]
            after_rollback = i and recs[i - 1].get("guard", {}).get("rollback")
            # NOTE: under guard.rollback.data=replay the guard skips the window itself when the same batch triggers
            # again on replay (stability/guard.py), and says so in the rollback's own event
            skipped = any(str(e).startswith("rollback:") and "data skip" in str(e) for e in r.get("events", []))
            if b["first"] != expect and not ((skip and after_rollback or skipped) and b["first"] > expect):
                out.append((i, _inv("continuity.sample_ids", t, b["first"], expect)))
            if "valid_tokens" in r and r["tokens"] != recs[p]["tokens"] + r["valid_tokens"]:
                out.append((i, _inv("continuity.tokens", t, r["tokens"], recs[p]["tokens"] + r["valid_tokens"])))
        rk = r.get("ranks") or {}
        if rk.get("first") and "first" in b:
            world = len(rk["first"])
            share = b["size"] // world
            off = [f - (b["first"] + k * share) for k, f in enumerate(rk["first"])]
            n_off = [n != share for n in rk.get("n", [share] * world)]
            if any(off) or any(n_off):
                # every rank off by the same amount: the cursor served other ids than it recorded (a
                # data-order fault); one rank off: that rank's inputs (a rank fault)
                if world > 1 and len(set(off)) > 1 or any(n_off):
                    k = next(k for k in range(world) if off[k] or n_off[k])
                    d = _inv("ranks.sharding", t, rk["first"][k], b["first"] + k * share, cls="rank.data")
                    d.layer_name = f"rank {k}"
                else:
                    d = _inv("continuity.sample_ids", t, rk["first"][0], b["first"])
                    d.layer_name = "ids read vs the cursor"
                out.append((i, d))
            h = rk.get("hash")
            if h:
                seen = content.setdefault(b["first"], h)
                if seen != h:
                    out.append((i, _inv("continuity.batch_content", t, b["first"], b["first"])))
                # NOTE: content is a function of the sample ids: one rank's batch equal to a batch it read
                # under other ids is a stream that repeats (a replay after a rollback has the same ids)
                for k, hk in enumerate(h):
                    was = owner.setdefault((k, hk), (b["first"], t))
                    if was[0] != b["first"]:
                        d = _inv("continuity.repeated_content", t, b["first"], was[0], cls="data.repeated_batch")
                        d.layer_name = f"rank {k}: the content of step {was[1]} (sample ids from {was[0]})"
                        out.append((i, d))
                        break
        prev = recs[i - 1].get("fingerprint") if i else None
        if prev and r.get("fingerprint"):
            out += [(i, d) for d in fingerprint_change(prev, r)]
        last_at[t] = i
    return out


# the timeline layer a config group's change acts in first
GROUP_LAYER = {"data": INPUT, "seed": INPUT, "model": FORWARD, "precision": FORWARD, "optim": BACKWARD,
               "train": BACKWARD}


def fingerprint_change(prev: dict, rec: dict) -> list[Deviation]:
    """Config and data fingerprints equal to the previous record's, unless declared: a resume names an
    accepted change in its events (resume.allow_config_change lists the key, resume.allow_data_change).
    NOTE: the data manifest may also change mid-run (a mixture switch): that is the guard's
    input.data_fingerprint trigger, judged as an objective change, not here."""
    fp, out = rec["fingerprint"], []
    notes = [str(e) for e in rec.get("events", [])]
    for g in sorted(set(fp) | set(prev)):
        if fp.get(g) == prev.get(g) or (g == "data" and not resumed(rec)):
            continue
        if g == "data":
            ok = any(n.startswith("resume: data changed") for n in notes)
        else:
            ok = any(n.startswith("resume: config changed") and (f": {g}." in n or f": {g}=" in n) for n in notes)
        if not ok:
            d = _inv(f"fingerprint/{g}", rec["step"], 1.0, 0.0, GROUP_LAYER.get(g, BACKWARD), "state.config_change")
            d.layer_name = (f"{g}: fingerprint {prev.get(g)} -> {fp.get(g)}"
                            + (" at a resume that did not declare it" if resumed(rec) else ""))
            out.append(d)
    return out


def system_change(recs: list[dict], start: int, window: int) -> tuple[Deviation | None, str | None]:
    """The first step from which one component's time grew ≥ SLOW× and its share of the step by ≥
    SHARE_MOVE (the other components did not grow as much): a run-caused slowdown, with its step and
    component. Otherwise, a whole step ≥ ENV_SLOW× slower with every share unchanged, or with process
    CPU time per step unchanged, is the machine's (environmental) and returned as a note."""
    rows = [(r["step"], [float((r.get("time_s") or {}).get(c, math.nan)) for c in COMPONENTS],
             (r.get("time_s") or {}).get("cpu")) for r in recs]
    rows = [x for x in rows if all(math.isfinite(v) and v >= 0 for v in x[1]) and sum(x[1]) > 0]
    if len(rows) < 2 * K_SYS + MIN_ROWS:
        return None, None
    steps = np.array([x[0] for x in rows])
    tm = np.array([x[1] for x in rows])                       # (n, C) seconds per component
    share = tm / tm.sum(axis=1, keepdims=True)
    n, C = tm.shape
    # NOTE: vectorised: base = median of the `window` steps before i (fewer at the start, never < MIN_ROWS),
    # ahead = median of the K_SYS steps from i
    pad = np.concatenate([np.full((window, C), np.nan), tm])
    pads = np.concatenate([np.full((window, C), np.nan), share])
    idx = np.arange(MIN_ROWS, n - K_SYS + 1)
    base = np.nanmedian(np.lib.stride_tricks.sliding_window_view(pad, window, axis=0)[idx], axis=2)
    s0 = np.nanmedian(np.lib.stride_tricks.sliding_window_view(pads, window, axis=0)[idx], axis=2)
    fwd = np.lib.stride_tricks.sliding_window_view(tm, K_SYS, axis=0)[idx]
    ahead, floor = np.median(fwd, axis=2), np.min(fwd, axis=2)
    s1 = np.median(np.lib.stride_tricks.sliding_window_view(share, K_SYS, axis=0)[idx], axis=2)
    growth = ahead / np.maximum(base, 1e-12)                   # (m, C)
    for c in range(C):
        others = np.delete(growth, c, axis=1)
        hit = ((steps[idx] >= start) & (base[:, c] > 0) & (growth[:, c] >= SLOW) & (tm[idx, c] >= SLOW * base[:, c])
               & (floor[:, c] >= SLOW_MIN * base[:, c])
               & (s1[:, c] - s0[:, c] >= SHARE_MOVE) & (others < growth[:, c:c + 1] / ENV_SLOW).all(axis=1))
        if hit.any():
            j = int(np.argmax(hit))
            i, g = int(idx[j]), others[j]
            d = Deviation(f"system.time/{COMPONENTS[c]}", SYSTEM, c, int(steps[i]), float(tm[i, c]), float(base[j, c]),
                          float(growth[j, c]), COMPONENTS[c], "invariant", "system.slow_component")
            return d, (f"{COMPONENTS[c]} time {base[j, c] * 1e3:.3g} -> {ahead[j, c] * 1e3:.3g} ms per step from step "
                       f"{steps[i]} (share of the step {s0[j, c]:.2f} -> {s1[j, c]:.2f}; the other components ×"
                       + ", ×".join(f"{x:.2f}" for x in g) + ")")
    k = len(rows) // 3
    a, z = rows[:k], rows[-k:]
    ta, tz = statistics.median(sum(x[1]) for x in a), statistics.median(sum(x[1]) for x in z)
    if tz < ENV_SLOW * ta:
        return None, None
    sa, sz = np.median(share[:k], axis=0), np.median(share[-k:], axis=0)
    cpu = [x[2] for x in rows if x[2] is not None]
    cpu_note = ""
    if len(cpu) == len(rows):
        ca, cz = statistics.median(cpu[:k]), statistics.median(cpu[-k:])
        cpu_note = f"; process CPU time per step {ca * 1e3:.3g} -> {cz * 1e3:.3g} ms"
    return None, (f"environmental: the step took {ta * 1e3:.3g} -> {tz * 1e3:.3g} ms (first vs last third, ×"
                  f"{tz / ta:.2f}) with every component slower in proportion (shares "
                  + ", ".join(f"{n} {p:.2f}->{q:.2f}" for n, p, q in zip(COMPONENTS, sa, sz))
                  + f"){cpu_note}: the machine got slower, not the run")
