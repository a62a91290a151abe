"""prefix: every layer of the step's own forward computes its math — on the steps between the reference steps, on
HEAD + TAIL positions of one row of the step's batch: its first and its last (the embedding's output, a lookup, over
the whole row). The row moves with the step (`row`), over every micro-batch and every row of it, so a fault that spares
some rows (one micro-batch's, a row's tokens) is met within a few steps, where a fixed row would never meet it.

The forward check (spec/checks/forward.py) holds every layer to the FP64 reference on reference steps only, every
spec.every steps: a fault that begins between two of them shows at the next one, up to spec.every − 1 steps late, and a
fault that leaves the layers' output RMS where it was (a rounding inside an attention, another ε in a norm, another
activation) cannot be dated back from any per-step series. Yet the step's forward has already run the very positions the
probe runs, and more: causal attention makes a prefix of a sequence a sequence of its own, and every layer but the
attention is position by position, so what each layer took and gave on a few positions is a probe run — without the
probe's second forward. The last positions read every key of the row, which the probe's 32 do not reach: a fault in how
far an attention reads (a window) shows there. Forward hooks keep those rows (a copy of HEAD + TAIL rows a layer, and of
each attention's projection over the whole row, the keys and values its last positions read; the call of the row's
micro-batch, counted by a pre-hook on the model, and its first: not the recompute of activation checkpointing) and,
before the update, the forward check's own comparisons — the same reference, tolerances and names — judge them: every
layer is checked every step, the first failing step is the fault's, and the guard can refuse it. Each layer is fed what
it took, so the blocks are independent here: the reference runs them as one group (rows), an op for all where the
reference steps' wired layers run one a block.

What the probe adds and this leaves to the reference steps: the loss (the step's loss sums the whole batch), the
gradient, the layer reruns that tell a rounding from another function, the exact FP64 reruns. A failure here is one the
monitor follows with the reference checks at the same step, on the same row (spec/monitor.py on_demand), which class
it — or, where the probe's positions do not show it (past its first 32: a window), this check's own comparison
(ForwardCheck.classify); the doctor reads this check as the forward check's `family`: a failure here and the forward
check's at the same layer are one incident. Not under FSDP2 (the weights are shards: gathering them every step is the
step's collectives again), nor under train.compile (a hook breaks the graph).
"""
from __future__ import annotations

import re
import time

import torch
from einops import rearrange
from torch import Tensor

from spec.check import BEFORE, STEP
from spec.checks.forward import ForwardCheck, logit_bound
from spec.checks.state import module_state
from spec.probe import Calls, ProbeRun, Taken, kept_layers, routing, row
from spec.reference import F64, IGNORE, Keys, Reference, rms_norm
from spec.tolerance import LAMBDA, u


# the positions of the row checked: the first HEAD and the last TAIL. Every layer, head and expert's math on 8 tokens;
# RoPE's rotations by the smallest and the largest angles; the causal mask among the first, and each of the last
# reading every key before it, so a fault in the attention's reach (a window, a mask that drops far keys) shows.
# NOTE: 8 tokens, fewer than the probe's 32: every step, the FP64 matmuls (an MoE layer's every expert on every row,
# spec/reference.py) cost as many times less; the keys and values the last positions read between them are the
# training path's own projection (PrefixCheck.keys): an FP64 one of the whole row costs T·D·2·K·d a block, more than
# the rest of the check at nanoGPT's shape
HEAD, TAIL = 4, 4


class PrefixCheck(ForwardCheck):
    name, cadence, phase = "prefix", STEP, BEFORE
    rank = 23  # after the forward check's own (20, on demand at the same step), which classes the layer's miss
    family = "forward"
    onset_series = None
    doc = ("each layer's output on the first and last positions of a row of the step's own batch (the rows in turn) "
           "against the FP64 reference, between reference steps")

    @classmethod
    def applies(cls, ctx) -> bool:
        return not ctx.sharded and not ctx.compiled

    def before_forward(self, s) -> None:
        for h in getattr(self, "_hooks", []):  # a step that ended before its update (it raised) left them
            h.remove()
        self._hooks = []
        if self.ctx.reference_step(s.step):  # the forward check's step: its probe checks the same positions
            return
        self.taken, self._unread = Taken(), None
        self.mb, self.row = row(s.step, len(s.micro), s.micro[0].tokens.shape[0])
        kept = {k: m for k, m in kept_layers(self.ctx.model).items() if k != "norm"}
        kept.update({f"block{i}.attn.qkv": b.attn.qkv for i, b in enumerate(self.ctx.model.blocks)})
        self.calls = Calls(self.ctx.model)
        self._hooks = [self.calls.hook]
        self._hooks += [m.register_forward_hook(self._keep(key)) for key, m in kept.items()]

    def _keep(self, key: str):
        def keep(module, args, out):
            # micro-batch mb's training call, the first (not activation checkpointing's recompute in its backward)
            if self.calls.n != self.mb or key in self.taken.io or not args or not torch.is_grad_enabled():
                return
            t0 = time.perf_counter()
            try:
                at, j = self.at(args[0].shape[1], args[0].device), self.row
                # a qkv projection: its keys and values (past q's columns) over the whole row, which the last positions
                # read; an attention that did not call it: its input over the whole row instead (PrefixCheck.keys)
                if key.endswith(".qkv"):
                    skip = self.ctx.model_cfg.n_heads * self.ctx.model_cfg.head_dim
                    self.taken.io[key] = (None, out.detach()[j:j + 1, :, skip:].clone())
                elif key.endswith(".attn") and key + ".qkv" not in self.taken.io:
                    self.taken.io[key] = (args[0].detach()[j:j + 1].clone(), _rows(out, at, j))
                elif key == "emb":  # a lookup: the whole row, held to the specification's tokens (PrefixCheck.rows)
                    self.taken.io[key] = (None, out.detach()[j:j + 1].clone())
                else:
                    self.taken.io[key] = (_rows(args[0], at, j), _rows(out, at, j))
            except (IndexError, TypeError, AttributeError) as e:  # the step's forward goes on: the check fails
                self._unread = f"{key}: {type(e).__name__}: {e}"
            self.seconds += time.perf_counter() - t0  # the step's time_s.spec counts it (spec/monitor.py took)
        return keep

    def before_update(self, s) -> None:
        for h in self._hooks:
            h.remove()
        if not self._hooks:
            return
        self._hooks, taken, self.taken = [], self.taken, None
        if self._unread:  # a layer gave what no layer of the model's gives: a failure of this check (spec/monitor.py)
            raise ValueError(f"a layer's input or output is not the model's: {self._unread}")
        model, c = self.ctx.model, self.ctx.model_cfg
        # NOTE: the model's math runs every kept layer as its module, once a micro-batch; one that did not run so on
        # this micro-batch (computed inline, a fused path) ran what no check of the module reads: a failure at this
        # step (its first kind, mismatch: spec/monitor.py), not a check skipped
        if missing := [k for k in kept_layers(model) if k != "norm" and k not in taken.io]:
            raise ValueError(f"not run as their modules on micro-batch {self.mb}: {', '.join(missing)}")
        mb, j = s.micro[self.mb], self.row
        ids, bias = routing(model, taken)
        w, stacks = self._weights()
        at = self.at(mb.tokens.shape[1], mb.tokens.device)
        run = ProbeRun(mb.tokens[j:j + 1, at], mb.labels[j:j + 1, at], taken, {}, None, ids, w, bias)
        names, err, tol, scale, self.places = self.rows(Reference(c, w, bias, stacks), run, at, mb.tokens[j:j + 1])
        self.measure(err, tol, where=names)
        # every layer's miss relative to its output, every step between the reference steps: the series that dates a
        # failure of the exact check (a rounding inside a module that stays within the recipe's bound, which no
        # check between the reference steps fails, moves it by orders of magnitude: doctor/conformance.py)
        self.extra["prefix_err"] = (names, err / scale.clamp(min=1e-300))

    def at(self, T: int, device) -> Tensor:
        """The positions checked in a row of T (all of them where T ≤ HEAD + TAIL), ascending."""
        if getattr(self, "_at", (None,))[0] != (T, device):
            self._at = ((T, device), torch.tensor(sorted({*range(min(HEAD, T)), *range(max(T - TAIL, 0), T)}),
                                                  device=device))
        return self._at[1]

    @torch.no_grad()
    def rows(self, ref: Reference, run: ProbeRun, at: Tensor,
             tokens: Tensor) -> tuple[list[str], Tensor, Tensor, Tensor, "Places"]:
        """The forward check's layers (its names, misses, tolerances and scales, spec/checks/forward.py) on the kept rows,
        every block at once: each is fed its own input here (no gradient wires them), so the blocks' attentions are
        one group of the reference (row i of the group, block i on its input: spec/reference.py Reference.layer),
        and so are the dense MLPs, the norms and the comparisons — an op a group where the forward check's layers
        run one a block. The MoE layers run one by one (their cost is their experts' FLOPs, not their ops'). The
        rows are at positions `at` of the sequence (an attention's input kept whole: PrefixCheck.keys); the embedding's
        output is held to `tokens`, the row's whole sequence as the specification gives it (the data check's): a
        lookup is exact wherever it is right, so every position is checked for the cost of a gather — a token or an
        embedding row changed inside the forward shows wherever in the row it lies."""
        c, io = self.ctx.model_cfg, run.taken.io
        every = tuple(range(c.n_layers))
        dense = tuple(i for i in every if not ref.is_moe(i))

        def stacked(key: str, side: int, part=lambda v: v) -> Tensor:  # every block's (L, T, D), in FP64
            return torch.cat([part(io[f"block{i}{key}"][side]) for i in every]).to(F64)
        x_in, x_out = stacked("", 0), stacked("", 1, lambda v: v[0])
        a_in, a_out = stacked(".attn", 0, lambda v: v if v.shape[1] == len(at) else v[:, at]), stacked(".attn", 1)
        keys = self.keys(ref, io, at)
        m_in, m_out = stacked(".mlp", 0), stacked(".mlp", 1, lambda v: v.y if hasattr(v, "y") else v)
        u_p = u(getattr(torch, self.ctx.cfg.parallel.param_dtype, torch.float32))
        emb = self.compare(io["emb"][1].to(F64), ref.embed(tokens), torch.full((), LAMBDA * u_p, dtype=F64))

        qk = {}
        attn = ref.attention(every, a_in, keep=qk, keys=keys)
        rel_attn = self.attn_tolerance(keys.k.shape[1], logit_bound(qk["q"], qk["k"], rows=True))
        mlp, rel_mlp, moe = torch.empty_like(m_out), torch.empty(len(every), dtype=F64, device=m_out.device), {}
        if dense:
            mlp[list(dense)] = ref.dense_mlp(dense, m_in[list(dense)])
            rel_mlp[list(dense)] = self.dense_tolerance()
        valid = (run.labels != IGNORE).reshape(-1)
        for i in every:
            if i not in dense:
                moe[i] = ref.moe(i, m_in[i], run.ids.get(i), valid, aux=False)
                mlp[i], rel_mlp[i] = moe[i].y, self.moe_tolerance(ref, i, m_in[i], moe[i].logits)
        n1 = rms_norm(x_in, ref.gain(every, "attn_norm.weight", x_in), c.norm_eps)
        n2 = rms_norm(x_out - m_out, ref.gain(every, "mlp_norm.weight", x_out), c.norm_eps)

        attns = self.compare(a_out, attn, rel_attn, rows=True)
        mlps = self.compare(m_out, mlp, rel_mlp, rows=True)
        rel_norm = torch.full_like(rel_attn, self.norm_tolerance())
        blocks = self.block_composition(x_in, a_in, a_out, m_in, m_out, x_out, n1, n2, rel_norm, [], rows=True)
        err, tol, scale = (torch.cat([emb[j].reshape(1), torch.stack([attns[j], mlps[j], blocks[j]], 1).reshape(-1)])
                           for j in (0, 1, 2))
        names = ["emb", *(f"block{i}{part}" for i in every for part in (".attn", ".mlp", ""))]

        def place(j: int) -> tuple:  # row j's (got, want, tol, extra), as the forward check's layers give it
            if j == 0:
                return emb[3]
            i, part = divmod(j - 1, 3)
            one = slice(i, i + 1)
            if part == 0:
                return (a_out[one], attn[one], attns[1][i], {"rerun": None, "rel": rel_attn[i],
                        "attention": lambda causal: ref.attention(i, a_in[one], causal,
                                                                  keys=Keys(at, keys.k[one], keys.v[one]))})
            if part == 1:
                extra = {"rerun": None} if i in dense else {"rerun": None, "moe": moe[i], "rel": rel_mlp[i]}
                return m_out[one], mlp[one], mlps[1][i], extra
            box = blocks[3][3]
            return None, None, None, {"pairs": [(g[one], w[one], rel[i]) for g, w, rel in box["pairs"]],
                                      "tols": [t[i] for t in box["tols"]], "ratios": box["ratios"][:, i],
                                      "reruns": [None] * 3}
        return names, err, tol, scale, Places(place)

    def keys(self, ref: Reference, io: dict, at: Tensor) -> Keys:
        """Every block's keys and values over the row, (L, T, K, d) before QK-norm and RoPE: the projection the step's
        forward made (the qkv module's output), whose rows at `at` the reference's attention makes again itself. The
        rows in between are the training path's own, as each layer's input is: what the last positions' attention is
        held to is how it reads them (a window, a mask); the projection is held on the rows at `at`. An FP64 product
        of the whole row (the attention's input, kept whole then) only for a block whose forward did not call it."""
        c = self.ctx.model_cfg
        skip = c.n_heads * c.head_dim

        def block(i: int) -> Tensor:
            got = io.get(f"block{i}.attn.qkv")
            if got is not None:
                return got[1].to(F64)
            return io[f"block{i}.attn"][0].to(F64) @ ref.layer(i, "attn.qkv.weight")[skip:].mT
        kv = torch.cat([block(i) for i in range(c.n_layers)])
        k, v = rearrange(kv, "l t (h d) -> l t h d", d=c.head_dim).split([c.kv_heads, c.kv_heads], dim=2)
        return Keys(at, k, v)

    def after_update(self, s) -> None: ...

    def _weights(self) -> tuple[dict[str, Tensor], dict[tuple, Tensor]]:
        """Every parameter by name in FP64, copied into buffers kept from step to step (one foreach copy, nothing
        allocated: the step's weights are a few MB of FP64 each step); and the blocks' weights of one name and shape
        stacked (the groups of Reference.layer: each block's buffer a view of its group's, so one copy fills both)."""
        params = dict(module_state(self.ctx.model)[0])  # named_parameters(), from a plain walk (spec/checks/state.py)
        shapes = [(n, p.shape, p.device) for n, p in params.items()]
        if getattr(self, "_shapes", None) != shapes:
            self._shapes, self._w, self._stacks = shapes, {}, {}
            groups: dict[tuple, list[int]] = {}
            for n, p in params.items():
                if (m := re.fullmatch(r"blocks\.(\d+)\.(.+)", n)) is not None:
                    groups.setdefault((m[2], tuple(p.shape), p.device), []).append(int(m[1]))
            for (name, shape, device), layers in groups.items():
                stack = torch.empty(len(layers), *shape, dtype=F64, device=device)
                self._stacks[(tuple(layers), name)] = stack
                self._w.update({f"blocks.{i}.{name}": stack[j] for j, i in enumerate(layers)})
            self._w.update({n: torch.empty_like(p, dtype=F64) for n, p in params.items() if n not in self._w})
        torch._foreach_copy_([self._w[n] for n in params], [p.detach() for p in params.values()])
        return self._w, self._stacks


class Places:
    """A check's places by row, (got, want, tol, extra) as ForwardCheck.classify reads them: built on a failure only."""

    def __init__(self, place):
        self.place = place

    def __getitem__(self, j: int) -> tuple:
        return self.place(j)


def _rows(x, at: Tensor, j: int):
    """The checked rows, row j at positions `at`, of a layer's input or output (a block's (x, MoEOutput), an MoE
    layer's MoEOutput: its output and its tokens' experts), copied (an index is a gather): the step may write over its
    activations, and keeps no view of them alive."""
    if torch.is_tensor(x):
        return x.detach()[j:j + 1, at]
    if isinstance(x, tuple) and hasattr(x, "route_ids_Nk"):  # (B·T, k): row by row, row j's tokens from j·T
        return x._replace(y=_rows(x.y, at, j), route_ids_Nk=x.route_ids_Nk[at + j * x.y.shape[1]])
    if isinstance(x, tuple):
        return tuple(_rows(v, at, j) for v in x)
    return x
