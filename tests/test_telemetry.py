"""Per-layer telemetry against naive recomputation, injected faults, and 2-process DDP / FSDP2.

The references here never call stability.telemetry: layer names come from a plain string rule,
activations from hooks registered by hand on a copy of the model, gradients from a separate
unclipped, unscaled backward, Δθ from cloned parameters.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

from data import build_data
from data.config import DataConfig
from data.loader import Loader
from model import Transformer
from optim import build_optimizer
from optim.accumulate import count_valid_tokens, forward_backward, reduce_step_sums
from optim.config import OptimConfig
from optim.scaler import DynamicLossScaler
from precision import optimizer_step
from stability.record import floor_by_source
from stability.resume_fields import state_summary
from stability.config import TelemetryConfig
from stability.telemetry import Telemetry, first_nonfinite, moe_summary, nonfinite_flags
from helpers import model_config

DATA = {"kind": "synthetic", "seq_len": 16, "min_doc_len": 4, "seed": 5,
        "sources": [{"name": "markov", "kind": "markov", "weight": 0.5, "alphabet": 8, "order": 1, "support": 2},
                    {"name": "copy", "kind": "copy", "weight": 0.5, "alphabet": 8, "segment": 3}]}
# Dense block 0, MoE blocks 1 and 2 (routed experts + a shared expert). A clamp of 0.05 bites often at
# this init scale, so the hit-rate is a real fraction. NOTE: no Switch / router-z loss: they are means
# per micro-batch, so 1 and 2 processes would optimise (slightly) different objectives.
MODEL = {"d_model": 16, "n_layers": 3, "n_heads": 2, "swiglu_clamp": 0.05,
         "moe": {"n_experts": 4, "top_k": 2, "expert_hidden": 16, "shared_expert": True, "first_dense": 1,
                 "every": 1, "balance_coef": 0.0, "router_z_coef": 0.0}}
BATCH, CLIP, EXPERT_H = 8, 0.05, 16  # CLIP small: the clip bites, so grad_rms must undo it


pytestmark = pytest.mark.usefixtures("one_thread")


def build(tied: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    ds = build_data(DataConfig.from_dict(DATA))
    model = Transformer(model_config({**MODEL, "tie_embeddings": tied,
                                               "vocab_size": ds.vocab_size, "seq_len": ds.seq_len}))
    return ds, model


def step(model, wrapped, opt, tel, mbs, n, scaler=None, world=1, before=None, after=None, record=None):
    """One train.py-shaped step with telemetry; `before` runs after backward, `after` after the update.
    With a `record` dict: the step's reduced sums and state_summary (as train.py takes them) land there."""
    tel.start(n)
    n_valid = count_valid_tokens(mbs, "cpu")
    sums = forward_backward(wrapped, mbs, n_valid, 1e-4, world, 2, loss_scale=scaler.scale if scaler else None)
    if before:
        before(model)
    tel.before_update()
    res = optimizer_step(model.parameters(), opt, scaler, CLIP)
    if after:
        after(model)
    out = tel.finish(res.coef)
    opt.zero_grad(set_to_none=True)
    if record is not None:
        stats = reduce_step_sums(sums, n_valid.item())
        record.update(floor_by_source=floor_by_source(stats, ["markov", "copy"]), state=state_summary(opt, model),
                      moe=moe_summary(stats["moe_load"], stats["moe_out_sq"]))
    return out, res


def ref_layer(name: str) -> str:
    """A norm's gain is a layer of its own (the model's norms are named *_norm): it must not swamp a matrix's."""
    top = name.split(".")[0]
    if top != "blocks":
        return {"tok_emb": "emb", "norm": "norm", "head": "head"}[top]
    i, part = name.split(".")[1:3]
    return f"block{i}.{part}"


def ref_activations(model, mbs) -> tuple[dict, dict]:
    """act RMS per layer and clamp (hits, total) per SwiGLU layer, from hand-registered hooks."""
    sq, n, clamp = {}, {}, {}
    L = model.cfg.swiglu_clamp

    def acc(key, x):
        sq[key] = sq.get(key, 0.0) + x.detach().double().square().sum().item()
        n[key] = n.get(key, 0) + x.numel()

    def count(key, gate_up):
        gate, up = gate_up.detach().chunk(2, dim=-1)
        hits, total = clamp.get(key, (0, 0))
        clamp[key] = (hits + int(((gate > L) | (up.abs() > L)).sum()), total + gate.numel())

    mods = [("emb", model.tok_emb, lambda o: o), ("norm", model.norm, lambda o: o)]
    if "head.weight" in dict(model.named_parameters()):
        mods.append(("head", model.head, lambda o: o))
    for i, b in enumerate(model.blocks):
        mods += [(f"block{i}.attn", b.attn, lambda o: o), (f"block{i}", b, lambda o: o[0]),
                 (f"block{i}.mlp", b.mlp, lambda o: o if torch.is_tensor(o) else o.y)]
        key = f"block{i}.mlp"
        for sub in ([b.mlp] if hasattr(b.mlp, "w_gate_up") else [b.mlp.shared]):
            sub.w_gate_up.register_forward_hook(lambda m, a, o, key=key: count(key, o))
        if hasattr(b.mlp, "experts"):
            plain = b.mlp.experts.linear

            def linear(x, w, plain=plain, key=key):
                y = plain(x, w)
                if w.shape[0] == 2 * EXPERT_H:  # the gate/up matmul, not the down projection
                    count(key, y)
                return y
            b.mlp.experts.linear = linear
    for key, mod, pick in mods:
        mod.register_forward_hook(lambda m, a, o, key=key, pick=pick: acc(key, pick(o)))
    with torch.no_grad():
        for mb in mbs:
            model(mb.tokens, mb.labels)
    return {k: math.sqrt(sq[k] / n[k]) for k in sq}, clamp


def ref_grad_rms(model, mbs) -> dict:
    forward_backward(model, mbs, count_valid_tokens(mbs, "cpu"), 1e-4, 1, 2)  # unscaled, unclipped
    return per_layer_rms({n: p.grad for n, p in model.named_parameters()})


def per_layer_rms(tensors: dict) -> dict:
    sq, n = {}, {}
    for name, t in tensors.items():
        k = ref_layer(name)
        sq[k] = sq.get(k, 0.0) + t.double().square().sum().item()
        n[k] = n.get(k, 0) + t.numel()
    return {k: math.sqrt(sq[k] / n[k]) for k in sq}


def ref_ratios(before: dict, model, eps=1e-8) -> dict:
    d2, t2 = {}, {}
    for name, p in model.named_parameters():
        k = ref_layer(name)
        d2[k] = d2.get(k, 0.0) + (p.detach().double() - before[name].double()).square().sum().item()
        t2[k] = t2.get(k, 0.0) + before[name].double().square().sum().item()
    return {k: math.sqrt(d2[k]) / (math.sqrt(t2[k]) + eps) for k in d2}


def close(a: float, b: float, rel=1e-5) -> bool:
    return a == pytest.approx(b, rel=rel, abs=1e-12)


# ---------------------------------------------------------------- single process

@pytest.mark.parametrize("tied, fp16", [(True, False), (False, True)])
def test_layers_match_naive_recomputation(tied, fp16):
    ds, model = build(tied)
    opt, _ = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))
    loader, tel = Loader(ds, BATCH), Telemetry(model, TelemetryConfig(every=1))
    scaler = DynamicLossScaler(init_scale=2.0**10) if fp16 else None
    step(model, model, opt, tel, loader.next().micro_batches(2), 1, scaler)  # Adam state exists now
    mbs = loader.next().micro_batches(2)
    ref_model = copy.deepcopy(model)
    act, clamp = ref_activations(copy.deepcopy(model), mbs)
    grad = ref_grad_rms(ref_model, mbs)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def eval_forward(m):  # an eval / routing-only forward mid-step (no_grad) must not be counted
        with torch.no_grad():
            m(mbs[0].tokens)
    out, res = step(model, model, opt, tel, mbs, 2, scaler, before=eval_forward)
    assert not res.skipped and res.coef.item() < 0.5  # the clip bit: grad_rms must undo it
    ratio = ref_ratios(before, model)

    layers = out["layers"]
    expected_keys = ["emb"] + [f"block{i}{part}" for i in range(3) for part in (".attn_norm", ".attn", ".mlp_norm",
                                                                              ".mlp", "")] + ["norm"] + ([] if tied else ["head"])
    assert list(layers) == expected_keys
    assert set(act) == {k for k in layers if "act_rms" in layers[k]} == {k for k in expected_keys if "_norm" not in k}
    for k in act:
        assert close(layers[k]["act_rms"], act[k]), k
    assert set(grad) == set(ratio) == {k for k in layers if "grad_rms" in layers[k]}
    for k in grad:
        assert close(layers[k]["grad_rms"], grad[k]), k
        assert close(layers[k]["update_ratio"], ratio[k]), k
        assert ratio[k] > 0
    assert out["update_ratio_max"] == max(layers[k]["update_ratio"] for k in grad)
    assert set(clamp) == {k for k in layers if "clamp_hit_rate" in layers[k]} == {f"block{i}.mlp" for i in range(3)}
    for k, (hits, total) in clamp.items():
        assert 0 < hits < total
        assert close(layers[k]["clamp_hit_rate"], hits / total, rel=1e-12), k
    assert out["nonfinite"] == {"grads": False}
    assert out["replica"] == {}
    # the step is over: no hook left behind, clamp counting off
    assert all(not m._forward_hooks for m in model.modules() if m is not model)
    assert not any(m.record_stats for _, m in model.swiglus())



@pytest.mark.parametrize("clamp", [0.05, 10.0])
def test_telemetry_leaves_training_bit_identical(clamp, monkeypatch):
    """Recording every step (hooks, clamp counting through its own path, the logit probe, θ snapshots)
    must not move one bit of training. clamp 0.05 hits often (the exact count decides), 10.0 never (the
    cheap test on the clamp's outputs decides)."""
    monkeypatch.setitem(MODEL, "swiglu_clamp", clamp)
    params = []
    for every in (0, 1):
        ds, model = build()
        opt, _ = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))
        loader, tel = Loader(ds, BATCH), Telemetry(model, TelemetryConfig(every=every))
        outs = [step(model, model, opt, tel, loader.next().micro_batches(2), n)[0] for n in range(1, 5)]
        params.append([p.detach().clone() for p in model.parameters()])
    assert all(outs) and all("clamp_hit_rate" in outs[-1]["layers"][f"block{i}.mlp"] for i in range(3))
    assert (outs[-1]["layers"]["block1.mlp"]["clamp_hit_rate"] > 0) == (clamp < 1)
    assert all(torch.equal(a, b) for a, b in zip(*params))

def _plant_inf_grad(model):
    model.blocks[1].mlp.experts.w_down.grad.view(-1)[3] = math.inf


def test_skipped_step_has_zero_update_and_reads_real_params():
    ds, model = build()
    opt, _ = build_optimizer(model, OptimConfig(lr=1e-2))
    loader, tel = Loader(ds, BATCH), Telemetry(model, TelemetryConfig(every=1))
    step(model, model, opt, tel, loader.next().micro_batches(2), 1)
    out, res = step(model, model, opt, tel, loader.next().micro_batches(2), 2, before=_plant_inf_grad)
    assert res.skipped and out["nonfinite"]["grads"]
    assert math.isinf(out["layers"]["block1.mlp"]["grad_rms"])
    assert math.isfinite(out["layers"]["block0.mlp"]["grad_rms"])
    ratios = [v["update_ratio"] for v in out["layers"].values() if "update_ratio" in v]
    assert len(ratios) == 14 and all(r == 0.0 for r in ratios) and out["update_ratio_max"] == 0.0

    # Skipped again, but something moved block0.attn's weights after the step: ρ must see the real θ.
    w = model.blocks[0].attn.qkv.weight
    w_before, attn = w.detach().clone(), dict(model.blocks[0].named_parameters())
    theta = math.sqrt(sum(p.detach().double().square().sum().item() for n, p in attn.items()
                          if n.startswith("attn.")))  # its matrices: the gain is block0.attn_norm
    out, res = step(model, model, opt, tel, loader.next().micro_batches(2), 3, before=_plant_inf_grad,
                    after=lambda m: m.blocks[0].attn.qkv.weight.data.add_(1e-3))
    delta = (w.detach().double() - w_before.double()).norm().item()
    assert res.skipped
    assert close(out["layers"]["block0.attn"]["update_ratio"], delta / (theta + 1e-8))
    assert all(v["update_ratio"] == 0.0 for k, v in out["layers"].items() if "update_ratio" in v and k != "block0.attn")


def test_nan_activation_marks_its_layer_and_every_later_one():
    ds, model = build()
    opt, _ = build_optimizer(model, OptimConfig(lr=1e-2))
    tel = Telemetry(model, TelemetryConfig(every=1))

    def plant(module, args, out):  # registered before telemetry's hooks: they see the NaN
        out = out.clone()
        out[:, 0, 0] = math.nan  # position 0: causal attention carries it to every later position
        return out
    model.blocks[1].attn.register_forward_hook(plant)
    out, res = step(model, model, opt, tel, Loader(ds, BATCH).next().micro_batches(2), 1)
    layers = out["layers"]
    order = [k for k in layers if "act_rms" in layers[k]]  # a norm gain's entry holds parameter numbers only
    bad = order.index("block1.attn")
    assert all(math.isfinite(layers[k]["act_rms"]) for k in order[:bad])
    assert all(math.isnan(layers[k]["act_rms"]) for k in order[bad:])
    assert first_nonfinite(layers) == "block1.attn"
    assert res.skipped and out["nonfinite"]["grads"] and out["update_ratio_max"] == 0.0


def test_nonfinite_optimizer_state_is_flagged():
    """From the moments' norms the StepRecord takes every step (stability/resume_fields.py): no second pass."""
    from stability.resume_fields import state_nonfinite, state_summary
    ds, model = build()
    opt, _ = build_optimizer(model, OptimConfig(lr=1e-2))
    loader, tel = Loader(ds, BATCH), Telemetry(model, TelemetryConfig(every=1))
    step(model, model, opt, tel, loader.next().micro_batches(2), 1)
    assert state_nonfinite(opt, state_summary(opt, model)) is False
    state = opt.state[model.blocks[2].mlp.router.weight]["exp_avg_sq"]
    state.view(-1)[5] = 1e30  # finite, but its square overflows FP32: must not read as non-finite
    step(model, model, opt, tel, loader.next().micro_batches(2), 2)
    summary = state_summary(opt, model)
    assert state_nonfinite(opt, summary) is False and all(math.isfinite(v) for v in summary.values())
    state.view(-1)[5] = math.inf
    out, res = step(model, model, opt, tel, loader.next().micro_batches(2), 3)
    assert not res.skipped and out["nonfinite"] == {"grads": False}
    assert state_nonfinite(opt, state_summary(opt, model)) is True


def test_nonfinite_muon_momentum_is_flagged():
    """State beside Adam's moments (Muon's momentum buffer) is checked on its own."""
    from stability.resume_fields import state_nonfinite, state_summary
    ds, model = build()
    opt, _ = build_optimizer(model, OptimConfig(name="muon", lr=1e-2))
    loader, tel = Loader(ds, BATCH), Telemetry(model, TelemetryConfig(every=1))
    step(model, model, opt, tel, loader.next().micro_batches(2), 1)
    bufs = [st["momentum_buffer"] for st in opt.state.values() if "momentum_buffer" in st]
    assert bufs and state_nonfinite(opt, state_summary(opt, model)) is False
    bufs[0].view(-1)[0] = math.nan
    assert state_nonfinite(opt, state_summary(opt, model)) is True


def test_large_finite_gradient_is_measured_not_flagged():
    ds, model = build()
    opt, _ = build_optimizer(model, OptimConfig(lr=1e-2))
    tel, ref = Telemetry(model, TelemetryConfig(every=1)), {}

    def plant(m):  # |g| = 1e25: Σg² overflows FP32, yet the gradient is finite
        m.blocks[0].mlp.w_down.weight.grad.view(-1)[0] = 1e25
        ref.update(per_layer_rms({n: p.grad for n, p in m.named_parameters()}))
    out, res = step(model, model, opt, tel, Loader(ds, BATCH).next().micro_batches(2), 1, before=plant)
    assert not res.skipped and out["nonfinite"]["grads"] is False
    assert close(out["layers"]["block0.mlp"]["grad_rms"], ref["block0.mlp"])
    assert close(out["layers"]["block1.attn"]["grad_rms"], ref["block1.attn"])


def assert_armed(model):
    assert all(b.attn._forward_hooks and b._forward_hooks for b in model.blocks)
    assert all(m.record_stats for _, m in model.swiglus())


def test_every_gates_the_work_and_bad_values_name_the_key():
    ds, model = build()
    opt, _ = build_optimizer(model, OptimConfig(lr=1e-2))
    loader = Loader(ds, BATCH)

    def no_hooks(m):
        assert not any(mod._forward_hooks for mod in m.modules())
    off = Telemetry(model, TelemetryConfig(every=0))
    assert not off.wants(0) and not off.start(5)
    assert step(model, model, opt, off, loader.next().micro_batches(2), 1, before=no_hooks)[0] == {}
    tel = Telemetry(model, TelemetryConfig(every=3))
    assert [s for s in range(1, 10) if tel.wants(s)] == [3, 6, 9]
    assert step(model, model, opt, tel, loader.next().micro_batches(2), 4, before=no_hooks)[0] == {}
    out, _ = step(model, model, opt, tel, loader.next().micro_batches(2), 6, before=assert_armed)
    assert out["layers"] and not any(mod._forward_hooks for mod in model.modules())
    with pytest.raises(ValueError, match="telemetry.every"):  # the schema's rule (stability/config.py)
        TelemetryConfig(every=-1)


def test_parameters_replaced_after_construction_are_followed():
    ds, model = build()
    tel = Telemetry(model, TelemetryConfig(every=1))  # before the swap, as if built before an FSDP wrap
    model.norm.weight = torch.nn.Parameter(model.norm.weight.detach().clone())
    opt, _ = build_optimizer(model, OptimConfig(lr=1e-2))
    out, _ = step(model, model, opt, tel, Loader(ds, BATCH).next().micro_batches(2), 1)
    assert out["layers"]["norm"]["update_ratio"] > 0  # stale references would read 0


def test_moe_summary_on_hand_made_loads():
    got = moe_summary({3: torch.tensor([4.0, 0.0, 2.0, 2.0]), 1: torch.tensor([3.0, 3.0, 3.0, 3.0])})
    assert list(got) == ["1", "3"]
    assert got["3"] == {"load": [4, 0, 2, 2], "max_violation": 1.0, "dead": 1}
    assert got["1"] == {"load": [3, 3, 3, 3], "max_violation": 0.0, "dead": 0}
    with pytest.raises(ValueError, match="layer 2"):
        moe_summary({2: torch.ones(2, 2)})


@pytest.mark.parametrize("args, flagged", [((2.0, 30.0, 1.0), set()), ((math.nan, 30.0, 1.0), {"loss"}),
                                           ((2.0, math.inf, 1.0), {"logits"}), ((2.0, 3.0, -math.inf), {"grads"})])
def test_nonfinite_flags(args, flagged):
    assert {k for k, v in nonfinite_flags(*args).items() if v} == flagged


# ---------------------------------------------------------------- 2 processes (gloo)

def test_state_summary_equals_fp64_norms_of_the_moments_and_weights():
    """stability/resume_fields.py takes FP32 fused norms (cheap enough for every step); the doctor compares
    them across a resume, so they must equal the exact FP64 norms to FP32 precision, per group."""
    from stability.resume_fields import state_summary

    torch.manual_seed(0)
    model = Transformer(model_config({**MODEL, "vocab_size": 8, "seq_len": 16}))
    opt, _ = build_optimizer(model, OptimConfig(name="adamw", lr=1e-2))
    for _ in range(2):
        model(torch.randint(0, 8, (2, 16)), torch.randint(0, 8, (2, 16))).loss_sum.backward()
        opt.step()
        opt.zero_grad()
    for _, m in model.moe_layers():
        m.bias_E.uniform_(-1, 1)
    got = state_summary(opt, model)
    expect = {}
    for i, g in enumerate(opt.param_groups):
        for slot, short in (("exp_avg", "m"), ("exp_avg_sq", "v")):
            sq = sum(opt.state[p][slot].double().square().sum().item() for p in g["params"])
            expect[f"{short}/{g.get('name', f'group{i}')}"] = math.sqrt(sq)
        # ‖θ‖ per group: torch's own FP64 norm over the group's parameters, the moments' reference above
        expect[f"w/{g.get('name', f'group{i}')}"] = torch.linalg.vector_norm(
            torch.cat([p.detach().double().flatten() for p in g["params"]])).item()
    expect.update({f"moe_bias/{i}": m.bias_E.double().norm().item() for i, m in model.moe_layers()})
    assert got.keys() == expect.keys() and len(expect) == 3 * len(opt.param_groups) + 2
    for k, v in expect.items():
        assert v > 0 and abs(got[k] - v) <= 1e-6 * v, (k, got[k], v)
