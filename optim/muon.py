"""Muon for the hidden matrices, AdamW for everything else, in one torch.optim.Optimizer.

Muon (Jordan et al. 2024; Moonlight, Liu et al. 2025) on a hidden weight W (m × n) with gradient G:

    M ← μ·M + G                          momentum (state "momentum_buffer")
    U = G + μ·M  (Nesterov)  or  M
    O = NS5(U)                           ≈ the orthogonal factor U·(UᵀU)^(-1/2): every singular value → ~1
    W ← (1 − η·λ)·W − η · s·√max(m, n) · O

NS5 is 5 Newton–Schulz steps of the quintic X ← a·X + (b·A + c·A²)·X, A = X·Xᵀ, (a, b, c) =
(3.4445, −4.7750, 2.0315) (Jordan's coefficients), from X₀ = U/‖U‖_F. It does not converge to exactly 1:
it pushes every singular value into a band around 1 fast (tests/test_muon.py states the band).

Update RMS matched to AdamW (Moonlight's rule): an orthogonal m × n matrix has RMS 1/√max(m, n), so
s·√max(m, n)·O has RMS ≈ s; with s = 0.2 (`optim.muon.rms_scale`) Muon's update is as large, element for
element, as AdamW's typical 0.2–0.4, and both share one learning rate and weight decay.

Which matrices: Muon owns a parameter iff build_optimizer's contract says it is a hidden matrix (no kind
among bias / norm / embedding / router / expert_bias, not the output head, 2-D or 3-D); AdamW owns the
rest. Fused matrices are orthogonalised per part (qkv: q, k, v rows; SwiGLU w_gate_up: gate, up rows):
orthogonalising the concatenation would couple matrices that play different roles. Stacked expert
weights (E, m, n) are E matrices: NS5 runs batched over the leading expert dimension.

Distributed: under DDP every rank holds the full, already averaged gradient, and NS5 is deterministic,
so the replicas stay bit-identical. Under FSDP2 a parameter is a DTensor sharded on dim 0; NS5 needs the
whole matrix (orthogonalising row shards separately is a different map, with an error that grows with
the number of shards), so the momentum-corrected U is gathered (DTensor.full_tensor), every rank
orthogonalises the full matrix, and takes back its own rows of O. Cost: one all-gather per hidden matrix
and the NS5 work repeated on every rank.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from precision.units import native_bf16

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def ns_dtype_for(setting: str, device: torch.device | str) -> tuple[str, str]:
    """optim.muon.ns_dtype on `device` (auto resolved), and why, one clause. bfloat16 saves only time, and only where
    the device multiplies it natively: elsewhere its emulated matmuls make NS5 slower than in float32, and NS5 is
    most of a Muon step on a small model."""
    if setting != "auto":
        return setting, f"optim.muon.ns_dtype={setting}"
    native, fact = native_bf16(device)
    return ("bfloat16" if native else "float32"), f"auto: {fact}"


def newton_schulz5(G: Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype = torch.float32) -> Tensor:
    """Approximate orthogonal factor of each trailing matrix of G (..., m, n), computed in `dtype`
    (float32, or bfloat16 as Jordan's reference runs it), returned in float32."""
    return _ns5(G, steps, eps, dtype).float()


def _ns5(G: Tensor, steps: int, eps: float, dtype: torch.dtype) -> Tensor:
    """newton_schulz5 in `dtype`, left in it."""
    a, b, c = NS_COEFFS
    X = G.to(dtype)
    transposed = X.shape[-2] > X.shape[-1]
    if transposed:  # NOTE: iterate on the wide side: A = X·Xᵀ is then the smaller Gram matrix
        X = X.mT
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + eps)  # σ_max ≤ ‖X‖_F = 1: inside NS's basin
    lead = X.shape[:-2]
    X = X.reshape(-1, *X.shape[-2:])
    for _ in range(steps):
        A = torch.bmm(X, X.mT)
        # NOTE: baddbmm folds the scalings into the GEMMs: b·A + c·A·A, then a·X + B·X, with no element-wise
        # pass between them (those passes cost as much as the matmuls for 128-wide matrices on a CPU)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a, alpha=1.0)
    X = X.reshape(*lead, *X.shape[-2:])
    return X.mT if transposed else X


def orthogonalise(U: Tensor, row_splits: list[int] | None, steps: int, rms_scale: float,
                  dtype: torch.dtype = torch.float32) -> Tensor:
    """s·√max(m, n)·NS5(U_part) for each row block of U (..., rows, n), concatenated back."""
    return orthogonalise_many([U], [row_splits], steps, rms_scale, dtype)[0]


def orthogonalise_many(Us: list[Tensor], row_splits: list[list[int] | None], steps: int, rms_scale: float,
                       dtype: torch.dtype = torch.float32) -> list[Tensor]:
    """orthogonalise() of each U, with the parts of equal shape run as ONE batched NS5."""
    return [torch.cat([o.float() * (rms_scale * s) for _, o, s in parts], dim=-2).to(U.dtype)
            for U, parts in zip(Us, orthogonal_parts(Us, row_splits, steps, dtype))]


def orthogonal_parts(Us: list[Tensor], row_splits: list[list[int] | None], steps: int,
                     dtype: torch.dtype = torch.float32) -> list[list[tuple[int, Tensor, float]]]:
    """For each U, its row blocks as (first row, NS5(block) in `dtype`, √max(m, n)); equal shapes batched.

    NOTE: a small model's hidden matrices are many small GEMMs (128 × 128: q, k, v, proj of every layer);
    one batched matmul over all of them runs several times faster on a CPU than a loop of small ones.
    Tall parts are transposed first, so a (320, 128) gate and a (128, 320) down projection share a batch.
    Each trailing matrix keeps its own Frobenius normalisation: batching changes no matrix's result
    beyond the matmul's summation order. The blocks are returned unscaled and uncast, so the caller can
    fold s·√max(m, n) into the update's alpha and add each block to its rows without a concatenation.
    """
    parts = [list(U.split(rs, dim=-2)) if rs else [U] for U, rs in zip(Us, row_splits)]
    starts = [[sum(rs[:j]) for j in range(len(rs))] if rs else [0] for rs in row_splits]
    by_shape: dict[tuple, list[tuple[int, int]]] = {}
    for i, ps in enumerate(parts):
        for j, P in enumerate(ps):
            wide = P.mT if P.shape[-2] > P.shape[-1] else P
            by_shape.setdefault(tuple(wide.shape), []).append((i, j))
    outs: list[list] = [[None] * len(ps) for ps in parts]
    for shape, where in by_shape.items():
        tall = [parts[i][j].shape[-2] > parts[i][j].shape[-1] for i, j in where]
        O = _ns5(torch.stack([parts[i][j].mT if t else parts[i][j] for (i, j), t in zip(where, tall)]), steps,
                 1e-7, dtype)
        for (i, j), t, o in zip(where, tall, O.unbind(0)):
            outs[i][j] = (starts[i][j], o.mT if t else o, math.sqrt(max(shape[-2:])))
    return outs


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Muon(torch.optim.Optimizer):
    """Param groups carry `optimizer` = "muon" or "adamw" (build_optimizer makes them), plus lr and
    weight_decay; `row_splits` maps a Muon parameter to the row sizes of its fused parts.

    State per parameter, both kept in checkpoints through state_dict(): Muon: momentum_buffer. AdamW:
    step (a float32 scalar tensor, as torch's AdamW), exp_avg, exp_avg_sq.
    """

    def __init__(self, groups: list[dict], lr: float, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, rms_scale: float = 0.2, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, row_splits: dict[int, list[int]] | None = None,
                 ns_dtype: str = "float32"):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, rms_scale=rms_scale,
                        betas=betas, eps=eps, weight_decay=weight_decay, optimizer="adamw")
        super().__init__(groups, defaults)
        # NOTE: keyed by the parameter's identity, not saved: derived from the model, like the groups.
        self.row_splits = row_splits or {}
        # NOTE: not a group's hyperparameter, so not saved: a speed choice of the machine the step runs on
        # (optim.muon.ns_dtype=auto, ns_dtype_for), made again by a resume on another one, where a checkpoint's
        # would carry an emulated bfloat16 over
        self.ns_dtype = NS_DTYPES[ns_dtype]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["optimizer"] == "muon":
                self._muon(group)
            else:
                self._adamw(group)
        return loss

    def _muon(self, group: dict) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        steps, scale, dtype = group["ns_steps"], group["rms_scale"], self.ns_dtype
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
        sharded = [p for p in params if isinstance(p.grad, DTensor)]
        for p in sharded:
            g, buf = p.grad, self.state[p]["momentum_buffer"]
            buf.mul_(mu).add_(g)
            U = g.add(buf, alpha=mu) if group["nesterov"] else buf
            # FSDP2: the full matrix for NS5, then this rank's rows of the result (every rank holds the
            # same full O, so no communication is needed to take the shard back: src_data_rank=None).
            O = orthogonalise(U.full_tensor(), self.row_splits.get(id(p)), steps, scale, dtype)
            O = distribute_tensor(O, U.device_mesh, U.placements, src_data_rank=None)
            pl = _local(p)
            pl.mul_(1.0 - lr * wd)
            pl.add_(_local(O), alpha=-lr)
        plain = [p for p in params if not isinstance(p.grad, DTensor)]
        if not plain:
            return
        # NOTE: the replicated matrices in foreach ops and one batched NS5 per shape: at 128 wide the
        # per-tensor Python and kernel launches cost as much as the arithmetic
        grads, bufs = [p.grad for p in plain], [self.state[p]["momentum_buffer"] for p in plain]
        torch._foreach_mul_(bufs, mu)
        torch._foreach_add_(bufs, grads)
        Us = torch._foreach_add(grads, bufs, alpha=mu) if group["nesterov"] else bufs
        parts = orthogonal_parts(Us, [self.row_splits.get(id(p)) for p in plain], steps, dtype)
        torch._foreach_mul_(plain, 1.0 - lr * wd)
        for p, blocks in zip(plain, parts):
            for start, o, root in blocks:  # W[rows] −= lr · s·√max(m, n) · NS5(U[rows])
                p.narrow(-2, start, o.shape[-2]).add_(o, alpha=-lr * scale * root)

    def _adamw(self, group: dict) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        b1, b2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = _local(p.grad)
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p.grad)
                state["exp_avg_sq"] = torch.zeros_like(p.grad)
            state["step"] += 1
            t = state["step"].item()
            m, v, pl = _local(state["exp_avg"]), _local(state["exp_avg_sq"]), _local(p)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            # torch's AdamW, term for term: θ ← θ(1 − ηλ) − (η/bc1) · m / (√v/√bc2 + ε)
            pl.mul_(1.0 - lr * wd)
            denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(eps)
            pl.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))


def fused_row_splits(model) -> dict[int, list[int]]:
    """id(parameter) → row sizes of its fused parts: attention qkv (q, k, v) and every SwiGLU w_gate_up
    (gate, up; a stacked expert weight (E, 2H, D) splits on its rows the same way)."""
    out = {}
    for module in model.modules():
        if hasattr(module, "qkv_row_splits"):
            out[id(module.qkv.weight)] = module.qkv_row_splits()
        w = getattr(module, "w_gate_up", None)
        w = getattr(w, "weight", w)
        if isinstance(w, torch.Tensor):
            out[id(w)] = [w.shape[-2] // 2] * 2
    return out


def split_groups(model, groups: list[dict], table: list[dict], adamw_patterns: list[str]):
    """Each decay group → its Muon part (hidden matrices) and its AdamW part; table rows likewise.

    A parameter with no AdamW kind that is not a 2-D / 3-D matrix has no owner: an error naming it, not a
    silent choice (a new 1-D scale or a 4-D tensor must be placed on purpose, via optim.muon.adamw).
    """
    from fnmatch import fnmatchcase

    from optim.groups import param_kinds

    kinds, names = param_kinds(model), {id(p): n for n, p in model.named_parameters()}
    head = getattr(model, "head", None)
    head_ids = {id(head.weight)} if head is not None else set()
    used = [False] * len(adamw_patterns)
    out_groups, out_table = [], []
    for g, row in zip(groups, table):
        parts = {"muon": [], "adamw": []}
        for p in g["params"]:
            n = names[id(p)]
            hits = [i for i, pat in enumerate(adamw_patterns) if fnmatchcase(n, pat)]
            for i in hits:
                used[i] = True
            if hits or kinds[n] or id(p) in head_ids:
                parts["adamw"].append(p)
            elif p.ndim in (2, 3):
                parts["muon"].append(p)
            else:
                raise ValueError(f"optim.muon.adamw: parameter {n} of shape {tuple(p.shape)} is no hidden "
                                 "matrix Muon can own (2-D, or 3-D stacked experts) and has no AdamW kind "
                                 "(bias, norm, embedding, router, expert_bias); list it in optim.muon.adamw")
        for opt, ps in parts.items():
            if not ps:
                continue
            out_groups.append({**g, "params": ps, "name": f"{g['name']}/{opt}", "optimizer": opt})
            out_table.append({**row, "group": f"{g['name']}/{opt}", "tensors": len(ps),
                              "parameters": sum(p.numel() for p in ps), "optimizer": opt})
    for i, ok in enumerate(used):
        if not ok:
            raise ValueError(f"optim.muon.adamw[{i}]={adamw_patterns[i]!r} matches no parameter")
    return out_groups, out_table
