""""The objective changed" vs "the optimisation broke", told apart from per-source telemetry alone.

The data are two known-entropy Markov sources (data/synthetic.py), so every source has an exact loss
floor. The same seed trains three times; at step S
  (a) nothing happens (the reference),
  (b) the mixture moves from 0.5/0.5 to 0.1/0.9 towards the harder source,
  (c) an optimisation fault hits (lr × 30 for 5 steps, or Adam's second moments zeroed).
In (b) and (c) the total train loss both jump up. Only the per-source view separates them: in (b)
each source's loss stays on its trajectory and the *floor of the mixture* (Σ_s share_s · floor_s)
moved; in (c) the per-source losses rise away from their floors.

classify() decides from StepRecord-shaped telemetry (loss_by_source, tokens_by_source per step) and the
floors, never from knowing which run is which; the doctor can reuse window / spread / classify on
runs/<run>/metrics.jsonl.
"""
from __future__ import annotations

import dataclasses
import math

from labs.common import single_thread, train_small
from model import ModelConfig
from precision.config import PrecisionConfig

TITLE = "mixture: 'the objective changed' vs 'the optimisation broke', from per-source loss vs floor"
HEALTHY, OBJECTIVE, BROKE = "healthy", "objective changed", "optimisation broke"
K = 5.0            # a change counts when it exceeds K standard errors of the reference's noise
NEW_WEIGHTS = (0.1, 0.9)
LR_MULT, FAULT_STEPS = 30.0, 5
MODEL = ModelConfig(d_model=64, n_layers=2, n_heads=4)
DATA = {"kind": "synthetic", "min_doc_len": 32,
        "sources": [{"name": "easy", "kind": "markov", "weight": 0.5, "alphabet": 16, "order": 1, "support": 2,
                     "concentration": 0.5},
                    {"name": "hard", "kind": "markov", "weight": 0.5, "alphabet": 32, "order": 1, "support": 8,
                     "concentration": 1.0}]}


# ---- the classifier: plain functions over StepRecord-shaped dicts ---------------------------------
def window(records: list[dict], lo: int, hi: int) -> dict:
    """Token-weighted per-source loss of records[lo:hi]: {steps, loss_by_source, tokens_by_source}."""
    sums, toks = {}, {}
    for r in records[lo:hi]:
        for s, n in r["tokens_by_source"].items():
            if n:
                sums[s] = sums.get(s, 0.0) + r["loss_by_source"][s] * n
                toks[s] = toks.get(s, 0) + n
    return {"steps": len(records[lo:hi]), "loss_by_source": {s: sums[s] / toks[s] for s in toks},
            "tokens_by_source": toks}


def mixture_floor(tokens_by_source: dict, floors: dict) -> float:
    """Σ_s share_s · floor_s: the Bayes floor of the mixture these tokens were drawn from."""
    total = sum(tokens_by_source.get(s, 0) for s in floors)
    return sum(tokens_by_source.get(s, 0) * f for s, f in floors.items()) / total


def spread(records: list[dict], floors: dict) -> dict:
    """Noise of per-step telemetry, from consecutive-step differences (they cancel the slow trend).

    Source s: a step's loss is a mean over n_t tokens, so E[(l_t − l_{t−1})²] = σ_s²(1/n_t + 1/n_{t−1}):
    σ_s is the noise per √token. The mixture floor of a step: σ_mix per step.
    """
    sq, cnt = {s: 0.0 for s in floors}, {s: 0 for s in floors}
    mix = [mixture_floor(r["tokens_by_source"], floors) for r in records]
    for prev, cur in zip(records, records[1:]):
        for s in floors:
            n0, n1 = prev["tokens_by_source"].get(s, 0), cur["tokens_by_source"].get(s, 0)
            if n0 and n1:
                sq[s] += (cur["loss_by_source"][s] - prev["loss_by_source"][s]) ** 2 / (1 / n0 + 1 / n1)
                cnt[s] += 1
    d_mix = [(b - a) ** 2 for a, b in zip(mix, mix[1:])]
    return {"by_source": {s: math.sqrt(sq[s] / cnt[s]) for s in floors if cnt[s]},
            "mix_floor": math.sqrt(sum(d_mix) / (2 * len(d_mix)))}


def evidence(before: dict, after: dict, floors: dict, noise: dict) -> dict:
    """The numbers classify() decides on: per-source excess over the floor (loss − floor) before and
    after, its rise in standard errors, and the shift of the mixture floor in standard errors."""
    for name, w in (("before", before), ("after", after)):
        if not w["steps"] or not any(w["tokens_by_source"].get(s) for s in floors):
            raise ValueError(f"{name} window={w}: holds no tokens of any source in {sorted(floors)}")
    out = {"excess_before": {}, "excess_after": {}, "rise_se": {}}
    for s, f in floors.items():
        lb, la = before["loss_by_source"].get(s), after["loss_by_source"].get(s)
        if lb is None or la is None:
            continue  # a source absent from a window: only the mixture floor can speak for it
        out["excess_before"][s], out["excess_after"][s] = lb - f, la - f
        se = noise["by_source"][s] * math.sqrt(1 / before["tokens_by_source"][s] + 1 / after["tokens_by_source"][s])
        out["rise_se"][s] = (la - lb) / se if math.isfinite(la) else math.inf
    out["mix_before"] = mixture_floor(before["tokens_by_source"], floors)
    out["mix_after"] = mixture_floor(after["tokens_by_source"], floors)
    se = noise["mix_floor"] * math.sqrt(1 / before["steps"] + 1 / after["steps"])
    out["mix_shift_se"] = (out["mix_after"] - out["mix_before"]) / se
    return out


def classify(before: dict, after: dict, floors: dict, noise: dict, k: float = K) -> str:
    """"optimisation broke" when any source's loss rose above its trajectory by > k standard errors;
    else "objective changed" when the mixture floor moved by > k standard errors; else "healthy".

    before/after: window() of the steps before and after the suspect step; floors: floor per source;
    noise: spread() of a healthy stretch (the reference run's, or this run's own early steps).
    NOTE: "rose" is measured against the window before, so the test assumes a run that is still
    descending or flat there (a rising trend would read as a fault); a rise is also only a rise
    in the loss *above its floor*, since the floor of a source never moves.
    """
    ev = evidence(before, after, floors, noise)
    if any(r > k for r in ev["rise_se"].values()):
        return BROKE
    if abs(ev["mix_shift_se"]) > k:
        return OBJECTIVE
    return HEALTHY


# ---- the three runs -------------------------------------------------------------------------------
def _mixture_change(at: int, weights):
    def on_step(step, model, optimizer, loader):
        if step == at:
            loader.dataset.set_weights(weights)
    return on_step


def _lr_spike(at: int):
    def on_step(step, model, optimizer, loader):
        if at <= step < at + FAULT_STEPS:  # the scheduler restores every lr after the step
            for g in optimizer.param_groups:
                g["lr"] *= LR_MULT
    return on_step


def _zero_second_moments(at: int):
    def on_step(step, model, optimizer, loader):
        if step == at:  # Adam then divides by √v̂ of one gradient: every step size jumps to ~lr/√(1−β2)
            for st in optimizer.state.values():
                st["exp_avg_sq"].zero_()
    return on_step


FAULTS = {"lr": (_lr_spike, f"lr × {LR_MULT:g} for {FAULT_STEPS} steps"),
          "adam_v": (_zero_second_moments, "Adam exp_avg_sq zeroed")}


def records_of(run_: dict) -> list[dict]:
    """train_small's curves as StepRecord-shaped dicts (sources without tokens left out, as train.py does)."""
    names = list(run_["train_loss_by_source"])
    out = []
    for t, loss in enumerate(run_["train_loss"]):
        toks = {s: run_["train_tokens_by_source"][s][t] for s in names}
        out.append({"step": t + 1, "loss": loss, "tokens_by_source": toks,
                    "loss_by_source": {s: run_["train_loss_by_source"][s][t] for s in names if toks[s]}})
    return out


def run(seed: int, quick: bool = False, fault: str | None = "lr", new_weights=NEW_WEIGHTS) -> dict:
    """fault: a key of FAULTS, or None (run c then trains like the reference: the test's negative)."""
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"fault={fault!r}: expected one of {', '.join(FAULTS)} or None")
    with single_thread():
        return _run(seed, quick, fault, tuple(new_weights))


def _run(seed: int, quick: bool, fault: str | None, new_weights: tuple) -> dict:
    steps, W, seq_len = (120, 20, 32) if quick else (240, 40, 64)
    S = int(0.6 * steps)
    data = {**DATA, "seq_len": seq_len, "seed": seed}
    # NOTE: one layer is enough for order-1 sources (a bigram needs no attention between layers), at half
    # the time per step
    model = dataclasses.replace(MODEL, n_layers=1) if quick else MODEL
    fault_hook, fault_label = FAULTS[fault] if fault else (None, "no fault (switched off)")
    plan = {"a: reference": None,
            f"b: mixture → {'/'.join(f'{w:g}' for w in new_weights)}": _mixture_change(S, new_weights),
            f"c: {fault_label}": fault_hook(S) if fault_hook else None}
    runs = {name: train_small(model, data, PrecisionConfig(), steps, 16, seed, eval_samples=64, on_step=hook)
            for name, hook in plan.items()}
    floors = next(iter(runs.values()))["floor_by_source"]
    ref = records_of(runs["a: reference"])
    noise = spread(ref[S // 2:], floors)  # the reference's own noise, past the steep early descent
    verdicts, telemetry = {}, {}
    for name, r in runs.items():
        recs = records_of(r)
        before, after = window(recs, S - W, S), window(recs, S, S + W)
        verdicts[name] = classify(before, after, floors, noise)
        telemetry[name] = {"before": before, "after": after, **evidence(before, after, floors, noise),
                           "loss_before": sum(r["train_loss"][S - W:S]) / W,
                           "loss_after": sum(r["train_loss"][S:S + W]) / W}
    expected = [HEALTHY, OBJECTIVE, BROKE]
    checks = {f"{name} → {want}": verdicts[name] == want for name, want in zip(runs, expected)}
    result = {"seed": seed, "quick": quick, "fault": fault, "steps": steps, "S": S, "window": W, "k": K,
              "floors": floors, "noise": noise, "verdicts": verdicts, "telemetry": telemetry,
              "curves": {n: {"loss": r["train_loss"], "by_source": r["train_loss_by_source"],
                             "mix_floor": [mixture_floor({s: r["train_tokens_by_source"][s][t] for s in floors}, floors)
                                           for t in range(steps)]} for n, r in runs.items()},
              "seconds": {n: r["seconds"] for n, r in runs.items()}, "checks": checks,
              "ok": list(verdicts.values()) == expected}
    result["table"] = table(result)
    return result


def table(r: dict) -> str:
    src = list(r["floors"])
    lines = [f"{r['steps']} steps from seed {r['seed']}, event at step S={r['S']}; windows [S−{r['window']}, S) "
             f"and [S, S+{r['window']}); exact floors " + ", ".join(f"{s} {f:.4f}" for s, f in r["floors"].items()),
             f"{'run':<34}{'total loss':>16}{'mixture floor':>16}"
             + "".join(f"{s + ' − floor':>20}" for s in src) + f"{'rise/SE':>8}{'mix/SE':>8}  verdict"]
    for name, t in r["telemetry"].items():
        exc = "".join(f"{t['excess_before'].get(s, math.nan):>+9.3f} →{t['excess_after'].get(s, math.nan):>+8.3f}"
                      for s in src)
        rise = max(t["rise_se"].values(), default=math.nan)
        lines.append(f"{name:<34}{t['loss_before']:>7.3f} →{t['loss_after']:>7.3f}{t['mix_before']:>7.3f} →"
                     f"{t['mix_after']:>7.3f}{exc}{rise:>+8.1f}{t['mix_shift_se']:>+8.1f}  {r['verdicts'][name]}")
    lines += [f"verdict: any source's loss − floor rose by > {r['k']:g} SE → optimisation broke; else the mixture "
              f"floor moved by > {r['k']:g} SE → objective changed; else healthy",
              "SE from the reference's step-to-step noise per √token: "
              + ", ".join(f"{s} {v:.3f}" for s, v in r["noise"]["by_source"].items())
              + f"; mixture floor {r['noise']['mix_floor']:.3f} per step",
              "run time: " + ", ".join(f"{n.split(':')[0]} {s:.1f} s" for n, s in r["seconds"].items())]
    lines += [""] + [f"[{'ok' if v else 'FAIL'}] {k}" for k, v in r["checks"].items()]
    return "\n".join(lines)


def plot(r: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(ys, k=5):
        ys = [y if math.isfinite(y) else math.nan for y in ys]
        return [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    for (name, c), color in zip(r["curves"].items(), ("C0", "C2", "C3")):
        a.plot(range(1, len(c["loss"]) + 1), smooth(c["loss"]), color=color, label=f"{name}: {r['verdicts'][name]}")
        if "mix_floor" in c:  # Σ_s share_s · floor_s of each step's tokens: what the objective asks for
            a.plot(range(1, len(c["mix_floor"]) + 1), smooth(c["mix_floor"]), color=color, ls="--", lw=0.9,
                   label=f"{name.split(':')[0]}: mixture floor")
        for (s, ys), ls in zip(c["by_source"].items(), ("-", "--")):
            excess = [y - r["floors"][s] for y in ys]
            b.plot(range(1, len(ys) + 1), smooth(excess), color=color, ls=ls, label=f"{name.split(':')[0]} {s}")
    for ax in (a, b):
        ax.axvline(r["S"], color="k", ls=":", lw=1)
        ax.set_xlabel("step (dotted: S)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    a.set_ylabel("total train loss (nats/token)")
    t_b = next(v for k, v in r["telemetry"].items() if k.startswith("b"))
    a.set_title(f"total loss (solid) and its mixture floor (dashed): b's floor moves "
                f"{t_b['mix_before']:.2f} → {t_b['mix_after']:.2f}", fontsize=9)
    b.set_ylabel("per-source loss − exact floor")
    b.set_title("per source: only c leaves its trajectory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
