"""Muon's orthogonalisation from its definition, in float64: the optimizer check's oracle (spec/checks/optimizer.py).

    X₀ = U / (‖U‖_F + 1e-7)      (the wide orientation: X·Xᵀ the smaller Gram matrix)
    X ← a·X + (b·A + c·A²)·X,  A = X·Xᵀ,  (a, b, c) = (3.4445, −4.7750, 2.0315)    (Jordan et al. 2024)

each fused matrix orthogonalised per part: attention's qkv as q, k, v rows; a SwiGLU w_gate_up (or a stack of
experts' (E, 2H, D)) as its gate and up halves — what the algorithm owns per part, read from the model's config.

`orthogonalised` evaluates the same iteration on the Gram matrix's eigenvalues. Each iteration keeps X's singular
vectors and maps every singular value σ to φ(σ) = a·σ + b·σ³ + c·σ⁵, so with X₀·X₀ᵀ = Q·diag(λ)·Qᵀ (λ = σ²)

    X₅ = Q·diag(ρ)·Qᵀ·X₀,   ρ₀ = 1,  ρ_{k+1} = ρ_k·(a + b·ρ_k²·λ + c·ρ_k⁴·λ²)   (ρ_k = σ_k/σ₀, defined at λ = 0)

one product X₀·X₀ᵀ, one symmetric eigendecomposition and two products in FP64 instead of five iterations of three
products (tests/test_muon.py holds it to the iteration).
"""
from __future__ import annotations

import torch
from torch import Tensor

COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(U: Tensor, steps: int) -> Tensor:
    a, b, c = COEFFS
    X = U.double()
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    X = X / (X.square().sum((-2, -1), keepdim=True).sqrt() + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def orthogonalised(U: Tensor, steps: int) -> Tensor:
    """newton_schulz(U, steps) from the Gram matrix's eigendecomposition (this module's doc), in float64; leading
    dims are a batch of matrices."""
    a, b, c = COEFFS
    X = U.double()
    tall = X.shape[-2] > X.shape[-1]
    if tall:  # the wide orientation, as the iteration takes it
        X = X.mT
    X = X / (X.square().sum((-2, -1), keepdim=True).sqrt() + 1e-7)
    lam, Q = torch.linalg.eigh(X @ X.mT)
    lam = lam.clamp(min=0)  # a Gram matrix's eigenvalues, ≥ 0 but for the decomposition's rounding
    rho = torch.ones_like(lam)
    for _ in range(steps):
        s = rho.square() * lam
        rho = rho * (a + b * s + c * s.square())
    O = (Q * rho[..., None, :]) @ (Q.mT @ X)
    return O.mT if tall else O


def row_parts(name: str, model_cfg, W: Tensor) -> list[int]:
    """The row sizes of a fused matrix's parts (the whole matrix when it is not fused)."""
    rows = W.shape[-2]
    if name.endswith("attn.qkv.weight"):
        H, K, d = model_cfg.n_heads, model_cfg.kv_heads, model_cfg.head_dim
        return [H * d, K * d, K * d]
    if "w_gate_up" in name:
        return [rows // 2, rows // 2]
    return [rows]
