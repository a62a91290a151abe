"""route: the MoE layers' router chose what its definition chooses — every step, every token of the batch.

           The experts each token went to (kept by a hook on each MoE layer, with the input it routed, from the
           step's own forward) are a top-k (the config's k) of the router's scores plus the bias the step ran
           with, recomputed from that input (its logits in FP32, the router's own precision, the rest in FP64):
           the largest score (plus bias) left out may exceed the smallest one chosen only by the two sides'
           rounding of the logits, 2·λ·(the router's FP32 stage)·(1 + the largest |router logit|) (a near-tie
           can fall either way). Under anticipatory routing the specification is
           the routes the step was given: equal, exactly. Chosen experts that all lie in a set of k while the
           router would spread them further: the routing collapsed (moe.load_collapse). Known before the update
           (the bias moves after it): the guard can refuse the step.

A compiled forward runs no Python hook: there the same comparison runs on the probe's tokens, on reference
steps (route_probe).
"""
from __future__ import annotations

import time

import torch
from torch import Tensor

from spec.check import AFTER, BEFORE, FORWARD, REFERENCE, STEP, Check, Kind, on_device
from spec.checks.forward import ROUTER_FORMATS, router_scores
from spec.probe import PROBE_TOKENS
from spec.reference import F64
from spec.tolerance import LAMBDA, U32, stage


class RouteCheck(Check):
    name, layer, cadence, phase = "route", FORWARD, STEP, BEFORE
    rank = 25
    doc = "every token's experts against the router's top-k (with the bias), or the given routes"
    kinds = {"topk": Kind("moe.routing", "the named MoE layer's experts are not its router's top-k"),
             "collapse": Kind("moe.load_collapse", "the named MoE layer routes every token to the same k experts"),
             "precision": Kind("numerics.precision", "the named MoE layer's router rounds its logits coarser than the "
                                                     "FP32 the recipe keeps it in: its experts are the top-k of those "
                                                     "rounded scores", layer=FORWARD)}

    @classmethod
    def applies(cls, ctx) -> bool:
        # NOTE: a hook inside a compiled graph breaks it: route_probe checks a compiled run
        return bool(ctx.model.moe_layers()) and not ctx.compiled

    def before_forward(self, s) -> None:
        self.kept: dict[int, list[tuple[Tensor, Tensor]]] = {i: [] for i, _ in self.ctx.model.moe_layers()}
        self._hooks = [moe.register_forward_hook(self._keep(i)) for i, moe in self.ctx.model.moe_layers()]

    def _keep(self, i: int):
        def keep(module, args, out):
            t0 = time.perf_counter()
            self.kept[i].append((args[0].detach(), out.route_ids_Nk))
            self.seconds += time.perf_counter() - t0  # the step's time_s.spec counts it (spec/monitor.py took)
        return keep

    def before_update(self, s) -> None:
        for h in self._hooks:
            h.remove()
        if any(len(v) < len(s.micro) for v in self.kept.values()):  # a forward the hooks did not see
            return
        rows = {}
        for i, moe in self.ctx.model.moe_layers():
            xs = [x.reshape(-1, x.shape[-1]) for x, _ in self.kept[i]]
            ids = torch.cat([ids for _, ids in self.kept[i]])
            # a layer recomputed (activation checkpointing) ran again on each micro-batch's rows in its backward,
            # before the next micro-batch: each micro-batch's given routes as many times, in that order
            again = len(self.kept[i]) // len(s.micro)
            given = (None if s.routes is None else
                     torch.cat([r[i].reshape(-1, ids.shape[-1]) for r in s.routes for _ in range(again)]))
            rows[i] = (xs, ids, given)
        self.kept = {}
        compare(self, rows)

    def classify(self, i: int) -> str:
        return classify(self, i)


class RouteProbeCheck(RouteCheck):
    name, cadence, phase = "route_probe", REFERENCE, AFTER
    rank = 25
    doc = "the probe tokens' experts against the router's top-k (with the bias), or the given routes (compiled runs)"

    @classmethod
    def applies(cls, ctx) -> bool:
        return bool(ctx.model.moe_layers()) and ctx.compiled

    def before_forward(self, s) -> None: ...

    def before_update(self, s) -> None: ...

    def after_update(self, s) -> None:
        run = self.ctx.probe(s)
        if run is None:
            return
        rows = {}
        for i, _ in self.ctx.model.moe_layers():
            x = run.taken.io[f"block{i}.mlp"][0]
            ids = run.ids[i]
            given = None if s.routes is None else s.routes[0][i][:1, :PROBE_TOKENS].reshape(-1, ids.shape[-1])
            rows[i] = ([x.reshape(-1, x.shape[-1])], ids, given)
        compare(self, rows, run.bias)


def compare(check: Check, rows: dict[int, tuple[list[Tensor], Tensor, Tensor | None]],
            bias: dict | None = None) -> None:
    """Measure each MoE layer's chosen experts (ids, (N, k)) on its input rows (xs: each micro-batch's, (N_i, D))
    against its router's top-k with its bias (the module's own, or `bias` by layer), or against the routes given.
    Whether a miss is a collapse is decided for a failing layer only, after the read (classify)."""
    errs, tols, where, check.places = [], [], [], []
    k_spec = check.ctx.model_cfg.moe.top_k
    for i, moe in check.ctx.model.moe_layers():
        xs, ids, given = rows[i]
        ranked_EN = b = w = tol = None
        if ids.shape[-1] != k_spec:  # the router chose another number of experts than the config's top_k
            errs.append(on_device(torch.inf, ids.device, F64))
            tols.append(on_device(0.5, ids.device, F64))
            where.append(f"moe{i}")
            check.places.append((None, ids, given, None))
            continue
        if given is not None:  # anticipatory routing: the specification is the routes given, no router to rerun
            err, tol = (given.to(ids.device) != ids).sum().double(), on_device(0.5, ids.device, F64)
        else:
            w = moe.router.weight.detach()
            w = (w.full_tensor() if hasattr(w, "full_tensor") else w).to(xs[0].device)
            b = (bias[i] if bias is not None else moe.bias_E.detach()).to(xs[0].device, F64)
            # NOTE: the logits in FP32 (the router's own precision) on each micro-batch's rows, then FP64: the rows
            # neither copied to FP64 nor concatenated (an (N, D) pass each, where the logits are (E, N) and E a
            # handful). Experts along the rows: a softmax or a product along a short contiguous last dimension
            # costs CPU kernels several times more than along a long one
            w32 = w.float()
            logits_EN = torch.cat([w32 @ x.float().T for x in xs], 1).to(F64)
            scores_EN = router_scores(logits_EN, check.ctx.model_cfg.moe.score, 0)
            ranked_EN = scores_EN + b[:, None]
            ids_kN = ids.to(logits_EN.device).T
            low = ranked_EN.gather(0, ids_kN).min(0).values                    # the weakest expert chosen
            high = ranked_EN.scatter(0, ids_kN, -torch.inf).max(0).values      # the strongest left out
            # NOTE: a non-finite input row is upstream's miss (loss_grad names the layer): its comparison is 0, and
            # the tolerance, non-finite then, judges nothing (spec/check.py pack)
            err = (high - low).nan_to_num(nan=0.0).clamp(min=0).max()
            # the path's FP32 logits and these, each within the stage's rounding of the exact ones: twice it
            tol = (2 * LAMBDA * stage(xs[0].shape[-1], U32) * (1 + logits_EN.abs().max()) * scores_EN.max()
                   + 2 * U32 * b.abs().max())
        errs.append(torch.as_tensor(err, dtype=F64))
        tols.append(torch.as_tensor(tol, dtype=F64, device=err.device))
        where.append(f"moe{i}")
        check.places.append((ranked_EN, ids, given, None if ranked_EN is None else (xs, w, b, tol)))
    check.measure(torch.stack(errs), torch.stack(tols), "topk", where=where)


def classify(check: Check, i: int) -> str:
    """A failing layer's kind (on the host, after the read): a collapse when the chosen experts all lie in a set of k
    while the router's own top-k spreads further; precision when they are the top-k of the scores the router's logits
    give rounded to a 16-bit format (within the tie tolerance, at every token none of whose logits lies within FP32's
    error of that format's rounding boundary)."""
    ranked_EN, ids, given, router = check.places[i]
    k = ids.shape[-1]
    if given is not None or ranked_EN is None:
        return "topk"
    xs, w, b, tol = router
    logits_EN = w.to(F64) @ torch.cat(xs).to(F64).T  # the exact logits (FP64), for a failing layer only
    # NOTE: a logit within the path's FP32 error of a rounding boundary of the format may round either way there
    # (its FP32 value and this FP64 one): its token is not judged; every other token must be that top-k exactly
    near = LAMBDA * stage(check.ctx.model_cfg.d_model, U32) * (1 + logits_EN.abs())
    for fmt in ROUTER_FORMATS:
        r = router_scores(logits_EN.to(fmt).to(F64), check.ctx.model_cfg.moe.score, 0) + b[:, None]
        judged = ((logits_EN + near).to(fmt) == (logits_EN - near).to(fmt)).all(0)
        low = r.gather(0, ids.T).min(0).values
        high = r.scatter(0, ids.T, -torch.inf).max(0).values
        if bool(torch.where(judged, (high - low).nan_to_num(nan=0.0), 0.0).max() <= tol):
            return "precision"
    spread = torch.topk(ranked_EN, k, 0).indices.unique().numel()
    return "collapse" if ids.unique().numel() <= k < spread else "topk"
