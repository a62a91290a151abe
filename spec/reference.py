"""An independent FP64 reference of the model, written from the math: the oracle of the forward and backward
checks (spec/checks/forward.py).

It imports nothing from model/ but the config: the weights come in by their parameter names (a state dict),
and every operation is written here again from its definition, so that a kernel, a hook or a module of the
training path that computes something else cannot also change the reference. What it computes, per block
(pre-norm; docs/course.md, model/ for the training path's own account):

    h   = x + Attn(RMSNorm(x))          Attn: causal GQA softmax(q·kᵀ/√d)·v, RoPE on q and k, QK-norm
    out = h + MLP(RMSNorm(h))           MLP: SwiGLU silu(min(gate, L))·clamp(up, −L, L), or MoE:
                                        Σ_j gate_j·expert_{id_j}(h) + shared(h), gates the router's scores at
                                        the chosen ids (renormalised over the k), balance and router z-loss
    loss = Σ_valid (lse − logit[label]),  z = Σ_valid lse²      on RMSNorm(final) · W_headᵀ

Everything runs in float64 (the course's "单卡高精度建立参考": a high-precision single-device reference).
MoE routing is discontinuous (a near-tie flips top-k between FP32 and FP64), so a forward is given the expert
ids the training path chose; that those ids ARE the router's top-k (within rounding) is checked apart
(spec/checks/forward.py: route_margin).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from einops import rearrange
from torch import Tensor

from model.config import ModelConfig

IGNORE = -100  # the label of a position without a target (data/batch.py's IGNORE_INDEX; the spec's own copy)
F64 = torch.float64


def rms_norm(x: Tensor, gain: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x²) + eps) · gain, over the last dimension."""
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * gain


def rotate(x_BTHd: Tensor, theta: float, at: Tensor | None = None, T: int | None = None) -> Tensor:
    """RoPE: each pair (x[2i], x[2i+1]) at position t turned by the angle t·θ^(−2i/d) — the pair as the complex
    number x[2i] + i·x[2i+1], times e^(i·t·θ^(−2i/d)); at: the positions of x's rows (ascending, of a sequence of
    T), where they are not 0, 1, ..."""
    d = x_BTHd.shape[-1]
    turn = _turns(x_BTHd.shape[1] if at is None else T, d, theta, x_BTHd.device)
    pairs = torch.view_as_complex(rearrange(x_BTHd, "... (f two) -> ... f two", two=2).contiguous())
    return rearrange(torch.view_as_real(pairs * (turn if at is None else turn[at])), "... f two -> ... (f two)")


_ANGLES: dict[tuple, tuple[Tensor, Tensor]] = {}


def _angles(T: int, d: int, theta: float, device) -> tuple[Tensor, Tensor]:
    """(cos, sin) of t·θ^(−2i/d), (T, 1, d/2), in float64 (cached: the same for every call of a run)."""
    key = (T, d, theta, str(device))
    if key not in _ANGLES:
        freq = theta ** (-torch.arange(0, d, 2, dtype=F64, device=device) / d)
        angle_TF = torch.arange(T, dtype=F64, device=device)[:, None] * freq[None, :]
        _ANGLES[key] = (angle_TF.cos()[:, None, :], angle_TF.sin()[:, None, :])
    return _ANGLES[key]


_TURNS: dict[tuple, Tensor] = {}


def _turns(T: int, d: int, theta: float, device) -> Tensor:
    """e^(i·t·θ^(−2i/d)), (T, 1, d/2), complex128 (cached as the angles)."""
    key = (T, d, theta, str(device))
    if key not in _TURNS:
        _TURNS[key] = torch.complex(*_angles(T, d, theta, device))
    return _TURNS[key]


_FUTURE: dict[tuple, Tensor] = {}


def _future(T: int, device) -> Tensor:
    """(T, T) True where the key comes after the query: the causal mask (cached per length, as the angles)."""
    key = (T, str(device))
    if key not in _FUTURE:
        _FUTURE[key] = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)
    return _FUTURE[key]


def rope_tables(T: int, d: int, theta: float, device) -> tuple[Tensor, Tensor]:
    """(cos, sin) of t·θ^(−2i/d) as (T, d/2) in float64: the tables a model's attention is given, exact."""
    cos, sin = _angles(T, d, theta, device)
    return cos[:, 0], sin[:, 0]


def swiglu(x: Tensor, w_gate_up: Tensor, w_down: Tensor, limit: float | None) -> Tensor:
    """One expert's (weights (2H, D), (D, H)) or every expert's at once (weights (E, 2H, D), (E, D, H): (E, N, D))."""
    gate, up = (x @ w_gate_up.mT).chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (gate * torch.sigmoid(gate) * up) @ w_down.mT


@dataclass
class Keys:
    """The keys and values of a sequence an attention's rows are some positions of (Reference.attention): `at` the
    rows' positions (ascending); k and v (B, S, kv heads, d) every position's, as the projection gives them (before
    QK-norm and RoPE), the rows' own replaced by the reference's."""
    at: Tensor
    k: Tensor
    v: Tensor


@dataclass
class MoEParts:
    """What a reference MoE layer computed on its rows (N = B·T), beside its output."""
    y: Tensor          # (N, D)
    ids: Tensor        # (N, k) the experts used
    gates: Tensor      # (N, k)
    scores: Tensor     # (N, E) the router's scores (softmax or sigmoid of its logits)
    aux: Tensor        # balance_coef·balance + router_z_coef·router_z
    outs: Tensor       # (N, k, D) each chosen expert's output, before its gate
    shared: Tensor     # (N, D) the shared expert's output (zeros without one)
    logits: Tensor     # (N, E) the router's logits


class Reference:
    """The model of `cfg` from weights `w` (parameter name -> tensor, any dtype; taken in float64)."""

    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], bias: dict[int, Tensor] | None = None,
                 stacks: dict[tuple, Tensor] | None = None):
        self.cfg = cfg
        self.w = w
        self.bias = bias or {}  # MoE layer -> (E,) the aux-loss-free selection bias (a buffer, not a weight)
        self.stacks = stacks or {}  # (layers, name in a block) -> their weights stacked (a layer group's, below)

    def p(self, name: str) -> Tensor:
        return self.w[name]

    def layer(self, i: int | tuple[int, ...], name: str) -> Tensor:
        """Block i's weight `name` (its name inside the block); for a group of blocks (a tuple), the group's weights
        stacked along a first dimension, which a group's input carries as its batch dimension: row b of the input
        goes through block i[b]. The blocks are independent where each is fed its own input (spec/checks/prefix.py),
        so a group is one op where its blocks would be one each."""
        if isinstance(i, int):
            return self.w[f"blocks.{i}.{name}"]
        if (i, name) not in self.stacks:
            self.stacks[(i, name)] = torch.stack([self.w[f"blocks.{j}.{name}"] for j in i])
        return self.stacks[(i, name)]

    def gain(self, i: int | tuple[int, ...], name: str, x: Tensor) -> Tensor:
        """Block i's (or a group's) norm gain `name`, broadcast against x (batch first, features last)."""
        g = self.layer(i, name)
        return g if isinstance(i, int) else g.reshape(g.shape[0], *[1] * (x.dim() - 2), g.shape[-1])

    def is_moe(self, i: int) -> bool:
        return f"blocks.{i}.mlp.router.weight" in self.w

    # --- the pieces, each from its definition -------------------------------------------------------
    def embed(self, tokens_BT: Tensor) -> Tensor:
        return self.p("tok_emb.weight")[tokens_BT]

    def qk_v(self, i: int | tuple[int, ...], x_BTD: Tensor, keys: Keys | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Block i's queries, keys and values on its (already normed) input, (B, T, heads, d): q and k QK-normed,
        before RoPE; keys: x's rows are at positions keys.at of a longer sequence, whose other positions' keys and
        values are keys.k and keys.v."""
        c = self.cfg
        H, K, d = c.n_heads, c.kv_heads, c.head_dim
        qkv = rearrange(x_BTD @ self.layer(i, "attn.qkv.weight").mT, "b t (h d) -> b t h d", d=d)
        q, k, v = qkv.split([H, K, K], dim=2)
        if keys is not None:
            k, v = keys.k.index_copy(1, keys.at, k), keys.v.index_copy(1, keys.at, v)
        if c.qk_norm:
            q = rms_norm(q, self.gain(i, "attn.q_norm.weight", q), c.norm_eps)
            k = rms_norm(k, self.gain(i, "attn.k_norm.weight", k), c.norm_eps)
        return q, k, v

    def attention(self, i: int | tuple[int, ...], x_BTD: Tensor, causal: bool = True,
                  keep: dict | None = None, keys: Keys | None = None) -> Tensor:
        """Attn of block i on its (already normed) input, a sequence from position 0; keys: x's rows are at positions
        keys.at (ascending) of a longer sequence, whose other keys and values are given, and each reads every key the
        mask lets it; keep: given, the q and k before RoPE are left in it."""
        c = self.cfg
        H, K = c.n_heads, c.kv_heads
        q, k, v = self.qk_v(i, x_BTD, keys)
        if keep is not None:
            keep["q"], keep["k"] = q.detach(), k.detach()
        at, S = (None, None) if keys is None else (keys.at, k.shape[1])
        q, k = rotate(q, c.rope_theta, at, S), rotate(k, c.rope_theta)
        # query head h reads kv head h // (H/K)
        k, v = k.repeat_interleave(H // K, dim=2), v.repeat_interleave(H // K, dim=2)
        s_BHTS = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(c.head_dim)
        if causal:
            future = _future(k.shape[1], x_BTD.device)
            s_BHTS = s_BHTS.masked_fill(future if at is None else future[at], -math.inf)
        y = rearrange(torch.einsum("bhts,bshd->bthd", s_BHTS.softmax(-1), v), "b t h d -> b t (h d)")
        return y @ self.layer(i, "attn.proj_out.weight").mT

    def dense_mlp(self, i: int | tuple[int, ...], x: Tensor) -> Tensor:
        return swiglu(x, self.layer(i, "mlp.w_gate_up.weight"), self.layer(i, "mlp.w_down.weight"),
                      self.cfg.swiglu_clamp)

    def router_scores(self, i: int, x_ND: Tensor) -> Tensor:
        logits = x_ND @ self.p(f"blocks.{i}.mlp.router.weight").T
        return logits.softmax(-1) if self.cfg.moe.score == "softmax" else torch.sigmoid(logits)

    def moe(self, i: int, x_ND: Tensor, ids_Nk: Tensor | None, valid_N: Tensor | None, aux: bool = True) -> MoEParts:
        """The MoE layer of block i on rows x_ND. ids_Nk None: the router's own top-k (with the bias). aux False: its
        balance and router z-loss are not computed (MoEParts.aux 0), where no loss is compared."""
        mc, pre = self.cfg.moe, f"blocks.{i}.mlp."
        # NOTE: given ids, their k (the route check holds it to the config's top_k): this is the definition applied to
        # the experts the training path chose
        N, E, k = x_ND.shape[0], mc.n_experts, mc.top_k if ids_Nk is None else ids_Nk.shape[-1]
        logits = x_ND @ self.p(pre + "router.weight").T
        scores = logits.softmax(-1) if mc.score == "softmax" else torch.sigmoid(logits)
        if ids_Nk is None:
            bias = self.bias.get(i, torch.zeros(E, dtype=F64, device=x_ND.device))
            ids_Nk = torch.topk(scores.detach() + bias, k, dim=-1).indices
        gates = scores.gather(-1, ids_Nk)
        if k > 1 and (mc.norm_topk or mc.score == "sigmoid"):
            gates = gates / gates.sum(-1, keepdim=True)
        # every expert on every row, then each row's k chosen ones (the sum above as written, no loop over experts):
        # E/k times the FLOPs of routing, which a probe's few rows afford; a row's gradient reaches only the experts
        # it chose (the gather)
        all_END = swiglu(x_ND, self.p(pre + "experts.w_gate_up"), self.p(pre + "experts.w_down"), self.cfg.swiglu_clamp)
        outs_NkD = all_END[ids_Nk, torch.arange(N, device=x_ND.device)[:, None]]
        shared = (swiglu(x_ND, self.p(pre + "shared.w_gate_up.weight"), self.p(pre + "shared.w_down.weight"),
                         self.cfg.swiglu_clamp) if mc.shared_expert else torch.zeros_like(x_ND))
        y = (outs_NkD * gates[..., None]).sum(1) + shared
        terms = self.aux(logits, scores, ids_Nk, valid_N) if aux else torch.zeros((), dtype=F64, device=x_ND.device)
        return MoEParts(y, ids_Nk, gates, scores, terms, outs_NkD, shared, logits)

    def aux(self, logits_NE: Tensor, scores_NE: Tensor, ids_Nk: Tensor, valid_N: Tensor | None) -> Tensor:
        """An MoE layer's auxiliary loss on its rows: balance_coef·balance + router_z_coef·router z-loss."""
        mc = self.cfg.moe
        # NOTE: E the config's: an expert id past it (a model built with more experts) fails the check here
        N, E, k = scores_NE.shape[0], mc.n_experts, ids_Nk.shape[-1]
        valid = torch.ones(N, dtype=torch.bool, device=scores_NE.device) if valid_N is None else valid_N
        n = valid.sum().clamp(min=1).to(F64)
        # Switch balance E·Σ_e f_e·P_e (f: the share of valid assignments, no gradient; P: the mean probability)
        f_E = torch.zeros(E, dtype=F64, device=scores_NE.device).index_add(
            0, ids_Nk.flatten(), valid.repeat_interleave(k).to(F64)) / (n * k)
        probs = scores_NE if mc.score == "softmax" else scores_NE / scores_NE.sum(-1, keepdim=True)
        P_E = torch.where(valid[:, None], probs, 0.0).sum(0) / n
        balance = E * (f_E * P_E).sum()
        router_z = torch.where(valid, torch.logsumexp(logits_NE, -1).square(), 0.0).sum() / n
        return mc.balance_coef * balance + mc.router_z_coef * router_z

    def block(self, i: int, x_BTD: Tensor, ids_Nk: Tensor | None = None, valid_BT: Tensor | None = None):
        """(block output, its MoEParts or None)."""
        c, pre = self.cfg, f"blocks.{i}."
        h = x_BTD + self.attention(i, rms_norm(x_BTD, self.p(pre + "attn_norm.weight"), c.norm_eps))
        m_in = rms_norm(h, self.p(pre + "mlp_norm.weight"), c.norm_eps)
        if not self.is_moe(i):
            return h + self.dense_mlp(i, m_in), None
        B, T, D = m_in.shape
        parts = self.moe(i, m_in.reshape(B * T, D), ids_Nk, None if valid_BT is None else valid_BT.reshape(-1))
        return h + parts.y.reshape(B, T, D), parts

    def head(self, x_BTD: Tensor) -> Tensor:
        """Logits from the last block's output."""
        w = self.w.get("head.weight", self.p("tok_emb.weight"))
        return rms_norm(x_BTD, self.p("norm.weight"), self.cfg.norm_eps) @ w.T

    # --- the whole model ------------------------------------------------------------------------------
    def forward(self, tokens_BT: Tensor, labels_BT: Tensor, ids: dict[int, Tensor] | None = None) -> dict:
        """{"ce", "z", "aux", "n", "blocks": [outputs], "moe": {layer: MoEParts}} on one batch; `ids`: the
        expert ids per MoE layer, (B·T, k), as the training path chose them."""
        valid = labels_BT != IGNORE
        x = self.embed(tokens_BT)
        outs, moes = [], {}
        for i in range(self.cfg.n_layers):
            x, parts = self.block(i, x, (ids or {}).get(i), valid)
            outs.append(x)
            if parts is not None:
                moes[i] = parts
        ce, z = losses(self.head(x), labels_BT)
        aux = sum((p.aux for p in moes.values()), torch.zeros((), dtype=F64, device=x.device))
        return {"ce": ce, "z": z, "aux": aux, "n": valid.sum(), "blocks": outs, "moe": moes}


def token_terms(logits_BTV: Tensor, labels_BT: Tensor) -> tuple[Tensor, Tensor]:
    """Each position's (cross-entropy, lse²), 0 where its label is ignored."""
    valid = labels_BT != IGNORE
    lse = torch.logsumexp(logits_BTV, -1)
    at = logits_BTV.gather(-1, labels_BT.clamp(min=0)[..., None])[..., 0]
    return torch.where(valid, lse - at, 0.0), torch.where(valid, lse.square(), 0.0)


def losses(logits_BTV: Tensor, labels_BT: Tensor) -> tuple[Tensor, Tensor]:
    """(Σ cross-entropy, Σ lse²) over the valid labels."""
    ce, z = token_terms(logits_BTV, labels_BT)
    return ce.sum(), z.sum()


def weights_f64(model: torch.nn.Module, requires_grad: bool = False) -> dict[str, Tensor]:
    """Every parameter of `model` by name in float64 (a DTensor shard gathered whole), as leaves."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.to(F64).requires_grad_(requires_grad)
    return out
