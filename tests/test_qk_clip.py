"""QK-clip (optim/qk_clip.py): after the step every head's max logit on the step's batch is ≤ τ, heads
under τ keep their weights bit for bit, and the logged factors are τ/S."""
from __future__ import annotations

import pytest
import torch

from model import ModelConfig, Transformer
from optim import build_optimizer
from optim.config import QKClipConfig
from optim.config import OptimConfig
from optim.qk_clip import QKClip

pytestmark = pytest.mark.usefixtures("one_thread")
ROUND = 1e-5  # float32: the clipped logit is S·(τ/S) with S recomputed from scaled weights


def _model(kv, **kw):
    torch.manual_seed(0)
    # a large init: logits of O(10), so a τ between heads exists on the first step
    return Transformer(ModelConfig(vocab_size=29, seq_len=16, d_model=32, n_layers=3, n_heads=4, n_kv_heads=kv,
                                   init_std=0.3, **kw))


@pytest.mark.parametrize("kv", [4, 2])
@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
def test_after_a_step_every_head_is_at_most_tau_and_heads_under_tau_are_untouched(kv, opt_name):
    model = _model(kv)
    opt, _ = build_optimizer(model, OptimConfig(name=opt_name, lr=1e-2, weight_decay=0.1, groups=[]))
    g = torch.Generator().manual_seed(1)
    micro = [torch.randint(29, (3, 16), generator=g) for _ in range(2)]
    for x in micro:
        model(x, x).loss_sum.backward()
    opt.step()
    clip = QKClip(model, QKClipConfig(tau=1.0))
    S0 = clip.measure(micro)  # after the update, before the clip
    tau = torch.cat(S0).median().item()  # about half the heads over it
    clip.tau = tau
    W0 = [b.attn.qkv.weight.detach().clone() for b in model.blocks]
    log = clip.after_update(micro)
    S1 = clip.measure(micro)
    H, d = 4, 8
    for i, (s0, s1) in enumerate(zip(S0, S1)):
        assert (s1 <= tau * (1 + ROUND)).all(), (i, s1, tau)
        W1 = model.blocks[i].attn.qkv.weight.detach()
        for h in range(H):
            q_rows = slice(h * d, (h + 1) * d)
            k_rows = slice(H * d + h * d, H * d + (h + 1) * d)
            name = f"block{i}.h{h}"
            if name not in log["factors"]:
                assert torch.equal(W1[q_rows], W0[i][q_rows]), name
                if kv == H:
                    assert torch.equal(W1[k_rows], W0[i][k_rows]), name
                continue
            gamma = log["factors"][name]
            if kv == H:  # √γ on q and on k
                torch.testing.assert_close(W1[q_rows], W0[i][q_rows] * gamma ** 0.5)
                torch.testing.assert_close(W1[k_rows], W0[i][k_rows] * gamma ** 0.5)
            else:  # γ on q, the shared k untouched
                torch.testing.assert_close(W1[q_rows], W0[i][q_rows] * gamma)
        if kv != H:
            assert torch.equal(W1[H * d:], W0[i][H * d:])  # k and v rows
    # layer 0 sees the same input before and after: exact bookkeeping there
    over0 = {f"block0.h{h}" for h in range(H) if S0[0][h] > tau}
    assert over0 and over0 == {k for k in log["factors"] if k.startswith("block0.")}
    for h in range(H):
        if S0[0][h] > tau:
            assert log["factors"][f"block0.h{h}"] == pytest.approx(tau / S0[0][h].item(), rel=1e-6)
            assert S1[0][h].item() == pytest.approx(tau, rel=ROUND)
        else:
            assert S1[0][h] == S0[0][h]
    assert log["heads_clipped"] == len(log["factors"]) > 0
    assert log["logit_max"]["block0"] == pytest.approx(S0[0].max().item())


@pytest.mark.parametrize("tau", [0, -1.0, float("nan")])
def test_bad_tau_names_the_key(tau):
    with pytest.raises(ValueError, match=r"^optim\.qk_clip\.tau="):
        QKClipConfig(tau=tau)


def test_qk_clip_refuses_qk_norm():
    with pytest.raises(ValueError, match=r"^optim\.qk_clip\.tau=.*model\.qk_norm"):
        QKClip(_model(4, qk_norm=True), QKClipConfig(tau=10.0))
