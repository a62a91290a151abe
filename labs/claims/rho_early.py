"""The update-to-weight ratio rises before the loss blows up (docs/course.md §8: per-layer
ρ_ℓ = ‖Δθ_ℓ‖/(‖θ_ℓ‖+ε) exposes trouble earlier than waiting for a NaN).

A run is pushed to divergence by an LR that grows ×RAMP per step from LR0, with no clipping (an LR
range test). stability/telemetry.Telemetry records ρ_ℓ for every layer on every step, exactly as
train.py does. The alarm is the first step where max_ℓ ρ_ℓ exceeds K × its median over the first
W steps; the blow-up is the first step whose loss is non-finite or > BLOWUP × the first step's. The
claim holds when the alarm comes at least LEAD_MIN steps before the blow-up. A control run at the
constant LR0 must raise no alarm (ρ is not a noise source of false alarms).

NOTE: that arm alone is nearly circular: under Adam ρ_ℓ ≈ lr/‖θ_ℓ‖, so a growing LR raises every
layer's ρ together, and logging the LR would show the same thing. What ρ_ℓ adds (docs/course.md §8) is
to separate "the global LR is too high" from "one layer is wrong". So a third arm, `layer_fault`, keeps
the global LR at a normal constant LR0 and breaks one layer: from step FAULT_START its update is FAULT×
what AdamW computed (as if that layer alone had a FAULT× LR — a wrong per-group LR, a broken
init scale). The logged LR is flat; the whole-model update ratio ‖Δθ‖/‖θ‖ is diluted by the healthy
layers and stays under its own alarm; the loss does not blow up; ρ_ℓ of that one layer alarms at once,
and names it.
"""
from __future__ import annotations

import math
import statistics

import torch

from torch.optim.lr_scheduler import LambdaLR

from data.loader import Loader
from labs.claims.tiny import build, check_lines, figure, first_index, make_optimizer, save, train_step
from labs.common import single_thread
from stability.config import TelemetryConfig
from stability.telemetry import Telemetry
from stability.telemetry_layers import param_layers

TITLE = "rho_early: per-layer update ratio ρ_ℓ crosses K× its early median steps before the loss blows up"
LR0, RAMP = 1e-3, 1.2
K, W = 5.0, 5  # alarm: max ρ > K × median of the first W steps
BLOWUP = 10.0  # blow-up: loss non-finite or > BLOWUP × the first step's loss
LEAD_MIN = 2
MAX_STEPS = 60  # LR0 · RAMP^60 ≈ 56: far past any sane LR
AFTER = 3  # steps recorded past the blow-up, for the plot
FAULT_LAYER, FAULT, FAULT_START, FAULT_STEPS = "block1.attn", 10.0, 10, 30  # the single-layer fault arm


def train(seed: int, ramp: float, max_steps: int) -> dict:
    """Train until the blow-up (+AFTER steps) or max_steps; per step the loss and every layer's ρ."""
    dataset, model = build(seed)
    optimizer, _ = make_optimizer(model, LR0)
    # NOTE: the ramp replaces the constant schedule: lr(s) = LR0 · ramp^s for step s = 0, 1, ...
    scheduler = LambdaLR(optimizer, lambda s: ramp ** s)
    telemetry = Telemetry(model, TelemetryConfig(every=1))
    loader = Loader(dataset, 8)
    loss, lr, rho_max, layers = [], [], [], {}
    for step in range(1, max_steps + 1):
        lr.append(optimizer.param_groups[0]["lr"])
        rec = train_step(model, optimizer, scheduler, loader, None, telemetry=telemetry, step=step)
        loss.append(rec["loss"])
        rho_max.append(rec["telemetry"]["update_ratio_max"])
        for name, v in rec["telemetry"]["layers"].items():
            if "update_ratio" in v:
                layers.setdefault(name, []).append(v["update_ratio"])
        blowup = first_index(not math.isfinite(x) or x > BLOWUP * loss[0] for x in loss)
        if blowup is not None and step >= blowup + 1 + AFTER:
            break
    return {"ramp": ramp, "lr": lr, "loss": loss, "rho_max": rho_max, "rho_layers": layers}


def train_layer_fault(seed: int, layer: str, factor: float, start: int, steps: int) -> dict:
    """Constant LR0; from step `start` the parameters of `layer` move `factor`× AdamW's update. Per step:
    the loss, the logged LR, every layer's ρ_ℓ and the whole-model update ratio ‖Δθ‖/‖θ‖."""
    dataset, model = build(seed)
    optimizer, scheduler = make_optimizer(model, LR0, steps)
    layer_of = param_layers(model)
    faulty = [p for n, p in model.named_parameters() if layer_of[n] == layer]
    if not faulty:
        raise ValueError(f"rho_early: fault_layer={layer!r} owns no parameters")
    adam_step, step_now = optimizer.step, [0]

    def step_with_fault(*args, **kwargs):
        # NOTE: the fault acts inside optimizer.step, so the telemetry's Δθ (θ after − θ before the
        # step) sees it exactly as it would see a wrong per-group LR.
        before = [p.detach().clone() for p in faulty]
        out = adam_step(*args, **kwargs)
        if step_now[0] >= start:
            with torch.no_grad():
                for p, b in zip(faulty, before):
                    p.copy_(b + factor * (p - b))
        return out

    # NOTE: the scheduler's check for "step replaced after the scheduler was built" looks for this mark;
    # step_with_fault calls the marked original, so the order the check protects is kept.
    step_with_fault._wrapped_by_lr_sched = True
    optimizer.step = step_with_fault
    telemetry, loader, params = Telemetry(model, TelemetryConfig(every=1)), Loader(dataset, 8), list(model.parameters())
    loss, lr, whole, layers = [], [], [], {}
    for step in range(1, steps + 1):
        step_now[0] = step
        lr.append(optimizer.param_groups[0]["lr"])
        before = [p.detach().clone() for p in params]
        rec = train_step(model, optimizer, scheduler, loader, None, telemetry=telemetry, step=step)
        loss.append(rec["loss"])
        dn = math.sqrt(sum((p.detach() - b).pow(2).sum().item() for p, b in zip(params, before)))
        whole.append(dn / math.sqrt(sum(b.pow(2).sum().item() for b in before)))
        for name, v in rec["telemetry"]["layers"].items():
            if "update_ratio" in v:
                layers.setdefault(name, []).append(v["update_ratio"])
    return {"layer": layer, "factor": factor, "start": start, "loss": loss, "lr": lr, "rho_whole": whole,
            "rho_layers": layers}


def alarm_step(rho: list[float]) -> int | None:
    """1-based first step after the early window whose ρ exceeds K × the early median (NaN counts)."""
    base = statistics.median(rho[:W])
    i = first_index(not (x <= K * base) for x in rho[W:])
    return None if i is None else W + i + 1


def blowup_step(loss: list[float]) -> int | None:
    i = first_index(not math.isfinite(x) or x > BLOWUP * loss[0] for x in loss)
    return None if i is None else i + 1


def run(seed: int, quick: bool = False, ramp: float = RAMP, fault_layer: str = FAULT_LAYER,
        fault_factor: float = FAULT) -> dict:
    """ramp: the LR growth per step (1.0: no push, nothing diverges, the claim has nothing to show);
    fault_factor: the single-layer fault's update multiplier (1.0: no fault, nothing for ρ_ℓ to name)."""
    with single_thread():
        pushed = train(seed, ramp, MAX_STEPS)
        control = train(seed, 1.0, 20 if quick else MAX_STEPS)
        fault = train_layer_fault(seed, fault_layer, fault_factor, FAULT_START, FAULT_STEPS)
    fault.update(layer_alarm={k: alarm_step(v) for k, v in fault["rho_layers"].items()},
                 whole_alarm=alarm_step(fault["rho_whole"]), blowup_step=blowup_step(fault["loss"]),
                 whole_rise=max(fault["rho_whole"][FAULT_START - 1:]) / statistics.median(fault["rho_whole"][:W]))
    alarmed = {k: s for k, s in fault["layer_alarm"].items() if s is not None}
    alarm, blow = alarm_step(pushed["rho_max"]), blowup_step(pushed["loss"])
    pushed.update(alarm_step=alarm, blowup_step=blow,
                  layer_alarm={k: alarm_step(v) for k, v in pushed["rho_layers"].items()})
    control.update(alarm_step=alarm_step(control["rho_max"]), blowup_step=blowup_step(control["loss"]))
    checks = {
        f"pushed run blows up (loss non-finite or > {BLOWUP:g}× its first) within {MAX_STEPS} steps": blow is not None,
        f"max ρ crosses {K:g}× its early median >= {LEAD_MIN} steps before the blow-up":
            blow is not None and alarm is not None and alarm <= blow - LEAD_MIN,
        "control run (constant LR0): no ρ alarm, no blow-up":
            control["alarm_step"] is None and control["blowup_step"] is None,
        f"layer fault ({fault_layer} ×{fault_factor:g} from step {FAULT_START}, global LR constant): "
        f"ρ_ℓ alarms for that layer alone, within 2 steps":
            set(alarmed) == {fault_layer} and alarmed[fault_layer] <= FAULT_START + 2,
        "…while the global view stays quiet: the logged LR is flat, the whole-model update ratio stays "
        f"under {K:g}× its early median, the loss does not blow up":
            len(set(fault["lr"])) == 1 and fault["whole_alarm"] is None and fault["blowup_step"] is None,
    }
    r = {"seed": seed, "quick": quick, "lr0": LR0, "K": K, "W": W, "pushed": pushed, "control": control,
         "layer_fault": fault,
         "checks": checks, "ok": all(checks.values())}
    r["table"] = table(r)
    return r


def table(r: dict) -> str:
    p, c = r["pushed"], r["control"]
    alarm, blow = p["alarm_step"], p["blowup_step"]
    lead = blow - alarm if alarm is not None and blow is not None else None
    lines = [f"pushed: lr = {r['lr0']:g} · {p['ramp']:g}^step, no clipping; control: constant lr {r['lr0']:g}. "
             f"ρ_ℓ from stability/telemetry.py every step", "",
             f"{'run':<9}{'steps':>6}{'early median max ρ':>20}{'alarm step':>12}{'blow-up step':>14}{'lead':>6}"]
    for name, x in (("pushed", p), ("control", c)):
        lead_x = lead if name == "pushed" else None
        lines.append(f"{name:<9}{len(x['loss']):>6}{statistics.median(x['rho_max'][:W]):>20.4f}"
                     f"{x['alarm_step'] or '—':>12}{x['blowup_step'] or '—':>14}{lead_x if lead_x is not None else '—':>6}")
    lines += [f"(alarm: max ρ > {r['K']:g}× the median of steps 1-{r['W']}; blow-up: loss non-finite or "
              f"> {BLOWUP:g}× step 1's)", "", "pushed run, per layer"]
    marks = [s for s in (1, alarm, blow) if s is not None]
    lines.append(f"{'layer':<13}{'own alarm':>10}" + "".join(f"{f'ρ @ step {s}':>14}" for s in marks))
    for name, rho in p["rho_layers"].items():
        own = p["layer_alarm"][name]
        lines.append(f"{name:<13}{own or '—':>10}" + "".join(f"{rho[s - 1]:>14.4f}" for s in marks))
    lines.append(f"{'loss':<13}{'':>10}" + "".join(f"{p['loss'][s - 1]:>14.3f}" for s in marks))
    lines.append(f"{'lr':<13}{'':>10}" + "".join(f"{p['lr'][s - 1]:>14.4g}" for s in marks))
    f = r.get("layer_fault")
    if f:
        s0 = f["start"]
        lines += ["", f"layer fault: constant lr {r['lr0']:g}; {f['layer']}'s update ×{f['factor']:g} from step {s0}",
                  f"{'layer':<13}{'own alarm':>10}{'ρ early median':>16}{f'ρ @ step {s0}':>14}{'rise':>8}"]
        rows = [(n, f["layer_alarm"][n], v) for n, v in f["rho_layers"].items()]
        rows.append(("whole model", f["whole_alarm"], f["rho_whole"]))
        for name, own, rho in rows:
            base = statistics.median(rho[:r["W"]])
            lines.append(f"{name:<13}{own or '—':>10}{base:>16.4g}{rho[s0 - 1]:>14.4g}{rho[s0 - 1] / base:>7.1f}×")
        lines.append(f"{'loss':<13}{'':>10}{statistics.median(f['loss'][:r['W']]):>16.3f}{f['loss'][s0 - 1]:>14.3f}"
                     f"   (lr {f['lr'][0]:g} on every step; blow-up: {f['blowup_step'] or 'none'})")
    return "\n".join(lines + [""] + check_lines(r["checks"]))


def plot(r: dict, path) -> None:
    fig, (a, b, c) = figure(3)
    f = r["layer_fault"]
    steps_f = range(1, len(f["loss"]) + 1)
    for name, rho in f["rho_layers"].items():
        c.semilogy(steps_f, rho, lw=1.6 if name == f["layer"] else 0.8, label=name)
    c.semilogy(steps_f, f["rho_whole"], "k--", lw=1.2, label=f"whole model (rise {f['whole_rise']:.1f}×)")
    c.axvline(f["start"], color="C3", ls=":", lw=1.2)
    c.set_xlabel(f"step (dotted: {f['layer']} ×{f['factor']:g}; lr constant {f['lr'][0]:g})")
    c.set_ylabel("ρ_ℓ")
    c.set_title(f"one bad layer: only its ρ_ℓ alarms (at step {f['layer_alarm'][f['layer']] or '—'})")
    c.legend(fontsize=7)
    p = r["pushed"]
    steps = range(1, len(p["loss"]) + 1)
    for name, rho in p["rho_layers"].items():
        a.semilogy(steps, rho, lw=0.9, label=name)
    a.semilogy(range(1, len(r["control"]["rho_max"]) + 1), r["control"]["rho_max"], "k:", label="control: max ρ")
    a.axhline(r["K"] * statistics.median(p["rho_max"][:r["W"]]), color="C3", ls="--", lw=1, label=f"{r['K']:g}× early median")
    b.semilogy(steps, [x if math.isfinite(x) else float("nan") for x in p["loss"]], "k-", label="pushed: loss")
    b.axhline(BLOWUP * p["loss"][0], color="C3", ls="--", lw=1, label=f"{BLOWUP:g}× first loss")
    for ax in (a, b):
        for s, style in ((p["alarm_step"], "C1"), (p["blowup_step"], "C3")):
            if s is not None:
                ax.axvline(s, color=style, ls=":", lw=1.2)
        ax.set_xlabel("step (dotted: alarm, blow-up)")
        ax.legend(fontsize=7)
    a.set_ylabel("update ratio ρ_ℓ = ‖Δθ_ℓ‖/(‖θ_ℓ‖+ε)")
    b.set_ylabel("train loss (nats/token)")
    save(fig, path)
