"""BF16 vs FP8 GEMMs on activations with outlier channels: where per-tensor scaling breaks, and why
DeepSeek-V3 scales per 1×128 tile / 128×128 block.

E4M3 is a floating-point format: one scale per tensor costs nothing while max/|x| stays inside its
~2^15 range of normal numbers. A few channels a thousand to a hundred thousand times the median (the
"massive activations" of LLMs) push the per-tensor scale so high that ordinary elements fall into
E4M3's subnormals, and their relative error grows from 2^-4 towards 1. A 1×128 tile only shares its
scale with 127 neighbours, so only the tiles that hold an outlier pay.

Measured here: relative error of the FP8 copy of x (non-outlier and outlier elements), GEMM output
error quantiles, dgrad and wgrad error through the real FP8 Linear (precision/fp8_linear.py); the
non-outlier error against the outlier magnitude; then FP32 vs FP8-block training of a small model.

Accumulation (the part of V3's recipe the plain emulation cannot show, since it sums in exact FP32):
the same FP8 block GEMM through precision/fp8_gemm.limited_accumulation_gemm_nt, a narrow (~14-bit)
accumulator over the whole K vs one promoted to FP32 every 128 elements (V3 §3.3.2), error against
the exact product of the same FP8 operands as K grows.
"""
from __future__ import annotations

import math

import torch

from labs.common import train_small
from model import ModelConfig, MoEConfig
from precision.config import PrecisionConfig
from precision.fp8_gemm import ACC_BITS, limited_accumulation_gemm_nt
from precision.fp8_linear import fp8_linear
from precision.quant import fake_quantize, quantize

TITLE = "lowprec_gemm: BF16 vs FP8 per-tensor vs FP8 block-scaled GEMMs on outlier channels"
FORMATS = ("bf16", "fp8_tensor", "fp8_block")
HEADLINE = 1e4  # outlier channels at 10^4 × the typical activation
SWEEP = (1.0, 1e1, 1e2, 1e3, 1e4, 1e5)
# The training comparison: every FP8 path (attention and MLP Linears, routed experts) in a small model
# on the quickstart's mixture (a Markov source and a copy source that needs an induction head).
MODEL = ModelConfig(d_model=128, n_layers=2, n_heads=4, swiglu_clamp=10.0,
                    moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=128, shared_expert=True, first_dense=1, every=1,
                                  bias_update_speed=0.001, balance_coef=0.0))
DATA = {"kind": "synthetic", "min_doc_len": 16,
        "sources": [{"name": "markov", "kind": "markov", "weight": 0.5, "alphabet": 32, "order": 1,
                     "support": 4, "concentration": 0.5},
                    {"name": "copy", "kind": "copy", "weight": 0.5, "alphabet": 32, "segment": 12}]}


def _operands(seed: int, M: int, K: int, N: int, n_outliers: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * K ** -0.5
    dy = torch.randn(M, N, generator=g)
    outlier_K = torch.zeros(K, dtype=torch.bool)
    outlier_K[torch.randperm(K, generator=g)[:n_outliers]] = True
    return x, w, dy, outlier_K


def _rel(err: torch.Tensor, ref: torch.Tensor) -> float:
    return (err.norm() / ref.norm()).item()


def _with_outliers(x, outlier_K, magnitude):
    x = x.clone()
    x[:, outlier_K] *= magnitude
    return x


def input_error(x, outlier_K, fmt) -> tuple[float, float]:
    """Relative RMS error of the operand copy the GEMM multiplies, on non-outlier and outlier channels."""
    if fmt == "bf16":
        xq = x.bfloat16().float()
    else:
        xq = fake_quantize(x, "tile" if fmt == "fp8_block" else "tensor")
    d = xq - x
    return _rel(d[:, ~outlier_K], x[:, ~outlier_K]), _rel(d[:, outlier_K], x[:, outlier_K])


def gemm_errors(x, w, dy, outlier_K, fmt) -> dict:
    """y = x·W^T, dx = dy·W, dW = dy^T·x in the format, against FP64 reference products.

    NOTE: dW's outlier columns are 10^4 × the rest and would dominate a norm over all of dW, so its
    error is also reported on the non-outlier columns, the ones per-tensor scaling damages.
    """
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    y_ref, dx_ref, dw_ref = x64 @ w64.t(), dy64 @ w64, dy64.t() @ x64
    if fmt == "bf16":  # BF16 operands, FP32 accumulation: BF16×BF16 products are exact in FP32
        xb, wb, dyb = x.bfloat16().float(), w.bfloat16().float(), dy.bfloat16().float()
        y, dx, dw = xb @ wb.t(), dyb @ wb, dyb.t() @ xb
    else:
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xr, wr, None, "block" if fmt == "fp8_block" else "tensor")
        y.backward(dy)
        y, dx, dw = y.detach(), xr.grad, wr.grad
    err_MN = (y.double() - y_ref).abs() / y_ref.pow(2).mean().sqrt()
    q = torch.quantile(err_MN.flatten().float(), torch.tensor([0.5, 0.9, 0.99]))
    return {"y_p50": q[0].item(), "y_p90": q[1].item(), "y_p99": q[2].item(), "y_max": err_MN.max().item(),
            "dgrad": _rel(dx.double() - dx_ref, dx_ref), "wgrad": _rel(dw.double() - dw_ref, dw_ref),
            "wgrad_nonoutlier": _rel((dw.double() - dw_ref)[:, ~outlier_K], dw_ref[:, ~outlier_K])}


PROMOTE = 128  # V3's N_C


def accumulation_errors(seed: int, Ks: tuple[int, ...], MN: int) -> dict:
    """Relative error (norm) of y = x·W^T from FP8 block operands, by K: narrow accumulator over the
    whole K ("no promotion") vs promoted to FP32 every PROMOTE elements, against the exact (FP64)
    product of the same FP8 operands — so only the accumulation differs."""
    g = torch.Generator().manual_seed(seed + 1)
    out = {"K": list(Ks), "none": [], "promoted": []}
    for K in Ks:
        a = quantize(torch.randn(MN, K, generator=g), "tile")
        b = quantize(torch.randn(MN, K, generator=g) * K ** -0.5, "block")
        ref = a.dequantize().double() @ b.dequantize().double().t()
        for key, every in (("none", None), ("promoted", PROMOTE)):
            out[key].append(_rel(limited_accumulation_gemm_nt(a, b, every).double() - ref, ref))
    return out


def run(seed: int, quick: bool = False) -> dict:
    M, K, N = (256, 512, 256) if quick else (1024, 2048, 1024)
    x0, w, dy, outlier_K = _operands(seed, M, K, N, n_outliers=4 if quick else 8)
    x = _with_outliers(x0, outlier_K, HEADLINE)
    formats = {}
    for fmt in FORMATS:
        non, out = input_error(x, outlier_K, fmt)
        formats[fmt] = {"x_nonoutlier": non, "x_outlier": out, **gemm_errors(x, w, dy, outlier_K, fmt)}
    sweep = {fmt: [input_error(_with_outliers(x0, outlier_K, m), outlier_K, fmt)[0] for m in SWEEP]
             for fmt in FORMATS}

    data = {**DATA, "seq_len": 32 if quick else 64, "seed": seed}
    steps, batch = (20, 8) if quick else (300, 16)
    runs = {name: train_small(MODEL, data, PrecisionConfig(name=name), steps, batch, seed, eval_samples=64 if quick else 256)
            for name in ("fp32", "fp8_block")}
    gap = (runs["fp8_block"]["eval_loss"] - runs["fp32"]["eval_loss"]) / runs["fp32"]["eval_loss"]
    gap_by_source = {n: (runs["fp8_block"]["eval_by_source"][n] - v) / v for n, v in runs["fp32"]["eval_by_source"].items()}
    for r in runs.values():
        r["copy_transition_step"] = transition_step(r["train_loss_by_source"]["copy"], r["floor_by_source"]["copy"])

    acc = accumulation_errors(seed, (512, 2048) if quick else (512, 1024, 2048, 4096), 32 if quick else 64)
    big = [i for i, m in enumerate(SWEEP) if m >= HEADLINE]
    checks = {
        f"block < per-tensor on non-outlier elements at outlier magnitude >= {HEADLINE:g}":
            all(sweep["fp8_block"][i] < sweep["fp8_tensor"][i] for i in big),
        "fp8 block GEMM output p99 error < per-tensor": formats["fp8_block"]["y_p99"] < formats["fp8_tensor"]["y_p99"],
        "fp8 block training stays finite": math.isfinite(runs["fp8_block"]["eval_loss"]),
        f"narrow accumulator: error grows with K; promoting every {PROMOTE} cuts it >= 5× at the largest K":
            acc["none"][-1] > acc["none"][0] and acc["promoted"][-1] * 5 < acc["none"][-1],
    }
    result = {"seed": seed, "quick": quick, "shape": {"M": M, "K": K, "N": N},
              "outlier_channels": outlier_K.nonzero().flatten().tolist(), "headline_magnitude": HEADLINE,
              "formats": formats, "sweep": {"magnitude": list(SWEEP), **sweep}, "training": runs,
              "loss_gap": gap, "loss_gap_by_source": gap_by_source, "accumulation": acc, "checks": checks, "ok": all(checks.values())}
    result["table"] = table(result)
    return result


def transition_step(curve: list[float], floor: float, window: int = 20) -> int | None:
    """First step at which the copy source's running-mean loss is below halfway from its plateau
    (the highest running mean after the first 2·window steps) down to its floor: when the model has
    found the induction mechanism that copying needs. None: not within the run."""
    clean = [c for c in curve if math.isfinite(c)]
    run = [sum(clean[max(0, i - window + 1):i + 1]) / len(clean[max(0, i - window + 1):i + 1])
           for i in range(len(clean))]
    if len(run) <= 2 * window:
        return None
    mid = (max(run[2 * window:]) + floor) / 2
    return next((i + 1 for i in range(2 * window, len(run)) if run[i] < mid), None)


def table(r: dict) -> str:
    lines = [f"GEMM {r['shape']['M']}×{r['shape']['K']} · ({r['shape']['N']}×{r['shape']['K']})^T, "
             f"{len(r['outlier_channels'])} outlier channels at {r['headline_magnitude']:g}× "
             "(errors relative: x by RMS of the group, y by RMS(y), dgrad/wgrad by norm)",
             f"{'format':<11}{'x non-outl':>11}{'x outlier':>10}{'y p50':>9}{'y p90':>9}{'y p99':>9}"
             f"{'y max':>9}{'dgrad':>9}{'wgrad':>9}{'wgrad n-o':>10}"]
    for fmt, m in r["formats"].items():
        lines.append(f"{fmt:<11}{m['x_nonoutlier']:>11.2e}{m['x_outlier']:>10.2e}{m['y_p50']:>9.2e}"
                     f"{m['y_p90']:>9.2e}{m['y_p99']:>9.2e}{m['y_max']:>9.2e}{m['dgrad']:>9.2e}{m['wgrad']:>9.2e}"
                     f"{m['wgrad_nonoutlier']:>10.2e}")
    lines += ["", "non-outlier error of x vs outlier magnitude",
              f"{'magnitude':<11}" + "".join(f"{f:>12}" for f in FORMATS)]
    for i, mag in enumerate(r["sweep"]["magnitude"]):
        lines.append(f"{mag:<11g}" + "".join(f"{r['sweep'][f][i]:>12.2e}" for f in FORMATS))
    acc = r.get("accumulation")
    if acc:
        lines += ["", f"accumulation: FP8 block GEMM, accumulator of {ACC_BITS + 1} mantissa bits (truncating), "
                  "relative error vs the exact product of the same FP8 operands",
                  f"{'K':<11}{'no promotion':>14}{f'FP32 every {PROMOTE}':>16}"]
        lines += [f"{k:<11}{n:>14.2e}{p:>16.2e}" for k, n, p in zip(acc["K"], acc["none"], acc["promoted"])]
    t = r["training"]
    src = list(t["fp32"]["eval_by_source"])
    lines += ["", f"training: {t['fp32']['steps']} steps, {t['fp32']['params'] / 1e6:.2f}M-param dense+MoE model, "
              f"synthetic {' + '.join(src)} (eval loss per token)",
              f"{'recipe':<11}{'eval loss':>10}" + "".join(f"{n:>9}" for n in src) + f"{'copy found at':>15}{'seconds':>9}"]
    for name, run_ in t.items():
        found = run_["copy_transition_step"]
        lines.append(f"{name:<11}{run_['eval_loss']:>10.4f}" + "".join(f"{run_['eval_by_source'][n]:>9.4f}" for n in src)
                     + f"{f'step {found}' if found else 'not yet':>15}{run_['seconds']:>9.1f}")
    f = t["fp32"]
    lines.append(f"{'exact floor':<11}{f['floor']:>10.4f}" + "".join(f"{f['floor_by_source'][n]:>9.4f}" for n in src))
    lines.append(f"relative loss gap (fp8_block - fp32) / fp32: {r['loss_gap']:+.2%} overall, "
                 + ", ".join(f"{n} {g:+.2%}" for n, g in r["loss_gap_by_source"].items()))
    lines.append("NOTE: the copy source needs an induction head, which appears abruptly; a run that finds it "
                 "later shows a large gap\n      there until it does (and the step varies with the seed): "
                 "compare the markov gap for precision alone.")
    lines += [""] + [f"[{'ok' if v else 'FAIL'}] {k}" for k, v in r["checks"].items()]
    return "\n".join(lines)


def plot(r: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = r.get("accumulation")
    fig, axes = plt.subplots(1, 3 if acc else 2, figsize=(16.5 if acc else 11, 4))
    a, b = axes[0], axes[1]
    for fmt in FORMATS:
        a.loglog(r["sweep"]["magnitude"], r["sweep"][fmt], "o-", label=fmt)
    a.axhline(2 ** -4, color="k", ls=":", lw=1, label="E4M3 max rel. rounding 2^-4")
    a.set_xlabel("outlier channel magnitude (× typical)")
    a.set_ylabel("relative error, non-outlier elements")
    a.set_title("one outlier, one scale: who pays")
    a.legend(fontsize=8)
    a.grid(alpha=0.3, which="both")
    for (name, run_), color in zip(r["training"].items(), ("C0", "C3")):
        for (src, ys), ls in zip(run_["train_loss_by_source"].items(), ("-", "--", ":")):
            k = max(1, len(ys) // 30)
            smooth = [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
            b.plot(range(1, len(ys) + 1), smooth, color=color, ls=ls, label=f"{name} {src}")
    for src, fl in r["training"]["fp32"]["floor_by_source"].items():
        b.axhline(fl, color="k", lw=0.7, alpha=0.5)
    b.set_xlabel("step (thin lines: exact floors)")
    b.set_ylabel("train loss by source (nats/token)")
    b.set_title("fp32 vs fp8 block: " + ", ".join(f"{n} gap {g:+.2%}" for n, g in r["loss_gap_by_source"].items()))
    b.legend(fontsize=8)
    b.grid(alpha=0.3)
    if acc:
        c = axes[2]
        c.loglog(acc["K"], acc["none"], "o-", color="C3", label="narrow accumulator, no promotion")
        c.loglog(acc["K"], acc["promoted"], "o-", color="C0", label=f"promoted to FP32 every {PROMOTE}")
        c.set_xlabel("contraction length K")
        c.set_ylabel("relative error of y (same FP8 operands)")
        c.set_title(f"accumulation: at K={acc['K'][-1]} {acc['none'][-1]:.1%} → {acc['promoted'][-1]:.2%}")
        c.legend(fontsize=8)
        c.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
