"""The doctor's fault report (docs/course.md §11's deliverable): report.md for people, report.json for
tools and tests, doctor_timeline.png for the eye — all written into the run directory.

report.md sections (SECTIONS), after the natural incidents and the changes a resume declared (when there are
any): the earliest anomaly; the diagnosis (symptom-table row, decision-tree
walk); the reproducible batch with its replay command; state and environment versions; the rejected
hypotheses with their evidence; one single-variable fix; the regression command; the timeline around
the incident. A drill's ground truth, when events.jsonl holds one, is a separate last line that the
diagnosis never read.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from doctor.diagnosis import Diagnosis
from doctor.timeline import LAYERS, Run

SECTIONS = ("Earliest anomaly", "Diagnosis", "Reproducible batch", "State and environment", "Rejected hypotheses",
            "Fix to try", "Regression check", "Timeline")
PLOT = "doctor_timeline.png"


def _f(x, fmt: str = ".4g") -> str:
    return "—" if x is None else (str(x) if isinstance(x, str) else format(x, fmt))


def to_json(run: Run, diag: Diagnosis, devs: dict, state: dict, fix: dict, commands: dict) -> dict:
    a = diag.anomaly
    nearby = sorted((d for d in devs.values() if a is not None and abs(d.step - a.step) <= 1),
                    key=lambda d: (d.step, LAYERS.index(d.layer), d.order))
    return {
        "run": str(run.dir), "class": diag.fault_class, "summary": diag.summary,
        "earliest": None if a is None else {
            "step": a.step, "layer": diag.layer or a.layer, "quantity_layer": a.layer, "quantity": a.quantity,
            "kind": a.kind, "model_layer": diag.model_layer,
            "rank": diag.rank, "value": _num(a.value), "baseline": _num(a.baseline), "z": _num(a.z)},
        "nearby": [{"step": d.step, "layer": d.layer, "quantity": d.quantity, "value": _num(d.value)} for d in nearby],
        "symptom": list(diag.symptom) if diag.symptom else None,
        "tree": [{"node": n, "finding": f} for n, f in diag.tree],
        "confirmed": [vars(c) for c in diag.confirmed], "rejected": [vars(c) for c in diag.rejected],
        "untestable": [vars(c) for c in diag.untestable],
        "batch": diag.batch, "state": state, "fix": fix, "commands": commands,
        "segment": diag.seg_index,
        "judgement": diag.judgement.verdict if diag.judgement else None, "lever": diag.lever,
        "incidents": [{"step": i.step, "class": i.fault_class, "quantity": i.anomaly.quantity if i.anomaly else None,
                       "kind": i.anomaly.kind if i.anomaly else None,
                       "layer": (i.layer or i.anomaly.layer) if i.anomaly else None, "model_layer": i.model_layer,
                       "segment": i.seg_index, "summary": i.summary, "judgement": i.judgement.verdict,
                       "reason": i.judgement.reason, "evidence": _plain(i.judgement.evidence)}
                      for i in (diag.incidents or [])],
        "environment": diag.environment, "notes": list(run.notes), "declared": run.declared,
        "ground_truth": ground_truth(run),
    }


def _plain(x):
    """JSON-safe evidence: non-finite floats as strings, as everywhere in report.json."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return _num(x) if isinstance(x, float) else x


def _num(x):
    return None if x is None else (x if math.isfinite(x) else str(x))


def ground_truth(run: Run) -> str | None:
    if not run.truth:
        return None
    f = run.truth[0]
    extra = ", ".join(f"{k}={v}" for k, v in f.items() if k not in ("step", "kind", "fault", "summary"))
    return f"fault={f.get('fault')} at step {f.get('step')}" + (f" ({extra})" if extra else "")


def runs_of(incidents: list[dict]) -> list[tuple[dict, str]]:
    """Each run of consecutive incidents alike (judgement, class, quantity, segment) as (its first, where: "step S" or
    "N steps, S1 to Sn"): a fault that persists is one line of the report, not one per step it lasted."""
    def alike(i: dict) -> tuple:
        return i["judgement"], i["class"], i["quantity"], i["segment"]
    out: list[tuple[dict, list[int]]] = []
    for i in incidents:
        if out and alike(out[-1][0]) == alike(i):
            out[-1][1].append(i["step"])
        else:
            out.append((i, [i["step"]]))
    return [(first, f"step {steps[0]}" if len(steps) == 1 else f"{len(steps)} steps, {steps[0]} to {steps[-1]}")
            for first, steps in out]


def render(run: Run, diag: Diagnosis, report: dict) -> str:
    a, st, fix, cmd = diag.anomaly, report["state"], report["fix"], report["commands"]
    incs = report["incidents"]
    faults = [i for i in incs if i["judgement"] != "natural"]
    natural = [i for i in incs if i["judgement"] == "natural"]
    unstable = diag.judgement is not None and diag.judgement.verdict == "instability"
    verdict = (f"**Verdict: recipe instability** — at step {diag.step}" if a is not None and unstable else
               f"**Verdict: fault** — {diag.fault_class} at step {diag.step}" if a is not None else
               f"**Verdict: {diag.fault_class}**" + (" — no fault" if diag.fault_class == "healthy" else ""))
    out = [f"# Doctor report: {run.dir.name}", "", verdict, "", f"{diag.summary}", ""]
    if a is not None and diag.judgement is not None:
        out += [f"Judged {'a recipe instability' if unstable else 'a fault'}: {diag.judgement.reason}.", ""]
        if unstable and diag.lever:
            out += [f"Lever (from the evidence): {diag.lever.get('means')} — `{diag.lever.get('override')}`: "
                    f"{diag.lever.get('why')}.", ""]
    if run.notes:
        out += [f"> {n}" for n in run.notes] + [""]
    if run.declared:  # NOTE: changes the run was told of: each segment is judged against its own settings
        out += ["## Declared changes", ""] + [f"- {c}" for c in run.declared] + [""]
    if natural:
        out += ["## Natural incidents (the run's own behaviour, not faults)", ""]
        out += [f"- {at} (segment {i['segment']}): {i['class']} — `{i['quantity']}`: {i['reason']}"
                for i, at in runs_of(natural)] + [""]
    if len(faults) > 1:
        out += ["## Faults and recipe instabilities (execution order)", ""]
        out += [f"{k}. {at} (segment {i['segment']}): **{i['class']}** — `{i['quantity']}`: {i['reason']}"
                + (" (the first of them)" if "steps" in at else "") for k, (i, at) in enumerate(runs_of(faults), 1)]
        out += ["", "The sections below are about the first.", ""]
    if diag.environment:
        out += [f"Environment: {diag.environment}", ""]
    out += ["## Earliest anomaly", ""]
    if a is None:
        out += ["No incident was judged a fault (the natural ones are listed above)." if natural else
                "No quantity of the timeline left its baseline (the false-alarm budget's thresholds)."]
    else:
        e = report["earliest"]
        out += [f"- step **{a.step}**, timeline layer **{diag.layer or a.layer}**, quantity `{a.quantity}`"
                + (f" (a {a.layer}-layer quantity: {diag.layer} is inferred)" if diag.layer and diag.layer != a.layer else ""),
                f"- model layer: {_f(e['model_layer'])}; rank: {_f(diag.rank)}",
                f"- {a.describe()}", "- deviating within ±1 step (timeline order): "
                + (", ".join(f"`{d['quantity']}`@{d['step']}" for d in report["nearby"][:12]) or "none")]
    out += ["", "## Diagnosis", ""]
    if diag.symptom:
        s = diag.symptom
        out += [f"Symptom-table row: **{s[0]}** — check first: {s[1]}; easily mistaken for: {s[2]}.", ""]
    out += ["Decision tree (docs/course.md §5):", ""]
    out += [f"{i}. *{node}*: {finding}" for i, (node, finding) in enumerate(diag.tree, 1)]
    out += ["", "Confirmed:", ""] + [f"- **{c.name}** — {c.evidence}" for c in diag.confirmed or []]
    if not diag.confirmed:
        out += ["- nothing: every check was rejected (see below)"]
    out += ["", "## Reproducible batch", ""]
    if diag.batch:
        b = diag.batch
        rec = next(r for r in run.paths[diag.seg_index] if r["step"] == b["step"])
        out += [f"- step {b['step']}: global sample ids [{b['first']}, {b['first'] + b['size']}) of the train split "
                f"(rank r of {rec.get('world', 1)} holds the r-th contiguous share)",
                f"- documents by source {rec.get('source_mix')}, {rec.get('valid_tokens')} valid tokens, "
                f"inputs {json.dumps(rec.get('inputs', {}))}",
                f"- state: {st['replay_checkpoint_note']}"]
        out += [f"- replay: `{cmd['replay']}`", f"- high precision: `{cmd['replay_fp64']}`"] if cmd["replay"] else []
    else:
        out += ["- no anomalous step: nothing to replay"]
    out += ["", "## State and environment", "", "| item | value |", "|---|---|"]
    out += [f"| {k.replace('_', ' ')} | {_f(v)} |" for k, v in st.items() if k != "replay_checkpoint_note"]
    out += ["", "## Rejected hypotheses", ""]
    out += [f"- **{c.name}** — {c.evidence}" for c in diag.rejected] or ["- none"]
    out += [f"- *not testable*: **{c.name}** — {c.evidence}" for c in diag.untestable]
    if fix is None:
        out += ["", "## Fix to try (one variable)", "", "- none: no incident was judged a fault"]
    else:
        out += ["", "## Fix to try (one variable)", "", f"- variable: {fix['variable']}", f"- change: {fix['change']}",
                f"- override: `{fix['override']}`" if fix.get("override") else
                "- override: none (no single config override tests this fix)"]
        out += (["", "## Regression check", "", "```", cmd["regression"], "```", "", f"Expect: {fix['expect']}"]
                if cmd["regression"] else ["", "## Regression check", "", "- none: the run recorded no command line "
                                           "(environment.json argv) to repeat"])
    if report.get("verified") is not None:
        out += ["", "## Verified", "", *verified_lines(report["verified"], md=True)]
    out += ["", "## Timeline", "", *timeline_table(run, diag), "", f"![timeline]({PLOT})"]
    guard = [e for e in run.events if diag.step is None or abs(e["step"] - diag.step) <= 3][:8]
    if guard:
        out += ["", "Guard actions near the incident (events.jsonl):", ""]
        out += [f"- step {e['step']} {e['kind']}: {e.get('summary', '')}" for e in guard]
    if report["ground_truth"]:
        out += ["", "---", "", f"Ground truth for this drill (events.jsonl `fault`; not read by the diagnosis): "
                f"{report['ground_truth']}"]
    return "\n".join(out) + "\n"


def verified_lines(v: dict, md: bool = False) -> list[str]:
    """The proof (doctor/verify.py) in words: attribution, the two counterfactuals, the fix, the commands."""
    if v["status"] != "verified":
        return [f"verify: {v['status']}: {v['why']}"]
    a, f = v["attribution"], v["fix"]
    what = ("the natural incident" if v["judgement"] == "natural" else
            "the recipe instability" if v["judgement"] == "instability" else v["class"])
    out = [f"verify: {what} at step {v['step']} ({v['quantity']}), rebuilt from {a['rebuilt']['from']} "
           f"(steps {a['rebuilt']['steps'][0]}..{a['rebuilt']['steps'][1]}: {a['rebuilt']['records_equal']} records "
           f"equal to the run's, bit for bit)",
           f"verify: attribution: {a['verdict']}; {a['fp64']}"]
    for c in v["counterfactuals"]:
        share = "—" if c["deviation_share"] is None else f"{round(100 * c['deviation_share']) + 0} %"
        out.append(f"verify: counterfactual, {c['tests']}: {c['verdict']} ({v['quantity']} {_f(c['value'])} vs logged "
                   f"{_f(c['logged'])}, baseline {_f(c['baseline'])}: {share} of the deviation left)")
    if not v["counterfactuals"]:
        out.append(f"verify: counterfactuals: none run ({f.get('counterfactuals', f['why'])})")
    if f["ran"]:
        out.append(f"verify: fix `{' '.join(f['overrides'])}` over steps {f['window'][0]}..{f['window'][1]} (from "
                   f"{f.get('from', 'the state before the incident')}): {f['verdict']}")
        g = f["floor_gap"]
        out.append("verify: loss − exact floor by source (nats): " + "; ".join(
            f"{s} {g['fix'][s]:.3f} with the fix, {_f(g['before'].get(s))} before the incident, "
            f"{_f(g['without_fix'].get(s))} without the fix" for s in g["fix"]))
    else:
        out.append(f"verify: fix: {f['why']}")
    out.append(f"verify: {v['replayed_steps']} steps replayed in {len(v['runs'])} runs "
               f"({sum(r['seconds'] for r in v['runs']):.0f} s; budget {v['budget']})")
    if md:
        out = [f"- {x.removeprefix('verify: ')}" for x in out]
        out += ["", "Each run (under verify/ in the run directory):", "", "```"]
        out += [r["command"] for r in v["runs"]] + ["```"]
    return out


def timeline_table(run: Run, diag: Diagnosis) -> list[str]:
    seg = run.paths[diag.seg_index]
    t0 = diag.step if diag.step is not None else seg[-1]["step"]
    rows = [r for r in seg if t0 - 4 <= r["step"] <= t0 + 2]  # a few steps either side: what a reader scans
    out = ["| step | input: label align / top token / doc start | forward: loss "
           "| backward/update: lr / grad norm / ρ max | system: replica spread / tokens/s |", "|---|---|---|---|---|"]
    for r in rows:
        i, rep = r.get("inputs", {}), r.get("replica", {})
        mark = " ◀" if r["step"] == diag.step else ""
        out.append(f"| {r['step']}{mark} | {_f(i.get('label_alignment'), '.3f')} / "
                   f"{_f(i.get('top_token_frac'), '.3f')} / "
                   f"{_f(i.get('doc_start_frac'), '.2f')} | {_f(r['loss'])} | {_f(r['lr'], '.3g')} / "
                   f"{_f(r['grad_norm'], '.3g')} / {_f(r.get('update_ratio_max'), '.3g')} | "
                   f"{_f(max(rep.values()) if rep else None, '.3g')} / {_f(r.get('tokens_per_s'), '.0f')} |")
    return out


def plot(run: Run, diag: Diagnosis, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # NOTE: headless
    import matplotlib.pyplot as plt
    recs = run.paths[diag.seg_index]
    t = [r["step"] for r in recs]
    fig, axes = plt.subplots(4, 1, figsize=(8, 9), sharex=True)  # NOTE: layout only (one panel per timeline layer)
    panels = [("input", [(k, [r.get("inputs", {}).get(k) for r in recs]) for k in
                         ("label_alignment", "top_token_frac", "doc_start_frac", "valid_frac")], False),
              ("forward", [("loss", [r["loss"] for r in recs])] + [
                  (f"loss {s}", [r.get("loss_by_source", {}).get(s) for r in recs])
                  for s in recs[0].get("loss_by_source", {})], False),
              ("backward/update", [("grad norm", [r["grad_norm"] for r in recs]),
                                   ("ρ max", [r.get("update_ratio_max") for r in recs])], True),
              ("system", [("tokens/s", [r.get("tokens_per_s") for r in recs])], False)]
    for ax, (name, lines, logy) in zip(axes, panels):
        for label, ys in lines:
            ax.plot(t, [math.nan if y is None else y for y in ys], lw=0.9, label=label)
        if logy:
            ax.set_yscale("log")
        if diag.step is not None:
            ax.axvline(diag.step, color="r", ls="--", lw=1)
        ax.set_ylabel(name)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
    axes[0].set_title(f"{run.dir.name}: {diag.fault_class}" + (f" (step {diag.step})" if diag.step else ""))
    axes[-1].set_xlabel(f"optimizer step (segment {diag.seg_index} of the execution order)")
    fig.subplots_adjust(left=0.1, right=0.98, top=0.95, bottom=0.06, hspace=0.08)  # NOTE: fixed margins: tight_layout measures every text artist
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(run: Run, diag: Diagnosis, report: dict, plots: bool = True) -> None:
    (run.dir / "report.json").write_text(json.dumps(report, indent=1, allow_nan=True))
    (run.dir / "report.md").write_text(render(run, diag, report))
    if plots:
        plot(run, diag, run.dir / PLOT)
