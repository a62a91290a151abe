"""Local vs global gradient norm under sharding (docs/course.md §2): a rank's norm is not the model's.

    ‖g‖ = sqrt(Σ_ranks Σ_i g_i²)        g ← g · min(1, c / (‖g‖ + ε))

Ranks are emulated in one process: the gradient of one real step (optim/accumulate.py) is split into
`world` pieces two ways — FSDP2-style (every parameter's dim 0 cut into `world` row blocks) and
pipeline-style (contiguous groups of whole parameters). Each "rank" computes its local norm and the
clip coefficient it would apply alone; optim/clip.py's rule — each rank's sum of squares
(`_sum_of_squares`, the very function clip_grad_norm runs on its shard), one SUM all-reduce (here a
Python sum over the emulated ranks), then sqrt — must give the single-process norm that
clip_grad_norm computes on the whole model. Also shown: two wrong reductions (all-reducing the norms;
all-reducing the squares of a *replicated* DDP gradient, which counts it once per rank: √world too large).
"""
from __future__ import annotations

import math

import torch

from labs.claims.tiny import BATCH, MICRO, build, check_lines, figure, save
from labs.common import single_thread
from optim import clip
from optim.accumulate import count_valid_tokens, forward_backward

TITLE = "shard_norm: each rank's local grad norm and clip coefficient vs the global ones; √world double count"
EPS = 1e-6  # clip_grad_norm's default ε
C_FRACTION = 0.8  # the clip threshold c as a fraction of the true global norm: the global clip bites


def _partitions(grads: list[torch.Tensor], world: int) -> dict[str, list[list[torch.Tensor]]]:
    """partition name -> for each rank, the gradient pieces it holds."""
    # NOTE: tensor_split always returns `world` pieces (FSDP2 pads instead; the norm is the same)
    rows = [g.tensor_split(world, dim=0) for g in grads]
    fsdp = [[pieces[r] for pieces in rows] for r in range(world)]
    bounds = [round(i * len(grads) / world) for i in range(world + 1)]
    pipeline = [grads[bounds[r]:bounds[r + 1]] for r in range(world)]
    return {"fsdp_dim0": fsdp, "pipeline": pipeline}


def _norm_of(pieces: list[torch.Tensor]) -> float:
    return clip._sum_of_squares(pieces, torch.device("cpu")).sqrt().item()


def run(seed: int, quick: bool = False, world: int = 2) -> dict:
    """world: number of emulated ranks (world=1 leaves nothing to get wrong)."""
    with single_thread():
        dataset, model = build(seed)
        batch = dataset.samples(range(BATCH if quick else 4 * BATCH))
        micro = batch.micro_batches(MICRO)
        forward_backward(model, micro, count_valid_tokens(micro, "cpu"), 0.0, 1, len(dataset.source_names))
        params = list(model.parameters())
        grads = [p.grad.detach().clone() for p in params]
        exact = torch.cat([g.flatten().double() for g in grads]).norm().item()  # FP64, by hand
        single, _ = clip.clip_grad_norm(params, None)  # the repository's single-process norm
        single = single.item()
        c = C_FRACTION * single
        _, coef_single = clip.clip_grad_norm(params, c)  # and its clip, applied in place
        clipped_single = torch.cat([p.grad.flatten() for p in params])

    parts = {}
    for name, ranks in _partitions(grads, world).items():
        local = [_norm_of(pieces) for pieces in ranks]
        sq = sum(clip._sum_of_squares(pieces, torch.device("cpu")) for pieces in ranks)  # the SUM all-reduce
        rule = sq.sqrt().item()
        local_coef = [min(1.0, c / (n + EPS)) for n in local]
        # what the optimizer would see if every rank clipped with its own coefficient
        flat = [torch.cat([p.flatten() for p in pieces]).double() for pieces in ranks]
        clipped_local = torch.cat([f * k for f, k in zip(flat, local_coef)])
        reorder = torch.cat(flat)
        clipped_true = reorder * coef_single.item()
        parts[name] = {"local_norm": local, "local_coef": local_coef, "rule_norm": rule,
                       "rule_rel_err": abs(rule - exact) / exact, "sum_of_norms": sum(local),
                       "cosine_local_vs_global": torch.nn.functional.cosine_similarity(
                           clipped_local, clipped_true, dim=0).item(),
                       "update_norm_ratio": (clipped_local.norm() / clipped_true.norm()).item()}
    replicated = math.sqrt(sum(clip._sum_of_squares(grads, torch.device("cpu")).item() for _ in range(world)))

    coef = coef_single.item()
    checks = {
        "every rank's local norm differs from the global norm":
            all(abs(n - single) > 1e-3 * single for p in parts.values() for n in p["local_norm"]),
        "some rank's local clip coefficient differs from the global one":
            all(any(abs(k - coef) > 1e-3 for k in p["local_coef"]) for p in parts.values()),
        "clip.py rule (Σ_ranks Σ g² then sqrt) = single-process norm (rel err <= 1e-6)":
            all(p["rule_rel_err"] <= 1e-6 for p in parts.values()) and abs(single - exact) <= 1e-6 * exact,
        f"all-reducing a replicated grad's squares gives √world = {math.sqrt(world):.4f}× the norm":
            abs(replicated / single - math.sqrt(world)) <= 1e-5,
        "clip_grad_norm leaves the clipped single-process grad at norm c":
            abs(clipped_single.norm().item() - c) <= 1e-4 * c,
    }
    r = {"seed": seed, "quick": quick, "world": world, "global_norm": single, "global_norm_fp64": exact,
         "max_norm": c, "global_coef": coef, "partitions": parts, "replicated_allreduce_norm": replicated,
         "checks": checks, "ok": all(checks.values())}
    r["table"] = table(r)
    return r


def table(r: dict) -> str:
    g, c, W = r["global_norm"], r["max_norm"], r["world"]
    lines = [f"one step's gradient, {W} emulated ranks; global norm ‖g‖ = {g:.6f} (FP64 by hand "
             f"{r['global_norm_fp64']:.6f}); clip c = {C_FRACTION}·‖g‖ = {c:.4f} → global coef {r['global_coef']:.4f}",
             "", f"{'partition':<11}{'rank':>5}{'local norm':>12}{'local/global':>14}{'local coef':>12}"
             f"{'global coef':>13}"]
    for name, p in r["partitions"].items():
        for i, (n, k) in enumerate(zip(p["local_norm"], p["local_coef"])):
            lines.append(f"{name if i == 0 else '':<11}{i:>5}{n:>12.6f}{n / g:>14.4f}{k:>12.4f}{r['global_coef']:>13.4f}")
    lines += ["", f"{'partition':<11}{'clip.py rule':>14}{'rel err':>10}{'Σ local norms':>15}"
              f"{'cos(local-clipped, global-clipped)':>36}{'‖update‖ ratio':>16}"]
    for name, p in r["partitions"].items():
        lines.append(f"{name:<11}{p['rule_norm']:>14.6f}{p['rule_rel_err']:>10.1e}{p['sum_of_norms']:>15.6f}"
                     f"{p['cosine_local_vs_global']:>36.6f}{p['update_norm_ratio']:>16.4f}")
    lines += ["", f"replicated (DDP) gradient, squares all-reduced over {W} ranks: {r['replicated_allreduce_norm']:.6f} "
              f"= {r['replicated_allreduce_norm'] / g:.6f}·‖g‖ (√{W} = {math.sqrt(W):.6f}); clip.py sums a "
              "replicated gradient locally, without the all-reduce"]
    return "\n".join(lines + [""] + check_lines(r["checks"]))


def plot(r: dict, path) -> None:
    fig, (a, b) = figure(2)
    names = list(r["partitions"])
    W = r["world"]
    for j, name in enumerate(names):
        p = r["partitions"][name]
        xs = [j * (W + 2) + i for i in range(W)]
        a.bar(xs, p["local_norm"], label=f"{name}: local norms")
        b.bar(xs, p["local_coef"], label=f"{name}: local coef")
    for ax, y, lab in ((a, r["global_norm"], "global norm"), (b, r["global_coef"], "global coef")):
        ax.axhline(y, color="k", ls="--", lw=1, label=lab)
        ax.set_xticks([])
        ax.legend(fontsize=8)
    a.axhline(r["replicated_allreduce_norm"], color="C3", ls=":", lw=1, label="replicated, squares all-reduced")
    a.legend(fontsize=8)
    a.set_title("grad norm seen by each rank")
    b.set_title(f"clip coefficient each rank would apply (c = {r['max_norm']:.3f})")
    save(fig, path)
