"""forward: every layer of the training path computes its math, on the probe, within the recipe's rounding.

Layer by layer (emb, block{i}.attn, block{i}.mlp, block{i} — its norms and residual adds —, loss), the FP64
reference (spec/reference.py) is fed the input the training path's layer took and its output is compared
with what that layer gave: a local error, so the first layer that computes something else is the one named,
and an error upstream does not accumulate into the layers after it. Each layer's tolerance is the chain of
its rounded stages (spec/tolerance.py): its matmuls (inner length K, inputs in the recipe's matmul dtype,
FP32 accumulation), the softmax's sensitivity (1 + the largest |logit|, bounded by ‖q‖·‖k‖/√d), the
elementwise ops. The measured relative error of every layer is recorded as well (StepRecord.spec.ref_err): the
recipe's numerical error, per layer, every reference step.

How a layer missed decides the class (declared rules on what the comparison measured), read for a failing layer
only, after the step's read (spec/monitor.py calls classify):
  nonfinite    a non-finite output
  scaled       the output is the reference times a factor (what is left after the best factor is within tol)
  leak         (attention) the output is the reference without its causal mask, or a position's output moves
               when only the positions after it change (spec/rerun.py sees_ahead): the model sees the future
  gates / dead_expert   (MoE) the output is a gate-weighted sum of the chosen experts' outputs with other
               gates (least squares per token on its k expert outputs), with one expert's weight zero: dead
  precision    the output is the reference rounded coarser than the recipe: relative error below 2^-3, the
               unit roundoff of the coarsest format there is (FP8 E5M2; the loss's CE and z sums each of itself,
               their sizes being far apart), and the layer rerun at a perturbed point misses by a fresh draw
               (spec/rerun.py; the loss, which is no module, spec/loss_rerun.py; an MoE layer with its tokens'
               experts kept) — a rounding, not another function
  mismatch     anything else: the layer computes another function (a small miss that the rerun keeps too)
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from spec.check import AFTER, FORWARD, REFERENCE, Check, Kind, on_device
from spec.loss_rerun import HeadLoss, loss_kind, loss_miss, per_position
from spec.reference import F64, IGNORE, Reference, losses, rms_norm, rope_tables
from spec.rerun import Rerun
from spec.tolerance import LAMBDA, U32, matmul_dtype, stage, u

ROUNDING_ONLY = 2.0 ** -3  # unit roundoff of FP8 E5M2, the coarsest float format: below it, an error is a rounding
# the 16-bit formats a router's logits can be rounded to where the recipe keeps them in FP32 (model/moe.py router_logits)
ROUTER_FORMATS = (torch.float16, torch.bfloat16)
EW = 4 * U32  # the elementwise ops of a layer (norm scale, RoPE, SwiGLU, residual add), once each


def router_scores(logits: Tensor, score: str, dim: int) -> Tensor:
    """The router's scores from its logits (model.moe.score): a softmax over the experts, or a sigmoid each."""
    return logits.softmax(dim) if score == "softmax" else torch.sigmoid(logits)


class ForwardCheck(Check):
    name, layer, cadence, phase = "forward", FORWARD, REFERENCE, AFTER
    rank = 20
    onset_series = "out_rms"  # every layer's output RMS, every step (spec/checks/final_norm.py)
    doc = "each layer's output on the probe against the FP64 reference fed the same input"
    kinds = {
        "mismatch": Kind("numerics.mismatch", "the named layer computes another function than its math: its "
                                              "kernel, a hook on it, or the module"),
        "precision": Kind("numerics.precision", "the named layer rounds coarser than the precision recipe says "
                                                "(a cast, a low-precision kernel)"),
        "scaled": Kind("numerics.activation_outlier", "the named layer's output is scaled: its inputs, norm, a hook"),
        "nonfinite": Kind("numerics.nonfinite", "a non-finite output of the named layer"),
        "leak": Kind("forward.below_floor", "the attention of the named block is not causal: the model sees the "
                                            "tokens it predicts"),
        "gates": Kind("moe.routing", "the MoE layer's gates are not the router's scores at the chosen experts"),
        "dead_expert": Kind("moe.dead_expert", "an expert of the named MoE layer contributes nothing"),
    }

    def after_update(self, s) -> None:
        run = self.ctx.probe(s)
        if run is None:
            return
        rows = list(self.layers(Reference(self.ctx.model_cfg, run.ref_w, run.bias), run))
        names = [r[0] for r in rows]
        err, tol, scale = (torch.stack([r[i] for r in rows]) for i in (1, 2, 3))
        self.places = [r[4] for r in rows]  # what classify() reads, for a layer that failed
        self.measure(err, tol, where=names)
        self.extra["ref_err"] = (names, err / scale.clamp(min=1e-300))

    @torch.no_grad()
    def classify(self, i: int) -> str:
        """The kind of layer i's miss (after the read, on a failure only): the declared rules of this module's doc."""
        got, want, tol, extra = self.places[i]
        rerun = extra.get("rerun")
        if "pairs" in extra:  # a block's composition: its worst pair
            j = int(extra["ratios"].argmax())
            (got, want, _), tol, rerun = extra["pairs"][j], extra["tols"][j], extra["reruns"][j]
        if "attention" in extra and (bool((got - extra["attention"](causal=False)).norm() <= tol)
                                     or (rerun is not None and rerun.sees_ahead(extra["rel"]))):
            return "leak"
        kind = kind_of(got, want, tol, scalable="sums" not in extra)
        if kind == "precision" and "sums" in extra and bool(((got - want).abs() / want.abs().clamp(min=1e-300)).max()
                                                            >= ROUNDING_ONLY):
            kind = "mismatch"  # CE and z are sums of different sizes: each is held to a rounding of itself
        if kind == "precision" and "sums" in extra and rerun is not None:  # a rounding, or another loss close to it?
            return loss_kind(rerun, want, tol, extra["mag"])
        if "moe" in extra and kind != "nonfinite":
            moe = moe_kind(got.reshape(-1, got.shape[-1]), extra["moe"], extra["rel"], self.ctx.model_cfg.moe)
            if moe is not None:
                return moe
        if kind == "precision" and rerun is not None:  # a rounding, or another function close to the layer's?
            return rerun.kind(got - want)
        return kind

    def rerun(self, run, key: str, module, prefix: str, reference, x: Tensor | None = None) -> Rerun | None:
        """The training path's `module` (the probe's call `key`, or on input x) to rerun against `reference(x, w)`;
        None under FSDP2 (a module's weights are shards there, gathered only inside the model's forward), and where
        the run kept no call to repeat (spec/checks/prefix.py's, from the step's own forward)."""
        if self.ctx.sharded or key not in run.taken.calls:
            return None
        args, kwargs = run.taken.calls[key]
        return Rerun(module, prefix, args if x is None else (x,), kwargs if x is None else {}, reference,
                     run.autocast)

    def exact(self, run, layer: str, what: str, rerun: Rerun | None, want: Tensor, i: int,
              x: Tensor | None = None) -> None:
        """The module of `rerun` again, to rerun in FP64 on x (default: its own input) against `want`, the reference
        at that input: the exact check's row (spec/checks/exact.py), kept in run.cache["exact"]; nothing is computed
        here. An attention is given RoPE tables exact in FP64 (spec/reference.py's), not the model's FP32 ones."""
        if rerun is not None:
            x, rest = rerun.args[0] if x is None else x, rerun.args[1:]
            if what == "attn":
                c = self.ctx.model_cfg
                rest = (*rope_tables(rest[0].shape[0], c.head_dim, c.rope_theta, x.device), *rest[2:])
            again = Rerun(rerun.module, rerun.prefix, (x, *rest), rerun.kwargs, rerun.reference, fp64=True)
            run.cache.setdefault("exact", []).append((layer, what, again, x, want.detach(),
                                                      run.cache.get(("s_max", i))))

    # --- tolerances -------------------------------------------------------------------------------------
    def u_in(self) -> float:
        return u(matmul_dtype(self.ctx.recipe, self.ctx.cfg.parallel.param_dtype))

    def layer_tolerances(self, ref: Reference, run, i: int) -> dict[str, Tensor]:
        """The relative tolerance of block i's attention, MLP and norms, from the probe's own inputs to them (once
        per probe: the gradient check reads them too)."""
        key = ("tolerances", i)
        if key not in run.cache:
            run.cache[key] = self._layer_tolerances(ref, run, i)
        return run.cache[key]

    @torch.no_grad()
    def _layer_tolerances(self, ref: Reference, run, i: int) -> dict[str, Tensor]:
        io = run.taken.io
        if ("s_max", i) not in run.cache:  # the layers' attention leaves it (its own q and k); a reader before them
            run.cache[("s_max", i)] = logit_bound(*ref.qk_v(i, io[f"block{i}.attn"][0].to(F64))[:2])
        attn = self.attn_tolerance(run.tokens.shape[1], run.cache[("s_max", i)])
        if ref.is_moe(i):
            mlp = self.moe_tolerance(ref, i, io[f"block{i}.mlp"][0].to(F64))
        else:
            mlp = on_device(self.dense_tolerance(), attn.device, F64)
        return {"attn": attn, "mlp": mlp, "norm": torch.full_like(attn, self.norm_tolerance())}

    def attn_tolerance(self, T: int, s_max: Tensor) -> Tensor:
        """An attention's relative tolerance on T positions whose logits are at most s_max (one a layer, any shape)."""
        c, u_in = self.ctx.model_cfg, self.u_in()
        return LAMBDA * (stage(c.d_model, u_in) + stage(c.head_dim, u_in) + stage(T, u_in)
                         + stage(c.n_heads * c.head_dim, u_in) + EW) * (1 + s_max)

    def dense_tolerance(self) -> float:
        c, u_in = self.ctx.model_cfg, self.u_in()
        return LAMBDA * (stage(c.d_model, u_in) + stage(c.ffn_hidden, u_in) + EW)

    def moe_tolerance(self, ref: Reference, i: int, x: Tensor, logits: Tensor | None = None) -> Tensor:
        """MoE layer i's relative tolerance on its input rows x (FP64): the router's logits set its softmax's (given:
        the reference's own on x, MoEParts.logits)."""
        c, u_in = self.ctx.model_cfg, self.u_in()
        logits = x @ ref.p(f"blocks.{i}.mlp.router.weight").T if logits is None else logits
        router_max = logits.detach().abs().max()
        return LAMBDA * (stage(c.d_model, U32) * (1 + router_max) + stage(c.d_model, u_in)
                         + stage(c.moe.expert_hidden, u_in) + EW)

    def norm_tolerance(self) -> float:
        return LAMBDA * stage(self.ctx.model_cfg.d_model, U32)

    def head_tolerance(self, vocab: int) -> float:
        return LAMBDA * (stage(self.ctx.model_cfg.d_model, self.u_in()) + stage(vocab, U32)
                         + stage(self.ctx.model_cfg.d_model, U32))

    # --- the layers --------------------------------------------------------------------------------------
    def layers(self, ref: Reference, run):
        """(layer, err, tol, ‖ref‖, (got, want, tol, extra)) for every layer, in forward order: err = ‖train − ref‖,
        tol the bound on it; the last is what classify() reads if the layer fails.

        Each layer of the reference is fed what the training path's layer took, and the layers are wired into one
        graph by `through`: the reference linearised at the training path's activations. Its probe objective
        (run.cache["objective"], when the weights are leaves with a gradient) is what the gradient check
        differentiates, so one FP64 forward serves both checks."""
        c, io, blocks = self.ctx.model_cfg, run.taken.io, self.ctx.model.blocks
        grad = any(w.requires_grad for w in run.ref_w.values())

        def with_w(w: dict[str, Tensor]) -> Reference:  # the reference on some weights replaced (a rerun's)
            return Reference(c, {**run.ref_w, **w}, run.bias)
        with torch.set_grad_enabled(grad):
            u_p = u(getattr(torch, self.ctx.cfg.parallel.param_dtype, torch.float32))
            carry = ref.embed(run.tokens)  # the reference's output so far, the graph its gradient flows back through
            yield ("emb", *self.compare(io["emb"][1].to(F64), carry, torch.full((), LAMBDA * u_p, dtype=F64)))
            valid = (run.labels != IGNORE).reshape(-1)
            aux = torch.zeros((), dtype=F64, device=carry.device)
            for i in range(c.n_layers):
                pre = f"blocks.{i}."
                x_in, x_out = io[f"block{i}"][0].to(F64), io[f"block{i}"][1][0].to(F64)
                a_in, a_out = io[f"block{i}.attn"][0].to(F64), io[f"block{i}.attn"][1].to(F64)
                m_in, m_raw = io[f"block{i}.mlp"]
                m_in, m_out = m_in.to(F64), (m_raw.y if hasattr(m_raw, "y") else m_raw).to(F64)
                x = through(x_in, carry)
                n1 = rms_norm(x, ref.p(pre + "attn_norm.weight"), c.norm_eps)
                qk = {}
                attn = ref.attention(i, through(a_in, n1), keep=qk)  # through: a_in's value, so its q and k bound
                run.cache[("s_max", i)] = logit_bound(qk["q"], qk["k"])
                tol = self.layer_tolerances(ref, run, i)
                rerun = self.rerun(run, f"block{i}.attn", blocks[i].attn, pre + "attn.",
                                   lambda x, w, i=i: with_w(w).attention(i, x))
                self.exact(run, f"block{i}.attn", "attn", rerun, attn, i)
                yield (f"block{i}.attn", *self.compare(a_out, attn, tol["attn"], rerun=rerun, rel=tol["attn"],
                                                       attention=lambda causal, i=i, a_in=a_in: ref.attention(i, a_in, causal)))
                mid = through(x_out - m_out, x + attn)  # the residual after the attention
                n2 = rms_norm(mid, ref.p(pre + "mlp_norm.weight"), c.norm_eps)
                if ref.is_moe(i):
                    B, T, D = m_in.shape
                    # the auxiliary terms where a loss is compared (the probe's; spec/checks/prefix.py compares none)
                    parts = ref.moe(i, through(m_in, n2).reshape(B * T, D), run.ids.get(i), valid, aux=bool(run.loss))
                    mlp, aux = parts.y.reshape(B, T, D), aux + parts.aux
                    rerun = self.rerun(run, f"block{i}.mlp", blocks[i].mlp, pre + "mlp.",
                                       lambda x, w, i=i: with_w(w).moe(i, x.reshape(-1, x.shape[-1]), run.ids.get(i),
                                                                       valid).y.reshape(x.shape))
                    if rerun is not None:  # the experts the probe's tokens went to, kept: a perturbed input re-routes
                        rerun.args = (rerun.args[0], run.ids.get(i), *rerun.args[2:])
                    yield (f"block{i}.mlp", *self.compare(m_out, mlp, tol["mlp"], moe=parts, rel=tol["mlp"],
                                                          rerun=rerun))
                else:
                    mlp = ref.dense_mlp(i, through(m_in, n2))
                    rerun = self.rerun(run, f"block{i}.mlp", blocks[i].mlp, pre + "mlp.",
                                       lambda x, w, i=i: with_w(w).dense_mlp(i, x))
                    self.exact(run, f"block{i}.mlp", "mlp", rerun, mlp, i)
                    yield (f"block{i}.mlp", *self.compare(m_out, mlp, tol["mlp"], rerun=rerun))
                x_raw, mid_in = io[f"block{i}"][0], mid.detach()  # mid's value is x_out − m_out, bit for bit
                norms = [self.rerun(run, f"block{i}", norm, pre + name + ".",
                                    lambda x, w, key=pre + name + ".weight": rms_norm(x, w[key], c.norm_eps), x=x)
                         for norm, name, x in ((blocks[i].attn_norm, "attn_norm", x_raw),
                                               (blocks[i].mlp_norm, "mlp_norm", mid_in.to(x_raw.dtype)))]
                # NOTE: the MLP norm's input in FP64 as the reference took it (its FP32 rounding is one u32 off)
                for rerun, want, x in zip(norms, (n1, n2), (None, mid_in)):
                    self.exact(run, f"block{i}", "norm", rerun, want, i, x)
                yield (f"block{i}", *self.block_composition(x_in, a_in, a_out, m_in, m_out, x_out, n1, n2, tol["norm"],
                                                            reruns=[*norms, None]))
                carry = mid + mlp
            logits = ref.head(through(io["norm"][0].to(F64), carry))
            ce, z = losses(logits, run.labels)
            run.cache["aux"] = aux.detach()  # the MoE layers' auxiliary loss with the config's coefficients
            if grad:
                z_coef = float(self.ctx.cfg.train.z_loss)
                run.cache["objective"] = (ce + z_coef * z) / valid.sum().clamp(min=1).to(F64) + aux
            ce, z, logits = ce.detach(), z.detach(), logits.detach()
        lse = torch.logsumexp(logits, -1)
        at = logits.gather(-1, run.labels.clamp(min=0)[..., None])[..., 0]
        mag = torch.where(run.labels != IGNORE, lse.abs() + at.abs(), 0.0).sum()  # the CE sum's terms, unsigned
        tol = self.head_tolerance(logits.shape[-1]) * mag + 1e-300
        err = loss_miss(run.loss["ce"] - ce, run.loss["z"] - z, z, mag)
        got, want = torch.stack([run.loss["ce"], run.loss["z"]]), torch.stack([ce, z])
        rerun = self.rerun(run, "norm", HeadLoss(self.ctx.model, run.labels), "",
                           lambda x, w: per_position(with_w(w), x, run.labels))
        yield ("loss", err, tol, ce.abs(), (got, want, tol, {"sums": True, "rerun": rerun, "mag": mag}))

    @staticmethod
    def block_composition(x_in, a_in, a_out, m_in, m_out, x_out, n1, n2, rel_norm: Tensor, reruns: list,
                          rows: bool = False):
        """A block's own work around its two layers, from what the training path's layers took and gave: the norm
        before each (n1, n2: the reference's RMSNorm of the residual stream, x_in and x_out − m_out), and the
        residual adds x + attn + mlp. (err, tol, scale, place) of the worst of the three, as a share of its
        tolerance times the output's norm. reruns: the two norms' (spec/rerun.py), and None for the adds. rows: a
        group of blocks, one a row (spec/checks/prefix.py): every figure one a row, `ratios` (3, rows)."""
        # NOTE: the residual after the attention is one rounding of x_out away from the path's own: 2·u32 more
        pairs = [(a_in, n1.detach(), rel_norm), (m_in, n2.detach(), rel_norm + LAMBDA * 2 * U32),
                 (x_out, x_in + a_out + m_out, torch.full_like(rel_norm, LAMBDA * 2 * U32))]
        tols = [rel * norm(want, rows) + 1e-300 for _, want, rel in pairs]
        ratios = torch.stack([norm(got - want, rows) / t for (got, want, _), t in zip(pairs, tols)])
        scale = norm(x_out, rows)
        # every pair is kept: classify() picks the worst, on a failure only
        return ratios.amax(0) * scale, scale + 1e-300, scale, (None, None, None, {"pairs": pairs, "tols": tols,
                                                                                  "ratios": ratios, "reruns": reruns})

    @staticmethod
    def compare(got: Tensor, want: Tensor, rel_tol: Tensor, rows: bool = False, **extra):
        """(err, tol, scale, place) of one layer's output against its reference, normwise, on the device; rows: a
        group of layers, one a row (spec/checks/prefix.py), every figure one a row."""
        want = want.detach()
        scale = norm(want, rows)
        tol = on_device(rel_tol, scale.device, scale.dtype) * scale + 1e-300
        return norm(got - want, rows), tol, scale, (got, want, tol, extra)


def norm(t: Tensor, rows: bool = False) -> Tensor:
    """‖t‖ (Frobenius); rows: one for each row along the first dimension."""
    return t.flatten(1).norm(dim=1) if rows else t.norm()


def through(value: Tensor, graph: Tensor) -> Tensor:
    """`value` (what the training path's layer took, FP64) carrying `graph`'s gradient: value + (graph − graph),
    exactly `value` in every bit (y − y = 0), differentiable as `graph`. Wired between the reference's layers, the
    chain rule runs through the reference, with every layer at the training path's own input."""
    if not graph.requires_grad:
        return value
    # NOTE: where: a non-finite reference (inf − inf) leaves the value as it is
    return value + torch.where(torch.isfinite(graph), graph - graph.detach(), 0.0)


def kind_of(got: Tensor, want: Tensor, tol: Tensor, scalable: bool = True) -> str:
    """How an output missed its reference (read on the host: a failure's only): non-finite, a scaled copy (what is
    left after the best factor is within tolerance), a coarser rounding (below 2^-3 relative), or another function.
    scalable=False: the output is a few sums (the loss's CE and z), where one factor fitted to as many numbers
    explains almost any miss: no "scaled" there (a loss multiplier is loss_grad's scaled gradient at the same step)."""
    if not bool(torch.isfinite(got).all()):
        return "nonfinite"
    scale = want.norm().clamp(min=1e-300)
    c = float((got * want).sum() / scale.square())  # the best factor: got ≈ c·want
    # NOTE: a factor of about 0 (an output or a gradient within tolerance of nothing) is an erased value, not a scaled
    # copy: another function ("mismatch"), never a spike or an outlier
    if scalable and c != 1 and not bool(got.norm() <= tol) and bool((got - c * want).norm() <= tol * max(abs(c), 1.0)):
        return "scaled"
    return "precision" if bool((got - want).norm() / scale < ROUNDING_ONLY) else "mismatch"


def moe_kind(y: Tensor, parts, rel_tol: Tensor, mc) -> str | None:
    """precision when the training output is the reference's with the router's logits rounded to a 16-bit format
    (within the layer's tolerance: the same experts, their gates from those logits); gates / dead_expert when it is a
    gate-weighted sum of the chosen experts' outputs with other weights (least squares per token on its k expert
    outputs); None otherwise. mc: the config's model.moe."""
    for fmt in ROUTER_FORMATS:
        g = router_scores(parts.logits.to(fmt).to(F64), mc.score, -1).gather(-1, parts.ids)
        if parts.ids.shape[-1] > 1 and (mc.norm_topk or mc.score == "sigmoid"):
            g = g / g.sum(-1, keepdim=True)
        if bool((y - (parts.outs * g[..., None]).sum(1) - parts.shared).norm() <= rel_tol * y.norm() + 1e-300):
            return "precision"
    A, b = parts.outs.transpose(1, 2), (y - parts.shared)[..., None]  # (N, D, k), (N, D, 1)
    g = torch.linalg.lstsq(A, b).solution[..., 0]                     # (N, k)
    if not bool((A @ g[..., None] - b).norm() <= rel_tol * y.norm() + 1e-300):
        return None
    gone = (g.abs() <= rel_tol * parts.gates.abs().max()) & (parts.gates > 0)  # a chosen expert weighted 0
    for e in parts.ids.unique().tolist():  # dead: an expert whose every assignment here fitted 0
        if bool(gone[parts.ids == e].all()):
            return "dead_expert"
    return "gates"


def logit_bound(q: Tensor, k: Tensor, rows: bool = False) -> Tensor:
    """max |q·k|/√d over an attention's queries and keys (B, T, heads, d), QK-normed and before RoPE (a rotation: the
    same norms): ≤ max‖q‖·max‖k‖/√d, no score computed. rows: one bound a row (a group of layers, one a row)."""
    def most(t: Tensor) -> Tensor:
        return t.norm(dim=-1).flatten(int(rows)).amax(-1)
    return most(q) * most(k) / math.sqrt(q.shape[-1])
