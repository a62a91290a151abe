"""A mean per micro-batch over-weights short samples; token normalisation does not (docs/course.md §7).

The step's objective is the mean loss per valid label token of the whole batch, L = Σ ce / N. With M
micro-batches of n_1..n_M valid tokens:

    token-normalised (optim/accumulate.py):  Σ_m Σ_tok ce / N        every token weighs 1/N
    mean of micro-batch means:               (1/M) Σ_m Σ_tok ce / n_m  a token of micro-batch m weighs 1/(M·n_m)

so a token in a micro-batch of short samples counts N/(M·n_m) times what it should. The lab builds a
batch whose micro-batches hold unequal token counts (samples bucketed by length, as a length-grouping
sampler would do) and compares both accumulated gradients with the one-pass full-batch gradient.
The wrong scheme is the repository's own forward_backward, handed the per-micro-batch count.
"""
from __future__ import annotations

import torch

from labs.claims.tiny import build, check_lines, figure, save
from labs.common import single_thread
from model import IGNORE_INDEX
from optim.accumulate import count_valid_tokens, forward_backward

TITLE = "microbatch_mean: token-normalised accumulation = full batch; a mean of micro-batch means is not"
TOL = 1e-6


def _grads(model) -> torch.Tensor:
    g = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    model.zero_grad(set_to_none=True)
    return g


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).norm() / ref.norm()).item()


def run(seed: int, quick: bool = False, equal_lengths: bool = False) -> dict:
    """equal_lengths: every document fills the window, so all micro-batches hold the same count and
    the two schemes coincide (the effect disappears)."""
    n_samples, M = (8, 4) if quick else (32, 4)
    with single_thread():
        dataset, model = build(seed, {"min_doc_len": 33} if equal_lengths else None)
        n_src = len(dataset.source_names)
        pool = dataset.samples(range(4 * n_samples))
        n_valid_pool = (pool.labels != IGNORE_INDEX).sum(1)
        # Length-bucketed batch: take n_samples samples spread over the length range, sorted, so the
        # first micro-batch holds the shortest samples and the last the longest.
        order = torch.argsort(n_valid_pool, stable=True)[torch.linspace(0, 4 * n_samples - 1, n_samples).long()]
        batch = dataset.samples(pool.sample_ids[order].tolist())
        micro = batch.micro_batches(M)
        n_mb = [mb.n_valid for mb in micro]

        out = model(batch.tokens, batch.labels)  # the reference: one pass over the whole batch
        (out.loss_sum / out.n_valid).backward()
        g_full = _grads(model)

        forward_backward(model, micro, count_valid_tokens(micro, "cpu"), 0.0, 1, n_src)
        g_token = _grads(model)
        for mb in micro:  # mean of means: each micro-batch normalised by its own count, then ÷ M
            forward_backward(model, [mb], count_valid_tokens([mb], "cpu") * M, 0.0, 1, n_src)
        g_means = _grads(model)

    N = sum(n_mb)
    per_sample = (batch.labels != IGNORE_INDEX).sum(1).tolist()
    short, long_ = per_sample.index(min(per_sample)), per_sample.index(max(per_sample))
    mb_of = lambda i: i // (n_samples // M)  # noqa: E731
    weights = {name: {"valid_tokens": per_sample[i], "micro_batch": mb_of(i), "token_norm": 1 / N,
                      "mean_of_means": 1 / (M * n_mb[mb_of(i)])}
               for name, i in (("short", short), ("long", long_))}
    err_token, err_means = _rel(g_token, g_full), _rel(g_means, g_full)
    checks = {
        f"micro-batches hold unequal valid-token counts {n_mb}": len(set(n_mb)) > 1,
        f"token-normalised accumulated grad = full-batch grad (rel err <= {TOL:g})": err_token <= TOL,
        "mean of micro-batch means differs from the full-batch grad (rel err > 1e-3)": err_means > 1e-3,
        "mean of means gives a short sample's token more weight than a long one's":
            weights["short"]["mean_of_means"] > weights["long"]["mean_of_means"],
    }
    r = {"seed": seed, "quick": quick, "equal_lengths": equal_lengths, "micro_batches": M,
         "valid_tokens_by_micro_batch": n_mb, "valid_tokens_by_sample": per_sample, "total_valid_tokens": N,
         "rel_err_token_norm": err_token, "rel_err_mean_of_means": err_means, "token_weights": weights,
         "checks": checks, "ok": all(checks.values())}
    r["table"] = table(r)
    return r


def table(r: dict) -> str:
    M, n_mb, N = r["micro_batches"], r["valid_tokens_by_micro_batch"], r["total_valid_tokens"]
    lines = [f"{len(r['valid_tokens_by_sample'])} samples in {M} micro-batches, bucketed by length; "
             f"valid tokens per micro-batch {n_mb} (N = {N})", "",
             f"{'scheme':<34}{'rel. error vs full-batch grad':>30}",
             f"{'token-normalised (Σ ce / N)':<34}{r['rel_err_token_norm']:>30.2e}",
             f"{'mean of micro-batch means':<34}{r['rel_err_mean_of_means']:>30.2e}", "",
             "weight of one token in the step objective",
             f"{'sample':<8}{'valid tokens':>13}{'micro-batch':>12}{'token-norm 1/N':>16}{'mean-of-means':>15}"
             f"{'over-weight':>13}"]
    for name, w in r["token_weights"].items():
        lines.append(f"{name:<8}{w['valid_tokens']:>13}{w['micro_batch']:>12}{w['token_norm']:>16.2e}"
                     f"{w['mean_of_means']:>15.2e}{w['mean_of_means'] / w['token_norm']:>12.2f}×")
    return "\n".join(lines + [""] + check_lines(r["checks"]))


def plot(r: dict, path) -> None:
    fig, (a, b) = figure(2)
    n_mb, N, M = r["valid_tokens_by_micro_batch"], r["total_valid_tokens"], r["micro_batches"]
    x = range(len(n_mb))
    a.bar([i - 0.2 for i in x], [1 / N] * len(n_mb), 0.4, label="token-normalised 1/N")
    a.bar([i + 0.2 for i in x], [1 / (M * n) for n in n_mb], 0.4, label="mean of means 1/(M·n_m)")
    a.set_xticks(list(x), [f"mb {i}\nn={n}" for i, n in enumerate(n_mb)])
    a.set_ylabel("weight of one token")
    a.set_title("per-token weight by micro-batch")
    a.legend(fontsize=8)
    b.bar(["token-normalised", "mean of means"], [max(r["rel_err_token_norm"], 1e-12), r["rel_err_mean_of_means"]])
    b.set_yscale("log")
    b.axhline(TOL, color="k", ls=":", lw=1, label=f"tolerance {TOL:g}")
    b.set_ylabel("rel. error vs one-pass full-batch gradient")
    b.legend(fontsize=8)
    save(fig, path)
