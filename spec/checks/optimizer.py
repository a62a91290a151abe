"""optimizer: on probe elements of every parameter, the parameter and its optimizer state after the step are the
algorithm applied in FP64 to the values the previous step left and the step's clipped gradient, with every
hyperparameter from the config and the schedule (never from the param groups), each parameter's group by the config's
rules (optim/groups.py group_of) rather than the group the optimizer holds it in:

    AdamW   m' = β1·m + (1−β1)·g     v' = β2·v + (1−β2)·g²     t' = t + 1
            θ' = θ·(1 − η·λ) − (η / (1−β1^t')) · m' / (√v' / √(1−β2^t') + ε)
    Muon    M' = μ·M + g     U = g + μ·M' (Nesterov) or M'     θ' = θ·(1 − η·λ) − η·s·√max(m, n)·NS5(U)
            (NS5 of the whole matrix, per fused part, in FP64 here: spec/muon_ref.py; θ' on reference steps only,
            over the whole matrix: NS5's error bound is normwise, and the bound on one element is the whole norm's;
            one block's matrices a reference step, the blocks in turn, the others' every time: muon_turn)
    g = coef·g₀: the backward's gradient (before the clip, unscaled) times the clip policy's coefficient
    (spec/checks/clip.py), within the tolerance the clip check allows the applied one where it clips; a skipped
    step (a non-finite gradient, the guard's veto) leaves all of it as it was;
    a head QK-clip scaled after the update (optim/qk_clip.py, the factor it reported) is scaled so here too.

"The values the previous step left" are read at the end of the previous step, after every lever, drill and the
balancing update, not just before this update: a state altered in between (a loader, a hook, a load) is not
the state the algorithm was given. Tolerances are the deterministic bound of n roundings of FP32 arithmetic,
n·u32 per term's magnitude (×4: SAFETY), plus what the inputs' own roundings carry into the result (the
gradient's into m and, doubled through g², into v; and, for Muon, the Newton–Schulz iteration's, amplified by
at most a = 3.4445 per iteration). A moment (m, v, M) or step count off its algebra is the state's fault
(optim.state), unless every moment of the group is exactly its algebra with another β, or for the gradient times
another factor than the clip's (a setting: classify, spec/optimizer_fits.py); the moments right and the parameter
wrong, a setting's (optim.settings: weight decay, eps, an update multiplier). The probe elements of all parameters
are one vector: the algebra runs once per step.
"""
from __future__ import annotations

import math
import zlib

import torch
from torch import Tensor

from optim.groups import group_of
from optim.muon import ns_dtype_for
from spec.check import AFTER, STEP, SYSTEM, UPDATE, Check, Kind, on_device
from spec.checks.precision import on_coarser_grid
from spec.muon_ref import orthogonalised, row_parts
from spec.optimizer_fits import l2_decay, other_factor
from spec.schedule import group_settings, lr_at
from spec.tolerance import LAMBDA, SAFETY, U32, stage, u

K = 4       # probe elements per parameter tensor
N_OPS = 9   # FP32 roundings on the way to θ' (decay, bias corrections, sqrt, eps add, divide, scale, subtract, clip)
N_G = 3     # roundings in the gradient the optimizer receives: the unscale, the clip coefficient, its multiply
STATES = ("exp_avg", "exp_avg_sq", "momentum_buffer")
F64 = torch.float64


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class OptimizerCheck(Check):
    name, layer, cadence, phase = "optimizer", UPDATE, STEP, AFTER
    rank = 50
    doc = "probe elements of every parameter and its state against the optimizer's algebra in FP64"
    kinds = {"state": Kind("optim.state", "the named parameter's optimizer state is not its algebra's: the "
                                          "moments or the step count were altered or lost"),
             "update": Kind("optim.settings", "the named parameter's update is not the configured optimizer's: "
                                              "a setting (weight decay, eps, betas), its param group (the config's "
                                              "optim.groups rules) or a multiplier changed"),
             "precision": Kind("numerics.precision", "the named parameter or its optimizer state is kept coarser "
                                                     "than its dtype: its values on a coarser format's grid (a cast, "
                                                     "a low-precision copy or state)"),
             "clip": Kind("optim.settings", "the gradient the optimizer was given is the backward's times another "
                                            "factor than the clip policy's coefficient: a clip computed and not "
                                            "applied, applied twice, or the gradient scaled after it"),
             "rank": Kind("system.rank_divergence", "one rank's parameters or optimizer state left the algebra the "
                                                    "others followed: that rank's copy was changed", layer=SYSTEM)}

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = ctx.cfg
        self.muon = cfg.optim.name == "muon"
        # NOTE: replicas run one algebra on the same numbers: one of them off it (not all) is that rank's own copy.
        # Not under FSDP2, where each rank checks its own shard's elements
        self.rank_kind = "rank" if ctx.dist.world > 1 and not ctx.sharded else None
        self.params: list[tuple[str, Tensor, Tensor, str, str]] = []  # (name, param, idx, group, optimizer)
        # NOTE: each parameter's group (its weight decay, its LR scale) by the config's rules, not by the group the
        # optimizer holds it in: a parameter grouped wrongly (a norm gain decayed) is updated against the config's
        # algebra. Muon's groups keep their algorithm's suffix (<rule>/muon, <rule>/adamw: spec/schedule.py)
        rule = group_of(ctx.model, cfg.optim)
        for i, g in enumerate(ctx.optimizer.param_groups):
            held = g.get("name", f"group{i}")
            suffix = held[held.index("/"):] if "/" in held else ""
            for p in g["params"]:
                n = ctx.names[id(p)]
                numel = _local(p).numel()
                gen = torch.Generator().manual_seed(zlib.crc32(n.encode()))
                idx = torch.randint(0, max(numel, 1), (min(K, numel),), generator=gen).to(_local(p).device)
                group = rule[n] + suffix if n in rule else held
                self.params.append((n, p, idx, group, g.get("optimizer", "adamw")))
        self.where = [n for n, *_ in self.params]
        sizes = [len(idx) for _, _, idx, _, _ in self.params]
        dev = _local(self.params[0][1]).device
        self.owner = torch.repeat_interleave(torch.arange(len(sizes), device=dev), torch.tensor(sizes, device=dev))
        self.is_muon = torch.cat([torch.full((n,), kind == "muon", device=dev)
                                  for n, (*_, kind) in zip(sizes, self.params)])
        self.groups = [g for *_, g, _ in self.params]
        wd = [group_settings(cfg, g)[1] for g in self.groups]
        self.wd_of = wd  # each parameter's weight decay, by the config's rules
        self.wd = torch.repeat_interleave(torch.tensor(wd, dtype=F64, device=dev), torch.tensor(sizes, device=dev))
        self.sizes = sizes
        self.group_names = list(dict.fromkeys(self.groups))
        self.group_of = torch.repeat_interleave(torch.tensor([self.group_names.index(g) for g in self.groups]),
                                                torch.tensor(sizes)).to(dev)  # each probe element's group
        self.zeros = torch.zeros(sum(sizes), dtype=F64, device=dev)
        self.qk = {n: qk_heads(idx, ctx.model_cfg) for n, _, idx, _, _ in self.params if n.endswith("attn.qkv.weight")}
        self.start: dict[str, Tensor] | None = None
        self.w_before: dict[str, Tensor] | None = None  # Muon's hidden matrices before a reference step's update
        self.ortho: dict[str, tuple[Tensor, float]] | None = None  # their oracle update, and its relative tolerance
        self.updates: Tensor | None = None  # the spec's count of applied updates (AdamW's t before this step), 0-d

    # --- reading the probe elements ----------------------------------------------------------------------
    def snapshot(self) -> dict[str, Tensor]:
        """w and each optimizer state at the probe elements, as flat float64 vectors (0 where a state is absent)."""
        opt = self.ctx.optimizer
        states = [opt.state.get(p, {}) for _, p, *_ in self.params]
        # NOTE: torch.take reads a tensor as flat: one op a tensor (a DTensor's local shard: its own elements)
        out = {"w": torch.cat([torch.take(_local(p.detach()), idx) for _, p, idx, _, _ in self.params]).double()}
        for k in STATES:
            if not any(k in st for st in states):  # this optimizer keeps no such state
                out[k] = self.zeros
                continue
            out[k] = torch.cat([torch.take(_local(st[k]), idx) if k in st else torch.zeros(len(idx), device=idx.device)
                                for (_, _, idx, _, _), st in zip(self.params, states)]).double()
        dev = out["w"].device
        # AdamW's count per parameter (a scalar tensor, on the parameter's device when fused); −1: none
        steps = [st["step"] if "step" in st else None for st in states]
        if all(t is not None and t.device == steps[0].device for t in steps):
            out["step"] = on_device(torch.stack(steps), dev, F64).reshape(-1)  # AdamW keeps counts on the CPU
        else:
            out["step"] = torch.stack([on_device(t, dev, F64).reshape(()) if t is not None
                                       else on_device(-1.0, dev, F64) for t in steps])
        return out

    def before_batch(self, s) -> None:
        if self.start is None:  # the run's (or the resumed, or the rolled-back) first step: its own start
            self.start = self.snapshot()
        if self.updates is None:  # at a (re)start: the count the state says it has (on the device: nothing read)
            self.updates = self.start["step"].max().clamp(min=0)
        self.before_batch_muon(s)

    def before_update(self, s) -> None:
        scale = float(self.ctx.scaler.scale) if self.ctx.scaler is not None else 1.0
        g = [_local(p.grad).reshape(-1)[idx] if p.grad is not None else torch.full((len(idx),), math.nan, device=idx.device)
             for _, p, idx, _, _ in self.params]
        self.g0 = torch.cat(g).double() / scale  # NaN: a parameter without a gradient (the optimizer leaves it)

    def before_batch_muon(self, s) -> None:
        """Muon, before a reference step: the hidden matrices in turn (muon_turn) as the previous step left them,
        whole (an update is judged normwise: muon_update)."""
        self.w_before, self.ortho = None, None
        due = self.ctx.reference_step
        if self.muon and (due is None or due(s.step)):
            self.w_before = {n: _full(p.detach()).to(F64, copy=True) for n, p, *_, kind in self.params
                             if kind == "muon" and self.muon_turn(n, s.step)}

    def muon_turn(self, name: str, step: int) -> bool:
        """Whether a Muon matrix's update is checked against the oracle on this reference step: block b's on the
        reference steps k·every with k ≡ b (mod n_layers), a matrix outside the blocks on every one.
        NOTE: the oracle is an eigendecomposition in FP64 per matrix, about a step's time for all of them at the
        speedrun's size; in turn, each reference step checks every group's algebra on whole matrices (a Muon
        update's probe element is its matrix), and every matrix within n_layers reference steps. Its momentum is
        checked every step, element by element (end_step)."""
        parts = name.split(".")
        if len(parts) < 2 or parts[0] != "blocks" or not parts[1].isdigit():
            return True
        return int(parts[1]) == (step // self.ctx.reference_every) % self.ctx.model_cfg.n_layers

    def after_update(self, s) -> None:
        """Muon, on a reference step: NS5 in FP64 of the U of each hidden matrix in turn (before_batch_muon), from
        the momentum the update wrote and the clipped gradient, whole, per part (spec/muon_ref.py); the momentum's
        elements are checked against their own algebra at end_step, every step."""
        self.ortho = None
        if self.w_before is None:
            return
        mc = self.ctx.cfg.optim.muon
        dtype, _ = ns_dtype_for(mc.ns_dtype, self.params[0][1].device)  # the step's own: auto resolved as Muon's
        u_ns = u(getattr(torch, dtype))
        self.ortho = {}
        for n, p, _, _, kind in self.params:
            st = self.ctx.optimizer.state.get(p, {})
            if n in self.w_before and p.grad is not None and "momentum_buffer" in st:
                g, M = _full(p.grad).double(), _full(st["momentum_buffer"]).double()
                U = g + mc.momentum * M if mc.nesterov else M
                parts = U.split(row_parts(n, self.ctx.model_cfg, U), dim=-2)
                O = torch.cat([orthogonalised(q, mc.ns_steps) * math.sqrt(max(q.shape[-2:])) for q in parts], dim=-2)
                width = max(max(q.shape[-2:]) for q in parts)
                # NS5's normwise error in the step's dtype, amplified by at most a per iteration (spec/tolerance.py)
                self.ortho[n] = (O, LAMBDA * mc.ns_steps * 3.4445 ** mc.ns_steps * stage(width, u_ns))

    def muon_update(self, s, still: Tensor) -> Tensor:
        """Each parameter's Muon update against the oracle, normwise over the whole matrix (0 for the others):
        O_got = (W·(1 − η·λ) − W') / (η·s), and ‖O_got − O‖ within NS5's normwise bound plus what the update's own
        FP32 roundings carry in (N_OPS·u32 of |W| + |W'|, over η·s). A skipped step is the stillness check's."""
        cfg, mc = self.ctx.cfg, self.ctx.cfg.optim.muon
        out = torch.zeros(len(self.params), dtype=F64, device=still.device)
        clipped = (s.qk_clip or {}).get("factors") or {}
        for i, (n, p, _, group, _) in enumerate(self.params):
            if n not in self.ortho or n not in self.w_before or (clipped and n in self.qk):
                continue  # NOTE: a QK-clipped head's rows are scaled after the update: not the update's algebra alone
            lr = lr_at(cfg, group, s.step, self.ctx.schedule)
            if lr == 0:
                continue
            O, rel = self.ortho[n]
            eta = lr * mc.rms_scale
            W0, W1 = self.w_before[n], _full(p.detach()).double()
            err = ((W0 * (1 - lr * self.wd_of[i]) - W1) / eta - O).norm()
            tol = rel * O.norm() + SAFETY * N_OPS * U32 * (W0.abs() + W1.abs()).norm() / eta + 1e-300
            out[i] = err / tol
        return torch.where(still, 0.0, out)

    # --- the algebra -------------------------------------------------------------------------------------
    def end_step(self, s) -> None:
        cfg, a = self.ctx.cfg, self.start
        b = self.snapshot()
        b1, b2 = (float(x) for x in cfg.optim.betas)
        eps, t = float(cfg.optim.eps), on_device(self.updates, a["w"].device) + 1  # a 0-d tensor: the count stays there
        coef = self.ctx.coef_spec.double()
        skipped = ~self.ctx.norm_finite | on_device(bool(s.vetoed), coef.device, torch.bool)
        # the schedule's LR of each group (a few), spread to the probe elements of its parameters
        lr = on_device([lr_at(cfg, g, s.step, self.ctx.schedule) for g in self.group_names], a["w"].device, F64)
        lr, wd = lr[self.group_of], self.wd.to(a["w"].device)
        has_g = ~self.g0.isnan()
        g = torch.where(has_g, coef.to(self.g0.device) * self.g0, 0.0)
        clip = self.qk_factor(s.qk_clip, g)
        # what the gradient's own roundings carry in (v: twice, through g²), and the clip coefficient's tolerance
        tol_g = (SAFETY * N_G * U32 + self.ctx.coef_tol.to(g.device)) * g.abs()
        # AdamW
        m, v, w = a["exp_avg"], a["exp_avg_sq"], a["w"]
        m1, v1 = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        tol_m = SAFETY * 2 * U32 * (b1 * m.abs() + (1 - b1) * g.abs()) + (1 - b1) * tol_g
        tol_v = SAFETY * 3 * U32 * (b2 * v + (1 - b2) * g * g) + (1 - b2) * 2 * g.abs() * tol_g
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        denom = (v1 / bc2).sqrt() + eps
        step = (lr / bc1) * m1 / denom
        tol_step = (lr / bc1) * tol_m / denom + step.abs() * tol_v / (2 * v1).clamp(min=1e-300)
        state_err = torch.maximum((b["exp_avg"] - m1).abs() / (tol_m + 1e-300),
                                  (b["exp_avg_sq"] - v1).abs() / (tol_v + 1e-300))
        if self.muon:
            mc = cfg.optim.muon
            M = a["momentum_buffer"]
            M1 = mc.momentum * M + g
            tol_M = SAFETY * 2 * U32 * (mc.momentum * M.abs() + g.abs()) + tol_g
            state_err = torch.where(self.is_muon, (b["momentum_buffer"] - M1).abs() / (tol_M + 1e-300), state_err)
        w1 = clip * (w * (1 - lr * wd) - step)
        tol_w = clip * (SAFETY * N_OPS * U32 * (w.abs() + step.abs()) + tol_step) + 1e-300
        w_err = (b["w"] - w1).abs() / tol_w
        if self.muon:  # a Muon matrix: NS5's bound is normwise, judged over the whole matrix (muon_update), not here
            w_err = torch.where(self.is_muon, 0.0, w_err)
        # a skipped step, or a parameter without a gradient: everything as it was, exactly
        still = skipped | ~has_g
        unchanged = torch.stack([(b[k] - a[k]).abs() for k in ("w", *STATES)]).amax(0) * 1e300  # any change: a miss
        state_err = torch.where(still, unchanged, state_err)
        w_err = torch.where(still, unchanged, w_err)
        n = len(self.params)
        per_state = torch.zeros(n, dtype=F64, device=w.device).scatter_reduce(0, self.owner, state_err, "amax")
        # the step count is exact: the spec's count, plus one unless the step was skipped
        count = t - torch.where(skipped, 1.0, 0.0).to(w.device)
        miscounted = (b["step"] >= 0) & ((b["step"] - count).abs() > 0)
        per_state = torch.where(miscounted, math.inf, per_state)
        per_w = torch.zeros(n, dtype=F64, device=w.device).scatter_reduce(0, self.owner, w_err, "amax")
        if self.ortho and self.w_before:
            per_w = torch.maximum(per_w, self.muon_update(s, skipped.reshape(())))
        worst = torch.maximum(per_state, per_w)
        self.measure(worst, 1.0, torch.where(per_state >= per_w, 0.0, 1.0))
        moments = [(b["exp_avg"], m, g, tol_m), (b["exp_avg_sq"], v, g * g, tol_v)]
        if self.muon:
            moments.append((b["momentum_buffer"], M, g, tol_M))
        # what classify reads for a failure (references to this step's vectors, nothing copied)
        self.places = (moments, still, miscounted, per_state >= per_w, b["w"], w)
        self.start = b

    def classify(self, i: int) -> str:
        """A moment off its algebra with the config's coefficient is a setting's fault all the same when it is exactly
        its algebra with one other coefficient, across the parameter's group: each moment is x' = β'·x + (1−β')·y
        (AdamW's m: y = g; v: y = g²; Muon's M' = μ'·M + g, fitted as M' − g = μ'·M), so x' − y = β'·(x − y) with one
        β' for the group's probe elements, which least squares gives and the moment's own tolerance judges. A moment
        altered between the steps (a loader, a hook, a lost state) fits no single β': its elements' ratios (x' − y) /
        (x − y) spread with g²/v, far beyond FP32's rounding. Likewise AdamW's moments exactly their algebra for the
        gradient g + λ·w, one λ for the group (l2_decay): the decay entered the gradient (Adam's L2), a setting; or
        exactly their algebra for the gradient r·g, one r ≠ 1 (other_factor): the clip's coefficient is not what the
        gradient was multiplied by."""
        moments, still, miscounted, state_first, w_after, w_before = self.places
        own = self.owner == i
        # NOTE: the parameter or a moment whose every probe element lies on a coarser format's grid (its low bits zero:
        # the precision check's own test, by chance 2^-13 an element) was rounded there: kept in a lower precision
        dtype = self.params[i][1].dtype
        if any(on_coarser_grid(x[own], dtype) for x in (w_after, *(got for got, *_ in moments))):
            return "precision"
        if not bool(state_first[i]):
            return "update"
        if bool(miscounted[i]) or bool(still[own].any()):  # a count off, or a state that moved when nothing may
            return "state"
        mine = (self.group_of == self.group_of[own][0]) & ~still
        muon, adamw = self.is_muon & mine, ~self.is_muon & mine
        for k, (got, prev, y, tol) in enumerate(moments):
            sel = muon if k == 2 else adamw
            if not bool(sel.any()):
                continue
            if k == 2:  # Muon: M' − g = μ'·M (its y enters with coefficient 1, not 1 − μ)
                x, z = prev[sel], got[sel] - y[sel]
            else:
                x, z = prev[sel] - y[sel], got[sel] - y[sel]
            beta = (x * z).sum() / x.square().sum().clamp(min=1e-300)
            if not bool(((z - beta * x).abs() <= tol[sel]).all()):
                if k < 2 and l2_decay(moments, w_before, adamw):
                    return "update"
                b1, b2 = (float(b) for b in self.ctx.cfg.optim.betas)
                return "clip" if k < 2 and other_factor(moments, adamw, b1, b2) else "state"
        return "update"

    def qk_factor(self, qk_clip: dict, like: Tensor) -> Tensor:
        """Each probe element's QK-clip factor (optim/qk_clip.py: after the update, a clipped head's W_q rows ×
        γ under GQA; W_q and W_k rows × √γ each under MHA), from the factors the lever reported; 1 elsewhere."""
        out = torch.ones_like(like)
        factors = (qk_clip or {}).get("factors") or {}
        if not factors:
            return out
        mha = self.ctx.model_cfg.kv_heads == self.ctx.model_cfg.n_heads
        at = 0
        for (n, *_), size in zip(self.params, self.sizes):
            for j, (part, head) in enumerate(self.qk.get(n, [])):
                gamma = factors.get(f"block{n.split('.')[1]}.h{head}")
                if gamma is not None and part in ("q", "k") and (mha or part == "q"):
                    out[at + j] = math.sqrt(gamma) if mha else gamma
            at += size
        return out

    def after_read(self, s) -> None:
        """The host knows whether the update applied: the count moves on with it."""
        if not s.skipped:  # NOTE: the host's copy of the step's flag, read with the step
            self.updates = self.updates + 1

    def rolled_back(self, cursor: int) -> None:
        self.start, self.updates = None, None

    def state_dict(self) -> dict:
        return {"updates": None if self.updates is None else self.updates.to("cpu")}

    def load_state_dict(self, sd: dict) -> None:
        u = sd.get("updates")
        self.updates, self.start = None if u is None else torch.as_tensor(u, dtype=F64), None


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def qk_heads(idx: Tensor, cfg) -> list[tuple[str, int]]:
    """(part, head) of each probe element of a fused qkv weight: its row is a q head's, a k head's or a v head's."""
    H, K_, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    out = []
    for r in (idx // cfg.d_model).tolist():
        if r < H * d:
            out.append(("q", r // d))
        elif r < (H + K_) * d:
            out.append(("k", (r - H * d) // d))
        else:
            out.append(("v", (r - (H + K_) * d) // d))
    return out
