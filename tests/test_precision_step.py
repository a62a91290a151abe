"""FP16 loss scaling and the update order:
unscale → global norm → agreed finite check → clip → step or counted skip."""
from __future__ import annotations

import copy
import os

import pytest
import torch

from data import build_data
from data.config import DataConfig
from model import Transformer
from optim import build_optimizer, clip_grad_norm
from optim.accumulate import count_valid_tokens, forward_backward
from optim.config import OptimConfig
from optim.scaler import DynamicLossScaler
from precision import build_recipe, optimizer_step
from helpers import in_group, model_config, precision_config, spawn

DATA = {"kind": "synthetic", "seq_len": 16, "min_doc_len": 8, "seed": 5,
        "sources": [{"name": "markov", "kind": "markov", "weight": 1.0, "alphabet": 16, "order": 1, "support": 3,
                     "concentration": 0.5}]}
OPTIM = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
         "groups": [{"name": "no_decay", "kinds": ["norm", "embedding"], "weight_decay": 0.0}]}


def setup(seed=0):
    ds = build_data(DataConfig.from_dict(DATA))
    torch.manual_seed(seed)
    model = Transformer(model_config({"vocab_size": ds.vocab_size, "seq_len": 16, "d_model": 32,
                                               "n_layers": 2, "n_heads": 2}))
    return ds, model, build_optimizer(model, OptimConfig.from_dict(OPTIM))[0]


def backward(model, ds, loss_scale=None, autocast=None, start=0):
    micro = ds.samples(range(start, start + 8)).micro_batches(2)
    return forward_backward(model, micro, count_valid_tokens(micro, "cpu"), 1e-4, 1, 1,
                            autocast=autocast, loss_scale=loss_scale)


def test_scaler_backs_off_on_overflow_and_grows_after_a_clean_interval():
    s = DynamicLossScaler(init_scale=8.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2, min_scale=1.0)
    overflow = [False, False, True, False, True, False, False, True, True, True, True]
    # by the rule: ×2 after 2 clean steps in a row, ×0.5 on overflow (resetting the count), floor 1
    expected = [8.0, 16.0, 8.0, 8.0, 4.0, 4.0, 8.0, 4.0, 2.0, 1.0, 1.0]
    got = []
    for o in overflow:
        s.update(o)
        got.append(s.scale)
    assert got == expected and s.skipped_steps == 6
    restored = DynamicLossScaler()
    restored.load_state_dict(s.state_dict())
    assert (restored.scale, restored.good_steps, restored.skipped_steps) == (1.0, 0, 6)


def test_loss_scale_multiplies_every_gradient_exactly():
    ds, model, _ = setup()
    scaled = copy.deepcopy(model)
    plain_sums = backward(model, ds)
    scaled_sums = backward(scaled, ds, loss_scale=1024.0)
    for p, q in zip(model.parameters(), scaled.parameters()):
        assert torch.equal(q.grad, p.grad * 1024.0)  # a power of two: exact, no rounding anywhere
    assert torch.equal(plain_sums.loss_sum, scaled_sums.loss_sum)  # the logged loss is unscaled


def test_clip_after_unscale_gives_the_true_coefficient_and_clip_before_does_not():
    ds, ref_model, ref_opt = setup()
    backward(ref_model, ds)
    probe = clip_grad_norm(ref_model.parameters(), None)[0].item()
    c = 0.5 * probe  # clipping active: the true coefficient is 0.5
    norm_ref, coef_ref = clip_grad_norm(ref_model.parameters(), c)
    ref_opt.step()

    S = 1024.0
    _, model, opt = setup()
    backward(model, ds, loss_scale=S)
    res = optimizer_step(model.parameters(), opt, DynamicLossScaler(init_scale=S), c)
    assert not res.skipped and res.loss_scale == S
    assert res.norm.item() == pytest.approx(norm_ref.item(), rel=1e-6)
    assert res.coef.item() == pytest.approx(coef_ref.item(), rel=1e-6) and coef_ref.item() == pytest.approx(0.5, rel=1e-5)
    for p, q in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)

    # the bug: clip the scaled gradient, then unscale. The threshold silently becomes c/S.
    _, wrong, _ = setup()
    backward(wrong, ds, loss_scale=S)
    norm_wrong, coef_wrong = clip_grad_norm(wrong.parameters(), c)
    assert norm_wrong.item() == pytest.approx(S * norm_ref.item(), rel=1e-6)
    assert coef_wrong.item() == pytest.approx(coef_ref.item() / S, rel=1e-5)
    DynamicLossScaler(init_scale=S).unscale_(wrong.parameters())
    g_wrong = torch.cat([p.grad.flatten() for p in wrong.parameters()])
    g_right = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert g_wrong.norm().item() == pytest.approx(g_right.norm().item() / S, rel=1e-5)


def test_fp16_overflow_skips_counts_and_backs_off_until_the_step_fits():
    ds, model, opt = setup()
    recipe = build_recipe(precision_config({"name": "fp16", "loss_scale": {"init": 2.0 ** 32, "growth_interval": 1000}}))
    scaler = recipe.make_scaler()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    log = []
    for step in range(40):
        backward(model, ds, scaler.scale, recipe.autocast, start=8 * step)
        res = optimizer_step(model.parameters(), opt, scaler, 1.0)
        opt.zero_grad(set_to_none=True)
        log.append(res)
        if step == 0:  # a skipped step leaves weights and AdamW moments untouched
            assert res.skipped and not torch.isfinite(res.norm) and res.coef.item() == 1.0
            assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()) and not opt.state
        if not res.skipped:
            break
    n_skip = sum(r.skipped for r in log)
    # S·grad overflows fp16 (max 65504) inside backward until S has come down far enough
    assert 0 < n_skip < 40 and not log[-1].skipped and torch.isfinite(log[-1].norm)
    assert [r.loss_scale for r in log] == [2.0 ** (32 - i) for i in range(len(log))]
    assert [r.skipped_total for r in log] == [min(i + 1, n_skip) for i in range(len(log))]
    assert scaler.skipped_steps == n_skip and opt.state


def _agree_worker(rank, world, store, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.save(in_group(rank, world, store, _agree_steps), f"{out}.{rank}")


def _agree_steps(dist) -> list:
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=16.0)
    results = []
    for step in range(2):
        lin.weight.grad = torch.ones(4, 4)
        lin.bias.grad = torch.ones(4)
        if dist.rank == 1 and step == 0:  # only this rank's shard overflowed
            lin.weight.grad[2, 3] = float("inf")
        res = optimizer_step(lin.parameters(), opt, scaler, None)
        results.append((res.skipped, res.loss_scale, lin.weight.detach().clone()))
    return results


@pytest.mark.distributed
def test_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    spawn(_agree_worker, args=(2, str(tmp_path / "store"), str(tmp_path / "out")))
    r0, r1 = (torch.load(tmp_path / f"out.{r}") for r in range(2))
    assert [x[:2] for x in r0] == [x[:2] for x in r1] == [(True, 16.0), (False, 8.0)]
    assert torch.equal(r0[0][2], r1[0][2]) and torch.equal(r0[1][2], r1[1][2])


def test_empty_gradient_shards_are_ignored_by_the_finite_check():
    """An FSDP rank can own an empty shard of a small parameter: its max |g| is undefined, not inf."""
    w, empty = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(0))
    w.grad, empty.grad = torch.ones(3), torch.ones(0)
    res = optimizer_step([w, empty], torch.optim.SGD([w, empty], lr=0.5), DynamicLossScaler(init_scale=2.0), None)
    assert not res.skipped and torch.equal(w.detach(), torch.full((3,), 0.75))  # g/S = 0.5, step 0.5·0.5


def test_finite_check_is_the_fp64_norms_and_tells_overflow_from_large_grads():
    """The finite check needs no pass of its own: the FP64 Σg² is finite unless an element is inf/NaN. A norm
    past FP32 max from large *finite* gradients (‖g‖ = 6e38; the reported FP32 norm is inf) is no overflow
    and still gets clipped; an inf is an overflow, and the step is skipped."""
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([w], lr=1.0)
    w.grad = torch.full((4,), 0.5)
    assert not optimizer_step([w], opt, None, 1.0).skipped
    w.grad = torch.full((4,), 3e38)
    before = w.detach().clone()
    res = optimizer_step([w], opt, None, 1.0)
    assert not torch.isfinite(res.norm) and not res.skipped
    assert torch.linalg.vector_norm(w.detach() - before).item() == pytest.approx(1.0, rel=1e-5)  # clipped
    w.grad = torch.tensor([1.0, float("inf"), 0.0, 0.0])
    before = w.detach().clone()
    assert optimizer_step([w], opt, None, 1.0).skipped
    assert torch.equal(w.detach(), before)


def test_fused_adamw_skips_on_the_device_leaving_its_state_as_a_skip_does():
    """apply_update without the overflow read: fused AdamW takes the agreed flag as found_inf. A skipped step
    leaves parameters, moments and step counts bit for bit where the host-decided skip (no optimizer.step())
    leaves them, and a finite one moves them exactly as optimizer_step does; skipped is then the 0-d flag.
    Before the first step (no moments yet) the skip is the host's: found_inf would create the moments."""
    from precision.step import apply_update, prepare_update, skips_on_device

    def make():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(5))]
        return ps, torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True)

    host, dev = make(), make()
    g = torch.Generator().manual_seed(1)
    for t in range(6):
        grads = [torch.randn(p.shape, generator=g) for p in host[0]]
        if t in (0, 3):
            grads[0][2, 1] = float("nan")
        for (ps, _), gs in ((host, grads), (dev, grads)):
            for p, gr in zip(ps, gs):
                p.grad = gr.clone()
        ref = optimizer_step(host[0], host[1], None, 1.0)
        # step 0 is skipped, step 1 creates the moments: from step 2 on the device decides
        assert skips_on_device(dev[1], dev[0]) == (t > 1)
        res = apply_update(dev[0], dev[1], None, prepare_update(dev[0], None, 1.0))
        assert torch.is_tensor(res.skipped) == (t > 1) and bool(res.skipped) == ref.skipped == (t in (0, 3))
        for a, b in zip(host[0], dev[0]):
            assert torch.equal(a, b)
            sa, sb = host[1].state.get(a, {}), dev[1].state.get(b, {})
            assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    hook = dev[1].register_step_post_hook(lambda *_: None)  # it would see a step that a skip never makes
    assert not skips_on_device(dev[1], dev[0])
    hook.remove()
    assert skips_on_device(dev[1], dev[0])
