"""MoE layer against a per-token loop reference; balancing losses, bias balancing, route seam."""
from __future__ import annotations

import math

import pytest
import torch

from model import MoE, MoEConfig


def make_moe(seed=0, d=16, limit=None, **kw) -> MoE:
    torch.manual_seed(seed)
    cfg = MoEConfig(**({"n_experts": 6, "top_k": 2, "expert_hidden": 12} | kw))
    moe = MoE(cfg, d, limit)
    moe.init_weights(0.3, 0.2)
    return moe


def reference(moe: MoE, x_ND: torch.Tensor, route_ids=None):
    """One token at a time in float64: scores, top-k on scores + bias, Σ gate · expert(x)."""
    cfg, L = moe.cfg, moe.experts.limit
    Wr = moe.router.weight.detach().double()
    Wgu, Wd = moe.experts.w_gate_up.detach().double(), moe.experts.w_down.detach().double()
    H = cfg.expert_hidden

    def expert(W_gate_up, W_down, x):
        h = W_gate_up @ x
        gate, up = h[:H], h[H:]
        if L is not None:
            gate, up = gate.clamp(max=L), up.clamp(-L, L)
        return W_down @ (gate * torch.sigmoid(gate) * up)

    ys, ids = [], []
    for n, x in enumerate(x_ND.detach().double()):
        logits = Wr @ x
        s = logits.softmax(0) if cfg.score == "softmax" else logits.sigmoid()
        ranked = (s + moe.bias_E.double()).tolist()
        chosen = sorted(range(cfg.n_experts), key=lambda e: -ranked[e])[: cfg.top_k]
        if route_ids is not None:
            chosen = route_ids[n].tolist()
        g = [s[e].item() for e in chosen]
        if cfg.top_k > 1 and (cfg.norm_topk or cfg.score == "sigmoid"):  # k = 1: the raw p (Switch)
            g = [gi / sum(g) for gi in g]
        y = sum(gi * expert(Wgu[e], Wd[e], x) for gi, e in zip(g, chosen))
        if moe.shared is not None:
            sh = moe.shared
            y = y + expert(sh.w_gate_up.weight.detach().double(), sh.w_down.weight.detach().double(), x)
        ys.append(y)
        ids.append(chosen)
    return torch.stack(ys), ids


@pytest.mark.parametrize("kw", [
    {},
    {"score": "sigmoid", "shared_expert": True},
    {"norm_topk": False, "top_k": 3},
    {"top_k": 1, "shared_expert": True, "limit": 0.3},
])
def test_layer_matches_per_token_loop_and_is_dropless(kw):
    moe = make_moe(**kw)
    with torch.no_grad():
        moe.bias_E.copy_(torch.linspace(-0.05, 0.05, 6))  # the bias must steer selection only
    x = torch.randn(3, 10, 16)
    out = moe(x)
    ref_y, ref_ids = reference(moe, x.reshape(30, 16))
    assert out.y.shape == x.shape
    torch.testing.assert_close(out.y.reshape(30, 16).double(), ref_y, rtol=1e-5, atol=1e-5)
    assert [sorted(r) for r in out.route_ids_Nk.tolist()] == [sorted(r) for r in ref_ids]
    k = moe.cfg.top_k
    assert out.load_E.sum().item() == 30 * k and out.load_E.dtype == torch.float32
    assert torch.equal(out.load_E, torch.bincount(torch.tensor(ref_ids).flatten(), minlength=6).float())
    assert all(len(set(r)) == k for r in out.route_ids_Nk.tolist())


# Router weight = identity and x = A make the router logits exactly A: the routing is known by hand.
A = [[3.0, 1.0, 0.0, 0.0],   # top-2 {0, 1}
     [3.0, 0.0, 2.0, 0.0],   # {0, 2}
     [0.0, 2.0, 0.0, 1.0],   # {1, 3}
     [1.0, 0.0, 0.0, 4.0]]   # {3, 0}


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_switch_balance_and_router_z_on_hand_made_routing(score):
    moe = MoE(MoEConfig(n_experts=4, top_k=2, expert_hidden=4, score=score,
                        balance_coef=0.5, router_z_coef=0.25), 4, None)
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(4))
    out = moe(torch.tensor(A))
    f = [3 / 8, 2 / 8, 1 / 8, 2 / 8]
    if score == "softmax":
        probs = [[math.exp(v) / sum(math.exp(w) for w in row) for v in row] for row in A]
    else:
        sig = [[1 / (1 + math.exp(-v)) for v in row] for row in A]
        probs = [[v / sum(row) for v in row] for row in sig]
    P = [sum(p[e] for p in probs) / 4 for e in range(4)]
    balance = 4 * sum(fe * pe for fe, pe in zip(f, P))
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in A) / 4
    assert out.load_E.tolist() == [3.0, 2.0, 1.0, 2.0]
    assert out.balance_loss.item() == pytest.approx(balance, rel=1e-6)
    assert out.router_z.item() == pytest.approx(z, rel=1e-6)
    assert out.aux_loss.item() == pytest.approx(0.5 * balance + 0.25 * z, rel=1e-6)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_padding_counts_nowhere_in_loads_and_losses(score):
    """Issue 13 #7: a masked position is routed (its output is defined) but enters neither the loads nor
    the Switch loss nor the router z-loss. Reference: the same layer on the valid tokens alone."""
    moe = make_moe(n_experts=6, top_k=2, score=score, balance_coef=0.5, router_z_coef=0.25)
    x = torch.randn(40, 16)
    valid = torch.rand(40) < 0.6
    x[~valid] = x[~valid] * 3 + 1.0  # padding that would skew the loads if it counted
    out = moe(x, valid_N=valid)
    ref = moe(x[valid])
    assert out.load_E.sum().item() == 2 * int(valid.sum())
    assert torch.equal(out.load_E, ref.load_E)
    torch.testing.assert_close(out.balance_loss, ref.balance_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.router_z, ref.router_z, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.y[valid], ref.y, rtol=1e-6, atol=1e-6)
    # the aux loss's router gradient comes from the valid tokens alone
    g_out = torch.autograd.grad(out.aux_loss, moe.router.weight)[0]
    g_ref = torch.autograd.grad(ref.aux_loss, moe.router.weight)[0]
    torch.testing.assert_close(g_out, g_ref, rtol=1e-5, atol=1e-7)
    none = moe(x, valid_N=torch.zeros(40, dtype=torch.bool))  # a micro-batch of padding only: nothing counts
    assert none.load_E.sum().item() == 0 and none.aux_loss.item() == 0.0


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_top1_router_gets_lm_gradient(score):
    """Issue 13 #8: at k = 1 a renormalised gate is p/p = 1 and the router learned nothing from the LM
    loss (grad ~1e-8). With the raw p (Switch) its gradient is of the order of the top-2 one."""
    grads = {}
    for k in (1, 2):
        moe = make_moe(n_experts=4, top_k=k, score=score, balance_coef=0.0, router_z_coef=0.0)
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(5))
        target = torch.randn(64, 16, generator=torch.Generator().manual_seed(6))
        (moe(x).y - target).square().sum().backward()
        grads[k] = moe.router.weight.grad.norm().item()
    assert grads[1] > 0.05 * grads[2] > 0, grads


def test_balance_loss_is_one_at_uniform_routing():
    moe = MoE(MoEConfig(n_experts=4, top_k=1, expert_hidden=4), 4, None)
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(4))
    out = moe(torch.eye(4) * 2.0)  # each expert wins one token; mean probability is 1/4 by symmetry
    assert out.balance_loss.item() == pytest.approx(1.0, rel=1e-6)


def test_bias_update_moves_load_toward_uniform():
    moe = make_moe(seed=1, n_experts=8, top_k=2, bias_update_speed=0.004)
    x = torch.randn(256, 16) + 0.5
    with torch.no_grad():
        moe.router.weight[0] += 0.4  # every token leans toward expert 0 (x has a positive mean)
    ratio = lambda load: (load.max() / load.min().clamp_min(1)).item()
    loads = []
    with torch.no_grad():
        for _ in range(150):
            load = moe(x).load_E
            moe.update_bias(load)
            loads.append(load)
    late = torch.stack(loads[-30:]).mean(0)  # sign updates oscillate around balance: average them
    assert ratio(loads[0]) > 8
    assert ratio(late) < 1.5 < ratio(loads[0]) / 5
    assert moe.bias_E[0] == moe.bias_E.min()  # the overloaded expert was pushed down the most


def test_bias_update_rule_and_gamma_zero():
    moe = make_moe(bias_update_speed=0.1, n_experts=4)
    moe.update_bias(torch.tensor([10.0, 2.0, 4.0, 4.0]))  # mean 5
    torch.testing.assert_close(moe.bias_E, torch.tensor([-0.1, 0.1, 0.1, 0.1]))
    off = make_moe(bias_update_speed=0.0, n_experts=4)
    off.update_bias(torch.tensor([10.0, 2.0, 4.0, 4.0]))
    assert torch.equal(off.bias_E, torch.zeros(4))


def test_given_route_ids_are_used_and_router_still_learns():
    moe = make_moe(n_experts=4, top_k=2)
    x = torch.randn(32, 16)
    given = torch.tensor([[n % 4, (n + 1) % 4] for n in range(32)])
    own = moe(x).route_ids_Nk
    assert not torch.equal(own.sort(-1).values, given.sort(-1).values)
    out = moe(x, given)
    assert torch.equal(out.route_ids_Nk, given)
    assert out.load_E.tolist() == [16.0] * 4
    ref_y, _ = reference(moe, x, route_ids=given)
    torch.testing.assert_close(out.y.double(), ref_y, rtol=1e-5, atol=1e-5)
    out.y.square().sum().backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="top_k"):
        moe(x, given[:, :1])


def test_every_expert_parameter_gets_a_grad_even_without_tokens():
    moe = make_moe(n_experts=4, top_k=2, shared_expert=True)
    x = torch.randn(20, 16)
    out = moe(x, torch.tensor([[0, 1]] * 20))  # experts 2 and 3 receive nothing
    (out.y.sum() + out.aux_loss).backward()
    for name, p in moe.named_parameters():
        assert p.grad is not None, name
    for w in (moe.experts.w_gate_up, moe.experts.w_down):
        assert torch.all(w.grad[2:] == 0) and torch.all(w.grad[:2].flatten(1).abs().sum(1) > 0)


def test_router_runs_in_fp32_under_autocast():
    moe = make_moe()
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = moe.router_logits(x)
        out = moe(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x @ moe.router.weight.T, rtol=1e-6, atol=1e-6)
    assert out.load_E.dtype == torch.float32 and out.balance_loss.dtype == torch.float32


def test_expert_clamp_hits_are_counted_over_assignments():
    L = 0.4
    moe = make_moe(n_experts=4, top_k=2, limit=L)
    moe.experts.record_stats = True
    x = torch.randn(10, 16)
    out = moe(x)
    H, hits = 12, 0
    for n, chosen in enumerate(out.route_ids_Nk.tolist()):
        for e in chosen:
            h = moe.experts.w_gate_up[e].detach() @ x[n]
            hits += int(((h[:H] > L) | (h[H:].abs() > L)).sum())
    assert 0 < hits < 10 * 2 * H
    assert moe.experts.clamp_hits.item() == hits and moe.experts.clamp_total.item() == 10 * 2 * H
