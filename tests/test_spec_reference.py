"""The FP64 reference behind the forward and gradient checks (spec/reference.py, spec/checks/forward.py): the
layers fed the training path's inputs and wired by `through` differentiate as the chain rule says."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from model.config import ModelConfig, MoEConfig
from model.transformer import Transformer
from spec.check import SpecContext
from spec.checks.forward import ForwardCheck
from spec.checks.prefix import PrefixCheck
from spec.probe import run_probe
from spec.reference import Keys, Reference, weights_f64

Z = 1e-3


def _probe():
    """A dense + MoE model in FP64 (its activations the reference's but for its FP32 RoPE tables), one probe run."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=37, seq_len=16, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, init_std=0.2,
                      moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_dense=1, every=1))
    model = Transformer(cfg).double()
    tokens, labels = torch.randint(1, 37, (2, 16)), torch.randint(0, 37, (2, 16))
    labels[0, 12:] = -100  # a padded tail: the objective and the balance loss count valid positions only
    run = run_probe(model, [SimpleNamespace(tokens=tokens, labels=labels)], None, Z, None, None, want_grads=True)
    ctx = SpecContext(cfg=SimpleNamespace(parallel=SimpleNamespace(param_dtype="float32"),
                                          train=SimpleNamespace(z_loss=Z)),
                      model=model, model_cfg=cfg, wrapped=model, optimizer=None, loader=None, dataset=None, dist=None,
                      recipe=SimpleNamespace(name="fp32"), scaler=None, evals=[])
    return cfg, run, ForwardCheck(ctx)


def _grads(objective, run) -> dict[str, torch.Tensor]:
    names = [n for n, w in run.ref_w.items() if w.requires_grad]
    got = torch.autograd.grad(objective, [run.ref_w[n] for n in names], allow_unused=True)
    return {n: torch.zeros_like(run.ref_w[n]) if g is None else g for n, g in zip(names, got)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def test_the_linearised_reference_has_the_chain_rules_gradient():
    """The gradient check's oracle (the forward check's graph: each layer at the training path's input) against
    autograd through the whole reference from its own embedding, and through the FP64 model itself: every
    parameter within 1e-6 (the model's FP32 RoPE tables differ from the reference's FP64 angles by ~1e-8)."""
    cfg, run, fwd = _probe()
    rows = list(fwd.layers(Reference(cfg, run.ref_w, run.bias), run))
    assert all(float(err) <= float(tol) for _, err, tol, *_ in rows), [(r[0], float(r[1] / r[2])) for r in rows]
    linearised = _grads(run.cache["objective"], run)
    out = Reference(cfg, run.ref_w, run.bias).forward(run.tokens, run.labels, run.ids)
    chained = _grads((out["ce"] + Z * out["z"]) / out["n"].clamp(min=1) + out["aux"], run)
    assert linearised.keys() == run.grads.keys()
    for n, g in linearised.items():
        assert _rel(g, chained[n]) < 1e-6 and _rel(g, run.grads[n]) < 1e-6, n


@pytest.mark.parametrize("cut", [3, 4])
def test_a_miswired_reference_is_not_the_chain_rules_gradient(cut, monkeypatch):
    """The test above can fail: a wiring that drops its graph (block 0's 3rd, the residual after its attention;
    its 4th, the MLP's input from its norm) leaves the layers below without their share of the gradient."""
    import spec.checks.forward as forward

    orig = forward.through
    calls = []

    def cut_through(value, graph):
        calls.append(1)
        if len(calls) == cut:  # a block's wirings: its input, the attention's input, the residual, the MLP's input
            return value
        return orig(value, graph)
    monkeypatch.setattr(forward, "through", cut_through)
    cfg, run, fwd = _probe()
    list(fwd.layers(Reference(cfg, run.ref_w, run.bias), run))
    linearised = _grads(run.cache["objective"], run)
    assert max(_rel(g, run.grads[n]) for n, g in linearised.items()) > 1e-2


def test_the_prefix_check_runs_the_blocks_as_one_group_with_the_forward_checks_figures():
    """spec/checks/prefix.py feeds every block the input it took and runs them as one group of the reference (a
    stacked op for all blocks): on an FP32 model's taken rows (GQA, a dense and two MoE blocks) its names, misses,
    tolerances and the places classify() reads are the forward check's layers' — the same reference, one block at a
    time — up to FP64's rounding of another order of sums."""
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=37, seq_len=16, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, init_std=0.2,
                      moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_dense=1, every=1))
    model = Transformer(cfg)
    with torch.no_grad():  # every block's own gains (not the init's ones): a block fed another's weights differs
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    tokens, labels = torch.randint(1, 37, (1, 16)), torch.randint(0, 37, (1, 16))
    run = run_probe(model, [SimpleNamespace(tokens=tokens, labels=labels)], None, Z, None, None, want_grads=False)
    ctx = SpecContext(cfg=SimpleNamespace(parallel=SimpleNamespace(param_dtype="float32"),
                                          train=SimpleNamespace(z_loss=Z)),
                      model=model, model_cfg=cfg, wrapped=model, optimizer=None, loader=None, dataset=None, dist=None,
                      recipe=SimpleNamespace(name="fp32"), scaler=None, evals=[])
    prefix = PrefixCheck(ctx)
    w, stacks = prefix._weights()
    groups = set(stacks)
    names, err, tol, _, places = prefix.rows(Reference(cfg, w, run.bias, stacks), run, torch.arange(16), run.tokens)
    assert set(stacks) == groups  # every group read from the copy's own stacks: none stacked again
    wired = list(ForwardCheck(ctx).layers(Reference(cfg, weights_f64(model), run.bias), run))[:-1]  # not the loss
    assert names == [r[0] for r in wired]
    want_err, want_tol = (torch.stack([r[i] for r in wired]) for i in (1, 2))
    assert float(want_err[1:].min()) > 0 and float((err / tol).max()) < 1  # FP32's rounding, within the recipe's
    assert bool(((err - want_err).abs() <= 1e-8 * want_err).all())  # the embedding's a gather: 0 on both sides
    assert float(((tol - want_tol) / want_tol).abs().max()) < 1e-12
    for j, (name, *_, (got, want, t, extra)) in enumerate(wired):
        g_got, g_want, g_t, g_extra = places[j]
        if "pairs" in extra:
            assert torch.allclose(g_extra["ratios"], extra["ratios"], rtol=1e-8, atol=0), name
            continue
        assert torch.equal(g_got.to(want.dtype), got.to(want.dtype)), name
        assert _rel(g_want, want) < 1e-14 and _rel(g_t, t) < 1e-12, name
        if "attention" in extra:  # the leak rule's unmasked attention
            assert _rel(g_extra["attention"](False), extra["attention"](False)) < 1e-14, name
        if "moe" in extra:
            assert torch.equal(g_extra["moe"].ids, extra["moe"].ids) and _rel(g_extra["moe"].y, extra["moe"].y) < 1e-14


@pytest.mark.parametrize("causal", [True, False])
def test_an_attention_at_some_positions_is_the_whole_rows_at_them(causal):
    """The prefix check's attention (spec/checks/prefix.py) gives its output at a few positions of a row, every query
    reading the keys and values of the whole row (given): equal, for a block and for a group of blocks, to the whole
    row's attention at those positions (RoPE's angles and the mask's rows taken at them, not at 0, 1, ...)."""
    torch.manual_seed(2)
    cfg = ModelConfig(vocab_size=37, seq_len=16, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, init_std=0.2)
    w = {n: p.detach().double() for n, p in Transformer(cfg).named_parameters()}
    ref, at = Reference(cfg, w), torch.tensor([0, 1, 13, 15])
    x = torch.randn(3, 16, 32, dtype=torch.float64)
    for i, rows in ((1, x[1:2]), ((0, 1, 2), x)):
        kv = (rows @ ref.layer(i, "attn.qkv.weight")[..., 32:, :].mT).reshape(*rows.shape[:2], 4, 8)  # after q's 4·8
        keys = Keys(at, *kv.split([2, 2], dim=2))
        whole = ref.attention(i, rows, causal)
        assert _rel(ref.attention(i, rows[:, at], causal, keys=keys), whole[:, at]) < 1e-14
        assert _rel(ref.attention(i, rows[:, at], causal, keys=keys), whole[:, :4]) > 1e-3  # not the first positions'
        # the keys between the rows are read: others there move the output
        wrong = Keys(at, keys.k.roll(1, dims=1), keys.v)
        assert _rel(ref.attention(i, rows[:, at], causal, keys=wrong), whole[:, at]) > 1e-3
