"""precision: every layer's output carries the precision of its dtype — every step, at the step a cast loses it.

A value rounded to a coarser format and stored back in a finer one (a cast down and up in a hook, a kernel that
computes in a lower precision than the recipe says) keeps only the coarser format's significand: the low bits of
its own are zero. The coarser formats there are (tf32 and fp16 10 stored bits, bf16 7, FP8 E4M3 3, E5M2 2) zero
at least the low b = m − m_next bits of a dtype with m stored bits, m_next the largest below m:

    fp32 (23): b = 13        fp16 (10): b = 3 (bf16)        bf16 (7): b = 4 (E4M3)

A normal number (not zero, subnormal or non-finite: loss_grad's) that the dtype's own arithmetic rounded has its
low b bits zero by chance, 2^−b, and more often where its terms cancelled (a sum many times smaller than its terms
keeps their grid: Sterbenz), which no bound from the format alone covers. So the check assumes only that a layer's
own arithmetic leaves fewer than a quarter of its outputs on the coarser grid (P_OWN), where a cast leaves all of
them. It takes a strided sample of each layer's output on one micro-batch of the step, the micro-batches in turn
(step t: t mod M, as the prefix check's row; kept by a forward hook), and fails a layer when more than half of its
sampled normal numbers have those bits zero. Out of n of them that happens under the recipe with probability at
most exp(−n·KL(½‖¼)) (Chernoff), so a layer is judged only when that is at most exp(−λ²/2), the failure
probability of every other tolerance here (spec/tolerance.py): from MIN_COUNT = 348 sampled numbers, which the
stride leaves wherever the output has twice as many elements. A layer whose sample is all zero (an output projection
at its zero init) is not judged.

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
from spec.probe import Calls
from spec.tolerance import LAMBDA

STORED = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}  # significand bits stored, the implicit one not
COARSER = (10, 7, 3, 2)  # stored bits of tf32 / fp16, bf16, FP8 E4M3, E5M2: the formats a value can be rounded to
INT_OF = {4: torch.int32, 2: torch.int16}


def low_bits(dtype: torch.dtype) -> int:
    """b: the low significand bits of `dtype` that a rounding to the finest coarser format zeroes."""
    m = STORED[dtype]
    return m - max(c for c in COARSER if c < m)


P_OWN = 0.25  # the share of a layer's outputs its own arithmetic may leave on the coarser grid (the assumption above)
MIN_COUNT = math.ceil(LAMBDA ** 2 / 2 / (0.5 * math.log(0.5 / P_OWN) + 0.5 * math.log(0.5 / (1 - P_OWN))))
PRIMES = (61, 59, 53, 47, 43, 41, 37, 31, 29, 23, 19, 17, 13, 11, 7, 5, 3)  # odd: no power-of-two width shares one


def sample_stride(numel: int) -> int:
    """The largest of the odd primes up to 61 that leaves 2·MIN_COUNT elements of `numel` in the sample (a prime
    meets every row, column and head of an output); 1 for an output too small for any."""
    return next((p for p in PRIMES if numel // p >= 2 * MIN_COUNT), 1)


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


def on_coarser_grid(values: torch.Tensor, dtype: torch.dtype) -> bool:
    """Every one of `values` (float64 copies of a `dtype` tensor's elements) a normal number of `dtype` whose low bits
    a rounding to a coarser format zeroes (coarse_counts), and at least one of them normal."""
    if dtype not in STORED:
        return False
    k, n = coarse_counts(values.to(dtype)[None])
    return bool(n[0] > 0) and bool(k[0] == n[0]) and n[0] == values.numel()


class PrecisionCheck(Check):
    name, layer, cadence, phase = "precision", FORWARD, STEP, BEFORE
    rank = 22
    doc = "each layer's output on a micro-batch (in turn) uses its dtype's whole significand (no cast down and up)"
    kinds = {"coarse": Kind("numerics.precision", "the named layer's output is rounded coarser than its dtype: a "
                                                  "cast down and back (a hook, a kernel in a lower precision)")}

    @classmethod
    def applies(cls, ctx) -> bool:
        # NOTE: a hook inside a compiled graph breaks it (the reference forward check covers a compiled run)
        return not ctx.compiled

    def before_forward(self, s) -> None:
        self.samples: dict[str, Tensor] = {}
        self.mb, self.calls = s.step % len(s.micro), Calls(self.ctx.model)
        self._hooks = [self.calls.hook, *(m.register_forward_hook(self._keep(name)) for name, m in self.layers())]

    def layers(self) -> list[tuple[str, torch.nn.Module]]:
        """Every output the every-step checks read, and the head's logits: a cast there (the loss computed from
        rounded logits) leaves the same trace, and no other every-step check sees the head's output."""
        return [*output_layers(self.ctx.model), ("head", self.ctx.model.head)]

    def _keep(self, name: str):
        def keep(module, args, out):
            # micro-batch mb's call, the first (a recomputed layer runs again in the backward)
            if self.calls.n != self.mb or name in self.samples:
                return
            t0 = time.perf_counter()
            y = _tensor(out).detach()
            if y.dtype in STORED:
                # NOTE: copied now, while the output is in cache: after the backward, a strided gather misses it at
                # every element
                self.samples[name] = y.reshape(-1)[::sample_stride(y.numel())].clone()
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
            k, n = coarse_counts(torch.stack([self.samples[name] for name in group]))
            names += group
            err.append(torch.where(n >= MIN_COUNT, k / n.clamp(min=1), 0.0))
            tol.append(torch.full_like(k, 0.5))
        self.measure(torch.cat(err), torch.cat(tol), where=names)
        self.samples = {}
