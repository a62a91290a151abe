"""AdamW over the parameter-group contract.

    θ ← (1 − η·λ)·θ − η · m̂ / (√v̂ + ε)

Weight decay is decoupled (AdamW, Loshchilov & Hutter): λ shrinks θ directly and never enters the
adaptive denominator, so a group with λ = 0 (biases, norms, embeddings, router) is never pulled to 0.
"""

import torch
import torch.nn as nn

from optim.config import OptimConfig
from optim.groups import build_param_groups
from optim.muon import Muon, fused_row_splits, ns_dtype_for, split_groups
from run.config_errors import typed


def _fused_supported(params: list[torch.Tensor]) -> bool:
    """True when torch has a fused AdamW kernel for every param's device and dtype."""
    try:  # WARN: private helper; if torch moves it we lose fusion, not correctness.
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
    except ImportError:
        return False
    devices = _get_fused_kernels_supported_devices()
    return all(p.device.type in devices and torch.is_floating_point(p) for p in params)


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> tuple[torch.optim.Optimizer, list[dict]]:
    """AdamW (fused where supported, else foreach) over build_param_groups(model, cfg), and its table;
    or, with optim.name=muon, Muon on the hidden matrices and AdamW on the rest (optim/muon.py).

    cfg is the `optim` group's OptimConfig (its schema checked betas, eps, lr and the rules: optim/config.py).
    """
    cfg = typed(cfg, OptimConfig, "build_optimizer")
    betas, eps = tuple(float(b) for b in cfg.betas), float(cfg.eps)
    kind = cfg.name

    groups, table = build_param_groups(model, cfg)
    params = [p for g in groups for p in g["params"]]
    # NOTE: AdamW allocates m and v like the parameter, so FP32 masters are what keep the moments FP32.
    for name, p in model.named_parameters():
        if p.requires_grad and p.dtype != torch.float32:
            raise ValueError(f"optim: parameter {name} is {p.dtype}; "
                             "optimizer state needs FP32 master weights")

    if kind == "muon":
        mc = cfg.muon
        groups, table = split_groups(model, groups, table, list(mc.adamw))
        opt = Muon(groups, lr=float(cfg.lr), betas=betas, eps=eps, weight_decay=float(cfg.weight_decay),
                   row_splits=fused_row_splits(model), momentum=float(mc.momentum), nesterov=bool(mc.nesterov),
                   ns_steps=int(mc.ns_steps), rms_scale=float(mc.rms_scale),
                   ns_dtype=ns_dtype_for(str(mc.ns_dtype), params[0].device)[0])
        return opt, table
    table = [{**row, "optimizer": "adamw"} for row in table]
    fused = _fused_supported(params)
    opt = torch.optim.AdamW(groups, lr=float(cfg.lr), betas=betas, eps=eps,
                            weight_decay=float(cfg.weight_decay),
                            fused=fused, foreach=not fused)
    return opt, table
