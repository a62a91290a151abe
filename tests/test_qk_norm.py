"""QK-norm attention against softmax(QKᵀ/√d)V written out, and the per-head attention-logit probe."""
from __future__ import annotations

import math

import pytest
import torch

from model import ModelConfig, Transformer
from model.attention import Attention, head_logit_max
from model.rope import rope_tables
from optim.groups import param_kinds

pytestmark = pytest.mark.usefixtures("one_thread")
H, K, d, T = 6, 2, 4, 7


def _attn(qk_norm: bool) -> tuple[Attention, ModelConfig]:
    torch.manual_seed(3)
    cfg = ModelConfig(vocab_size=37, seq_len=16, d_model=24, n_layers=1, n_heads=H, n_kv_heads=K, qk_norm=qk_norm)
    attn = Attention(cfg).double()
    attn.init_weights(0.5, 0.5)
    if qk_norm:  # gains away from 1, so a norm applied without its gain (or to the wrong tensor) shows
        with torch.no_grad():
            attn.q_norm.weight.copy_(1 + 0.5 * torch.randn(d))
            attn.k_norm.weight.copy_(1 + 0.5 * torch.randn(d))
    return attn, cfg


def _reference(attn: Attention, cfg: ModelConfig, x: torch.Tensor):
    """Per head, per position: rmsnorm → rotate → scores s = q·k/√d over u ≤ t → softmax → Σ p·v."""
    q, k, v = attn.qkv(x).split([H * d, K * d, K * d], -1)
    q, k, v = q.view(2, T, H, d), k.view(2, T, K, d), v.view(2, T, K, d)

    def rms(z, g):
        return z / torch.sqrt(z.square().mean() + cfg.norm_eps) * g

    def rope(z, t):
        c = torch.complex(z[..., 0::2], z[..., 1::2])
        ang = t * cfg.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        c = c * torch.polar(torch.ones_like(ang), ang)
        return torch.stack([c.real, c.imag], -1).flatten(-2)

    y = torch.zeros(2, T, H, d, dtype=torch.float64)
    smax = torch.full((H,), -math.inf, dtype=torch.float64)
    for b in range(2):
        for h in range(H):
            g = h // (H // K)
            for t in range(T):
                qt = q[b, t, h] if attn.q_norm is None else rms(q[b, t, h], attn.q_norm.weight)
                qt = rope(qt, t)
                ks = [k[b, u, g] if attn.k_norm is None else rms(k[b, u, g], attn.k_norm.weight) for u in range(t + 1)]
                s = torch.stack([rope(ku, u) @ qt for u, ku in enumerate(ks)]) / math.sqrt(d)
                smax[h] = max(smax[h], s.max())
                y[b, t, h] = s.softmax(0) @ v[b, : t + 1, g]
    return attn.proj_out(y.reshape(2, T, H * d)), smax


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_and_logit_probe_match_explicit_reference(qk_norm):
    attn, cfg = _attn(qk_norm)
    cos, sin = (t.double() for t in rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta))
    x = torch.randn(2, T, 24, dtype=torch.float64)
    want, smax_H = _reference(attn, cfg, x)
    attn.probe_logits = True
    got = attn(x, cos, sin)
    # NOTE: the model's angle tables are stored in fp32, hence ~1e-7 relative agreement.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    q, k, _ = attn.qk(x, cos, sin)
    torch.testing.assert_close(head_logit_max(q, k).double(), smax_H, rtol=1e-5, atol=1e-6)
    # the probe reads the first sequence only: ≤ the whole batch's max, equal to sequence 0's
    torch.testing.assert_close(attn.logit_max_H.double(), head_logit_max(q[:1], k[:1]).double())
    assert (attn.logit_max_H.double() <= smax_H + 1e-6).all()
    if qk_norm:  # the bound: |q|,|k| ≤ |g|·√d after the norm, so s ≤ |g_q|·|g_k|·√d·... / √d
        bound = attn.q_norm.weight.abs().max() * attn.k_norm.weight.abs().max() * d / math.sqrt(d)
        assert (smax_H <= bound + 1e-9).all()


def test_qk_norm_gains_are_norm_params_and_do_not_decay():
    model = Transformer(ModelConfig(vocab_size=11, seq_len=8, d_model=16, n_layers=2, n_heads=2, qk_norm=True))
    kinds = param_kinds(model)
    for i in range(2):
        for n in ("q_norm", "k_norm"):
            assert kinds[f"blocks.{i}.attn.{n}.weight"] == {"norm"}
            assert model.get_parameter(f"blocks.{i}.attn.{n}.weight").shape == (8,)
    out = model(torch.randint(11, (2, 8)), torch.randint(11, (2, 8)))
    out.loss_sum.backward()
    assert model.blocks[0].attn.q_norm.weight.grad.abs().sum() > 0


def test_qk_norm_config_must_be_bool():
    # NOTE: "yes" / "on" are booleans to OmegaConf, as on the command line; "maybe" is not
    from pathlib import Path

    from run.config import compose_check
    with pytest.raises(ValueError, match="model.qk_norm"):
        compose_check(["model.qk_norm=maybe"], str(Path(__file__).resolve().parents[1] / "conf"))


def test_telemetry_records_attn_logit_max_per_layer():
    from data.loader import Loader
    from labs.claims.tiny import BATCH, build, make_optimizer, train_step
    from stability.config import TelemetryConfig
    from stability.telemetry import Telemetry

    dataset, model = build(7)
    opt, sched = make_optimizer(model, 1e-2)
    loader = Loader(dataset, BATCH)
    tel = Telemetry(model, TelemetryConfig(every=2))
    # the probe reads the first sequence of each micro-batch (train_step: 2 micro-batches of 4)
    expect, hooks = {}, []
    for i, block in enumerate(model.blocks):
        def hook(mod, args, out, i=i):
            if torch.is_grad_enabled():
                q, k, _ = mod.qk(*args)
                expect[i] = max(expect.get(i, -math.inf), head_logit_max(q[:1], k[:1]).max().item())
        hooks.append(block.attn.register_forward_hook(hook))
    rec1 = train_step(model, opt, sched, loader, 1.0, telemetry=tel, step=1)  # not a telemetry step
    assert rec1["telemetry"] == {} and all(not b.attn.probe_logits for b in model.blocks)
    expect.clear()
    rec = train_step(model, opt, sched, loader, 1.0, telemetry=tel, step=2)
    layers = rec["telemetry"]["layers"]
    for i in range(len(model.blocks)):
        assert layers[f"block{i}.attn"]["attn_logit_max"] == pytest.approx(expect[i], rel=1e-6)
    assert all(not b.attn.probe_logits for b in model.blocks)  # off again after the step


def _logit_max_by_masked_fill(q_BHTd, k_BKTd):
    """The plain form head_logit_max replaced: scale every score, mask the future, then the max."""
    K, d = k_BKTd.shape[1], q_BHTd.shape[-1]
    q = q_BHTd.float().unflatten(1, (K, -1))
    s = torch.einsum("bkgtd,bksd->bkgts", q, k_BKTd.float()) * d ** -0.5
    T = s.shape[-1]
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    return s.amax(dim=(0, 3, 4)).flatten()


def _same_bits(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("B,H,K,T,d", [(1, 4, 4, 128, 32), (3, 8, 2, 17, 16), (2, 6, 1, 1, 8)])
def test_head_logit_max_is_bit_identical_to_the_masked_form(B, H, K, T, d):
    # the fast path (max before the scale, an additive −0/−inf mask, a non-finite max redone by masked_fill)
    # must give the same bits as scaling and masking every score, for any magnitude and any non-finite score
    g = torch.Generator().manual_seed(B * 1000 + T)
    for trial in range(40):
        scale = 10.0 ** (torch.rand((), generator=g).item() * 44 - 22)  # up to fp32 overflow of q·k
        q = torch.randn(B, H, T, d, generator=g) * scale
        k = torch.randn(B, K, T, d, generator=g)
        if trial % 5 == 1 and T > 1:
            # only FUTURE scores overflow: query 0 and keys 1.. are huge along one direction, the causal
            # scores of query 0 (key 0) and of the later queries (small) stay finite
            q[:, :, 1:] *= 1e-30
            q[:, :, 0, 0] = 1e30
            k[:, :, 0] = 1.0
            k[:, :, 1:, 0] = 1e30
        if trial % 5 == 2:
            q[-1, -1, -1, 0] = math.nan
        if trial % 5 == 3:
            q[..., :] = -0.0  # every score a zero (the GEMM's sums start at +0: no −0 reaches the max)
        assert _same_bits(head_logit_max(q, k), _logit_max_by_masked_fill(q, k)), (trial, scale)
