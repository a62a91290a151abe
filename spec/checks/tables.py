"""tables: the fixed tables the model's attention reads every step (RoPE's cos and sin) are the config's.

The rotary tables are buffers of the model (model/transformer.py), built once from model.rope_theta and the head
size and never trained, not saved (persistent=False: the continuity check's state leaves them out) and read by
every attention. A table rewritten or built from another θ rotates every query and key by other angles: each
attention computes another function from that step on, which the forward check sees only on its next reference
step and the layers' output RMS barely shows. So every step, after the forward (a write made inside it is seen
at its step), each table is held to the definition in FP64 (spec/reference.py rope_tables): one rounding of a
value in [−1, 1] to the buffer's format, u·|v| ≤ u, plus FP64's error in the angle t·θ^(−2i/d) (≤ λ·u64·t at
position t, a cosine moving by no more than its angle).
"""
from __future__ import annotations

import torch

from spec.check import BEFORE, FORWARD, STEP, Check, Kind
from spec.reference import rope_tables
from spec.tolerance import LAMBDA, UNIT_ROUNDOFF, u

TABLES = ("rope_cos", "rope_sin")


class TablesCheck(Check):
    name, layer, cadence, phase = "tables", FORWARD, STEP, BEFORE
    rank = 15  # before the forward check: a wrong table explains its attentions' miss
    doc = "the model's RoPE tables against the config's, every step"
    kinds = {"mismatch": Kind("numerics.mismatch", "the model's RoPE table is not the one model.rope_theta and the "
                                                   "head size define: rewritten, or built from another setting")}

    @classmethod
    def applies(cls, ctx) -> bool:
        return all(torch.is_tensor(getattr(ctx.model, t, None)) for t in TABLES)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.want: tuple | None = None

    def before_update(self, s) -> None:
        model, c = self.ctx.model, self.ctx.model_cfg
        got = [getattr(model, t) for t in TABLES]
        if self.want is None or self.want[0].shape != got[0].shape:
            T = got[0].shape[0]
            want = rope_tables(T, c.head_dim, c.rope_theta, got[0].device)
            tol = u(got[0].dtype) + LAMBDA * UNIT_ROUNDOFF[torch.float64] * max(T - 1, 1)
            self.want = (*want, tol)
        *want, tol = self.want
        err = torch.stack([(g.double() - w).abs().amax() for g, w in zip(got, want)])
        self.measure(err, tol, "mismatch", where=list(TABLES))
