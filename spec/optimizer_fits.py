"""The algebra refits a failing optimizer check (spec/checks/optimizer.py classify) reads its kind from: a moment off
its algebra is the state's fault unless it is exactly that algebra for another input — the gradient with the decay
added (Adam's L2), or the gradient times another factor than the clip's. Each fit solves for its one unknown by
least squares over the group's probe elements and judges the residual by the moments' own tolerances."""
from __future__ import annotations

import torch
from torch import Tensor

from spec.tolerance import SAFETY, U32


def l2_decay(moments, w: Tensor, sel: Tensor) -> bool:
    """Whether AdamW's moments on the elements `sel` are their algebra for the gradient g + λ·w with one λ ≠ 0: Adam's
    L2 term, the decay added to the gradient instead of applied to the weight apart. m' − g = β·(m − g) + (1 − β)·λ·w:
    β and c = (1 − β)·λ by least squares, then v' − y = β₂·(v − y) with y = (g + λ·w)², one β₂; each judged by its
    moment's own tolerance, widened for the gradient g' = g + λ·w: its sum is one rounding more, and the algebra's
    roundings scale with |g'| ≤ |g| + |λ·w| (m: its 2 and the sum's 1; v: its 3 and the sum's, twice through g'²)."""
    (m1, m0, g, tol_m), (v1, v0, _, tol_v) = moments[:2]
    g, w = g[sel], w[sel]
    A, z = torch.stack([m0[sel] - g, w], -1), m1[sel] - g
    beta, c = torch.linalg.lstsq(A, z[:, None]).solution[:, 0]
    if not bool(c != 0) or not bool(beta < 1):
        return False
    lam = c / (1 - beta)
    big = g.abs() + (lam * w).abs()  # a bound on |g'|
    if not bool(((z - A @ torch.stack([beta, c])).abs() <= tol_m[sel] + (1 - beta) * SAFETY * 3 * U32 * big).all()):
        return False
    y = (g + lam * w).square()
    x, z = v0[sel] - y, v1[sel] - y
    beta2 = (x * z).sum() / x.square().sum().clamp(min=1e-300)
    return bool(((z - beta2 * x).abs() <= tol_v[sel] + (1 - beta2) * SAFETY * 5 * U32 * big.square()).all())


def other_factor(moments, sel: Tensor, b1: float, b2: float) -> bool:
    """Whether AdamW's moments on the elements `sel` are their algebra for the gradient r·g with one factor r ≠ 1, g the
    gradient the specification gives (the backward's times the clip policy's coefficient): the gradient was multiplied
    by another factor than the clip's (a clip computed and not applied, applied twice, a scaling after it).
    m' − β1·m = (1 − β1)·r·g gives r by least squares; v' − β2·v = (1 − β2)·r²·g² must then hold too. Both are judged by
    their moment's tolerance, scaled by max(|r|, 1) (its square for v): the algebra's roundings grow with the gradient
    it was given."""
    (m1, m0, g, tol_m), (v1, v0, _, tol_v) = moments[:2]
    sel = sel & (g != 0)
    if not bool(sel.any()):
        return False
    x, z = (1 - b1) * g[sel], m1[sel] - b1 * m0[sel]
    r = (x * z).sum() / x.square().sum().clamp(min=1e-300)
    big = max(abs(float(r)), 1.0)
    if not bool(((z - r * x).abs() <= big * tol_m[sel]).all()):
        return False
    zv = v1[sel] - b2 * v0[sel] - (1 - b2) * r.square() * g[sel].square()
    if not bool((zv.abs() <= big ** 2 * tol_v[sel]).all()):
        return False
    return bool(((r - 1).abs() * x.abs() > tol_m[sel]).any())  # a factor the moments' tolerance cannot hide
