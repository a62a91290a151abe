"""The `parallel` group's schema (parallel/wrap.py reads it)."""
from __future__ import annotations

from dataclasses import dataclass

from run.config_errors import choice

MODES = ("auto", "none", "ddp", "fsdp")
DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclass
class ParallelConfig:
    mode: str = "auto"                  # auto (DDP when launched with more than one process) | none | ddp | fsdp
    # FSDP2 only (mode=fsdp): MixedPrecisionPolicy; a precision recipe may override both dtypes
    param_dtype: str = "float32"        # dtype of the all-gathered parameters used in forward/backward
    reduce_dtype: str = "float32"       # dtype of the gradient reduce-scatter
    reshard_after_forward: bool = True  # free gathered parameters after forward (re-gathered in backward)

    def __post_init__(self) -> None:
        choice("parallel.mode", self.mode, MODES)
        choice("parallel.param_dtype", self.param_dtype, DTYPE_NAMES)
        choice("parallel.reduce_dtype", self.reduce_dtype, DTYPE_NAMES)
