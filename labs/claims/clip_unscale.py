"""Clip before unscale changes the threshold (docs/course.md §3: unscale first, then check, then clip).

Under loss scaling the backward produces S·g. Clipping that at c compares S·‖g‖ with c, i.e. clips the
true gradient at c/S, with a coefficient S times too small whenever S·‖g‖ > c. precision/step.py's
order — unscale (optim/scaler.py) → finite check → clip (optim/clip.py) → step — compares ‖g‖ with c.

Each loss scale S runs one real scaled step (optim/accumulate.forward_backward with loss_scale=S) from
the same weights twice: once through precision.optimizer_step, once clipping the scaled gradient first
and unscaling after. c is half the true gradient norm, so the right coefficient is ≈ 0.5.
NOTE: the optimizer is SGD with lr = 1 so that the update Δθ *is* the clipped gradient; AdamW would
divide most of the coefficient back out (m/√v is scale invariant) and hide the threshold.
"""
from __future__ import annotations

import copy

import torch

from labs.claims.tiny import BATCH, MICRO, build, check_lines, figure, save
from labs.common import single_thread
from optim.accumulate import count_valid_tokens, forward_backward
from optim.clip import clip_grad_norm
from optim.scaler import DynamicLossScaler
from precision import optimizer_step

TITLE = "clip_unscale: clipping the loss-scaled gradient clips the true one at c/S; unscale first"
SCALES = (1.0, 2.0**4, 2.0**8, 2.0**12, 2.0**16)
EPS = 1e-6  # clip_grad_norm's default ε


def _update_norm(before: list[torch.Tensor], model) -> float:
    return torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())]).double().norm().item()


def _scaled_step(base, micro, n_valid, n_src, S: float, c: float, clip_first: bool) -> tuple[float, float]:
    """(clip coefficient, ‖Δθ‖) of one SGD(lr=1) step at loss scale S, in either order."""
    model = copy.deepcopy(base)
    before = [p.detach().clone() for p in model.parameters()]
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = DynamicLossScaler(init_scale=S, min_scale=min(1.0, S))
    forward_backward(model, micro, n_valid, 0.0, 1, n_src, loss_scale=scaler.scale)
    if clip_first:  # WRONG order: clip S·g at c, then unscale
        _, coef = clip_grad_norm(model.parameters(), c)
        scaler.unscale_(model.parameters())
        sgd.step()
    else:
        coef = optimizer_step(model.parameters(), sgd, scaler, c).coef
    return coef.item(), _update_norm(before, model)


def run(seed: int, quick: bool = False, scales: tuple[float, ...] = SCALES) -> dict:
    with single_thread():
        dataset, model = build(seed)
        n_src = len(dataset.source_names)
        micro = dataset.samples(range(BATCH if quick else 4 * BATCH)).micro_batches(MICRO)
        n_valid = count_valid_tokens(micro, "cpu")
        ref = copy.deepcopy(model)
        forward_backward(ref, micro, n_valid, 0.0, 1, n_src)  # the true (unscaled) gradient
        g_norm = clip_grad_norm(ref.parameters(), None)[0].item()
        c = 0.5 * g_norm
        expected = min(1.0, c / (g_norm + EPS))
        rows = []
        for S in scales:
            coef, upd = _scaled_step(model, micro, n_valid, n_src, S, c, clip_first=False)
            coef_w, upd_w = _scaled_step(model, micro, n_valid, n_src, S, c, clip_first=True)
            rows.append({"scale": S, "coef": coef, "update_norm": upd, "clip_first_coef": coef_w,
                         "clip_first_update_norm": upd_w, "clip_first_threshold": c / S})

    big = [r for r in rows if r["scale"] > 1]
    checks = {
        "precision/step.py order: coefficient = min(1, c/‖g‖) at every S (rel 1e-4)":
            all(abs(r["coef"] - expected) <= 1e-4 * expected for r in rows),
        "precision/step.py order: the update has norm c at every S (rel 1e-4)":
            all(abs(r["update_norm"] - c) <= 1e-4 * c for r in rows),
        "clip-first coefficient is S times too small at every S > 1 (rel 1e-3)":
            bool(big) and all(abs(r["clip_first_coef"] * r["scale"] - expected) <= 1e-3 * expected for r in big),
        "clip-first update is clipped at c/S instead of c (rel 1e-3)":
            bool(big) and all(abs(r["clip_first_update_norm"] - c / r["scale"]) <= 1e-3 * c / r["scale"] for r in big),
    }
    r = {"seed": seed, "quick": quick, "true_grad_norm": g_norm, "max_norm": c, "expected_coef": expected,
         "rows": rows, "checks": checks, "ok": all(checks.values())}
    r["table"] = table(r)
    return r


def table(r: dict) -> str:
    lines = [f"true gradient norm ‖g‖ = {r['true_grad_norm']:.6f}; clip c = ‖g‖/2 = {r['max_norm']:.6f}; "
             f"right coefficient min(1, c/‖g‖) = {r['expected_coef']:.6f}", "",
             f"{'loss scale S':>13}{'step.py coef':>14}{'‖Δθ‖':>11}{'clip-first coef':>17}{'‖Δθ‖':>11}"
             f"{'clip-first threshold c/S':>26}"]
    for x in r["rows"]:
        lines.append(f"{x['scale']:>13g}{x['coef']:>14.6f}{x['update_norm']:>11.3e}{x['clip_first_coef']:>17.3e}"
                     f"{x['clip_first_update_norm']:>11.3e}{x['clip_first_threshold']:>26.3e}")
    lines.append("(SGD lr = 1: ‖Δθ‖ is the norm of the clipped gradient the optimizer received)")
    return "\n".join(lines + [""] + check_lines(r["checks"]))


def plot(r: dict, path) -> None:
    fig, (a, b) = figure(2)
    S = [x["scale"] for x in r["rows"]]
    a.loglog(S, [x["coef"] for x in r["rows"]], "o-", label="unscale → clip (precision/step.py)")
    a.loglog(S, [x["clip_first_coef"] for x in r["rows"]], "s--", label="clip → unscale")
    a.set_xlabel("loss scale S")
    a.set_ylabel("clip coefficient")
    a.legend(fontsize=8)
    a.grid(alpha=0.3, which="both")
    b.loglog(S, [x["update_norm"] for x in r["rows"]], "o-", label="unscale → clip")
    b.loglog(S, [x["clip_first_update_norm"] for x in r["rows"]], "s--", label="clip → unscale")
    b.axhline(r["max_norm"], color="k", ls=":", lw=1, label="c")
    b.set_xlabel("loss scale S")
    b.set_ylabel("‖update‖ (SGD, lr = 1)")
    b.legend(fontsize=8)
    b.grid(alpha=0.3, which="both")
    save(fig, path)
