"""The update-to-weight ratio rises before the loss blows up (docs/course.md §8: per-layer
ρ_ℓ = ‖Δθ_ℓ‖/(‖θ_ℓ‖+ε) exposes trouble earlier than waiting for a NaN).

A run is pushed to divergence by an LR that grows ×RAMP per step from LR0, with no clipping (an LR
range test). stability/telemetry.Telemetry records ρ_ℓ for every layer on every step, exactly as
train.py does. The alarm is the first step where max_ℓ ρ_ℓ exceeds K × its median over the first
W steps; the blow-up is the first step whose loss is non-finite or > BLOWUP × the first step's. The
claim holds when the alarm comes at least LEAD_MIN steps before the blow-up. A control run at the
constant LR0 must raise no alarm (ρ is not a noise source of false alarms).
"""
from __future__ import annotations

import math
import statistics

from torch.optim.lr_scheduler import LambdaLR

from data.loader import Loader
from labs.claims.tiny import build, check_lines, figure, first_index, make_optimizer, save, train_step
from labs.common import single_thread
from stability.telemetry import Telemetry

TITLE = "rho_early: per-layer update ratio ρ_ℓ crosses K× its early median steps before the loss blows up"
LR0, RAMP = 1e-3, 1.2
K, W = 5.0, 5  # alarm: max ρ > K × median of the first W steps
BLOWUP = 10.0  # blow-up: loss non-finite or > BLOWUP × the first step's loss
LEAD_MIN = 2
MAX_STEPS = 60  # LR0 · RAMP^60 ≈ 56: far past any sane LR
AFTER = 3  # steps recorded past the blow-up, for the plot


def train(seed: int, ramp: float, max_steps: int) -> dict:
    """Train until the blow-up (+AFTER steps) or max_steps; per step the loss and every layer's ρ."""
    dataset, model = build(seed)
    optimizer, _ = make_optimizer(model, LR0)
    # NOTE: the ramp replaces the constant schedule: lr(s) = LR0 · ramp^s for step s = 0, 1, ...
    scheduler = LambdaLR(optimizer, lambda s: ramp ** s)
    telemetry = Telemetry(model, every=1)
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


def alarm_step(rho: list[float]) -> int | None:
    """1-based first step after the early window whose ρ exceeds K × the early median (NaN counts)."""
    base = statistics.median(rho[:W])
    i = first_index(not (x <= K * base) for x in rho[W:])
    return None if i is None else W + i + 1


def blowup_step(loss: list[float]) -> int | None:
    i = first_index(not math.isfinite(x) or x > BLOWUP * loss[0] for x in loss)
    return None if i is None else i + 1


def run(seed: int, quick: bool = False, ramp: float = RAMP) -> dict:
    """ramp: the LR growth per step (1.0: no push, nothing diverges, the claim has nothing to show)."""
    with single_thread():
        pushed = train(seed, ramp, MAX_STEPS)
        control = train(seed, 1.0, 20 if quick else MAX_STEPS)
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
    }
    r = {"seed": seed, "quick": quick, "lr0": LR0, "K": K, "W": W, "pushed": pushed, "control": control,
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
    return "\n".join(lines + [""] + check_lines(r["checks"]))


def plot(r: dict, path) -> None:
    fig, (a, b) = figure(2)
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
