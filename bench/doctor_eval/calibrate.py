"""The doctor's thresholds against clean runs: the largest statistic each test reached, and the false alarms.

    python -m bench.doctor_eval.calibrate DIR [DIR ...]      # run directories, or folders of them (clean_seed*)

For every clean run (no fault planted) and every quantity of its timeline, the largest value each test
(doctor/timeline.py scores: point, sustained, change, guard) reached over the scored steps, leaving out the
steps within ±1 of a trigger of the run's own online guard (a natural incident the guard fired on too: the
doctor must report those). Then the doctor itself on each run: every incident that is not within ±1 step of
a guard trigger is a false alarm. Prints the top statistics per test beside its threshold, the false alarms,
and the alarm rate per 1000 scored steps.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from doctor.rules import diagnose
from doctor.scores import guard_test, scores, support, thresholds
from doctor.timeline import CHANGE_LAYER, SUSTAINED, THRESHOLD, load_run, scoring_start, timeline


def run_dirs(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += [p] if (p / "metrics.jsonl").is_file() else sorted(q.parent for q in p.glob("*/metrics.jsonl"))
    return out


def maxima(d: Path) -> tuple[list[tuple], int, list[int]]:
    """[(z, kind, quantity, step)] per quantity and test, scored steps, guard trigger steps."""
    run = load_run(d)
    gt, start = guard_test(run.config), scoring_start(run.config)
    trig = [r["step"] for r in run.records if (r.get("guard") or {}).get("triggers")]
    out, n = [], 0
    for k, path in enumerate(run.paths):
        since = start if k == 0 else run.segments[k][0]["step"]
        n += sum(1 for r in run.segments[k] if r["step"] >= since)
        tl = timeline(path, run.config)
        for q, s in tl.items():
            if s.spec.exact is not None or not s.values:
                continue
            sc, back = scores(s, gt, q), support(tl, s, since, THRESHOLD, SUSTAINED, gt, None)
            ok = (sc.steps[:sc.nf] >= since) & ~np.isin(sc.steps[:sc.nf], [t + j for t in trig for j in (-1, 0, 1)])
            for kind, z in sc.z.items():
                if back is not None:  # Spec.needs: only where the run-level quantity moved too can it count
                    z = np.where(back[:len(z)], z, -np.inf)
                zz = np.where(ok[:len(z)], z, -np.inf)
                if np.isfinite(zz).any() and zz.max() > -np.inf:
                    i = int(np.argmax(zz))
                    out.append((float(zz[i]), kind, q, int(sc.steps[i])))
    return out, n, trig


def main(argv=None) -> int:
    dirs = run_dirs(argv if argv is not None else sys.argv[1:])
    if not dirs:
        print("bench.doctor_eval.calibrate: no run directory (a folder holding metrics.jsonl) under the arguments",
              file=sys.stderr)
        return 2
    limits = thresholds(guard_test(load_run(dirs[0]).config))
    allz, steps, alarms = [], 0, []
    for d in dirs:
        z, n, trig = maxima(d)
        allz += [(v, k, q, t, d.name) for v, k, q, t in z]
        steps += n
        _, diag, _ = diagnose(d)
        for inc in diag.incidents or []:
            if not any(abs(inc.step - t) <= 1 for t in trig):
                alarms.append((d.name, inc.fault_class, inc.step, inc.anomaly.quantity, inc.anomaly.kind,
                               round(inc.anomaly.z, 1)))
    print(f"{len(dirs)} clean runs, {steps} scored steps")
    for kind, limit in limits.items():
        top = sorted((x for x in allz if x[1] == kind), reverse=True)[:3]
        per_layer = f" ({CHANGE_LAYER:g} per layer)" if kind == "change" else ""
        print(f"{kind:9s} threshold {limit:5.1f}{per_layer}; clean maxima: "
              + "; ".join(f"{v:.1f} {q} @{t} ({run})" for v, _, q, t, run in top))
    runs = len({a[0] for a in alarms})
    print(f"false alarms (incidents no guard trigger within ±1 step): {len(alarms)} in {runs} of {len(dirs)} runs, "
          f"{1000 * len(alarms) / max(steps, 1):.2f} per 1000 scored steps")
    for a in alarms:
        print("  ", *a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
