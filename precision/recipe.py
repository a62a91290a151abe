"""What a precision recipe answers, so train.py asks and never branches on a recipe's name.

    recipe.autocast()      context for each micro-batch's forward
    recipe.convert(model)  swap modules in place (before the optimizer is built); records decisions
    recipe.make_scaler()   a DynamicLossScaler, or None
    recipe.fsdp_policy()   FSDP2 MixedPrecisionPolicy (param all-gather / gradient reduce dtypes)
    recipe.table()         the PrecisionTable to print and save
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
from torch import nn

from model.moe import GroupedExperts, MoE
from model.attention import Attention
from optim.config import LossScaleConfig
from optim.scaler import DynamicLossScaler
from precision.table import ModuleDecision, PrecisionTable

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def mixed_precision_policy(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
    """FSDP2's MixedPrecisionPolicy (its import path moved in torch 2.6)."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def module_roles(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(name, module, role) for every module a recipe has an opinion on.

    Roles: embedding, head, router, norm, attention (the core: QK^T, softmax, PV inside SDPA),
    experts (stacked GroupedExperts weights), linear (every other nn.Linear: a conversion candidate).
    NOTE: the router and the head are found by position (MoE.router, the model's `head`), not by
    shape, so a renamed or resized layer cannot slip into FP8 unnoticed.
    """
    routers = {id(m.router) for m in model.modules() if isinstance(m, MoE)}
    head = getattr(model, "head", None)
    roles = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding):
            roles.append((name, m, "embedding"))
        elif m is head:
            roles.append((name, m, "head"))
        elif id(m) in routers:
            roles.append((name, m, "router"))
        elif isinstance(m, (nn.RMSNorm, nn.LayerNorm)) or type(m).__name__.endswith("Norm"):
            roles.append((name, m, "norm"))
        elif isinstance(m, Attention):
            roles.append((name, m, "attention"))
        elif isinstance(m, GroupedExperts):
            roles.append((name, m, "experts"))
        elif isinstance(m, nn.Linear):
            roles.append((name, m, "linear"))
    return roles


def swap_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def scaler_from_cfg(c: LossScaleConfig) -> DynamicLossScaler:
    """c: precision.loss_scale, checked by the schema (optim/config.py)."""
    return DynamicLossScaler(init_scale=float(c.init), growth_factor=float(c.growth_factor),
                             backoff_factor=float(c.backoff_factor), growth_interval=c.growth_interval,
                             min_scale=float(c.min_scale))


def dtype_from_cfg(cfg: Mapping, key: str) -> torch.dtype | None:
    v = cfg.get(key)  # checked by the schema (precision/config.py)
    return None if v is None else DTYPES[v]


class Recipe:
    """Base: FP32 everywhere. Subclasses override what they change."""

    name = "fp32"
    def __init__(self, cfg: Mapping, device: torch.device | str = "cpu"):
        """cfg: PrecisionConfig.options() (build_recipe makes it): the options this recipe reads."""
        self.cfg = dict(cfg)
        self.device = torch.device(device)
        self.modules: list[ModuleDecision] = []
        self.converted = False

    # --- what train.py calls ---------------------------------------------------------------------
    def autocast(self):
        return contextlib.nullcontext()

    def convert(self, model: nn.Module) -> nn.Module:
        self.modules = self.decide(model)
        self.converted = True
        return model

    def make_scaler(self) -> DynamicLossScaler | None:
        return None

    def fsdp_policy(self):
        return mixed_precision_policy(None, None)

    def fsdp_dtypes(self) -> dict[str, str]:
        """fsdp_policy() as parallel.wrap_model's options: {"param_dtype": ..., "reduce_dtype": ...}."""
        pol, names = self.fsdp_policy(), {v: k for k, v in DTYPES.items()}
        return {"param_dtype": names.get(pol.param_dtype, "float32"),
                "reduce_dtype": names.get(pol.reduce_dtype, "float32")}

    def table(self, sharded: bool = False) -> PrecisionTable:
        """sharded: the model is FSDP2-sharded (parallel.is_sharded). Its param_dtype then applies to EVERY
        parameter gathered for the forward, the fp32 ones of the table included: the table says so."""
        notes = [] if self.converted else ["convert(model) not called yet: module list omitted"]
        if self.converted and not self.modules:
            notes.append("every module computes in fp32")
        rows, modules = self.rows(), list(self.modules)
        gathered = self.fsdp_policy().param_dtype
        if sharded and gathered not in (None, torch.float32):
            lp = SHORT.get(gathered, str(gathered))
            # WARN: what runs, not what was meant: FSDP2 casts every all-gathered parameter to param_dtype,
            # so the embedding output, the norm weights and the router weights are low precision too.
            why = f"FSDP2 all-gathers every parameter in param_dtype={lp}"
            modules = [ModuleDecision(m.name, m.kind, f"{lp} params", why)
                       if m.precision == "fp32" and m.kind in ("Embedding", "RMSNorm") else
                       ModuleDecision(m.name, m.kind, f"fp32 compute on {lp} params", why)
                       if m.precision == "fp32" else m for m in modules]
            rows["activations"] = f"{lp}: the embedding output is {lp} (FSDP2 param_dtype), so the residual stream is {lp}"
            notes.append(f"FSDP2 param_dtype={lp}: embedding, norm and router weights are {lp} in the forward")
        return PrecisionTable(self.name, rows, modules, notes + self.notes())

    # --- what subclasses describe ----------------------------------------------------------------
    def decide(self, model: nn.Module) -> list[ModuleDecision]:
        return []

    def notes(self) -> list[str]:
        if self.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
            return ["torch.backends.cuda.matmul.allow_tf32 is on: FP32 matmuls round inputs to TF32"]
        return []

    def rows(self) -> dict[str, str]:
        return {
            "matmul inputs": "fp32",
            "accumulation": "fp32",
            "activations": "fp32",
            "master weights": "fp32",
            "gradients": "fp32 (.grad in the parameter dtype)",
            "reduction": "fp32 (loss sums, softmax/logsumexp, grad-norm sum of squares)",
            "communication": self.comm_row(),
            "optimizer state": "fp32 (AdamW exp_avg, exp_avg_sq)",
            "loss scaling": "none",
        }

    def comm_row(self) -> str:
        pol = self.fsdp_policy()
        gather = SHORT.get(pol.param_dtype, "fp32") if pol.param_dtype else "fp32"
        reduce = SHORT.get(pol.reduce_dtype, "fp32") if pol.reduce_dtype else "fp32"
        return f"DDP: fp32 gradient all-reduce; FSDP2: params all-gathered in {gather}, grads reduce-scattered in {reduce}"
