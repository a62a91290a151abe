"""z-loss bounds the logit normaliser (PaLM; docs/course.md §4: it constrains the scale of log Z, whether
the coefficient suits a run is still an experiment).

Softmax is shift-invariant, so cross-entropy never penalises log Z = logsumexp(logits) drifting: all
logits can rise together. z-loss adds z·Σ log Z² (model/loss.py computes it from the same logsumexp as
the CE; optim/accumulate.py adds it to the token-normalised objective), which pulls log Z toward 0 and
leaves the predicted distribution — hence the CE — essentially alone. The lab trains the same tiny
model from the same seed and batches with several z coefficients and compares RMS log Z, max |log Z|
and the CE, on the training steps and on fixed validation batches.
"""
from __future__ import annotations

import math

import torch

from data.loader import Loader, eval_batches
from labs.claims.tiny import BATCH, COSINE, build, check_lines, figure, make_optimizer, save, train_step
from labs.common import single_thread
from model import IGNORE_INDEX

TITLE = "zloss: z-loss keeps |log Z| small while the cross-entropy stays ~unchanged"
LR = 1e-2  # high enough that 80 steps show the drift (and z-loss's hold on it)
CE_TOL = 0.05  # relative CE change allowed for the largest coefficient


@torch.no_grad()
def evaluate(model, batches) -> dict:
    """CE per token, RMS and max |log Z| over the valid positions of the validation batches."""
    ce = z = n = 0.0
    lse_max = 0.0
    for b in batches:
        out = model(b.tokens, b.labels, return_logits=True)
        ce, z, n = ce + out.loss_sum.item(), z + out.z_sum.item(), n + out.n_valid.item()
        lse_BT = torch.logsumexp(out.logits.float(), dim=-1)
        lse_max = max(lse_max, lse_BT[b.labels != IGNORE_INDEX].abs().max().item())
    return {"ce": ce / n, "lse_rms": math.sqrt(z / n), "lse_max": lse_max}


def train(seed: int, z_coef: float, steps: int) -> dict:
    dataset, model = build(seed)
    optimizer, scheduler = make_optimizer(model, LR, steps, COSINE)  # decayed: steadier final CE
    loader = Loader(dataset, BATCH)
    log = [train_step(model, optimizer, scheduler, loader, 1.0, z_coef=z_coef) for _ in range(steps)]
    tail = log[-max(1, steps // 10):]  # the last 10 % of steps: a steadier number than the last one
    return {"z_coef": z_coef, "loss": [x["loss"] for x in log], "lse_rms": [x["lse_rms"] for x in log],
            "train_ce_tail": sum(x["loss"] for x in tail) / len(tail),
            "train_lse_rms_tail": sum(x["lse_rms"] for x in tail) / len(tail),
            "eval": evaluate(model, eval_batches(dataset, 128, 64))}


def run(seed: int, quick: bool = False, coefs: tuple[float, ...] | None = None) -> dict:
    coefs = coefs or ((0.0, 1e-2) if quick else (0.0, 1e-3, 1e-2))
    # NOTE: quick keeps all 200 steps (it only drops z = 1e-3): z-loss pulls log Z down over the whole
    # run, so a shorter run leaves the eval RMS ratio astride the 0.5 claim on some seeds; 200 steps give
    # the claim a margin on every seed (bench/seeds/labs_seeds.py runs the lab over seeds).
    steps = 200
    with single_thread():
        runs = [train(seed, z, steps) for z in coefs]
    base, top = runs[0], runs[-1]
    ce_change = (top["eval"]["ce"] - base["eval"]["ce"]) / base["eval"]["ce"]
    checks = {
        f"z = {top['z_coef']:g}: eval RMS |log Z| <= half of z = {base['z_coef']:g}'s":
            top["eval"]["lse_rms"] <= 0.5 * base["eval"]["lse_rms"],
        f"z = {top['z_coef']:g}: eval max |log Z| smaller than z = {base['z_coef']:g}'s":
            top["eval"]["lse_max"] < base["eval"]["lse_max"],
        f"z = {top['z_coef']:g}: eval CE within {CE_TOL:.0%} of z = {base['z_coef']:g}'s":
            abs(ce_change) <= CE_TOL,
    }
    r = {"seed": seed, "quick": quick, "steps": steps, "lr": LR, "runs": runs, "ce_change": ce_change,
         "checks": checks, "ok": all(checks.values())}
    r["table"] = table(r)
    return r


def table(r: dict) -> str:
    base = r["runs"][0]["eval"]["ce"]
    lines = [f"{r['steps']} steps, cosine lr {r['lr']:g} → {r['lr'] / 10:g}, same init and batches; log Z = logsumexp(logits) per valid token",
             "", f"{'z coef':>8}{'train CE':>10}{'train RMS logZ':>16}{'eval CE':>9}{'ΔCE':>8}{'eval RMS logZ':>15}"
             f"{'eval max|logZ|':>16}",
             f"{'':>8}{'(last 10 %)':>10}{'(last 10 %)':>16}"]
    for x in r["runs"]:
        e = x["eval"]
        lines.append(f"{x['z_coef']:>8g}{x['train_ce_tail']:>10.4f}{x['train_lse_rms_tail']:>16.3f}{e['ce']:>9.4f}"
                     f"{(e['ce'] - base) / base:>+8.1%}{e['lse_rms']:>15.3f}{e['lse_max']:>16.3f}")
    return "\n".join(lines + [""] + check_lines(r["checks"]))


def plot(r: dict, path) -> None:
    fig, (a, b) = figure(2)
    for x in r["runs"]:
        steps = range(1, len(x["loss"]) + 1)
        a.plot(steps, x["lse_rms"], label=f"z = {x['z_coef']:g}")
        b.plot(steps, x["loss"], lw=0.8, label=f"z = {x['z_coef']:g}")
    a.set_xlabel("step")
    a.set_ylabel("RMS log Z (train batch)")
    a.set_title("the normaliser drifts without z-loss")
    a.legend(fontsize=8)
    b.set_xlabel("step")
    b.set_ylabel("train CE (nats/token)")
    b.set_title("cross-entropy barely moves")
    b.legend(fontsize=8)
    save(fig, path)
