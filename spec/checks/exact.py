"""exact: each layer's own module, rerun in FP64 on the input the training path gave it, against the FP64 reference
at that input (the forward check's: spec/checks/forward.py leaves them in run.cache["exact"]).

The forward check's tolerance is the recipe's rounding bound. Its λ (a failure probability of 4e-22 a reduction)
and the softmax's condition (1 + a bound on the largest logit) put it far above the error a healthy layer makes, so
a module that rounds inside where the recipe does not (its q and k cast to fp16) or computes a function close to
its own can stay within it. In FP64 the recipe's roundings are gone (no autocast, the weights and the input in FP64):
what is left is the module's math against the reference's, with a bound of FP64's unit roundoff through the same
stages. An attention is given RoPE tables exact in FP64 (the model keeps them in FP32: the forward check sees those).

Not run where a recipe's rounding is the module's own code (FP8: its quantiser rounds explicitly), where the weights
are shards (FSDP2), nor under train.compile (the module would compile again for FP64). MoE layers are the forward
check's (their routing and gates). How a layer missed (classify, on a failure only): leak when a position's output
moves with only later positions changed; else precision when the miss is a rounding (spec/rerun.py: redrawn at a
perturbed point), mismatch when it is another function.
"""
from __future__ import annotations

import torch

from spec.check import AFTER, FORWARD, REFERENCE, Check, Kind
from spec.checks.forward import kind_of
from spec.tolerance import LAMBDA, stage, u

U64 = u(torch.float64)


class ExactCheck(Check):
    name, layer, cadence, phase = "exact", FORWARD, REFERENCE, AFTER
    rank = 21  # after the forward check, whose reference outputs it reads
    # its failures between reference steps leave the layers' output RMS as it was: dated by each layer's miss on the
    # steps between (spec/checks/prefix.py), which such a rounding moves from FP32's to its own
    onset_series = "prefix_err"
    doc = "each layer's module rerun in FP64 on the training path's input against the FP64 reference at that input"
    kinds = {
        "mismatch": Kind("numerics.mismatch", "the named layer's module computes another function than its math, "
                                              "within the recipe's rounding: its code, a hook on it"),
        "precision": Kind("numerics.precision", "the named layer's module rounds inside where the precision recipe "
                                                "does not (a cast in its code or a hook), within the recipe's bound"),
        "leak": Kind("forward.below_floor", "the attention of the named block is not causal: a position's output "
                                            "moves with the tokens after it"),
    }

    @classmethod
    def applies(cls, ctx) -> bool:
        name = getattr(ctx.recipe, "name", "fp32")
        return not ctx.sharded and not ctx.compiled and not name.startswith(("fp8", "te"))

    def after_update(self, s) -> None:
        run = self.ctx.probe(s)
        if run is None or not run.cache.get("exact"):
            return
        c, T = self.ctx.model_cfg, run.tokens.shape[1]
        rows, err, tol, self.places = run.cache["exact"], [], [], []
        for name, what, rerun, x, want, s_max in rows:
            got = rerun.output(x)
            scale = want.norm()
            err.append((got - want).norm())
            tol.append(tolerance(c, T, what, s_max) * scale + 1e-300)
            self.places.append((got, want, tol[-1], rerun))
        self.measure(torch.stack(err), torch.stack(tol), where=[r[0] for r in rows])

    @torch.no_grad()
    def classify(self, i: int) -> str:
        got, want, tol, rerun = self.places[i]
        if rerun.prefix.endswith(".attn.") and rerun.sees_ahead(tol / want.norm().clamp(min=1e-300)):
            return "leak"
        return "mismatch" if kind_of(got, want, tol, scalable=False) != "precision" else rerun.kind(got - want)


def tolerance(c, T: int, what: str, s_max):
    """The relative bound of a module in FP64 (c: the model config): an attention ("attn", its softmax's condition
    1 + s_max), a dense MLP ("mlp") or a norm ("norm"); FP64's stages as spec/tolerance.py counts them."""
    st = lambda K: stage(K, U64, U64)  # noqa: E731
    ew = 4 * U64  # the elementwise ops (norm scale, RoPE, SwiGLU), once each
    if what == "attn":
        return LAMBDA * (st(c.d_model) + st(c.head_dim) + st(T) + st(c.n_heads * c.head_dim) + ew) * (1 + s_max)
    if what == "mlp":
        return LAMBDA * (st(c.d_model) + st(c.ffn_hidden) + ew)
    return LAMBDA * (st(c.d_model) + ew)
