"""Transformer, attention/RoPE, losses, init and config validation (the elementwise kernels: test_model_kernels.py)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from model import IGNORE_INDEX, ModelConfig, MoEConfig, Transformer, token_losses
from model.attention import Attention
from model.rope import apply_rope, rope_tables


def tiny_cfg(moe: bool, **kw) -> ModelConfig:
    base = dict(vocab_size=37, seq_len=16, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                swiglu_clamp=10.0)
    if moe:
        base["moe"] = MoEConfig(n_experts=4, top_k=2, expert_hidden=16, shared_expert=True, router_z_coef=1e-3)
    base.update(kw)
    return ModelConfig(**base)


# ---------------------------------------------------------------- transformer

@pytest.mark.parametrize("moe", [False, True])
def test_shapes_and_causality(moe):
    torch.manual_seed(0)
    model = Transformer(tiny_cfg(moe))
    tokens = torch.randint(0, 37, (2, 16))
    out = model(tokens, return_logits=True)
    assert out.logits.shape == (2, 16, 37)
    for t in (0, 5, 14):
        changed = tokens.clone()
        changed[:, t + 1:] = torch.randint(0, 37, changed[:, t + 1:].shape)
        assert not torch.equal(changed, tokens)
        logits = model(changed, return_logits=True).logits
        torch.testing.assert_close(logits[:, :t + 1], out.logits[:, :t + 1], rtol=0, atol=1e-6)
        assert not torch.allclose(logits[:, t + 1:], out.logits[:, t + 1:])
    if moe:
        assert sorted(out.moe_load) == [1, 2]
        assert all(load.sum().item() == 2 * 16 * 2 for load in out.moe_load.values())


def test_ce_and_per_sample_sums_match_reference():
    torch.manual_seed(1)
    model = Transformer(tiny_cfg(moe=True))
    tokens = torch.randint(0, 37, (3, 16))
    labels = torch.randint(0, 37, (3, 16))
    labels[0, :5] = IGNORE_INDEX
    labels[2, :] = IGNORE_INDEX
    out = model(tokens, labels, return_logits=True)
    logits = out.logits.detach().double()
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(out.loss_sum.double(), ref, rtol=1e-6, atol=1e-5)
    assert out.n_valid.item() == 16 + 11 and out.n_valid.dtype == torch.int64
    assert out.n_valid_B.tolist() == [11, 16, 0]
    for b in range(3):
        ref_b = F.cross_entropy(logits[b], labels[b], reduction="sum", ignore_index=IGNORE_INDEX)
        torch.testing.assert_close(out.loss_sum_B[b].double(), ref_b, rtol=1e-6, atol=1e-5)
    assert out.logit_max.item() == pytest.approx(logits.abs().max().item(), rel=1e-6)
    assert out.loss_sum.requires_grad and out.z_sum.requires_grad and out.aux_loss.requires_grad


def test_z_loss_on_hand_made_logits():
    rows = [[0.0, 1.0, 2.0], [3.0, -1.0, 0.5], [100.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    labels = [2, 0, IGNORE_INDEX, 1]
    lse = [math.log(sum(math.exp(v) for v in r)) for r in rows[:2]] + [100.0 + math.log(1 + 2 * math.exp(-100))]
    lse.append(math.log(sum(math.exp(v) for v in rows[3])))
    valid = [i for i, y in enumerate(labels) if y != IGNORE_INDEX]
    expected_z_mean = sum(lse[i] ** 2 for i in valid) / len(valid)
    expected_ce = sum(lse[i] - rows[i][labels[i]] for i in valid)
    got = token_losses(torch.tensor([rows]), torch.tensor([labels]))
    assert got.n_valid.item() == 3
    assert (got.z_sum / got.n_valid).item() == pytest.approx(expected_z_mean, rel=1e-6)
    assert got.loss_sum.item() == pytest.approx(expected_ce, rel=1e-6)


def test_ignored_inf_logit_does_not_poison_the_sums():
    logits = torch.tensor([[[0.0, 1.0], [float("inf"), 0.0]]])
    got = token_losses(logits, torch.tensor([[1, IGNORE_INDEX]]))
    assert got.loss_sum.item() == pytest.approx(math.log(1 + math.e) - 1.0, rel=1e-6)
    assert math.isfinite(got.z_sum.item())


def test_inference_without_labels():
    model = Transformer(tiny_cfg(moe=False))
    out = model(torch.randint(0, 37, (2, 9)))
    assert out.logits.shape == (2, 9, 37)
    assert out.loss_sum.item() == 0 and out.n_valid.item() == 0 and out.aux_loss.item() == 0
    assert out.n_valid_B.tolist() == [0, 0]


def test_routes_reproduce_own_routing_and_reject_dense_layers():
    torch.manual_seed(2)
    model = Transformer(tiny_cfg(moe=True))
    tokens = torch.randint(0, 37, (2, 16))
    routes = model.compute_routes(tokens)
    assert sorted(routes) == [i for i, _ in model.moe_layers()] == [1, 2]
    assert all(r.shape == (2, 16, 2) and not r.requires_grad for r in routes.values())
    own, replayed = model(tokens, tokens), model(tokens, tokens, routes=routes)
    assert torch.equal(own.loss_sum, replayed.loss_sum)
    with pytest.raises(ValueError, match="layer 0"):
        model(tokens, tokens, routes={0: routes[1]})
    with pytest.raises(ValueError, match="model.seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_tied_head_and_param_count():
    tied = Transformer(tiny_cfg(moe=False))
    untied = Transformer(tiny_cfg(moe=False, tie_embeddings=False))
    assert tied.head.weight is tied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == 37 * 32
    assert tied.num_params() == sum(p.numel() for p in tied.state_dict().values()) - 37 * 32


# ---------------------------------------------------------------- attention and RoPE

def test_attention_matches_naive_reference_with_complex_rope():
    torch.manual_seed(3)
    cfg = tiny_cfg(moe=False, d_model=24, n_heads=6, n_kv_heads=2)
    attn = Attention(cfg).double()
    cos, sin = (t.double() for t in rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta))
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    got = attn(x, cos, sin)

    H, K, d = 6, 2, 4
    q, k, v = attn.qkv(x).split([H * d, K * d, K * d], -1)
    q, k, v = q.view(2, 7, H, d), k.view(2, 7, K, d), v.view(2, 7, K, d)

    def rope(z, t):  # pair (z[2i], z[2i+1]) as a complex number, rotated by t·theta^(-2i/d)
        c = torch.complex(z[..., 0::2], z[..., 1::2])
        ang = t * cfg.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        c = c * torch.polar(torch.ones_like(ang), ang)
        return torch.stack([c.real, c.imag], -1).flatten(-2)

    y = torch.zeros(2, 7, H, d, dtype=torch.float64)
    for b in range(2):
        for h in range(H):
            g = h // (H // K)  # query head h reads kv head h // group size
            for t in range(7):
                qt = rope(q[b, t, h], t)
                s = torch.stack([rope(k[b, u, g], u) @ qt for u in range(t + 1)]) / math.sqrt(d)
                y[b, t, h] = s.softmax(0) @ v[b, : t + 1, g]
    # NOTE: the model's angle tables are stored in fp32, hence ~1e-7 relative agreement, not 1e-15.
    torch.testing.assert_close(got, attn.proj_out(y.reshape(2, 7, H * d)), rtol=1e-5, atol=1e-7)


def test_rope_scores_depend_only_on_relative_position():
    cos, sin = rope_tables(32, 8, 10000.0)
    q, k = torch.randn(8), torch.randn(8)
    at = lambda z, t: apply_rope(z.view(1, 1, 1, 8).expand(1, 32, 1, 8), cos, sin)[0, t, 0]
    assert at(q, 9) @ at(k, 4) == pytest.approx((at(q, 25) @ at(k, 20)).item(), rel=1e-4)
    assert at(q, 9) @ at(k, 4) != pytest.approx((at(q, 9) @ at(k, 5)).item(), rel=1e-4)


# ---------------------------------------------------------------- gradient check

@pytest.mark.parametrize("moe", [False, True])
def test_gradcheck_float64(moe):
    torch.manual_seed(5)
    cfg = ModelConfig(vocab_size=7, seq_len=5, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1,
                      mlp_hidden=8, swiglu_clamp=50.0, tie_embeddings=not moe, init_std=0.5,
                      moe=MoEConfig(n_experts=3, top_k=2, expert_hidden=4, first_dense=1,
                                    balance_coef=0.3, router_z_coef=0.2) if moe else None)
    model = Transformer(cfg).double()
    tokens, labels = torch.randint(0, 7, (2, 5)), torch.randint(0, 7, (2, 5))
    labels[0, 0] = IGNORE_INDEX
    # NOTE: routing is piecewise constant; fixing the ids keeps finite differences off its boundaries.
    routes = model.compute_routes(tokens) if moe else None
    for _, m in model.swiglus():  # the clamp is on, but every activation sits inside its bound
        m.record_stats = True
    model(tokens, labels)
    assert all(m.clamp_hits.item() == 0 and m.clamp_total.item() > 0 for _, m in model.swiglus())
    # Every parameter at once; fast mode compares J·u from finite differences with the analytic
    # vᵀJ·u for random u, v: a wrong gradient anywhere shows up, at the cost of a few forwards.
    names, params = zip(*model.named_parameters())
    inputs = tuple(p.detach().clone().requires_grad_() for p in params)

    def objective(*ps):
        out = functional_call(model, dict(zip(names, ps)), (tokens, labels), {"routes": routes})
        return out.loss_sum + 0.1 * out.z_sum + out.aux_loss

    assert torch.autograd.gradcheck(objective, inputs, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)
    for _, m in model.swiglus():  # and through the step's own SwiGLU path (model/swiglu.py swiglu_fused)
        m.record_stats = False
    assert torch.autograd.gradcheck(objective, inputs, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)


# ---------------------------------------------------------------- init

def test_init_std_and_residual_scaling():
    torch.manual_seed(6)
    cfg = ModelConfig(vocab_size=512, seq_len=8, d_model=256, n_layers=8, n_heads=4, init_std=0.02,
                      moe=MoEConfig(n_experts=4, expert_hidden=256, shared_expert=True, first_dense=4))
    model = Transformer(cfg)
    resid = 0.02 / math.sqrt(16)
    expect = {"tok_emb.weight": 0.02}
    for i in (0, 5):
        expect |= {f"blocks.{i}.attn.qkv.weight": 0.02, f"blocks.{i}.attn.proj_out.weight": resid}
    expect |= {"blocks.0.mlp.w_gate_up.weight": 0.02, "blocks.0.mlp.w_down.weight": resid,
               "blocks.5.mlp.router.weight": 0.02, "blocks.5.mlp.experts.w_gate_up": 0.02,
               "blocks.5.mlp.experts.w_down": resid, "blocks.5.mlp.shared.w_down.weight": resid}
    params = dict(model.named_parameters())
    for name, std in expect.items():
        w = params[name].detach()
        assert w.std().item() == pytest.approx(std, rel=0.05), name
        assert abs(w.mean().item()) < 5 * std / math.sqrt(w.numel()), name
    assert torch.equal(params["blocks.3.mlp_norm.weight"], torch.ones(256))


# ---------------------------------------------------------------- config

def test_config_derived_sizes_and_layer_pattern():
    cfg = ModelConfig(vocab_size=10, seq_len=8, d_model=128, n_layers=7,
                      moe=MoEConfig(first_dense=2, every=2))
    assert cfg.ffn_hidden == 352 and cfg.head_dim == 32 and cfg.kv_heads == 4  # ceil(341.3 / 32) · 32
    assert [cfg.is_moe_layer(i) for i in range(7)] == [False, False, True, False, True, False, True]
    assert not ModelConfig(vocab_size=10, seq_len=8).is_moe_layer(3)


@pytest.mark.parametrize("changes, message", [
    ({"d_model": 130}, r"model\.d_model=130 is not divisible by model\.n_heads=4"),
    ({"n_kv_heads": 3}, r"model\.n_heads=4 is not divisible by model\.n_kv_heads=3"),
    ({"d_model": 12, "n_heads": 4}, r"model\.d_model/model\.n_heads=3 must be even"),
    ({"vocab_size": 0}, r"model\.vocab_size=0"),
    ({"seq_len": -1}, r"model\.seq_len=-1"),
    ({"n_layers": 0}, r"model\.n_layers=0"),
    ({"mlp_hidden": 0}, r"model\.mlp_hidden=0"),
    ({"init_std": 0.0}, r"model\.init_std=0\.0"),
    ({"norm_eps": -1e-5}, r"model\.norm_eps"),
    ({"swiglu_clamp": 0.0}, r"model\.swiglu_clamp=0\.0"),
    ({"moe": {"top_k": 9}}, r"model\.moe\.top_k=9 > model\.moe\.n_experts=8"),
    ({"moe": {"score": "relu"}}, r"model\.moe\.score='relu'"),
    ({"moe": {"n_experts": 0}}, r"model\.moe\.n_experts=0"),
    ({"moe": {"every": 0}}, r"model\.moe\.every=0"),
    ({"moe": {"first_dense": 4}}, r"model\.moe\.first_dense=4 leaves no MoE layer"),
    ({"moe": {"balance_coef": -0.1}}, r"model\.moe\.balance_coef=-0\.1"),
    ({"moe": {"bias_update_speed": -1.0}}, r"model\.moe\.bias_update_speed"),
])
def test_config_validation_names_the_key(changes, message):
    # the schema checks on construction: a bad ModelConfig never exists, so no model is built from one
    with pytest.raises(ValueError, match=message):
        moe = {"moe": MoEConfig(**changes["moe"])} if "moe" in changes else {}
        ModelConfig(**({"vocab_size": 10, "seq_len": 8} | changes | moe))


def test_rope_real_form_used_under_compile_equals_complex_form():
    from unittest import mock

    cos, sin = rope_tables(16, 8, 10000.0)
    x = torch.randn(2, 16, 3, 8)
    eager = apply_rope(x, cos, sin)
    with mock.patch("torch.compiler.is_compiling", return_value=True):
        traced = apply_rope(x, cos, sin)
    torch.testing.assert_close(traced, eager, rtol=1e-6, atol=1e-6)


def test_moe_loads_count_only_valid_label_positions():
    """Issue 13 #7, through the model: loads sum to top_k × valid tokens and equal the per-token count of
    the ids chosen at the valid positions; padding positions are routed but not counted."""
    from model import MoEConfig

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=11, seq_len=12, d_model=16, n_layers=2, n_heads=2,
                      moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=8, first_dense=1))
    model = Transformer(cfg)
    tokens = torch.randint(0, 11, (3, 12))
    labels = torch.randint(0, 11, (3, 12))
    labels[0, 7:] = IGNORE_INDEX
    labels[2, :] = IGNORE_INDEX
    out = model(tokens, labels)
    valid = labels != IGNORE_INDEX
    ids = model.compute_routes(tokens)[1]  # (B, T, k), the same parameters: the same choices
    assert out.moe_load[1].sum().item() == 2 * int(valid.sum()) == 2 * out.n_valid.item()
    assert torch.equal(out.moe_load[1], torch.bincount(ids[valid].flatten(), minlength=4).float())
