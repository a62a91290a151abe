"""NVIDIA Transformer Engine backend: te.Linear under te.autocast with a recipe from the config.

    recipe: block    Float8BlockScaling   E4M3, 1×128 activations / 128×128 weights (DeepSeek-V3 style)
            current  Float8CurrentScaling one scale per tensor from this step's amax
            delayed  DelayedScaling       one scale per tensor from the max over `amax_history_len`
                                          past steps (stale by design: a spike saturates before it
                                          shows up in the history)
Same module policy as precision/fp8.py, except that the stacked MoE experts stay high precision
(te.GroupedLinear would need the experts' weights split into one parameter per expert).

Transformer Engine installs and imports only on a CUDA machine: everything here is behind `load_te`,
whose guard catches ImportError, RuntimeError and OSError (a missing libcuda surfaces as any of them).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from precision.recipe import SHORT, Recipe, dtype_from_cfg, mixed_precision_policy, module_roles, swap_module
from precision.table import ModuleDecision

NEEDS = "precision=te_fp8 needs NVIDIA Transformer Engine on a CUDA GPU (pip install .[te] on a GPU machine)"
ALIGN = 16  # te.Linear's FP8 GEMMs need both dims divisible by 16


class TeUnavailable(ValueError):
    """A ValueError, so train.py's config-error handler prints it as its one line and exits non-zero."""


def load_te():
    """(transformer_engine.pytorch, transformer_engine.common.recipe), or TeUnavailable in one line."""
    if not torch.cuda.is_available():
        raise TeUnavailable(f"{NEEDS}; this machine has no CUDA device")
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as te_recipe
    except (ImportError, RuntimeError, OSError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise TeUnavailable(f"{NEEDS}; import failed: {type(e).__name__}: {first}") from None
    return te, te_recipe


class TeRecipe(Recipe):
    name = "te_fp8"
    def __init__(self, cfg, device="cpu"):
        super().__init__(cfg, device)
        # the schema checks these options (precision/config.py)
        self.kind, self.fmt = cfg["recipe"], cfg["fp8_format"]  # resolved by name: PrecisionConfig.options()
        self.history, self.algo, self.margin = cfg["amax_history_len"], cfg["amax_compute_algo"], cfg["margin"]
        self.high = dtype_from_cfg(cfg, "autocast_dtype")
        # NOTE: checked at build, so a CPU run stops before any model is built or data is read.
        self.te, recipes = load_te()
        self.te_recipe = self._make_te_recipe(recipes)

    def _make_te_recipe(self, r):
        fmt = getattr(r.Format, self.fmt)
        if self.kind == "block":
            return r.Float8BlockScaling(fp8_format=fmt)
        if self.kind == "current":
            return r.Float8CurrentScaling(fp8_format=fmt)
        return r.DelayedScaling(margin=self.margin, fp8_format=fmt, amax_history_len=self.history,
                                amax_compute_algo=self.algo)

    def autocast(self):
        stack = contextlib.ExitStack()
        if self.high is not None:
            stack.enter_context(torch.autocast("cuda", dtype=self.high))
        # NOTE: te.autocast(recipe=) since TE 2.8; fp8_autocast(fp8_recipe=) before (now deprecated).
        if hasattr(self.te, "autocast"):
            stack.enter_context(self.te.autocast(enabled=True, recipe=self.te_recipe))
        else:
            stack.enter_context(self.te.fp8_autocast(enabled=True, fp8_recipe=self.te_recipe))
        return stack

    def fsdp_policy(self):
        return mixed_precision_policy(self.high, torch.float32 if self.high else None)

    def decide(self, model: nn.Module) -> list[ModuleDecision]:
        fp8 = f"fp8 via TE ({self.describe()})"
        high = SHORT[self.high] if self.high else "fp32"
        keep = {"embedding": "embedding", "head": "output head", "router": "MoE router (fp32 logits)",
                "norm": "normalisation", "attention": "attention core (SDPA)",
                "experts": "stacked expert weights: te.GroupedLinear not wired, kept high precision"}
        out = []
        for name, m, role in module_roles(model):
            if role in keep:
                out.append(ModuleDecision(name, type(m).__name__, high, keep[role]))
            elif role == "linear" and type(m) is nn.Linear:
                if m.in_features % ALIGN or m.out_features % ALIGN:
                    out.append(ModuleDecision(name, "Linear", high, f"dims {m.in_features}→{m.out_features} "
                                              f"not multiples of {ALIGN} (te.Linear FP8 alignment)"))
                    continue
                swap_module(model, name, self._te_linear(m))
                out.append(ModuleDecision(name, "te.Linear", fp8, "eligible Linear"))
        return out

    def _te_linear(self, m: nn.Linear) -> nn.Module:
        # NOTE: fp32 params (master weights); te.Linear quantises them per step under te.autocast.
        new = self.te.Linear(m.in_features, m.out_features, bias=m.bias is not None,
                             params_dtype=torch.float32, device=m.weight.device)
        with torch.no_grad():
            new.weight.copy_(m.weight)
            if m.bias is not None:
                new.bias.copy_(m.bias)
        return new

    def describe(self) -> str:
        if self.kind == "block":
            return f"Float8BlockScaling {self.fmt}: 1×128 activations, 128×128 weights"
        if self.kind == "current":
            return f"Float8CurrentScaling {self.fmt}: per-tensor, current amax"
        return f"DelayedScaling {self.fmt}: per-tensor, amax = {self.algo} of {self.history} steps, margin {self.margin}"

    def rows(self) -> dict[str, str]:
        high = SHORT[self.high] if self.high else "fp32"
        return {**super().rows(),
                "matmul inputs": f"fp8 for te.Linear ({self.describe()}); {high} elsewhere",
                "accumulation": "fp32 GEMM output (cuBLASLt; TE chooses split accumulation per GEMM)",
                "activations": f"{high} between layers",
                "master weights": "fp32 (te.Linear params_dtype=float32)",
                "gradients": "fp32 .grad; output gradients quantised inside TE's backward GEMMs"}
