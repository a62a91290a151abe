"""How much learning-rate headroom each stability lever buys, each one alone, on one spiky configuration.

The configuration is made to spike: a tiny dense model on the embedded synthetic data (exact floor
known), a constant learning rate after a short warm-up (no decay to rescue a late run), Adam's β2 =
0.95 and a small batch (noisy second-moment estimates), and a large init (init_std = 0.1, five times the
default: q and k start large, so attention logits start large and grow — the attention-logit growth
instability of Dehghani et al. 2023 and Wortsman et al. 2023, which QK-norm and QK-clip address) — a
setting where the baseline's loss diverges within a few hundred steps once the LR passes a threshold.
Each lever is then switched on alone and the LR swept upward through the same grid:

    baseline      AdamW, fixed global-norm clip at 1.0
    z-loss        + z·mean(logsumexp²), z = 1e-3                               (PaLM; model/loss.py)
    SwiGLU clamp  silu(min(g, L))·clamp(u, ±L), L = 10                          (model/swiglu.py)
    QK-norm       RMSNorm on each q and k head before RoPE                      (model/attention.py)
    QK-clip       per head, scale W_q (W_k) so the max logit stays ≤ τ = 20     (optim/qk_clip.py)
    Muon+QK-clip  Muon on the hidden matrices, AdamW on the rest, and QK-clip   (optim/muon.py)
    z-score clip  adaptive clip at μ + 2.5σ of the grad norm's EMA              (optim/zclip.py)

A run diverged when its loss goes non-finite or its final loss (mean of the last 10 % of steps) is not
below halfway between its first loss and the exact floor; an (lever, LR) point diverged when most of its
seeds did (3 seeds, 1 with --quick). A lever's largest stable LR is the largest
grid LR below its first divergent one. Per run the lab also reports the spike detector's triggers
(stability/detector.py on loss and log grad norm, the guard's defaults), the final loss against the
exact floor, and the largest pre-softmax attention logit seen (the telemetry probe, model/attention.py).
The effect: at least one lever's largest stable LR is above the baseline's.
"""
from __future__ import annotations

import math

from data.loader import Loader
from labs.claims.tiny import build, check_lines, figure, save
from labs.common import single_thread
from optim import build_optimizer, build_scheduler
from optim.accumulate import count_valid_tokens, forward_backward
from optim.config import OptimConfig, QKClipConfig, ZScoreConfig
from optim.qk_clip import QKClip
from optim.zclip import ZScoreClip
from precision import optimizer_step
from stability.config import DetectorConfig
from stability.detector import SpikeDetector

TITLE = "levers: the largest stable learning rate per stability lever, each alone, on a spiky configuration"
MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 4, "init_std": 0.1}
BATCH = 8
TAU = 20.0
LEVERS = {
    "baseline": {},
    "z-loss": {"z_coef": 1e-3},
    "SwiGLU clamp": {"model": {"swiglu_clamp": 10.0}},
    "QK-norm": {"model": {"qk_norm": True}},
    "QK-clip": {"qk_clip": TAU},
    "Muon+QK-clip": {"optim": "muon", "qk_clip": TAU},
    "z-score clip": {"zscore": {"alpha": 0.97, "z_thresh": 2.5, "warmup": 25}},
}
DETECTOR = {"metrics": {"loss": {"direction": "up"}, "grad_norm": {"direction": "up", "log": True}},
            "window": 30, "threshold": 6.0, "min_history": 20, "warmup": 50, "cooldown": 10}


def optim_cfg(lr: float, name: str, steps: int) -> OptimConfig:
    return OptimConfig.from_dict({"name": name, "lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                  "groups": [{"name": "no_decay", "kinds": ["norm", "embedding"], "weight_decay": 0.0}],
                                  "schedule": {"name": "constant", "warmup_steps": max(1, steps // 20)}})


def train(seed: int, lever: dict, lr: float, steps: int) -> dict:
    """One run of `steps` steps at peak `lr` with `lever` on; stops early once the loss is non-finite."""
    dataset, model = build(seed, model={**MODEL, **lever.get("model", {})})
    cfg = optim_cfg(lr, lever.get("optim", "adamw"), steps)
    optimizer, _ = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg.schedule, steps)
    clip = ZScoreClip(ZScoreConfig(**lever["zscore"])) if "zscore" in lever else None
    qk_clip = QKClip(model, QKClipConfig(tau=lever["qk_clip"])) if "qk_clip" in lever else None
    detector = SpikeDetector(DetectorConfig(**DETECTOR))
    loader = Loader(dataset, BATCH)
    for b in model.blocks:
        b.attn.probe_logits = True  # the telemetry probe, every step: one sequence's QKᵀ per forward
    losses, triggers, logit_max, clipped = [], 0, 0.0, 0
    for step in range(steps):
        micro = loader.next().micro_batches(1)
        n_valid = count_valid_tokens(micro, "cpu")
        for b in model.blocks:
            b.attn.logit_max_H = None
        sums = forward_backward(model, micro, n_valid, lever.get("z_coef", 0.0), 1, len(dataset.source_names))
        res = optimizer_step(model.parameters(), optimizer, None, 1.0, clip=clip)
        if qk_clip is not None:
            clipped += qk_clip.after_update([mb.tokens for mb in micro])["heads_clipped"]
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss = sums.loss_sum.item() / n_valid.item()
        losses.append(loss)
        logit_max = max([logit_max] + [b.attn.logit_max_H.max().item() for b in model.blocks])
        fired = detector.observe(step, {"loss": loss, "grad_norm": res.norm.item()})
        triggers += sum(not t.suppressed for t in fired)
        if not math.isfinite(loss):
            break
    floor = dataset.expected_floor()
    tail = losses[-max(1, steps // 10):]
    final = sum(tail) / len(tail) if len(losses) == steps else math.nan
    halfway = floor + 0.5 * (losses[0] - floor)
    diverged = not (math.isfinite(final) and final < halfway)
    return {"lr": lr, "loss": losses, "final": final, "floor": floor, "gap": final - floor, "halfway": halfway,
            "diverged": diverged, "triggers": triggers, "logit_max": logit_max, "heads_clipped": clipped}


def largest_stable(runs: list[dict]) -> float | None:
    """The largest LR of the upward sweep before its first divergent run (None: the first one diverged)."""
    best = None
    for r in runs:
        if r["diverged"]:
            break
        best = r["lr"]
    return best


def point(seed: int, n_seeds: int, lever: dict, lr: float, steps: int) -> dict:
    """One (lever, LR) point over n_seeds seeds (data and init): diverged when most seeds diverge; the
    reported numbers are means over seeds (max for the logit, sum for the triggers)."""
    runs = [train(seed + i, lever, lr, steps) for i in range(n_seeds)]
    mean = lambda k: sum(r[k] for r in runs) / len(runs)  # noqa: E731
    return {"lr": lr, "diverged": sum(r["diverged"] for r in runs) * 2 > len(runs),
            "final": mean("final"), "floor": mean("floor"), "gap": mean("gap"),
            "triggers": sum(r["triggers"] for r in runs), "logit_max": max(r["logit_max"] for r in runs),
            "heads_clipped": sum(r["heads_clipped"] for r in runs),
            "seeds": [{k: r[k] for k in ("final", "floor", "halfway", "diverged", "triggers", "logit_max")} | {"loss": r["loss"]}
                      for r in runs]}


def run(seed: int, quick: bool = False, levers: dict | None = None) -> dict:
    levers = LEVERS if levers is None else levers
    lrs = [0.1, 0.2, 0.4] if quick else [0.05, 0.1, 0.2, 0.3, 0.4, 0.6]
    steps, n_seeds = 150, 1 if quick else 3
    sweeps = {}
    with single_thread():
        for name, lever in levers.items():
            runs = []
            for lr in lrs:
                runs.append(point(seed, n_seeds, lever, lr, steps))
                if runs[-1]["diverged"] and len(runs) >= 2 and runs[-2]["diverged"]:
                    break  # two divergent LRs in a row: higher ones diverge too (and cost the most)
            sweeps[name] = {"runs": runs, "largest_stable_lr": largest_stable(runs)}
    base = sweeps["baseline"]["largest_stable_lr"] or 0.0
    moved = {n: s["largest_stable_lr"] for n, s in sweeps.items()
             if n != "baseline" and (s["largest_stable_lr"] or 0.0) > base}
    checks = {"the baseline diverges somewhere on the grid (the configuration spikes)":
              any(r["diverged"] for r in sweeps["baseline"]["runs"]),
              "at least one lever moves the largest stable LR above the baseline's": bool(moved)}
    for n in ("QK-norm", "QK-clip"):  # the levers aimed at the logit itself: bounded where the baseline grows
        if n in sweeps:
            pairs = [(x, b) for x, b in zip(sweeps[n]["runs"], sweeps["baseline"]["runs"])
                     if b["logit_max"] > 10 * TAU]
            checks[f"{n}: largest attention logit <= 1/10 of the baseline's wherever the baseline's "
                   f"exceeds 10·τ = {10 * TAU:g}"] = bool(pairs) and all(
                x["logit_max"] <= 0.1 * b["logit_max"] for x, b in pairs)
    r = {"seed": seed, "quick": quick, "steps": steps, "seeds": n_seeds, "lrs": lrs, "tau": TAU, "sweeps": sweeps,
         "moved": moved, "checks": checks, "ok": all(checks.values())}
    r["table"] = table(r)
    return r


def table(r: dict) -> str:
    lines = [f"{r['steps']} steps per run × {r['seeds']} seed(s) per point (majority decides), constant LR after a {max(1, r['steps'] // 20)}-step warm-up, "
             f"LR grid {', '.join(f'{x:g}' for x in r['lrs'])}; diverged = non-finite, or final loss not below "
             "halfway from the first loss to the exact floor", "",
             f"{'lever':<14}{'largest':>9}{'×base':>7}  per LR: final − floor (detector triggers, max attn logit)",
             f"{'':<14}{'stable LR':>9}"]
    base = r["sweeps"]["baseline"]["largest_stable_lr"]
    for name, s in r["sweeps"].items():
        lr = s["largest_stable_lr"]
        ratio = f"{lr / base:.1f}" if lr and base else "-"
        cells = []
        for x in s["runs"]:
            gap = "div" if x["diverged"] and not math.isfinite(x["final"]) else f"{x['gap']:+.2f}" + ("!" if x["diverged"] else "")
            cells.append(f"{x['lr']:g}: {gap} ({x['triggers']}, {x['logit_max']:.0f})")
        lines.append(f"{name:<14}{(f'{lr:g}' if lr else 'none'):>9}{ratio:>7}  " + "  ".join(cells))
    lines += ["", "! = diverged by the halfway rule; div = non-finite loss", ""] + check_lines(r["checks"])
    return "\n".join(lines)


def plot(r: dict, path) -> None:
    fig, (a, b) = figure(2, width=6.5)
    for i, (name, s) in enumerate(r["sweeps"].items()):
        xs = [x["lr"] for x in s["runs"]]
        ys = [x["final"] - x["floor"] if math.isfinite(x["final"]) else float("nan") for x in s["runs"]]
        a.plot(xs, ys, marker="o", color=f"C{i}", label=name)
        for x in s["runs"]:
            if x["diverged"]:
                a.scatter([x["lr"]], [min(3.0, x["final"] - x["floor"]) if math.isfinite(x["final"]) else 3.0],
                          marker="x", color=f"C{i}", s=60)
        b.plot(xs, [x["logit_max"] for x in s["runs"]], marker="o", color=f"C{i}", label=name)
    a.set_xscale("log")
    a.set_xlabel("peak learning rate")
    a.set_ylabel("final train loss − exact floor (nats)")
    a.set_title("final loss vs LR per lever (× = diverged)")
    a.set_ylim(bottom=0)
    a.legend(fontsize=8)
    b.set_xscale("log")
    b.set_yscale("log")
    b.axhline(r["tau"], color="k", ls=":", lw=1, label=f"QK-clip τ = {r['tau']:g}")
    b.set_xlabel("peak learning rate")
    b.set_ylabel("largest pre-softmax attention logit")
    b.set_title("attention-logit growth")
    b.legend(fontsize=8)
    save(fig, path)
