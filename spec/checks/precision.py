"""precision: every layer's output carries the precision of its dtype — every step, at the step a cast loses it.

A value rounded to a coarser format and stored back in a finer one (a cast down and up in a hook, a kernel that
computes in a lower precision than the recipe says) keeps only the coarser format's significand: the low bits of
its own are zero. The coarser formats there are (tf32 and fp16 10 stored bits, bf16 7, FP8 E4M3 3, E5M2 2) zero
at least the low b = m − m_next bits of a dtype with m stored bits, m_next the largest below m:

    fp32 (23): b = 13        fp16 (10): b = 3 (bf16)        bf16 (7): b = 4 (E4M3)

A rounded result of the dtype's own arithmetic has its last bits spread evenly, so each normal number (not zero,
subnormal or non-finite: loss_grad's) has its low b bits zero with probability p = 2^−b. The check takes a strided
sample of each layer's output on the step's first micro-batch (kept by a forward hook) and fails a layer when more
than half of its sampled normal numbers have those bits zero. Out of n of them under the recipe that happens with
probability at most exp(−n·KL(½‖p)) (Chernoff), so a layer is judged only when n·KL(½‖p) ≥ λ²/2, the failure
probability exp(−λ²/2) of every other tolerance here (spec/tolerance.py): from 14 sampled numbers under FP32, 69
under bf16, 121 under fp16. A layer whose sample is all zero (an output projection at its zero init) is not judged.

The reference forward check names such a layer too (numerics.precision), on reference steps only; this one every
step, from the bits alone, and before the update: the guard can refuse the step. A precision lost inside a layer
whose output is then computed at the full precision (a matmul's inputs rounded, its FP32 accumulation kept) leaves
no such trace: that is the reference check's.
"""
from __future__ import annotations

import math
import time

import torch
from torch import Tensor

from spec.check import BEFORE, FORWARD, STEP, Check, Kind
from spec.checks.final_norm import _tensor, output_layers
from spec.checks.state import STRIDE  # a prime: the sample meets every row, column and head of an output
from spec.tolerance import LAMBDA

STORED = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}  # significand bits stored, the implicit one not
COARSER = (10, 7, 3, 2)  # stored bits of tf32 / fp16, bf16, FP8 E4M3, E5M2: the formats a value can be rounded to
INT_OF = {4: torch.int32, 2: torch.int16}


def low_bits(dtype: torch.dtype) -> int:
    """b: the low significand bits of `dtype` that a rounding to the finest coarser format zeroes."""
    m = STORED[dtype]
    return m - max(c for c in COARSER if c < m)


def min_count(b: int) -> float:
    """The sample size n from which more than half of n elements with their low b bits zero has probability at most
    exp(−λ²/2) under the recipe: n·KL(½‖2^−b) ≥ λ²/2."""
    p = 2.0 ** -b
    kl = 0.5 * math.log(0.5 / p) + 0.5 * math.log(0.5 / (1 - p))
    return LAMBDA ** 2 / 2 / kl


def coarse_counts(y: Tensor) -> tuple[Tensor, Tensor]:
    """(k, n) along the last dimension of y: its normal numbers whose low b bits (low_bits of its dtype) are zero,
    and its normal numbers, as float64."""
    b, m = low_bits(y.dtype), STORED[y.dtype]
    bits = y.view(INT_OF[y.element_size()])
    exp_mask = ((1 << (8 * y.element_size() - 1 - m)) - 1) << m
    exp = bits & exp_mask
    counted = (exp != 0) & (exp != exp_mask)  # a normal number: not zero, subnormal, inf or NaN
    coarse = ((bits & ((1 << b) - 1)) == 0) & counted
    return coarse.sum(-1, dtype=torch.float64), counted.sum(-1, dtype=torch.float64)


class PrecisionCheck(Check):
    name, layer, cadence, phase = "precision", FORWARD, STEP, BEFORE
    rank = 22
    doc = "each layer's output on the first micro-batch uses its dtype's whole significand (no cast down and up)"
    kinds = {"coarse": Kind("numerics.precision", "the named layer's output is rounded coarser than its dtype: a "
                                                  "cast down and back (a hook, a kernel in a lower precision)")}

    @classmethod
    def applies(cls, ctx) -> bool:
        # NOTE: a hook inside a compiled graph breaks it (the reference forward check covers a compiled run)
        return not ctx.compiled

    def before_forward(self, s) -> None:
        self.samples: dict[str, Tensor] = {}
        self._hooks = [m.register_forward_hook(self._keep(name)) for name, m in output_layers(self.ctx.model)]

    def _keep(self, name: str):
        def keep(module, args, out):
            if name in self.samples:  # the first micro-batch's (a recomputed layer runs again in the backward)
                return
            t0 = time.perf_counter()
            y = _tensor(out).detach()
            if y.dtype in STORED:
                self.samples[name] = y.reshape(-1)[::STRIDE]
            self.seconds += time.perf_counter() - t0  # the step's time_s.spec counts it (spec/monitor.py took)
        return keep

    def before_update(self, s) -> None:
        for h in self._hooks:
            h.remove()
        if not self.samples:
            return
        names, err, tol = [], [], []
        groups: dict[tuple, list[str]] = {}  # one set of ops per dtype and sample size (one under FP32: every output
        for name, y in self.samples.items():  # is (B, T, D)); two under autocast
            groups.setdefault((y.dtype, len(y)), []).append(name)
        for (dtype, _), group in groups.items():
            k, n = coarse_counts(torch.stack([self.samples[n] for n in group]))
            names += group
            err.append(torch.where(n >= min_count(low_bits(dtype)), k / n.clamp(min=1), 0.0))
            tol.append(torch.full_like(k, 0.5))
        self.measure(torch.cat(err), torch.cat(tol), where=names)
        self.samples = {}
