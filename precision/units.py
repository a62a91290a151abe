"""What a device's matmul units compute natively: the facts a dtype choice that is only about speed is decided on.

A bfloat16 matmul is fast only where the hardware multiplies bfloat16: a CUDA GPU that supports it, or a CPU with
AVX512-BF16 or AMX-BF16 instructions. Elsewhere oneDNN emulates it (converting through FP32), slower than the FP32
matmul it would replace. The CPU's flags are read from /proc/cpuinfo: a fact of the machine, the same on every run
there, so a choice made from it gives the same numerics for the same command on the same machine (as run/compile.py
decides from the device, never from a timing taken on the fly).
"""
from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 flags with a bfloat16 dot product in hardware


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where there is no such file (macOS, Windows)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")),
                          []))


def native_bf16(device: torch.device | str) -> tuple[bool, str]:
    """Whether `device` multiplies bfloat16 natively, and the fact that says so (one clause)."""
    device = torch.device(device)
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, f"{torch.cuda.get_device_name(device)} {'supports' if ok else 'lacks'} bfloat16"
    if device.type == "cpu":
        have = [f for f in BF16_CPU_FLAGS if f in cpu_flags()]
        if have:
            return True, f"the CPU has {', '.join(have)}"
        return False, f"the CPU has neither {' nor '.join(BF16_CPU_FLAGS)}: its bfloat16 matmul is emulated"
    return False, f"no bfloat16 units known for device {device.type}"
