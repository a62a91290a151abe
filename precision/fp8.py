"""FP8 recipes in plain PyTorch: block scaling (DeepSeek-V3 §3.3) and the per-tensor baseline.

Which modules go to FP8 (DeepSeek-V3 §3.3.1 keeps the rest in high precision):
    FP8    every nn.Linear of attention (qkv, proj_out) and of the MLPs (dense SwiGLU, shared expert),
           and the routed experts, quantised per expert (each expert's (2H, D) and (D, H) matrix is
           its own grid of 128×128 blocks)
    high   embedding, output head, MoE router, norms, attention core (QK^T, softmax, PV)
A Linear whose in/out features are not multiples of 16 (the FP8 GEMM alignment) stays high precision,
with the reason in the table. Other sizes are fine: a partial 128-tile is zero-padded, which changes
neither the amax nor the product (the CUDA kernel path needs whole 128-tiles and emulates otherwise).
"""
from __future__ import annotations

import torch
from torch import nn

from precision.fp8_gemm import fast_path_status
from precision.fp8_linear import Fp8GroupedExperts, Fp8Linear
from precision.recipe import SHORT, Recipe, dtype_from_cfg, mixed_precision_policy, module_roles, swap_module
from precision.table import ModuleDecision

ALIGN = 16
KEEP = {
    "embedding": "embedding (DeepSeek-V3 §3.3.1 keeps it in high precision)",
    "head": "output head (DeepSeek-V3 §3.3.1); the logits feed logsumexp",
    "router": "MoE router: fp32 logits decide the top-k (model/moe.py)",
    "norm": "normalisation (DeepSeek-V3 §3.3.1)",
    "attention": "attention core (QK^T, softmax, PV) stays high precision; qkv/proj_out are FP8 Linears",
}


class Fp8Recipe(Recipe):
    name = "fp8_block"

    def __init__(self, cfg, device="cpu"):
        super().__init__(cfg, device)
        self.scaling, self.name = cfg["scaling"], cfg["name"]  # resolved by name: PrecisionConfig.options()
        self.high = dtype_from_cfg(cfg, "autocast_dtype")  # None: non-FP8 ops in fp32
        # precision.fused_quant null: fused on CUDA only (the schema's comment says why)
        self.fused = self.device.type == "cuda" if cfg["fused_quant"] is None else cfg["fused_quant"]

    def autocast(self):
        if self.high is None:
            return super().autocast()
        return torch.autocast(self.device.type, dtype=self.high)

    def fsdp_policy(self):
        return mixed_precision_policy(self.high, torch.float32 if self.high else None)

    def decide(self, model: nn.Module) -> list[ModuleDecision]:
        fp8 = f"fp8 e4m3 ({self.grouping()})"
        high = SHORT[self.high] if self.high else "fp32"
        out = []
        for name, m, role in module_roles(model):
            if role in KEEP:
                out.append(ModuleDecision(name, type(m).__name__, high, KEEP[role]))
            elif isinstance(m, (Fp8Linear, Fp8GroupedExperts)):  # converted by an earlier call
                out.append(ModuleDecision(name, type(m).__name__, fp8, "already converted"))
            elif role == "experts":
                swap_module(model, name, Fp8GroupedExperts.from_experts(m, self.scaling, self.fused))
                out.append(ModuleDecision(name, "GroupedExperts", fp8, "routed experts, quantised per expert"))
            elif role == "linear":
                bad = [d for d in (m.in_features, m.out_features) if d % ALIGN]
                if bad:
                    out.append(ModuleDecision(name, "Linear", high, f"dims {m.in_features}→{m.out_features}: "
                                              f"{bad[0]} is not a multiple of {ALIGN} (FP8 GEMM alignment)"))
                    continue
                swap_module(model, name, Fp8Linear.from_linear(m, self.scaling, self.fused))
                pad = [d for d in (m.in_features, m.out_features) if d % 128] if self.scaling == "block" else []
                why = f"eligible Linear; dim {pad[0]} ends in a partial 128-tile (zero-padded)" if pad else "eligible Linear"
                out.append(ModuleDecision(name, "Linear", fp8, why))
        return out

    def grouping(self) -> str:
        if self.scaling == "block":
            return "x, dy: 1×128 tiles; W: 128×128 blocks; wgrad re-tiled 128×1"
        return "one scale per tensor"

    def notes(self) -> list[str]:
        gemm = fast_path_status()
        path = ("CPU: quantise → dequantise → fp32 matmul (emulation)" if self.device.type != "cuda" else
                "CUDA: torch scaled_mm where it supports the scaling, emulation elsewhere"
                + (f" ({'; '.join(f'{k}: {v}' for k, v in gemm.items())})" if gemm else ""))
        quant = ("quantiser: fused, one torch.compile'd function per kind (precision/quant_fused.py)" if self.fused
                 else "quantiser: eager (precision/quant.py)")
        setting = {None: "null (on for CUDA)", True: "true", False: "false"}[self.cfg["fused_quant"]]
        return super().notes() + [path, f"{quant}; precision.fused_quant={setting}"]

    def rows(self) -> dict[str, str]:
        high = SHORT[self.high] if self.high else "fp32"
        return {**super().rows(),
                "matmul inputs": (f"fp8 e4m3 for converted Linears ({self.grouping()}), online amax, "
                                  f"clamp ±448 before the cast; {high} elsewhere"),
                "accumulation": "fp32 (FP8 products summed in fp32)",
                "activations": f"{high} between layers (FP8 only inside the GEMMs)",
                "master weights": "fp32; FP8 copies made afresh from the parameters at every forward and backward",
                "gradients": "fp32 .grad; output gradients quantised to e4m3 inside the dgrad/wgrad GEMMs"}
