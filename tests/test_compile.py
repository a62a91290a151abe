"""train.compile: the compiled model computes what the eager one does (shakespeare_char compiles by default)."""
from __future__ import annotations

import copy

import pytest
import torch

from model import IGNORE_INDEX, ModelConfig, Transformer


# NOTE: inductor's cold compile is slow on a CPU (C++ codegen of every fused kernel), so the
# default suite traces through aot_eager (dynamo, AOT autograd, decompositions: the graph the kernels are
# generated from) and the full inductor run is marked slow.
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_model_matches_eager(backend):
    """Three batches through a dense model, eager vs torch.compile: losses and every gradient agree.

    The compiled graph differs from eager where it could go wrong: RoPE in its real form (inductor has
    no complex ops), fused SwiGLU clamp, fused logsumexp/gather loss with ignored labels. Step 1 turns
    the clamp telemetry on, which recompiles (dynamo guards on the flag): its counts must match too.
    """
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=37, seq_len=16, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                      swiglu_clamp=0.05)  # a bound this low is hit, so the clamp branch is exercised
    eager = Transformer(cfg)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, backend=backend)
    for step in range(3):
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
        labels = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
        labels[1, 10:] = IGNORE_INDEX  # a short document: ignored positions must stay out of both sums
        for m in (eager, twin):
            for _, sw in m.swiglus():
                sw.record_stats = step == 1
        outs = []
        for model, fn in ((eager, eager), (twin, compiled)):
            out = fn(tokens, labels)
            (out.loss_sum + 1e-3 * out.z_sum).backward()
            outs.append(out)
        e, c = outs
        assert e.n_valid.item() == c.n_valid.item() == 4 * cfg.seq_len - 6
        torch.testing.assert_close(c.loss_sum, e.loss_sum, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c.z_sum, e.z_sum, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c.loss_sum_B, e.loss_sum_B, rtol=1e-5, atol=1e-5)
        if step == 1:
            hits = [(sw.clamp_hits.item(), sw.clamp_total.item()) for m in (eager, twin) for _, sw in m.swiglus()]
            assert hits[:1] == hits[1:] and hits[0][0] > 0
        for (name, pe), pc in zip(eager.named_parameters(), twin.parameters()):
            # NOTE: relative to the gradient's norm: fused kernels sum in another order, and an
            # element that is a near-cancelling sum differs by ~1e-6 absolute, far more relative
            rel = ((pc.grad - pe.grad).norm() / pe.grad.norm()).item()
            assert rel < 1e-5, f"batch {step}: grad of {name} differs by {rel:.2e} of its norm"
            pe.grad = pc.grad = None
