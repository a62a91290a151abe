"""Autograd against central finite differences on sampled coordinates, in float64.

    g_fd[i] = (f(θ + h·e_i) − f(θ − h·e_i)) / 2h,    rel = ‖g_ad − g_fd‖ / max(‖g_ad‖, ‖g_fd‖, tiny)

In float64 the central difference has truncation error ~h²·f'''/6 and rounding error ~ε·|f|/h
(ε = 2^-53); h = 1e-5 keeps both near 1e-10, far below the 1e-6 a wrong backward cannot reach.

Piecewise-smooth functions (top-k routing, hard clamps) have a gradient only inside a piece. The
objective therefore also returns its *region* (the chosen expert ids, the clamp masks): a coordinate
whose perturbation θ±h changes the region straddles a kink or a tie, and is skipped and re-drawn.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

H = 1e-5
TINY = 1e-30

# objective() -> (scalar loss, region): region is any nest of tensors/tuples/dicts, or None.
Objective = Callable[[], tuple[Tensor, Any]]


def same_region(a, b) -> bool:
    """Equal nests of tensors (exactly), tuples/lists and dicts."""
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and a.keys() == b.keys() and all(same_region(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(map(same_region, a, b))
    return a == b


def rel_err(g_ad: Tensor, g_fd: Tensor) -> float:
    den = max(g_ad.norm().item(), g_fd.norm().item(), TINY)
    return (g_ad - g_fd).norm().item() / den


def autograd_grads(objective: Objective, tensors: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], Any]:
    """d loss / d tensor for every named leaf (zeros where the loss does not depend on it)."""
    loss, region = objective()
    leaves = list(tensors.values())
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return {n: torch.zeros_like(t) if g is None else g.detach()
            for (n, t), g in zip(tensors.items(), grads)}, region


@torch.no_grad()
def _at(objective: Objective, flat: Tensor, i: int, value: float):
    old = flat[i].item()
    flat[i] = value
    try:
        loss, region = objective()
    finally:
        flat[i] = old
    return loss.item(), region


def fd_check(objective: Objective, tensors: Mapping[str, Tensor], n_coords: int, gen: torch.Generator,
             h: float = H, max_skips: int | None = None) -> dict:
    """Compare autograd with central differences on n_coords coordinates drawn over `tensors`.

    Each coordinate picks a tensor uniformly (so a 32-element norm gain is checked as often as a large
    matrix), then an index. Coordinates whose ±h perturbation changes the objective's region are
    skipped and re-drawn (at most max_skips times, default 4·n_coords). Returns the checked count,
    skipped count, rel error, and g_ad / g_fd as lists (for the report and the plot).
    """
    for name, t in tensors.items():
        if t.dtype != torch.float64 or not t.is_leaf or not t.requires_grad:
            raise ValueError(f"gradcheck tensor {name}: needs a float64 leaf with requires_grad "
                             f"(got {t.dtype}, leaf={t.is_leaf}, requires_grad={t.requires_grad})")
    grads, region0 = autograd_grads(objective, tensors)
    names = list(tensors)
    max_skips = 4 * n_coords if max_skips is None else max_skips
    g_ad, g_fd, where, seen, skipped = [], [], [], set(), 0
    while len(g_ad) < n_coords:
        name = names[int(torch.randint(len(names), (), generator=gen))]
        t = tensors[name]
        i = int(torch.randint(t.numel(), (), generator=gen))
        if (name, i) in seen:
            if len(seen) >= sum(x.numel() for x in tensors.values()):
                break  # every coordinate has been tried
            continue
        seen.add((name, i))
        # NOTE: .data: the in-place perturbation must not enter autograd's version counter checks.
        flat = t.data.view(-1)
        x = flat[i].item()
        f_plus, r_plus = _at(objective, flat, i, x + h)
        f_minus, r_minus = _at(objective, flat, i, x - h)
        if not (same_region(region0, r_plus) and same_region(region0, r_minus)):
            skipped += 1
            if skipped > max_skips:
                raise RuntimeError(f"gradcheck: {skipped} coordinates straddle a kink or tie; "
                                   "move the test point away from it")
            continue
        g_fd.append((f_plus - f_minus) / (2 * h))
        g_ad.append(grads[name].view(-1)[i].item())
        where.append(f"{name}[{i}]")
    ad, fd = torch.tensor(g_ad, dtype=torch.float64), torch.tensor(g_fd, dtype=torch.float64)
    return {"coords": len(g_ad), "skipped": skipped, "rel_err": rel_err(ad, fd),
            "max_abs_err": (ad - fd).abs().max().item() if len(g_ad) else 0.0,
            "grad_norm": ad.norm().item(), "g_ad": g_ad, "g_fd": g_fd, "where": where}
