"""The MoE fast path (one grouped GEMM per expert matrix, no host sync) against the per-expert loop it
replaces: forward, gradients and loads on full and padded batches; and a compiled MoE model that keeps
one graph whatever the expert-load pattern."""
from __future__ import annotations

import pytest
import torch

from model import ModelConfig, MoEConfig, Transformer
from model.loss import IGNORE_INDEX
from model.moe import MoE, grouped_mm_runs

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not grouped_mm_runs(torch.zeros(1)), reason="no torch._grouped_mm on CPU")]


def pair(limit=None, top_k=2, shared=True):
    torch.manual_seed(0)
    cfg = MoEConfig(n_experts=6, top_k=top_k, expert_hidden=24, shared_expert=shared, router_z_coef=1e-3)
    fast = MoE(cfg, 16, limit)
    fast.init_weights(0.3, 0.3)
    fast.experts.grouped = True  # the default, written out: the pair differs only here
    ref = MoE(cfg, 16, limit)
    ref.load_state_dict(fast.state_dict())
    ref.experts.grouped = False
    return fast, ref


@pytest.mark.parametrize("limit, top_k, padded", [(None, 2, False), (1.0, 2, True), (None, 1, True)])
def test_grouped_equals_the_per_expert_loop(limit, top_k, padded):
    fast, ref = pair(limit, top_k)
    x = torch.randn(4, 12, 16)
    valid = torch.ones(48, dtype=torch.bool)
    if padded:
        valid[::3] = False  # a third of the positions are padding: they are routed but never counted
    outs, grads = [], []
    for m in (fast, ref):
        m.experts.record_stats = True
        xx = x.clone().requires_grad_(True)
        out = m(xx, valid_N=valid)
        loss = (out.y * torch.linspace(-1, 1, 16)).sum() + out.aux_loss
        grads.append(torch.autograd.grad(loss, [xx, *m.parameters()]))
        outs.append(out)
    a, b = outs
    torch.testing.assert_close(a.y, b.y, rtol=1e-5, atol=1e-6)
    assert torch.equal(a.route_ids_Nk, b.route_ids_Nk) and torch.equal(a.load_E, b.load_E)
    assert a.load_E.sum() == top_k * valid.sum()
    torch.testing.assert_close(a.aux_loss, b.aux_loss)
    for g_fast, g_ref in zip(*grads):
        torch.testing.assert_close(g_fast, g_ref, rtol=1e-5, atol=1e-6)
    assert fast.experts.clamp_hits == ref.experts.clamp_hits and fast.experts.clamp_total == ref.experts.clamp_total


def test_an_expert_without_tokens_still_gets_a_zero_gradient():
    fast, _ = pair()
    with torch.no_grad():
        fast.router.weight.zero_()
        fast.bias_E.copy_(torch.tensor([1.0, 1.0, 0, 0, 0, 0]))  # every token picks experts 0 and 1
    out = fast(torch.randn(2, 5, 16))
    out.y.sum().backward()
    g = fast.experts.w_gate_up.grad
    assert g is not None and g[2:].abs().sum() == 0 and g[:2].abs().sum() > 0


def test_compiled_moe_model_does_not_recompile_when_the_loads_change():
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(len(gm.graph.nodes))
        return gm.forward

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, seq_len=16, d_model=16, n_layers=2, n_heads=2,
                      moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_dense=1))
    model = Transformer(cfg)
    compiled = torch.compile(model, backend=counting, dynamic=False)
    loads = set()
    for step in range(6):
        tokens = torch.randint(1, 32, (4, 16))
        labels = tokens.roll(-1, 1)
        labels[:, -step - 1:] = IGNORE_INDEX  # a different padding pattern every step
        out = compiled(tokens, labels)
        out.loss_sum.backward()
        loads.add(tuple(out.moe_load[1].tolist()))
    assert len(loads) > 1, "the test needs different expert-load patterns"
    assert len(compiles) == 1, f"{len(compiles)} graphs compiled for {len(loads)} load patterns"


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_the_probe_answers_alike_whatever_the_first_callers_grad_mode(mode, monkeypatch):
    """The probe's backward once failed when the first MoE forward of a process ran under no_grad (a resumed
    run's first forward is the anticipatory routing-only one): that process then ran the loop, the run it
    resumed the grouped GEMM, and the resume was 1 ulp off (tests/test_matrix.py's MoE resume cell)."""
    from model import moe

    monkeypatch.setattr(moe, "_GROUPED_OK", {})
    with mode():
        assert grouped_mm_runs(torch.zeros(3))
    assert moe._GROUPED_OK == {("cpu", torch.float32): True}


def test_grouped_under_bf16_autocast_runs_bf16_gemms_and_matches_the_loop():
    """Under autocast the grouped GEMMs take the autocast dtype, as the loop's F.linear does (CUDA's grouped
    kernel is bf16-only: an fp32 input there would always have fallen back to the loop)."""
    if not grouped_mm_runs(torch.zeros(1), torch.bfloat16):
        pytest.skip("no bf16 torch._grouped_mm on CPU")
    fast, ref = pair()
    seen = []
    fast.experts.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    x = torch.randn(4, 12, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = fast(x), ref(x)
    assert seen == [torch.bfloat16]
    assert torch.equal(a.route_ids_Nk, b.route_ids_Nk)
    torch.testing.assert_close(a.y.float(), b.y.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("d_model, hidden, dtype", [(10, 16, torch.float32), (16, 12, torch.bfloat16)])
def test_rows_not_a_multiple_of_16_bytes_take_the_loop(d_model, hidden, dtype):
    """_grouped_mm raises "strides should be multiple of 16 bytes" on such rows: they must run (the loop)."""
    torch.manual_seed(0)
    cfg = MoEConfig(n_experts=4, top_k=2, expert_hidden=hidden)
    fast = MoE(cfg, d_model, None)
    fast.init_weights(0.3, 0.3)
    ref = MoE(cfg, d_model, None)
    ref.load_state_dict(fast.state_dict())
    ref.experts.grouped = False
    x = torch.randn(3, 5, d_model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        a, b = fast(x), ref(x)
    a.y.float().sum().backward()
    assert torch.equal(a.y, b.y)
