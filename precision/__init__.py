"""Precision recipes (fp32, bf16, fp16, fp8_block, fp8_tensor, te_fp8) and the per-run precision table.

    recipe = build_recipe(cfg.precision, device)   # a Recipe: autocast, convert, scaler, FSDP policy, table
    model = recipe.convert(model)                   # before the optimizer: it may swap modules
    ... forward_backward(..., autocast=recipe.autocast, loss_scale=scaler.scale if scaler else None)
    result = optimizer_step(model.parameters(), optimizer, scaler, max_grad_norm)
"""
from __future__ import annotations

import torch

from precision.amp import Bf16Recipe, Fp16Recipe
from precision.config import RECIPES, PrecisionConfig
from precision.fp8 import Fp8Recipe
from precision.recipe import Recipe
from precision.step import StepResult, optimizer_step
from precision.table import ModuleDecision, PrecisionTable

# NOTE: te_fp8 is imported lazily: precision/te.py is import-safe, but nothing pays for it unless asked.


def build_recipe(cfg: PrecisionConfig, device: torch.device | str = "cpu") -> Recipe:
    """The recipe named by precision.name, from precision.* (checked by the schema)."""
    cfg = cfg.options()  # the options this recipe reads, the by-name defaults filled in
    name = cfg["name"]
    if name == "fp32":
        return Recipe(cfg, device)
    if name == "bf16":
        return Bf16Recipe(cfg, device)
    if name == "fp16":
        return Fp16Recipe(cfg, device)
    if name in ("fp8_block", "fp8_tensor"):
        return Fp8Recipe(cfg, device)
    if name == "te_fp8":
        from precision.te import TeRecipe
        return TeRecipe(cfg, device)
    raise AssertionError(name)  # unreachable: the schema admits only RECIPES


__all__ = ["RECIPES", "ModuleDecision", "PrecisionTable", "Recipe", "StepResult", "build_recipe",
           "optimizer_step"]
