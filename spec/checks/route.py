"""route: the MoE layers' router chose what its definition chooses, on the probe.

           The experts each probe token went to are a top-k of the router's scores plus the current bias,
           recomputed in FP64 from the layer's own input: the largest score (plus bias) left out may exceed the
           smallest one chosen only by the scores' rounding, λ·(the router's FP32 stage)·(1 + the largest
           |router logit|) (a near-tie can fall either way). Under anticipatory routing the specification is
           the routes the step was given: equal, exactly. Chosen experts that all lie in a set of k while the
           router would spread them further: the routing collapsed (moe.load_collapse).
"""
from __future__ import annotations

import torch

from spec.check import AFTER, FORWARD, REFERENCE, Check, Kind
from spec.probe import PROBE_TOKENS
from spec.reference import F64
from spec.tolerance import LAMBDA, U32, stage


class RouteCheck(Check):
    name, layer, cadence, phase = "route", FORWARD, REFERENCE, AFTER
    rank = 25
    doc = "the probe tokens' experts against the router's top-k (with the bias), or the given routes"
    kinds = {"topk": Kind("moe.routing", "the named MoE layer's experts are not its router's top-k"),
             "collapse": Kind("moe.load_collapse", "the named MoE layer routes every token to the same k experts")}

    @classmethod
    def applies(cls, ctx) -> bool:
        return bool(ctx.model.moe_layers())

    def after_update(self, s) -> None:
        run = self.ctx.probe(s)
        if run is None:
            return
        model = self.ctx.model
        errs, tols, kinds, where = [], [], [], []
        for i, moe in model.moe_layers():
            x = run.taken.io[f"block{i}.mlp"][0].to(F64)
            x = x.reshape(-1, x.shape[-1])
            ids = run.ids[i].to(x.device)
            w = run.ref_w[f"blocks.{i}.mlp.router.weight"].detach()
            logits = x @ w.T
            scores = logits.softmax(-1) if moe.cfg.score == "softmax" else torch.sigmoid(logits)
            ranked = scores + run.bias[i].to(x.device)
            k = ids.shape[-1]
            if s.routes is not None:  # anticipatory routing: the specification is the routes given
                given = s.routes[0][i][:1, :PROBE_TOKENS].reshape(-1, k).to(ids.device)
                err, tol = (given != ids).sum().double(), torch.tensor(0.5, dtype=F64)
                kind = 0.0
            else:
                chosen = torch.zeros_like(ranked, dtype=torch.bool).scatter_(-1, ids, True)
                low = torch.where(chosen, ranked, torch.inf).min(-1).values
                high = torch.where(chosen, -torch.inf, ranked).max(-1).values
                err = (high - low).clamp(min=0).max()
                tol = LAMBDA * stage(x.shape[-1], U32) * (1 + logits.abs().max()) * scores.max() + 2 * U32 * \
                    run.bias[i].abs().max()
                E = ranked.shape[-1]
                used = torch.zeros(E, device=x.device).index_add(0, ids.flatten(), torch.ones(ids.numel(), device=x.device))
                top = torch.topk(ranked, k, -1).indices.flatten()
                wanted = torch.zeros(E, device=x.device).index_add(0, top, torch.ones(top.numel(), device=x.device))
                kind = torch.where(((used > 0).sum() <= k) & ((wanted > 0).sum() > k), 1.0, 0.0)
            errs.append(torch.as_tensor(err, dtype=F64))
            tols.append(torch.as_tensor(tol, dtype=F64))
            kinds.append(torch.as_tensor(kind, dtype=F64))
            where.append(f"moe{i}")
        self.measure(torch.stack(errs), torch.stack(tols), torch.stack(kinds), where=where)
