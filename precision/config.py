"""The `precision` group's schema: one dataclass for every recipe (the union of their options), and the
rule that a recipe refuses an option it does not read (precision/__init__.py builds the recipe)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from optim.config import LossScaleConfig
from run.config_errors import check, choice, unused_keys

RECIPES = ("fp32", "bf16", "fp16", "fp8_block", "fp8_tensor", "te_fp8")
SCALINGS = ("block", "tensor")
TE_RECIPES = ("block", "current", "delayed")
TE_FORMATS = ("E4M3", "HYBRID")
_USED = {  # options each recipe reads, beside name
    "fp32": set(), "bf16": set(), "fp16": {"loss_scale"},
    "fp8_block": {"scaling", "autocast_dtype", "fused_quant"},
    "fp8_tensor": {"scaling", "autocast_dtype", "fused_quant"},
    "te_fp8": {"recipe", "fp8_format", "amax_history_len", "amax_compute_algo", "margin", "autocast_dtype"},
}


@dataclass
class PrecisionConfig:
    name: str = "fp32"  # fp32 | bf16 | fp16 | fp8_block | fp8_tensor | te_fp8
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)  # fp16
    scaling: str | None = None          # fp8_*: block | tensor (null: the recipe's own, by name)
    autocast_dtype: str | None = None   # fp8_*, te_fp8: dtype of the non-FP8 ops (null: fp32) | bfloat16
    # fp8_*: true: quantise with one torch.compile'd function per kind (precision/quant_fused.py, the same
    # bits) | false: the eager quantiser | null: on for CUDA; off on a CPU, where compiling costs seconds and
    # Inductor's E4M3 cast is slower than eager's (docs/results/quant_fused.md)
    fused_quant: bool | None = None
    recipe: str = "block"               # te_fp8: block | current | delayed
    fp8_format: str | None = None       # te_fp8: E4M3 | HYBRID (null: E4M3 for block, else HYBRID)
    amax_history_len: int = 1024        # te_fp8 delayed: scale from the max amax over this many steps
    amax_compute_algo: str = "max"      # te_fp8 delayed: max | most_recent
    margin: int = 0                     # te_fp8 delayed: scale down by 2^margin for headroom

    def __post_init__(self) -> None:
        check(self.name in RECIPES, "precision.name", repr(self.name), f"expected one of {', '.join(RECIPES)}")
        unused_keys(self, {"name", *_USED[self.name]}, "precision", f"precision={self.name}")
        check(self.scaling is None or self.scaling in SCALINGS, "precision.scaling", repr(self.scaling),
              f"expected one of {', '.join(SCALINGS)}")
        check(self.fused_quant is None or isinstance(self.fused_quant, bool), "precision.fused_quant",
              repr(self.fused_quant), "expected null, true or false")
        check(self.autocast_dtype in (None, "bfloat16"), "precision.autocast_dtype", repr(self.autocast_dtype),
              "expected null or one of bfloat16")
        choice("precision.recipe", self.recipe, TE_RECIPES)
        check(self.fp8_format is None or self.fp8_format in TE_FORMATS, "precision.fp8_format",
              repr(self.fp8_format), f"expected one of {', '.join(TE_FORMATS)}")
        check(self.amax_history_len >= 1, "precision.amax_history_len", self.amax_history_len,
              "must be an integer >= 1")
        choice("precision.amax_compute_algo", self.amax_compute_algo, ("max", "most_recent"))
        check(self.margin >= 0, "precision.margin", self.margin, "must be an integer >= 0")

    def options(self) -> dict:
        """name and the options its recipe reads, with the by-name defaults filled in."""
        out = {"name": self.name}
        for f in fields(self):
            if f.name in _USED[self.name]:
                v = getattr(self, f.name)
                out[f.name] = v
        if "scaling" in out and out["scaling"] is None:
            out["scaling"] = "tensor" if self.name == "fp8_tensor" else "block"
        if "fp8_format" in out and out["fp8_format"] is None:
            out["fp8_format"] = "E4M3" if self.recipe == "block" else "HYBRID"
        return out
